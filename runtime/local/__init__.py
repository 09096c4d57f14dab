"""LocalPipe, the in-process backend: options, checks, the parts it builds, their memory, LoRAs and views,
the prompt-enhancer phase, running out of memory, and its description."""
