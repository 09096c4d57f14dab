"""LocalPipe: the in-process backend, its options, memory, LoRA views and checks."""
