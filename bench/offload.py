"""Chunked VRAM offload on the GPU: DiT step time and peak VRAM per budget, against diffusers' group offload.

    python bench/offload.py            # budget table (+ Turbo image at 12 GB vs resident)
    python bench/offload.py --soak     # 20 Turbo images in a row at 12 GB: host RSS and VRAM must stay flat

Full-size random weights from runtime/formats/configs (built on the GPU, streamed blocks moved into one pinned slab),
1024x1024, 256 text tokens. Each budget is enforced twice: the runtime's planner places the weights within it
and torch.cuda.set_per_process_memory_fraction makes the allocator fail above it. A failing row prints its
error and the run goes on.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import time
import traceback
from typing import Callable, Optional

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # as the CLI sets it

import torch

from common import (cuda_time_ms, dit_config, import_package, print_environment, quantise_block_linears_,
                    randomise_dit_, rss_bytes, table)

import_package()

from ernie_image.runtime.core.host import NullHost  # noqa: E402
from ernie_image.runtime.local.memory import measured_dit_size  # noqa: E402
from ernie_image.runtime.model.dit import DiTConfig, ErnieDiT  # noqa: E402
from ernie_image.runtime.offload.placement import DiTPlacement, TextPlacement  # noqa: E402
from ernie_image.runtime.offload.planner import (  # noqa: E402
                                                 GiB, DiTPlan, MemoryPlan, allocator_slack, plan_dit, plan_memory)
from ernie_image.runtime.offload.sizes import ModelSizes  # noqa: E402
from ernie_image.runtime.offload.streamer import typed_view  # noqa: E402
from ernie_image.runtime.offload.workspace import Job, dit_workspace  # noqa: E402

DEVICE = torch.device("cuda")
TEXT_TOKENS = 256
SIZES = ModelSizes.released("turbo")
TOTAL = torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else 0


def clean() -> None:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(1.0)


def enforce(budget: Optional[int]) -> None:
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.set_per_process_memory_fraction(1.0 if budget is None else min(1.0, budget / TOTAL))


def build_dit(plan: Optional[DiTPlan]) -> tuple[ErnieDiT, Optional[DiTPlacement]]:
    """Random DiT (same seed every time: same weights in every row) placed per `plan` (None: all resident)."""
    with torch.device(DEVICE):
        dit = ErnieDiT(DiTConfig.from_dict(dit_config("ERNIE-Image-Turbo"))).to(torch.bfloat16)
    dit.eval().requires_grad_(False)
    randomise_dit_(dit, seed=0)
    placement = DiTPlacement(dit, plan, DEVICE) if plan is not None and plan.streamed else None
    return dit, placement


def dit_inputs(batch: int):
    generator = torch.Generator(device=DEVICE).manual_seed(1)
    latents = torch.randn(batch, 128, 64, 64, generator=generator, device=DEVICE).to(torch.bfloat16)
    text = torch.randn(batch, TEXT_TOKENS, 3072, generator=generator, device=DEVICE).to(torch.bfloat16)
    timestep = torch.full((batch,), 700.0, device=DEVICE, dtype=torch.bfloat16)
    return latents, timestep, text, [TEXT_TOKENS] * batch


def timed_forward(dit: ErnieDiT, args, budget: Optional[int]) -> tuple[torch.Tensor, float, int]:
    """One checked forward (its output, fp32 on the host), the median step ms and the peak VRAM, which must stay
    within `budget` (None: unbounded)."""
    with torch.inference_mode():
        out = dit(*args)
        if not torch.isfinite(out).all():
            raise AssertionError("non-finite DiT output: fix the random init before trusting the numbers")
        ms = cuda_time_ms(lambda: dit(*args), warmup=2, iters=5)
        out = out.float().cpu()
    peak = torch.cuda.max_memory_allocated()
    if budget is not None and peak > budget:
        raise AssertionError(f"peak {peak / GiB:.2f} GiB above the budget {budget / GiB:.2f} GiB")
    return out, ms, peak


def budget_row(name: str, budget_gb: Optional[float], batch: int, all_streamed: bool = False) -> dict:
    job = Job(1024, 1024, batch, 1.0, TEXT_TOKENS)
    workspace = dit_workspace(SIZES, job)
    if all_streamed:
        plan = plan_dit(SIZES, 0, 2, workspace)
        budget = plan.gpu_weight_bytes + workspace
        budget += allocator_slack(budget)
    elif budget_gb is None:
        plan, budget = None, None
    else:
        budget = int(budget_gb * GiB)
        plan = plan_memory(budget, job, SIZES).dit
    dit, placement = build_dit(plan)
    args = dit_inputs(batch)
    clean()
    weights = torch.cuda.memory_allocated()
    enforce(budget)
    try:
        out, ms, peak = timed_forward(dit, args, budget)
        return {
            "row": name, "batch": batch, "budget GiB": "-" if budget is None else f"{budget / GiB:.2f}",
            "resident": 36 if plan is None else len(plan.resident), "peak GiB": f"{peak / GiB:.2f}",
            "pinned GiB": f"{(placement.pinned_bytes if placement else 0) / GiB:.2f}",
            "step ms": round(ms, 1), "ws est GiB": f"{workspace / GiB:.2f}",
            "ws meas GiB": f"{(peak - weights) / GiB:.2f}", "_ms": ms, "_out": out,
        }
    finally:
        if placement is not None:
            placement.release()
        dit = placement = None  # free the weights before clean()
        clean()


def quantised_budget_row(fmt: str, budget_gb: Optional[float], batch: int = 1) -> dict:
    """A DiT whose block Linears are packed to `fmt` (Triton dequant on the GPU), streamed compressed within a
    budget (None: all resident in that format)."""
    job = Job(1024, 1024, batch, 1.0, TEXT_TOKENS)
    sizes = ModelSizes.released("turbo", fmt)
    dit, _ = build_dit(None)
    quantise_block_linears_(dit, fmt)
    clean()
    budget = None if budget_gb is None else int(budget_gb * GiB)
    # the packed sizes decide, as LocalPipe re-plans
    sizes = dataclasses.replace(sizes, dit=measured_dit_size(dit, sizes.dit.largest_linear_params))
    plan = None if budget is None else plan_memory(budget, job, sizes).dit
    placement = DiTPlacement(dit, plan, DEVICE) if plan is not None and plan.streamed else None
    args = dit_inputs(batch)
    clean()
    enforce(budget)
    try:
        _, ms, peak = timed_forward(dit, args, budget)
        return {"row": f"{fmt} {'resident' if budget is None else f'{budget_gb:g} GiB'}", "batch": batch,
                "budget GiB": "-" if budget is None else f"{budget_gb:.2f}",
                "resident": 36 if plan is None else len(plan.resident), "peak GiB": f"{peak / GiB:.2f}",
                "pinned GiB": f"{(placement.pinned_bytes if placement else 0) / GiB:.2f}", "step ms": round(ms, 1),
                "_ms": ms}
    finally:
        if placement is not None:
            placement.release()
        dit = placement = None  # free the weights before clean()
        clean()


def diffusers_row(batch: int) -> dict:
    from diffusers import ErnieImageTransformer2DModel

    config = {k: v for k, v in dit_config("ERNIE-Image-Turbo").items() if not k.startswith("_")}
    dit, placement = build_dit(plan_dit(SIZES, 0, 2, 0))  # every block in our pinned slab: same host memory
    state = {}
    for name, tensor in dit.state_dict().items():
        if not name.startswith("layers."):
            state[name] = tensor.cpu()
    streamer = placement.streamer
    for k, index in enumerate(streamer.streamed):
        host = streamer._host[k]
        for entry in streamer._entries[k]:
            owner = next(n for n, m in dit.layers[index].named_modules() if m is entry.module)
            key = f"layers.{index}.{owner + '.' if owner else ''}{entry.name}"
            state[key] = typed_view(host, entry.offset, entry.dtype, entry.shape)
    with torch.device("meta"):
        model = ErnieImageTransformer2DModel.from_config(config)
    model.load_state_dict(state, assign=True)
    model.eval().requires_grad_(False)
    model.enable_group_offload(onload_device=DEVICE, offload_device=torch.device("cpu"), offload_type="block_level",
                               num_blocks_per_group=1, use_stream=True)
    latents, timestep, text, lens = dit_inputs(batch)
    lens_tensor = torch.tensor(lens, device=DEVICE)
    clean()
    enforce(None)
    try:
        def run():
            return model(latents, timestep, text, lens_tensor, return_dict=False)[0]

        with torch.inference_mode():
            out = run()
            ms = cuda_time_ms(run, warmup=2, iters=5)
        peak = torch.cuda.max_memory_allocated()
        return {"row": "diffusers group offload", "batch": batch, "budget GiB": "-", "resident": 0,
                "peak GiB": f"{peak / GiB:.2f}", "pinned GiB": "(ours)", "step ms": round(ms, 1), "_ms": ms,
                "_out": out.float().cpu()}
    finally:
        model = state = None
        placement.release()
        dit = placement = None  # free the weights before clean()
        clean()


# -- whole Turbo image -------------------------------------------------------------------------------------

def build_text_tower():
    from transformers import MistralConfig, MistralModel

    from ernie_image.runtime.formats.config_json import load_config

    raw = dict(load_config("turbo", "text_encoder")["text_config"])
    raw = {k: v for k, v in raw.items() if k not in ("model_type", "architectures", "dtype", "transformers_version")}
    raw["num_hidden_layers"] -= 1
    config = MistralConfig(**raw)
    config._attn_implementation = "sdpa"
    with torch.device(DEVICE):
        tower = MistralModel(config).to(torch.bfloat16)
    tower.norm = torch.nn.Identity()
    generator = torch.Generator(device=DEVICE).manual_seed(3)
    with torch.no_grad():
        for name, param in tower.named_parameters():
            if param.ndim >= 2:
                param.normal_(0.0, 0.5 / param.shape[-1] ** 0.5, generator=generator)
            else:
                param.fill_(1.0)
    return tower.eval().requires_grad_(False)


def build_vae():
    from diffusers import AutoencoderKLFlux2

    from ernie_image.runtime.formats.config_json import load_config

    config = {k: v for k, v in load_config("turbo", "vae").items() if not k.startswith("_") and k != "force_upcast"}
    with torch.device(DEVICE):
        vae = AutoencoderKLFlux2.from_config(config)
    vae.encoder = None
    vae.quant_conv = None
    return vae.to(torch.bfloat16).eval().requires_grad_(False)


def turbo_pipeline(budget_gb: Optional[float]) -> tuple[Callable[[], torch.Tensor], Callable[[], None], MemoryPlan]:
    from ernie_image.runtime.model.vae_decode import decode_images
    from ernie_image.runtime.sampling.euler import initial_noise, sample_euler
    from ernie_image.runtime.text.encoder import pad_text

    job = Job(1024, 1024, 1, 1.0, 512)
    budget = None if budget_gb is None else int(budget_gb * GiB)
    plan = plan_memory(budget, job, SIZES)
    dit, dit_placement = build_dit(plan.dit)
    tower = build_text_tower()
    text_placement = TextPlacement(tower, plan.text, DEVICE) if plan.text.mode == "streamed" else None
    vae = build_vae()
    ids = torch.randint(100, 130000, (1, TEXT_TOKENS), generator=torch.Generator().manual_seed(5))
    host = NullHost()

    def generate() -> torch.Tensor:
        with torch.inference_mode():
            embedding = tower(input_ids=ids.to(DEVICE if text_placement is None else "cpu")).last_hidden_state[0]
            if text_placement is not None:
                text_placement.streamer.park()
            text, lens = pad_text([embedding], DEVICE, torch.bfloat16)
            noise = initial_noise(11, 1, 1024, 1024).to(DEVICE)
            latents = sample_euler(lambda x, t: dit(x, t, text, lens), noise, 8, 4.0, 1.0, torch.bfloat16, host)
            return decode_images(latents, vae)

    def release() -> None:
        if dit_placement is not None:
            dit_placement.release()
        if text_placement is not None:
            text_placement.release()

    return generate, release, plan


def turbo_row(budget_gb: Optional[float]) -> dict:
    generate, release, plan = turbo_pipeline(budget_gb)
    clean()
    enforce(plan.budget if budget_gb is not None else None)
    try:
        image = generate()  # warm-up (cuDNN / cuBLAS choices)
        if not torch.isfinite(image).all():
            raise AssertionError("non-finite image")
        torch.cuda.synchronize()
        started = time.perf_counter()
        generate()
        torch.cuda.synchronize()
        seconds = time.perf_counter() - started
        peak = torch.cuda.max_memory_allocated()
        return {"row": "Turbo image (text + 8 steps + decode)", "budget GiB": "-" if budget_gb is None else budget_gb,
                "peak GiB": f"{peak / GiB:.2f}", "seconds": round(seconds, 3), "_s": seconds,
                "planned peak GiB": f"{plan.peak / GiB:.2f}"}
    finally:
        release()
        clean()


def soak(budget_gb: float, runs: int) -> None:
    generate, release, plan = turbo_pipeline(budget_gb)
    clean()
    enforce(plan.budget)
    records = []
    try:
        for run in range(runs):
            generate()
            torch.cuda.synchronize()
            gc.collect()
            records.append((rss_bytes(), torch.cuda.memory_allocated(), torch.cuda.memory_reserved()))
            print(f"soak run {run + 1}: host RSS {records[-1][0] / GiB:.3f} GiB, VRAM allocated "
                  f"{records[-1][1] / GiB:.3f} GiB, reserved {records[-1][2] / GiB:.3f} GiB", flush=True)
    finally:
        release()
        clean()
    first, last = records[1], records[-1]  # run 1 settles cuDNN/cuBLAS workspaces
    for label, a, b in (("host RSS", first[0], last[0]), ("VRAM allocated", first[1], last[1]),
                        ("VRAM reserved", first[2], last[2])):
        drift = (b - a) / max(a, 1)
        print(f"soak {label}: {a / GiB:.3f} -> {b / GiB:.3f} GiB ({100 * drift:+.2f}%) "
              f"{'OK' if abs(drift) <= 0.02 else 'FAIL (> 2%)'}")


def guarded(rows: list[dict], label: str, make: Callable[[], dict]) -> None:
    started = time.perf_counter()
    try:
        row = make()
    except Exception as error:  # noqa: BLE001 - a failing row is reported, the others still run
        traceback.print_exc(limit=3)
        row = {"row": label, "error": f"{type(error).__name__}: {str(error)[:120]}"}
        clean()
    row["wall s"] = round(time.perf_counter() - started, 1)
    rows.append(row)
    print({k: v for k, v in row.items() if not k.startswith("_")}, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--soak", action="store_true", help="20 Turbo images at 12 GB, RSS/VRAM drift")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--skip-image", action="store_true")
    parser.add_argument("--batches", default="1,2")
    parser.add_argument("--quant-rows", action="store_true", help="only the 4 GiB rows with Q4_K / NVFP4 weights")
    args = parser.parse_args()
    print_environment()
    if args.quant_rows:
        rows = []
        guarded(rows, "bf16 resident", lambda: budget_row("bf16 resident", None, 1))
        for fmt in ("q4_k", "nvfp4"):
            guarded(rows, f"{fmt} resident", lambda: quantised_budget_row(fmt, None))
            guarded(rows, f"{fmt} 4 GiB", lambda: quantised_budget_row(fmt, 4.0))
        for row in rows:
            if "_ms" in row and "_ms" in rows[0]:
                row["x bf16 resident"] = f"{row['_ms'] / rows[0]['_ms']:.2f}"
        print(table(rows, ["row", "batch", "budget GiB", "resident", "peak GiB", "pinned GiB", "step ms",
                           "x bf16 resident", "error"]))
        return
    if args.soak:
        soak(12.0, args.runs)
        return
    rows: list[dict] = []
    for batch in [int(b) for b in args.batches.split(",")]:
        start = len(rows)
        guarded(rows, f"resident b{batch}", lambda: budget_row("resident", None, batch))
        for budget in (24.0, 16.0, 12.0):
            guarded(rows, f"{budget:g} GiB b{batch}", lambda: budget_row(f"{budget:g} GiB", budget, batch))
        guarded(rows, f"all streamed b{batch}", lambda: budget_row("all streamed", None, batch, all_streamed=True))
        guarded(rows, f"diffusers b{batch}", lambda: diffusers_row(batch))
        batch_rows = rows[start:]
        resident = next((r for r in batch_rows if r.get("row") == "resident" and "_ms" in r), None)
        diffusers = next((r for r in batch_rows if r.get("row", "").startswith("diffusers") and "_ms" in r), None)
        for row in batch_rows:
            if "_ms" not in row:
                continue
            if resident:
                row["x resident"] = f"{row['_ms'] / resident['_ms']:.2f}"
                if "_out" in resident and "_out" in row and row is not resident:
                    diff = (row["_out"] - resident["_out"]).abs().max().item()
                    scale = resident["_out"].abs().max().item()
                    row["max rel diff"] = f"{diff / scale:.1e}"
            if diffusers:
                row["diffusers/this"] = f"{diffusers['_ms'] / row['_ms']:.2f}"
    print()
    print(table(rows, ["row", "batch", "budget GiB", "resident", "peak GiB", "pinned GiB", "step ms", "x resident",
                       "diffusers/this", "max rel diff", "ws est GiB", "ws meas GiB", "wall s", "error"]))
    if args.skip_image:
        return
    images: list[dict] = []
    guarded(images, "Turbo image resident", lambda: turbo_row(None))
    guarded(images, "Turbo image 12 GiB", lambda: turbo_row(12.0))
    if len(images) == 2 and "_s" in images[0] and "_s" in images[1]:
        images[1]["x resident"] = f"{images[1]['_s'] / images[0]['_s']:.2f}"
    print()
    print(table(images, ["row", "budget GiB", "peak GiB", "planned peak GiB", "seconds", "x resident", "wall s",
                         "error"]))


if __name__ == "__main__":
    main()
