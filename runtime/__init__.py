"""The ERNIE-Image runtime: everything but ComfyUI's side (nodes/, web/), which it never imports.

Its packages, in import order: each imports only itself and the packages above it in this list
(scripts/import_graph.py checks every import, tests/test_import_graph.py keeps it so).

    core/      what every part shares: errors, the Host interface, GenerationRequest/Result (and the
               StepCacheConfig a request holds), the ErniePipe protocol, the variant (Base or Turbo), non-finite
               checks, the models pipes built that are still alive (read without loading model code), numbers
               read from text in plain decimal form
    files/     the user's files: images and masks read, PNGs and outputs written whole, inputs never overwritten
    net/       HTTP to servers: URLs, API keys bound to origins and where they are read from, settings, client,
               errors and error answers, cancellation, the event-loop thread
    quant/     packed weights (GGUF blocks, FP8, NVFP4): reading, quantising and writing them, QuantLinear, the
               Triton dequantising kernels, what each format does on the detected GPU
    formats/   weight files in every layout users have, ModelSources, config.json files and the released configs,
               the tokenizer (Tekken)
    model/     the DiT (its arithmetic, chosen per model, and fused kernels), the VAE's halves, compile (at once or on a
               thread beside a run's calls) and whether its caches hold it, CUDA graphs, building the parts from
               their files
    text/      the text encoder's embeddings; the prompt enhancer (its model, decoder, token sampling, FP8
               weights), local or on a chat endpoint
    sampling/  the flow-match schedule, the Euler sampler, image inputs (img2img, inpainting), previews
    offload/   the VRAM plan per job and placing each phase's weights (resident or streamed, from page-locked
               host copies); what the device can give, and the room a job asks its host (ComfyUI) to make
    lora/      LoRA files, their keys and deltas, merged into the DiT or attached as branches
    step_cache/ the DiT's block-residual step cache (DBCache, First-Block-Cache): its denoiser, skip rule, CUDA
               graphs of block runs, the pipe view that runs with it, the with/without comparison (what is asked,
               StepCacheConfig, is core/'s)
    local/     LocalPipe, the in-process backend: options, checks, parts, memory and its out-of-memory messages,
               LoRA views, phases, when the DiT is compiled, the pipe's description
    remote/    RemotePipe on SGLang servers: the protocol, the fleet, the server check
    demo/      tiny random models built in code, for the no-weights demo and the tests
    cli/       the `ernie-image` command line; nothing imports it
"""
