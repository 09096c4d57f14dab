"""Image in on the GPU: VAE encode time and peak at 1024 and 2048, and a hires second pass at a 12 GB budget.

    python bench/image_in.py --out image_in.json      # CUDA, full-size random weights, about 2-3 minutes
    python bench/image_in.py --tiny                   # CPU smoke run of the same code paths, tiny models

Rows:
- VAE encode (posterior mean + patchify + BatchNorm, runtime/model/vae_encode.py) of the released FLUX.2 VAE config in bf16:
  whole 1024x1024, 2048x2048 as the runtime runs it unplanned (tiles of the VAE's 1024 sample size), and 2048x2048
  as the 12 GB plan places it (512-pixel tiles). Measured peak above the weights next to the planner's estimate.
- DiT step, text-to-image 1024x1024 at a 12 GB budget (the planner's placement, blocks streamed from pinned RAM).
- Hires second pass: 2048x2048 (16,384 image tokens + 512 text), denoise 0.4 with 8 Turbo steps (the last 8 of
  a 20-step schedule), started from encoded latents through image_in.StartState, the DiT placed by the 12 GB
  plan of a 2048x2048 job with an image in; then the VAE decode the plan picks. Every row's allocator is capped
  at its budget (set_per_process_memory_fraction): a plan that does not fit fails its row, loudly.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # as the CLI sets it

import torch

from common import dit_config, import_package, print_environment, randomise_dit_, table

import_package()

from ernie_image.runtime.core.host import NullHost  # noqa: E402
from ernie_image.runtime.formats.config_json import load_config  # noqa: E402
from ernie_image.runtime.model.dit import DiTConfig, ErnieDiT  # noqa: E402
from ernie_image.runtime.model.vae_decode import decode_images  # noqa: E402
from ernie_image.runtime.model.vae_encode import encode_images  # noqa: E402
from ernie_image.runtime.offload.placement import DiTPlacement  # noqa: E402
from ernie_image.runtime.offload.planner import GiB, plan_memory  # noqa: E402
from ernie_image.runtime.offload.sizes import ModelSizes  # noqa: E402
from ernie_image.runtime.offload.workspace import Job, dit_workspace, vae_encode_workspace, vae_workspace  # noqa: E402
from ernie_image.runtime.sampling.euler import initial_noise, sample_euler  # noqa: E402
from ernie_image.runtime.sampling.image_in import StartState, denoise_sigmas  # noqa: E402

TEXT_TOKENS = 512  # the planner's text length


@dataclass
class Setup:
    device: torch.device
    dtype: torch.dtype
    sizes: ModelSizes
    dit_config: dict
    vae_config: dict
    small: int  # the "1024" side
    large: int  # the "2048" side
    budget_gb: Optional[float]
    text_width: int


def full_setup() -> Setup:
    sizes = ModelSizes.released("turbo")
    return Setup(torch.device("cuda"), torch.bfloat16, sizes, dit_config("ERNIE-Image-Turbo"),
                 load_config("turbo", "vae"), 1024, 2048, 12.0, 3072)


def tiny_setup() -> Setup:
    from ernie_image.runtime.demo.tiny import TinySizes

    tiny = TinySizes()
    dit = {"hidden_size": tiny.dit_hidden, "num_attention_heads": tiny.dit_heads, "num_layers": tiny.dit_layers,
           "ffn_hidden_size": tiny.dit_hidden * 3, "in_channels": 128, "out_channels": 128,
           "text_in_dim": tiny.text_hidden, "rope_axes_dim": [8, 12, 12]}
    vae = {**load_config("turbo", "vae"), "block_out_channels": list(tiny.vae_channels), "layers_per_block": 1,
           "norm_num_groups": 8, "sample_size": 256}
    return Setup(torch.device("cpu"), torch.float32, ModelSizes.released("turbo"), dit, vae, 256, 512, None,
                 tiny.text_hidden)


def synchronize(setup: Setup) -> None:
    if setup.device.type == "cuda":
        torch.cuda.synchronize()


def clean(setup: Setup) -> None:
    gc.collect()
    if setup.device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(1.0)


def cap(setup: Setup, budget: Optional[int]) -> int:
    """Cap the allocator at `budget` and start a peak measurement; returns the bytes allocated now."""
    if setup.device.type != "cuda":
        return 0
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(1.0 if budget is None else min(1.0, budget / total))
    return torch.cuda.memory_allocated()


def peak(setup: Setup) -> int:
    return torch.cuda.max_memory_allocated() if setup.device.type == "cuda" else 0


def timed(setup: Setup, run: Callable[[], object], repeats: int = 3) -> tuple[object, float]:
    """The result of a warm-up call and the median wall seconds of `repeats` more."""
    result = run()
    synchronize(setup)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        synchronize(setup)
        times.append(time.perf_counter() - started)
    return result, sorted(times)[len(times) // 2]


def build_vae(setup: Setup, part: str):
    from diffusers import AutoencoderKLFlux2

    config = {k: v for k, v in setup.vae_config.items() if not k.startswith("_") and k != "force_upcast"}
    torch.manual_seed(0)
    with torch.device(setup.device):
        vae = AutoencoderKLFlux2.from_config(config)
    if part == "encoder":
        vae.decoder = vae.post_quant_conv = None
    else:
        vae.encoder = vae.quant_conv = None
    with torch.no_grad():
        vae.bn.running_var.fill_(1.0)
    return vae.to(setup.dtype).eval().requires_grad_(False)


def build_dit(setup: Setup, plan) -> tuple[ErnieDiT, Optional[DiTPlacement]]:
    with torch.device(setup.device):
        dit = ErnieDiT(DiTConfig.from_dict(setup.dit_config)).to(setup.dtype)
    dit.eval().requires_grad_(False)
    randomise_dit_(dit, seed=0)
    placement = DiTPlacement(dit, plan, setup.device) if plan is not None and plan.streamed else None
    return dit, placement


def image(setup: Setup, side: int) -> torch.Tensor:
    return torch.rand((1, side, side, 3), generator=torch.Generator().manual_seed(side))


def plan_for(setup: Setup, side: int, encode: bool):
    budget = None if setup.budget_gb is None else int(setup.budget_gb * GiB)
    return plan_memory(budget, Job(side, side, 1, 1.0, TEXT_TOKENS, encode=encode), setup.sizes, setup.device.type)


def encode_row(setup: Setup, side: int, tile: Optional[int], label: str) -> dict:
    vae = build_vae(setup, "encoder")
    pixels = image(setup, side)
    weights = cap(setup, None)
    try:
        with torch.inference_mode():
            latents, seconds = timed(setup, lambda: encode_images(pixels, vae, tile))
        if not torch.isfinite(latents).all():
            raise AssertionError("non-finite latents from the random VAE encoder")
        estimate = vae_encode_workspace(setup.sizes, Job(side, side, encode=True), tile, "cuda")
        return {"row": label, "size": f"{side}x{side}", "ms": round(1000 * seconds, 1),
                "peak GiB": f"{peak(setup) / GiB:.2f}", "work meas GiB": f"{(peak(setup) - weights) / GiB:.2f}",
                "work est GiB": f"{estimate / GiB:.2f}"}
    finally:
        vae = None
        clean(setup)


def dit_text_inputs(setup: Setup):
    generator = torch.Generator(device=setup.device).manual_seed(1)
    text = torch.randn(1, TEXT_TOKENS, setup.text_width, generator=generator, device=setup.device).to(setup.dtype)
    return text, [TEXT_TOKENS]


def text_to_image_step_row(setup: Setup) -> dict:
    plan = plan_for(setup, setup.small, encode=False)
    dit, placement = build_dit(setup, plan.dit)
    text, lens = dit_text_inputs(setup)
    noise = initial_noise(2, 1, setup.small, setup.small).to(setup.device)
    weights = cap(setup, None if setup.budget_gb is None else plan.budget)
    try:
        with torch.inference_mode():
            timestep = torch.full((1,), 700.0, device=setup.device, dtype=setup.dtype)
            _, seconds = timed(setup, lambda: dit(noise.to(setup.dtype), timestep, text, lens))
        return {"row": "DiT step, text-to-image", "size": f"{setup.small}x{setup.small}",
                "ms": round(1000 * seconds, 1), "peak GiB": f"{peak(setup) / GiB:.2f}",
                "work meas GiB": f"{(peak(setup) - weights) / GiB:.2f}",
                "work est GiB": f"{dit_workspace(setup.sizes, plan.job, 'cuda') / GiB:.2f}",
                "resident": f"{len(plan.dit.resident)}/{plan.dit.layers}"}
    finally:
        if placement is not None:
            placement.release()
        dit = placement = None
        clean(setup)


def hires_rows(setup: Setup) -> list[dict]:
    side = setup.large
    plan = plan_for(setup, side, encode=True)
    print(plan.table())
    encoder = build_vae(setup, "encoder")
    with torch.inference_mode():
        x0 = encode_images(image(setup, side), encoder, plan.encode.tile if plan.encode else None)
    encoder = None
    clean(setup)
    dit, placement = build_dit(setup, plan.dit)
    text, lens = dit_text_inputs(setup)
    noise = initial_noise(3, 1, side, side).to(setup.device)
    steps = 8
    start = StartState(denoise_sigmas(steps, 4.0, 0.4), x0.to(setup.device))
    budget = None if setup.budget_gb is None else plan.budget
    rows = []
    weights = cap(setup, budget)
    try:
        with torch.inference_mode():
            def second_pass():
                return sample_euler(lambda x, t: dit(x, t, text, lens), noise, steps, 4.0, 1.0, setup.dtype,
                                    NullHost(), start=start)
            latents, seconds = timed(setup, second_pass, repeats=1)
        if not torch.isfinite(latents).all():
            raise AssertionError("non-finite latents from the second pass")
        rows.append({"row": f"hires 2nd pass, {steps} steps at denoise 0.4 (per step)", "size": f"{side}x{side}",
                     "ms": round(1000 * seconds / steps, 1), "peak GiB": f"{peak(setup) / GiB:.2f}",
                     "work meas GiB": f"{(peak(setup) - weights) / GiB:.2f}",
                     "work est GiB": f"{dit_workspace(setup.sizes, plan.job, 'cuda') / GiB:.2f}",
                     "resident": f"{len(plan.dit.resident)}/{plan.dit.layers}"})
    finally:
        if placement is not None:
            placement.release()
        dit = placement = None
        clean(setup)
    decoder = build_vae(setup, "decoder")
    weights = cap(setup, budget)
    try:
        with torch.inference_mode():
            images, seconds = timed(setup, lambda: decode_images(latents, decoder, plan.vae.tile), repeats=1)
        estimate = vae_workspace(setup.sizes, plan.job, plan.vae.tile, "cuda")
        rows.append({"row": f"hires VAE decode ({'tiled ' + str(plan.vae.tile) if plan.vae.tile else 'as planned'})",
                     "size": f"{side}x{side}", "ms": round(1000 * seconds, 1), "peak GiB": f"{peak(setup) / GiB:.2f}",
                     "work meas GiB": f"{(peak(setup) - weights) / GiB:.2f}", "work est GiB": f"{estimate / GiB:.2f}"})
        assert images.shape == (1, side, side, 3)
    finally:
        decoder = None
        clean(setup)
    return rows


def guarded(rows: list[dict], label: str, make: Callable[[], object]) -> None:
    try:
        made = make()
        rows.extend(made if isinstance(made, list) else [made])
    except Exception as error:  # a failing row is reported and the run goes on
        traceback.print_exc()
        rows.append({"row": label, "ms": f"FAILED: {type(error).__name__}: {str(error)[:120]}"})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run with tiny models")
    parser.add_argument("--out", type=Path, help="write the rows and the environment as JSON here")
    args = parser.parse_args()
    if not args.tiny and not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (or --tiny for a CPU smoke run)")
    setup = tiny_setup() if args.tiny else full_setup()
    record = print_environment()
    started = time.perf_counter()
    rows: list[dict] = []
    small, large = setup.small, setup.large
    guarded(rows, "VAE encode whole", lambda: encode_row(setup, small, None, "VAE encode, whole image"))
    guarded(rows, "VAE encode unplanned", lambda: encode_row(setup, large, None, "VAE encode, unplanned (auto tiles)"))
    large_tile = plan_for(setup, large, True).encode
    guarded(rows, "VAE encode planned", lambda: encode_row(
        setup, large, large_tile.tile if large_tile else None, f"VAE encode, {setup.budget_gb or '-'} GB plan"))
    guarded(rows, "DiT step text-to-image", lambda: text_to_image_step_row(setup))
    guarded(rows, "hires second pass", lambda: hires_rows(setup))
    print()
    print(table(rows, ["row", "size", "ms", "peak GiB", "work meas GiB", "work est GiB", "resident"]))
    print(f"\n{time.perf_counter() - started:.0f} s in all; budget {setup.budget_gb or 'none'} GB")
    if args.out is not None:
        args.out.write_text(json.dumps({"environment": record, "budget_gb": setup.budget_gb, "rows": rows}, indent=2))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
