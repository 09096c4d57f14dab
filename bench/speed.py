"""DiT step and whole-image speed on the GPU, against diffusers on the same random weights in the same run.

    python bench/speed.py [--skip-e2e] [--skip-compile] [--fp8]

Prints: per variant, ms per DiT forward at 1024x1024 with 256 text tokens, TFLOP/s, ratio to diffusers eager,
ratio to the GEMM+attention floor; then whole Turbo and Base images (cold and warm) next to diffusers' pipeline.
"""
from __future__ import annotations

import argparse
import gc
import time

import torch

from common import (cuda_time_ms, dit_config, dit_flops, import_package, print_environment, quantise_block_linears_,
                    randomise_dit_, table)

import_package()

from ernie_image.runtime.dit import DiTConfig, ErnieDiT  # noqa: E402

WIDTH = HEIGHT = 1024
TEXT_TOKENS = 256
# Measured on this H200 (ERNIE.md): bf16 GEMM 752 TFLOP/s, flash SDPA 0.51 ms per layer at batch 1.
GEMM_TFLOPS_BF16 = 752.0
ATTENTION_MS_PER_LAYER = 0.51


def floor_ms(batch: int) -> float:
    seq = (WIDTH // 16) * (HEIGHT // 16) + TEXT_TOKENS
    gemm_flops = 36 * (8 * seq * 4096 ** 2 + 6 * seq * 4096 * 12288) * batch
    return gemm_flops / (GEMM_TFLOPS_BF16 * 1e12) * 1e3 + 36 * ATTENTION_MS_PER_LAYER * batch


def build_models():
    config = DiTConfig.from_dict(dit_config())
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        ours = ErnieDiT(config)
    torch.set_default_dtype(torch.float32)
    randomise_dit_(ours)
    ours.eval().requires_grad_(False)
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


def quantised_copy(model: ErnieDiT, fmt: str) -> ErnieDiT:
    """A second DiT sharing `model`'s non-Linear tensors, every block Linear packed to `fmt` on the GPU."""
    with torch.device("meta"):
        copy = ErnieDiT(model.config)
    if model.layers[0].self_attention.to_qkv is not None:
        for block in copy.layers:
            block.self_attention.fuse_projections()
            block.mlp.fuse_projections()
    copy.load_state_dict(model.state_dict(), assign=True)
    quantise_block_linears_(copy, fmt)
    return copy.eval().requires_grad_(False)


def fp8_rows(ours: ErnieDiT, measure) -> None:
    """FP8 weights (e4m3, per-row scales, torch._scaled_mm on SM >= 8.9), per-Linear and with fused projections."""
    from ernie_image.runtime.acceleration import compile_blocks

    for label in ("ours FP8 compiled, fused projections",):
        try:
            fp8 = quantised_copy(ours, "fp8")
        except Exception as error:
            print(f"# {label}: FAILED to build: {type(error).__name__}: {error}")
            continue
        compile_blocks(fp8)
        lat, ts, txt, lens = inputs(1)
        started = time.perf_counter()
        fp8(lat, ts, txt, lens)
        torch.cuda.synchronize()
        measure(label, 1, lambda: fp8(lat, ts, txt, lens), time.perf_counter() - started)
        weights = sum(t.numel() * t.element_size() for t in list(fp8.parameters()) + list(fp8.buffers()))
        print(f"# {label}: DiT weights {weights / 1e9:.2f} GB")
        fp8 = None
        torch.cuda.empty_cache()


def dit_rows(ours, reference, skip_compile: bool) -> list[dict]:
    rows = []
    outputs = {}

    def measure(name: str, batch: int, run, compile_s: float | None = None, padded: bool = False):
        try:
            ms = cuda_time_ms(run)
            flops = dit_flops() * batch
            rows.append({"variant": name, "batch": batch, "ms": f"{ms:.1f}", "TFLOP/s": f"{flops / ms / 1e9:.0f}",
                         "first call s": "" if compile_s is None else f"{compile_s:.1f}",
                         "x floor": f"{ms / floor_ms(batch):.2f}", "_ms": ms, "_padded": padded})
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
        measure("ours eager, CFG texts of unequal length", 2, lambda: ours(lat, ts, txt, lens), padded=True)

        if not skip_compile:
            from ernie_image.runtime.acceleration import compile_blocks, fuse_projections

            compile_blocks(ours)
            for batch in (1, 2):
                lat, ts, txt, lens = inputs(batch)
                started = time.perf_counter()
                ours(lat, ts, txt, lens)
                torch.cuda.synchronize()
                measure("ours compiled, unfused", batch, lambda: ours(lat, ts, txt, lens), time.perf_counter() - started)
            torch._dynamo.reset()
            fuse_projections(ours)
            compile_blocks(ours)
            for batch in (1, 2):
                lat, ts, txt, lens = inputs(batch)
                started = time.perf_counter()
                outputs[("ours compiled", batch)] = ours(lat, ts, txt, lens)
                torch.cuda.synchronize()
                measure("ours compiled", batch, lambda: ours(lat, ts, txt, lens), time.perf_counter() - started)
            lat, ts, txt, lens = inputs(2, padded=True)
            started = time.perf_counter()
            ours(lat, ts, txt, lens)
            torch.cuda.synchronize()
            measure("ours compiled, unequal CFG texts", 2, lambda: ours(lat, ts, txt, lens),
                    time.perf_counter() - started, padded=True)
            from torch.nn.attention import SDPBackend, sdpa_kernel

            lat, ts, txt, lens = inputs(1)
            for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION):
                def run_with_backend(backend=backend):
                    with sdpa_kernel([backend]):
                        return ours(lat, ts, txt, lens)
                try:
                    torch._dynamo.reset()
                    compile_blocks(ours)
                    started = time.perf_counter()
                    run_with_backend()
                    torch.cuda.synchronize()
                    measure(f"ours compiled, SDPA {backend.name}", 1, run_with_backend, time.perf_counter() - started)
                except Exception as error:
                    print(f"# SDPA {backend.name}: {type(error).__name__}: {error}"[:200])
            torch._dynamo.reset()
            compile_blocks(ours)
            fp8_rows(ours, measure)
            reference.compile_repeated_blocks(fullgraph=True)
            for batch in (1, 2):
                lat, ts, txt, lens = inputs(batch)
                lens_t = torch.tensor(lens, device="cuda")
                started = time.perf_counter()
                reference(lat, ts, txt, lens_t, return_dict=False)
                torch.cuda.synchronize()
                measure("diffusers compile_repeated_blocks", batch,
                        lambda: reference(lat, ts, txt, lens_t, return_dict=False), time.perf_counter() - started)

    for batch in (1, 2):
        base = outputs[("diffusers", batch)].float()
        assert torch.isfinite(base).all(), "reference output is not finite: rescale the random weights"
        for key in ("ours", "ours compiled"):  # "ours compiled" is the fused + compiled model
            if (key, batch) in outputs:
                ours_out = outputs[(key, batch)].float()
                assert torch.isfinite(ours_out).all()
                rel = ((ours_out - base).norm() / base.norm()).item()
                print(f"# numerics batch {batch} {key} vs diffusers: relative L2 error {rel:.2e}")
    eager = {r["batch"]: r["_ms"] for r in rows if r["variant"] == "diffusers eager" and "_ms" in r}
    for row in rows:
        if "_ms" in row and row["batch"] in eager:
            row["x diffusers"] = f"{row['_ms'] / eager[row['batch']]:.2f}"
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--skip-compile", action="store_true")
    parser.add_argument("--skip-e2e", action="store_true")
    args = parser.parse_args()
    print_environment()
    ours, reference = build_models()
    rows = dit_rows(ours, reference, args.skip_compile)
    print(f"\nDiT forward, {WIDTH}x{HEIGHT}, {TEXT_TOKENS} text tokens, bf16 "
          f"(floor = GEMMs at {GEMM_TFLOPS_BF16:.0f} TFLOP/s + flash attention: {floor_ms(1):.0f} ms b1)")
    print(table(rows, ["variant", "batch", "ms", "TFLOP/s", "x diffusers", "x floor", "first call s"]))
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
