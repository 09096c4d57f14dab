"""Benchmark the quantised DiT formats against bf16 in one run (GPU; `--tiny` runs anywhere).

Builds diffusers' ErnieImageTransformer2DModel at the released size with random weights (scaled so 36
blocks stay finite), then for each format swaps QuantLinear modules in for the Linear layers (weights
quantised on the GPU from the same bf16 weights), and reports:
  forward ms (1024x1024, 256 text tokens, batch 1, eager), ratio to bf16, DiT weight bytes resident,
  relative L2 error vs bf16 of one Linear (layers.0.mlp.up_proj on random inputs) and of the whole forward.
Modes ending in "+compile" route per-layer dequantisation through torch.compile (one fused kernel per
layer instead of ~10 eager ones); the first call's compile time is reported separately.

    python bench/quant.py                      # full size, needs ~40 GB of GPU memory, ~3-4 minutes
    python bench/quant.py --tiny --device cpu  # a smoke run of the same code on a tiny model
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parent.parent


def _import_pack():
    """Import the repo as the package `ernie_image` whatever the checkout folder is called."""
    import importlib.util
    if "ernie_image" not in sys.modules:
        spec = importlib.util.spec_from_file_location("ernie_image", ROOT / "__init__.py",
                                                      submodule_search_locations=[str(ROOT)])
        module = importlib.util.module_from_spec(spec)
        sys.modules["ernie_image"] = module
        spec.loader.exec_module(module)


_import_pack()
from ernie_image.runtime.quant import QuantLinear, enable_compiled_dequant, quantize_weight  # noqa: E402
from ernie_image.runtime.quant.writer import should_quantize  # noqa: E402

DEFAULT_MODES = ("bf16", "fp8", "q8_0", "q8_0+compile", "q4_k", "q4_k+compile", "nvfp4", "nvfp4+compile")
PROBE_LAYER = "layers.0.mlp.up_proj"


def build_model(tiny: bool, device: torch.device) -> tuple[nn.Module, dict]:
    from diffusers import ErnieImageTransformer2DModel
    config = json.loads((ROOT / "runtime/configs/ERNIE-Image/transformer/config.json").read_text())
    config = {k: v for k, v in config.items() if not k.startswith("_")}
    if tiny:
        config.update(hidden_size=256, num_attention_heads=2, num_layers=2, ffn_hidden_size=512, text_in_dim=256)
    torch.manual_seed(0)
    with torch.device(device):
        model = ErnieImageTransformer2DModel(**config).to(torch.bfloat16).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                fan_in = p[0].numel()
                # Modulation and gates small so 36 residual blocks stay finite with random weights.
                gain = 0.1 if "adaLN_modulation" in name else 1.0
                p.normal_(0.0, gain / fan_in ** 0.5)
            elif "norm" in name or "_ln" in name:
                p.fill_(1.0)
            else:
                p.zero_()
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--modes", default=",".join(DEFAULT_MODES))
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)

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
            if device.type == "cuda":
                torch.cuda.empty_cache()

    print(f"| mode | forward ms | x bf16 | DiT weights GB | Linear rel err | forward rel err | first call s |")
    print("|---|---|---|---|---|---|---|")
    for mode, ms, ratio, resident, lin, fwd, first, fell_back in rows:
        note = f" ({fell_back} layers fell back from native)" if fell_back else ""
        print(f"| {mode}{note} | {ms:.1f} | {ratio:.2f} | {resident / 1e9:.3f} | {lin:.4f} | {fwd:.4f} | {first:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
