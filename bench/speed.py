"""DiT step and whole-image speed on the GPU, against diffusers on the same random weights in the same run.

    python bench/speed.py [--skip-dit | --skip-e2e] [--skip-compile] [--compile-variants]
    python bench/speed.py --pe-e2e --out DIR [--tiny]   # whole images with the prompt enhancer (bench/pe_e2e.py)

Prints: per variant, ms per DiT forward at 1024x1024 with 256 text tokens, TFLOP/s, ratio to diffusers eager,
ratio to two floors, and the SM clock and power while it ran; then whole Turbo and Base images (cold and warm) next
to diffusers' pipeline.

The floors: "burst" is the issue's arithmetic (the GEMMs at 752 TFLOP/s, the rate one short GEMM reaches at the full
1980 MHz clock, plus flash attention at 0.51 ms per layer); "measured" is the step's own 144 GEMMs and 36 attentions
run back to back on the same weights in this run, nothing else. A sustained step holds the H200 at its 700 W power
cap, where the clock settles near 1450-1550 MHz, so only the measured floor is reachable.
"""
from __future__ import annotations

import argparse
import gc
import sys

import torch

from common import (GpuSampler, block_matmuls, cuda_time_ms, wall_time, dit_config, dit_flops, import_package, print_environment,
                    quantised_copy, randomise_dit_, table)

import_package()

from ernie_image.runtime.model.dit import DiTConfig, ErnieDiT  # noqa: E402

