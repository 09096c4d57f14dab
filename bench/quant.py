"""Benchmark the quantised DiT formats against bf16 in one run (GPU; `--tiny` runs anywhere).

Builds diffusers' ErnieImageTransformer2DModel at the released size with random weights (scaled so 36
blocks stay finite), then for each format swaps QuantLinear modules in for the Linear layers (weights
quantised on the GPU from the same bf16 weights), and reports:
  forward ms (1024x1024, 256 text tokens, batch 1, eager), ratio to bf16, DiT weight bytes resident,
  relative L2 error vs bf16 of one Linear (layers.0.mlp.up_proj on random inputs) and of the whole forward.
Modes: "q8_0" etc. dequantise per layer in eager torch; "+compile" routes that through torch.compile (one
fused kernel per layer instead of ~10 eager ones; the first call's compile time is reported separately);
"+triton" uses the one-pass Triton kernels (runtime/quant/triton_dequant.py), the default on CUDA.
`--micro` first times each Triton dequant kernel alone on one 12288x4096 weight (GB/s = packed bytes read
plus output bytes written, over the kernel time), against the eager torch dequant, and checks that both give
the same bf16 bits.

    python bench/quant.py                      # full size, needs ~40 GB of GPU memory, ~4-5 minutes
    python bench/quant.py --micro --modes bf16,q8_0+triton,q4_k+triton,nvfp4+triton   # ~2 minutes
    python bench/quant.py --micro-only         # the kernel table alone, ~20 s
    python bench/quant.py --tiny --device cpu  # a smoke run of the same code on a tiny model
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn

from common import cuda_time_ms, dit_config, import_package, randomise_dit_

import_package()
from ernie_image.runtime.model.compile import allow_cache_size  # noqa: E402
from ernie_image.runtime.quant import QuantLinear, enable_compiled_dequant, quantize_weight  # noqa: E402
from ernie_image.runtime.quant.gguf_blocks import BLOCK_GEOMETRY, FP16_SCALE_OFFSETS  # noqa: E402
from ernie_image.runtime.quant.linear import enable_triton_dequant  # noqa: E402
from ernie_image.runtime.quant.qweight import QuantizedWeight, dequantize_packed  # noqa: E402
from ernie_image.runtime.quant.triton_dequant import (DEFAULT_TILE, GGUF_KERNELS, dequantize_triton,  # noqa: E402
                                                      triton_available)
from ernie_image.runtime.quant.writer import should_quantize  # noqa: E402

DEFAULT_MODES = ("bf16", "fp8", "q8_0", "q8_0+compile", "q8_0+triton", "q4_k", "q4_k+compile", "q4_k+triton",
                 "nvfp4", "nvfp4+compile", "nvfp4+triton")
MICRO_SHAPE = (12288, 4096)  # the DiT's largest Linear (mlp up/gate: 4096 -> 12288)
MICRO_TILES = (1024, 2048, 4096, 8192)
PROBE_LAYER = "layers.0.mlp.up_proj"


def build_model(tiny: bool, device: torch.device) -> tuple[nn.Module, dict]:
    from diffusers import ErnieImageTransformer2DModel
    config = {k: v for k, v in dit_config().items() if not k.startswith("_")}
    if tiny:
        config.update(hidden_size=256, num_attention_heads=2, num_layers=2, ffn_hidden_size=512, text_in_dim=256)
    with torch.device(device):
        model = ErnieImageTransformer2DModel(**config).to(torch.bfloat16).eval()
    randomise_dit_(model)
    return model, config


def make_inputs(config: dict, tiny: bool, device: torch.device) -> tuple:
    side, text = (8, 16) if tiny else (64, 256)  # 1024x1024 -> 64x64 latent tokens
    g = torch.Generator(device="cpu").manual_seed(1)
    latents = torch.randn(1, config["in_channels"], side, side, generator=g).to(device, torch.bfloat16)
    text_emb = torch.randn(1, text, config["text_in_dim"], generator=g).to(device, torch.bfloat16)
    timestep = torch.tensor([500.0], device=device, dtype=torch.bfloat16)
    return latents, timestep, text_emb, torch.tensor([text], device=device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_forward(model: nn.Module, inputs: tuple, iters: int, device: torch.device) -> tuple[float, float, torch.Tensor]:
    """(first-call seconds, mean ms of `iters` later calls, output)."""
    with torch.no_grad():
        start = time.perf_counter()
        out = model(*inputs, return_dict=False)[0]
        _sync(device)
        first = time.perf_counter() - start
        model(*inputs, return_dict=False)
        _sync(device)
        start = time.perf_counter()
        for _ in range(iters):
            out = model(*inputs, return_dict=False)[0]
        _sync(device)
    return first, (time.perf_counter() - start) / iters * 1000, out


def _parent(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    parent, _, attr = name.rpartition(".")
    return (model.get_submodule(parent) if parent else model), attr


def swap_modules(model: nn.Module, replacements: dict[str, nn.Module]) -> dict[str, nn.Module]:
    previous = {}
    for name, module in replacements.items():
        parent, attr = _parent(model, name)
        previous[name] = getattr(parent, attr)
        setattr(parent, attr, module)
    return previous


def quantised_linears(model: nn.Module, fmt: str) -> dict[str, QuantLinear]:
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and should_quantize(f"{name}.weight", module.weight, fmt):
            qweight = quantize_weight(module.weight.data, fmt)
            out[name] = QuantLinear(qweight, None if module.bias is None else module.bias.data, torch.bfloat16, name)
    return out


def weight_bytes(model: nn.Module) -> int:
    seen, total = set(), 0
    for tensor in list(model.parameters()) + list(model.buffers()):
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            total += tensor.numel() * tensor.element_size()
    return total


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def micro_weights(device: torch.device) -> dict[str, QuantizedWeight]:
    """One MICRO_SHAPE weight per type: Q8_0, Q4_K and NVFP4 quantised from random values, the other GGUF
    types random blocks with sane fp16 scales (the kernels' speed does not depend on the values)."""
    torch.manual_seed(0)
    rows, cols = MICRO_SHAPE
    dense = torch.randn(MICRO_SHAPE, device=device) * 0.02
    out = {"Q8_0": quantize_weight(dense, "q8_0"), "Q4_K": quantize_weight(dense, "q4_k"),
           "NVFP4": quantize_weight(dense, "nvfp4")}
    for qtype in sorted(set(GGUF_KERNELS) - set(out)):
        block_size, type_size = BLOCK_GEOMETRY[qtype]
        raw = torch.randint(0, 256, (rows * cols // block_size, type_size), dtype=torch.uint8, device=device)
        for offset in FP16_SCALE_OFFSETS[qtype]:
            scales = (torch.rand(raw.shape[0], device=device) * 0.01).to(torch.float16)
            raw[:, offset:offset + 2] = scales.view(torch.uint8).reshape(-1, 2)
        out[qtype] = QuantizedWeight("gguf", qtype, raw.reshape(rows, -1), MICRO_SHAPE)
    return out


def micro_bench(device: torch.device) -> None:
    if device.type != "cuda" or not triton_available(device):
        print("# micro-bench skipped: needs CUDA and triton")
        return
    rows, cols = MICRO_SHAPE
    written = rows * cols * 2
    print(f"# dequant kernels, one {rows}x{cols} weight -> bf16 (GB/s = (packed bytes + bf16 bytes) / time)")
    print(f"| type | packed MB | triton us (tile {DEFAULT_TILE}) | triton GB/s | best tile | best us | "
          f"torch eager us | torch GB/s | speed-up | same bf16 bits |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for qtype, q in micro_weights(device).items():
        fmt = q.format
        args = (fmt, q.qtype, q.shape, q.data, q.scale, q.scale_2, torch.bfloat16)
        moved = q.nbytes + written
        per_tile = {tile: cuda_time_ms(lambda: dequantize_triton(*args, tile=tile), iters=20) for tile in MICRO_TILES}
        best_tile = min(per_tile, key=per_tile.get)
        default_ms = per_tile[DEFAULT_TILE]
        torch_ms = cuda_time_ms(lambda: dequantize_packed(*args), iters=5)
        same = torch.equal(dequantize_triton(*args).view(torch.int16), dequantize_packed(*args).view(torch.int16))
        print(f"| {qtype} | {q.nbytes / 1e6:.1f} | {default_ms * 1e3:.1f} | {moved / default_ms / 1e6:.0f} | "
              f"{best_tile} | {per_tile[best_tile] * 1e3:.1f} | {torch_ms * 1e3:.0f} | {moved / torch_ms / 1e6:.0f} | "
              f"{torch_ms / default_ms:.1f}x | {'yes' if same else 'NO'} |", flush=True)
    torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--modes", default=",".join(DEFAULT_MODES))
    parser.add_argument("--micro", action="store_true", help="first time each Triton dequant kernel alone")
    parser.add_argument("--micro-only", action="store_true", help="only the kernel micro-benchmark")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if args.micro or args.micro_only:
        micro_bench(device)
        if args.micro_only:
            return 0
    allow_cache_size()

    model, config = build_model(args.tiny, device)
    inputs = make_inputs(config, args.tiny, device)
    cap = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"# {name} (SM {cap}), torch {torch.__version__}, {'tiny' if args.tiny else 'full-size'} DiT, "
          f"tokens {inputs[0].shape[-1] * inputs[0].shape[-2]}+{inputs[2].shape[1]}, batch 1, eager")

    probe = model.get_submodule(PROBE_LAYER)
    probe_x = torch.randn(inputs[0].shape[-1] * inputs[0].shape[-2] + inputs[2].shape[1], probe.in_features,
                          device=device, dtype=torch.bfloat16)
    probe_ref = F.linear(probe_x, probe.weight)

    first, bf16_ms, reference = time_forward(model, inputs, args.iters, device)
    if not torch.isfinite(reference).all():
        print("reference bf16 output is not finite: the random init needs rescaling; no accuracy numbers")
        return 1
    rows = [("bf16", bf16_ms, 1.0, weight_bytes(model), 0.0, 0.0, first, 0)]
    for mode in [m for m in args.modes.split(",") if m and m != "bf16"]:
        fmt, _, option = mode.partition("+")
        enable_compiled_dequant(option == "compile")
        enable_triton_dequant(option == "triton")
        if option == "triton" and not triton_available(device):
            print(f"  {mode}: triton unavailable on {device}, the row below is the torch path")
        start = time.perf_counter()
        replacements = quantised_linears(model, fmt)
        _sync(device)
        quant_s = time.perf_counter() - start
        originals = swap_modules(model, replacements)
        try:
            resident = weight_bytes(model)
            with torch.no_grad():
                linear_err = rel_err(model.get_submodule(PROBE_LAYER)(probe_x), probe_ref)
            first, ms, out = time_forward(model, inputs, args.iters, device)
            fell_back = sum(getattr(m, "_native_failed", False) for m in replacements.values())
            rows.append((mode, ms, ms / bf16_ms, resident, linear_err, rel_err(out, reference), first, fell_back))
            print(f"  {mode}: quantised in {quant_s:.1f}s, first forward {first:.1f}s", flush=True)
        finally:
            swap_modules(model, originals)
            del replacements
            enable_compiled_dequant(False)
            enable_triton_dequant(True)
            if device.type == "cuda":
                torch.cuda.empty_cache()

    print("| mode | forward ms | x bf16 | DiT weights GB | Linear rel err | forward rel err | first call s |")
    print("|---|---|---|---|---|---|---|")
    for mode, ms, ratio, resident, lin, fwd, first, fell_back in rows:
        note = f" ({fell_back} layers fell back from native)" if fell_back else ""
        print(f"| {mode}{note} | {ms:.1f} | {ratio:.2f} | {resident / 1e9:.3f} | {lin:.4f} | {fwd:.4f} | {first:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