WIDTH = HEIGHT = 1024
TEXT_TOKENS = 256
SEQ = (WIDTH // 16) * (HEIGHT // 16) + TEXT_TOKENS
# Burst rates on this H200 (ERNIE.md): bf16 GEMM 752 TFLOP/s, flash SDPA 0.51 ms per layer at batch 1.
GEMM_TFLOPS_BF16 = 752.0
ATTENTION_MS_PER_LAYER = 0.51


def burst_floor_ms(batch: int) -> float:
    gemm_flops = 36 * (8 * SEQ * 4096 ** 2 + 6 * SEQ * 4096 * 12288) * batch
    return gemm_flops / (GEMM_TFLOPS_BF16 * 1e12) * 1e3 + 36 * ATTENTION_MS_PER_LAYER * batch


def build_ours() -> ErnieDiT:
    """The full-size DiT on the GPU in bf16, with random weights whose activations stay finite."""
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        ours = ErnieDiT(DiTConfig.from_dict(dit_config()))
    torch.set_default_dtype(torch.float32)
    randomise_dit_(ours)
    return ours.eval().requires_grad_(False)


def build_models():
    ours = build_ours()
    from diffusers import ErnieImageTransformer2DModel

    raw = {k: v for k, v in dit_config().items() if not k.startswith("_")}
    with torch.device("meta"):
        reference = ErnieImageTransformer2DModel(**raw)
    reference.load_state_dict(ours.state_dict(), assign=True)  # shares the same tensors: one copy of 16 GB
    return ours, reference.eval().requires_grad_(False)


def inputs(batch: int, padded: bool = False):
    generator = torch.Generator(device="cuda").manual_seed(1)
    latents = torch.randn((batch, 128, HEIGHT // 16, WIDTH // 16), device="cuda", generator=generator).bfloat16()
    timestep = torch.full((batch,), 500.0, device="cuda", dtype=torch.bfloat16)
    text = torch.randn((batch, TEXT_TOKENS, 3072), device="cuda", generator=generator).bfloat16()
    lens = [TEXT_TOKENS] * batch
    if padded and batch > 1:
        lens[0] = TEXT_TOKENS - 37
        text[0, lens[0]:] = 0
    return latents, timestep, text, lens


def fp8_rows(ours: ErnieDiT, measure) -> None:
    """FP8 weights (e4m3, per-row scales, torch._scaled_mm on SM >= 8.9) with fused projections, compiled."""
    from ernie_image.runtime.model.compile import compile_blocks

    label = "ours FP8 compiled, fused projections"
    try:
        fp8 = quantised_copy(ours, "fp8")
    except Exception as error:
        print(f"# {label}: FAILED to build: {type(error).__name__}: {error}")
        return
    compile_blocks(fp8)
    lat, ts, txt, lens = inputs(1)
    _, first_s = wall_time(lambda: fp8(lat, ts, txt, lens))
    measure(label, 1, lambda: fp8(lat, ts, txt, lens), first_s)
    weights = sum(t.numel() * t.element_size() for t in list(fp8.parameters()) + list(fp8.buffers()))
    print(f"# {label}: DiT weights {weights / 1e9:.2f} GB")
    fp8 = None  # drop the copy before emptying the cache
    torch.cuda.empty_cache()


# Compile settings weighed against the default (torch.compile of each block, inductor defaults).
COMPILE_VARIANTS = {
    "coordinate-descent tuned fused kernels": {"options": {"coordinate_descent_tuning": True}},
    "max-autotune (persistent TMA GEMM templates, epilogue fusion)": {"options": {
        "max_autotune": True, "coordinate_descent_tuning": True, "triton.enable_persistent_tma_matmul": True}},
}


def compiled_rows(ours: ErnieDiT, reference, measure, outputs: dict, variants: bool) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from ernie_image.runtime.model.compile import compile_blocks, fuse_projections

    def first_then_warm(name: str, batch: int, padded: bool = False, run=None, keep: str | None = None):
        lat, ts, txt, lens = inputs(batch, padded=padded)
        run = run or (lambda: ours(lat, ts, txt, lens))
        result, first_s = wall_time(run)
        if keep:
            outputs[(keep, batch)] = result
        measure(name, batch, run, first_s)

    compile_blocks(ours)
    for batch in (1, 2):
        first_then_warm("ours compiled, unfused", batch)
    torch._dynamo.reset()
    fuse_projections(ours)
    for batch in (1, 2):
        measure("floor: block GEMMs + attention only", batch, block_matmuls(ours, batch, SEQ))
    compile_blocks(ours)
    for batch in (1, 2):
        first_then_warm("ours compiled", batch, keep="ours compiled")
    first_then_warm("ours compiled, unequal CFG texts", 2, padded=True)
    lat, ts, txt, lens = inputs(1)
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION):
        def run_with_backend(backend=backend):
            with sdpa_kernel([backend]):
                return ours(lat, ts, txt, lens)
        try:
            torch._dynamo.reset()
            compile_blocks(ours)
            first_then_warm(f"ours compiled, SDPA {backend.name}", 1, run=run_with_backend)
        except Exception as error:
            print(f"# SDPA {backend.name}: {type(error).__name__}: {error}"[:200])
    for label, settings in (COMPILE_VARIANTS.items() if variants else ()):
        torch._dynamo.reset()
        for block in ours.layers:
            block.compile(**settings)
        for batch in (1, 2):
            first_then_warm(f"ours compiled, {label}", batch, keep=f"ours compiled, {label}")
    torch._dynamo.reset()
    compile_blocks(ours)
    fp8_rows(ours, measure)
    reference.compile_repeated_blocks(fullgraph=True)
    for batch in (1, 2):
        lat, ts, txt, lens = inputs(batch)
        lens_t = torch.tensor(lens, device="cuda")
        first_then_warm("diffusers compile_repeated_blocks", batch,
                        run=lambda: reference(lat, ts, txt, lens_t, return_dict=False))


def dit_rows(ours, reference, skip_compile: bool, variants: bool = False) -> list[dict]:
    rows = []
    outputs = {}
    sampler = GpuSampler()

    def measure(name: str, batch: int, run, compile_s: float | None = None):
        try:
            with sampler.phase():
                ms = cuda_time_ms(run)
            flops = dit_flops() * batch
            rows.append({"variant": name, "batch": batch, "ms": f"{ms:.1f}", "TFLOP/s": f"{flops / ms / 1e9:.0f}",
                         "first call s": "" if compile_s is None else f"{compile_s:.1f}",
                         "x burst floor": f"{ms / burst_floor_ms(batch):.2f}", "clock": sampler.summary(),
                         "_ms": ms})
            print(f"# {name} b{batch}: {ms:.1f} ms ({sampler.summary()})"
                  + ("" if compile_s is None else f", first call {compile_s:.1f} s"), flush=True)
        except Exception as error:  # one failing variant must not hide the others
            rows.append({"variant": name, "batch": batch, "ms": f"FAILED: {type(error).__name__}: {error}"[:90]})

    with torch.inference_mode():
        for batch in (1, 2):
            lat, ts, txt, lens = inputs(batch)
            lens_t = torch.tensor(lens, device="cuda")
            outputs[("diffusers", batch)] = reference(lat, ts, txt, lens_t, return_dict=False)[0]
            measure("diffusers eager", batch, lambda: reference(lat, ts, txt, lens_t, return_dict=False))
            outputs[("ours", batch)] = ours(lat, ts, txt, lens)
            measure("ours eager", batch, lambda: ours(lat, ts, txt, lens))
        lat, ts, txt, lens = inputs(2, padded=True)
        measure("ours eager, CFG texts of unequal length", 2, lambda: ours(lat, ts, txt, lens))

        if not skip_compile:
            compiled_rows(ours, reference, measure, outputs, variants)

    for batch in (1, 2):
        base = outputs[("diffusers", batch)].float()
        assert torch.isfinite(base).all(), "reference output is not finite: rescale the random weights"
        for key in sorted(key for key, b in outputs if key.startswith("ours") and b == batch):
            ours_out = outputs[(key, batch)].float()
            assert torch.isfinite(ours_out).all()
            rel = ((ours_out - base).norm() / base.norm()).item()
            print(f"# numerics batch {batch} {key} vs diffusers: relative L2 error {rel:.2e}")
    eager = {r["batch"]: r["_ms"] for r in rows if r["variant"] == "diffusers eager" and "_ms" in r}
    floor = {r["batch"]: r["_ms"] for r in rows if r["variant"].startswith("floor") and "_ms" in r}
    for row in rows:
        if "_ms" in row and row["batch"] in eager:
            row["x diffusers"] = f"{row['_ms'] / eager[row['batch']]:.2f}"
        if "_ms" in row and row["batch"] in floor:
            row["x floor"] = f"{row['_ms'] / floor[row['batch']]:.2f}"
    return rows


def main() -> None:
    if "--pe-e2e" in sys.argv[1:]:  # its own options (and --help): bench/pe_e2e.py
        from pe_e2e import main as pe_e2e_main

        pe_e2e_main([arg for arg in sys.argv[1:] if arg != "--pe-e2e"])
        return
    parser = argparse.ArgumentParser()
    parser.add_argument("--skip-compile", action="store_true")
    parser.add_argument("--skip-e2e", action="store_true")
    parser.add_argument("--skip-dit", action="store_true", help="whole images only")
    parser.add_argument("--compile-variants", action="store_true",
                        help="also inductor's coordinate-descent and max-autotune compiles (about 3 more minutes)")
    parser.add_argument("--pe-e2e", action="store_true",
                        help="only whole images with the prompt enhancer on and off, next to diffusers' use_pe=True; "
                             "its options: bench/speed.py --pe-e2e --help")
    args = parser.parse_args()
    print_environment()
    if not args.skip_dit:
        ours, reference = build_models()
        rows = dit_rows(ours, reference, args.skip_compile, args.compile_variants)
        print(f"\nDiT forward, {WIDTH}x{HEIGHT}, {TEXT_TOKENS} text tokens, bf16 (burst floor: GEMMs at "
              f"{GEMM_TFLOPS_BF16:.0f} TFLOP/s + flash attention, {burst_floor_ms(1):.0f} ms b1; measured floor: the row)")
        print(table(rows, ["variant", "batch", "ms", "TFLOP/s", "x diffusers", "x floor", "x burst floor",
                           "first call s", "clock"]))
        del ours, reference
        gc.collect()
        torch.cuda.empty_cache()
    if not args.skip_e2e:
        from e2e import end_to_end_rows

        e2e_rows = end_to_end_rows(compile_dit=not args.skip_compile)
        print("\nWhole image 1024x1024 (text encoding + steps + VAE decode), PE off, bf16, all resident")
        print(table(e2e_rows, ["pipeline", "preset", "cold s", "warm s", "text ms", "steps s", "decode ms"]))


if __name__ == "__main__":
    main()
