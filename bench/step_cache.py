"""Step cache on the GPU: what a skipped step saves, what the cache costs when it never skips, and its memory.

    python bench/step_cache.py --out DIR                 # H200: Base and Turbo, resident and 12 GiB, bf16 and FP8
    python bench/step_cache.py --out DIR --base-skips 0,20,40 --placements resident --formats bf16   # a quick look
    python bench/step_cache.py --smoke --out DIR         # CPU, tiny DiT: the same code in seconds (tests run it)

Each row runs a whole sampling run (Base: 50 steps at CFG 4, the negative prompt a second call group; Turbo: 8 at
CFG 1) through LocalPipe.sample, the production path (the same denoiser, graphs, block runner and streamer the
pipe uses), on a full-size DiT with random weights at 1024x1024 with 256 prompt tokens. An image's wall time is
this plus text encoding and VAE decode (constant; bench/e2e.py measures them).

- "uncached": no step cache. "never skips": the cache with threshold 0 and the window over every step, so every
  step but the first and last is measured (its host sync included) and none is skipped: the cost of the cache
  itself. "never skips, no sync": the same with the measurement's `.tolist()` replaced by a constant, to price the
  host sync alone. Those three alternate `--repeats` times; medians are reported.
- "forced k": the schedule skips k steps spread evenly over steps 1..N-2 (StepCacheConfig.forced): the wall time
  as a function of the skipped steps, whatever a threshold would pick on real weights. Random weights cannot judge
  quality, so no threshold is benchmarked here (docs/step-cache.md: how to judge on your weights).
- placements: resident (all 36 blocks on the GPU) and a VRAM budget (default 12 GiB: the planner's placement, the
  budget enforced on the allocator). modes: "compiled" (regional torch.compile, where Triton is), "graphs"
  (uncompiled, CUDA-graph replay of the block runs) and, streamed, "eager" (graphs never serve streamed blocks).
- cache MiB: the residuals the cache kept at its peak; peak GiB: the allocator's peak during the run.

Prints the environment line, a table and the overhead summary; writes DIR/step_cache.json.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # as the CLI sets it

import torch

from common import dit_config, environment, import_package, quantise_block_linears_, randomise_dit_, table

import_package()

from ernie_image.runtime.core.host import NullHost  # noqa: E402
from ernie_image.runtime.core.request import GenerationRequest  # noqa: E402
from ernie_image.runtime.formats.sources import ModelSources  # noqa: E402
from ernie_image.runtime.local.memory import measured_dit_size  # noqa: E402
from ernie_image.runtime.local.options import LoadOptions  # noqa: E402
from ernie_image.runtime.local.pipe import LocalPipe  # noqa: E402
from ernie_image.runtime.model.dit import DiTConfig, ErnieDiT  # noqa: E402
from ernie_image.runtime.offload.placement import DiTPlacement  # noqa: E402
from ernie_image.runtime.offload.planner import GiB, DiTPlan, plan_memory  # noqa: E402
from ernie_image.runtime.offload.sizes import ModelSizes  # noqa: E402
from ernie_image.runtime.offload.workspace import Job  # noqa: E402
from ernie_image.runtime.step_cache import StepCacheConfig  # noqa: E402
from ernie_image.runtime.step_cache import session as session_module  # noqa: E402

COLUMNS = ["placement", "format", "mode", "preset", "run", "skipped", "computed", "sampling s", "ms / step",
           "x uncached", "peak GiB", "cache MiB", "error"]


@dataclasses.dataclass
class Setup:
    device: torch.device
    dtype: torch.dtype
    dit: DiTConfig
    size: int
    text_tokens: int
    negative_tokens: int
    presets: dict  # name -> (steps, cfg, skips)
    smoke: bool

    @classmethod
    def of(cls, args: argparse.Namespace) -> "Setup":
        base_skips = [int(k) for k in args.base_skips.split(",")]
        turbo_skips = [int(k) for k in args.turbo_skips.split(",")]
        if args.smoke:
            tiny = DiTConfig(hidden_size=64, num_attention_heads=2, num_layers=6, ffn_hidden_size=128, text_in_dim=48,
                             rope_axes_dim=(8, 12, 12))
            presets = {"Base": (8, 4.0, [k for k in (0, 2, 4, 6) if k <= 6]), "Turbo": (4, 1.0, [0, 1, 2])}
            return cls(torch.device("cpu"), torch.float32, tiny, 256, 8, 3, presets, True)
        presets = {"Base": (50, 4.0, base_skips)}
        if not args.skip_turbo:
            presets["Turbo"] = (8, 1.0, turbo_skips)
        return cls(torch.device("cuda"), torch.bfloat16, DiTConfig.from_dict(dit_config()), 1024, 256,
                   args.negative_tokens, presets, False)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def forced_schedule(steps: int, skipped: int) -> str:
    """`skipped` S letters spread evenly over steps 1..steps-2 (the first and last are always computed)."""
    inner = steps - 2
    if not 0 <= skipped <= inner:
        raise SystemExit(f"{skipped} skipped steps do not fit in {steps} steps (at most {inner})")
    letters = ["C"] * steps
    for j in range(skipped):
        letters[1 + (j * inner) // skipped] = "S"
    return "".join(letters)


def build_dit(setup: Setup, fmt: str) -> ErnieDiT:
    """The DiT with random weights whose activations stay finite, projections fused on CUDA as LocalPipe fuses
    them, block Linears packed to FP8 for fmt 'fp8'."""
    from ernie_image.runtime.model.compile import fuse_projections

    with torch.device(setup.device):
        dit = ErnieDiT(setup.dit).to(setup.dtype)
    randomise_dit_(dit, seed=0)
    dit.eval().requires_grad_(False)
    if setup.device.type == "cuda":
        fuse_projections(dit)
    if fmt == "fp8":
        quantise_block_linears_(dit, "fp8")
    return dit


def place(setup: Setup, dit: ErnieDiT, fmt: str, budget_gb: Optional[float]) -> tuple[Optional[DiTPlacement], Any]:
    """Resident (None), or the planner's placement within `budget_gb` for a Base job with a step cache."""
    if budget_gb is None:
        return None, None
    if setup.smoke:  # the CPU has no budget to plan against: stream half the blocks through 2 slots
        layers = setup.dit.num_layers
        streamed = tuple(range(1, layers, 2))
        plan = DiTPlan(layers, tuple(i for i in range(layers) if i not in streamed), streamed, 2, 0, 0, 0)
        return DiTPlacement(dit, plan, setup.device), plan
    sizes = ModelSizes.released("base", fmt)
    sizes = dataclasses.replace(sizes, dit=measured_dit_size(dit, sizes.dit.largest_linear_params))
    job = Job(setup.size, setup.size, 1, 4.0, setup.text_tokens, step_cache=True,
              decision_after_blocks=StepCacheConfig().probe_blocks)  # as LocalPipe plans a job with the cache
    plan = plan_memory(int(budget_gb * GiB), job, sizes, "cuda").dit
    return (DiTPlacement(dit, plan, setup.device) if plan.streamed else None), plan


def make_pipe(setup: Setup, dit: ErnieDiT, mode: str) -> LocalPipe:
    options = LoadOptions(device=str(setup.device), dtype="fp32" if setup.smoke else "bf16", previews=False,
                          compile=mode == "compiled", cuda_graphs=mode == "graphs")
    pipe = LocalPipe(ModelSources(), options, "base")
    pipe.memory.active = False  # the bench's own placement; weights injected, not read from files
    pipe.parts.dit = dit
    return pipe


def text_rows(setup: Setup) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    width = setup.dit.text_in_dim
    prompt = torch.randn(setup.text_tokens, width, generator=generator).to(setup.device, setup.dtype)
    negative = torch.randn(setup.negative_tokens, width, generator=generator).to(setup.device, setup.dtype)
    return prompt, negative


class NoSync:
    """StepCacheRun._measure with the same reductions but no `.tolist()`: what the run costs without its host sync
    (it then never skips, as threshold 0 would not either)."""

    def __enter__(self):
        self.saved = session_module.StepCacheRun._measure

        def measure(run, heads):
            sums = torch.zeros(2, dtype=torch.float32, device=heads[0].x.device)
            for group, head in zip(run.groups, heads):
                sums[0] += (head.residual - group.first_residual).abs().sum(dtype=torch.float32)
                sums[1] += group.first_residual.abs().sum(dtype=torch.float32)
            return 1.0

        session_module.StepCacheRun._measure = measure
        return self

    def __exit__(self, *exc):
        session_module.StepCacheRun._measure = self.saved


def sample_once(setup: Setup, pipe: LocalPipe, steps: int, cfg: float, config: Optional[StepCacheConfig],
                rows: tuple[torch.Tensor, torch.Tensor]) -> dict:
    request = GenerationRequest(prompt="", width=setup.size, height=setup.size, steps=steps, cfg=cfg, seed=3,
                                step_cache=config)
    prompt, negative = rows
    if setup.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(setup.device)
    sync(setup.device)
    started = time.perf_counter()
    latents = pipe.sample(request, [prompt], [negative] if cfg > 1.0 else None, NullHost())
    sync(setup.device)
    seconds = time.perf_counter() - started
    if not torch.isfinite(latents).all():
        raise AssertionError("non-finite latents: fix the random init before trusting the numbers")
    report = pipe.last_step_cache if config is not None else None
    return {"s": seconds, "schedule": report.schedule if report else "C" * steps,
            "cache_bytes": report.cache_bytes if report else 0,
            "peak": torch.cuda.max_memory_allocated(setup.device) if setup.device.type == "cuda" else 0}


def preset_rows(setup: Setup, pipe: LocalPipe, labels: dict, preset: str, repeats: int, log: Callable) -> list[dict]:
    steps, cfg, skips = setup.presets[preset]
    rows_in = text_rows(setup)
    never = StepCacheConfig(threshold=0.0, start=0.0, end=1.0)
    runs: dict[str, list[dict]] = {"uncached": [], "never skips": [], "never skips, no sync": []}
    sample_once(setup, pipe, steps, cfg, None, rows_in)  # warm-up: compile / capture, cuBLAS plans
    sample_once(setup, pipe, steps, cfg, never, rows_in)
    for _ in range(repeats):  # alternated, so a clock or power drift hits each the same
        runs["uncached"].append(sample_once(setup, pipe, steps, cfg, None, rows_in))
        runs["never skips"].append(sample_once(setup, pipe, steps, cfg, never, rows_in))
        with NoSync():
            runs["never skips, no sync"].append(sample_once(setup, pipe, steps, cfg, never, rows_in))
    uncached_s = statistics.median(r["s"] for r in runs["uncached"])
    rows = []

    def row(run: str, results: list[dict], skipped: Optional[int] = None) -> dict:
        seconds = statistics.median(r["s"] for r in results)
        schedule = results[0]["schedule"]
        computed = schedule.count("C")
        out = {**labels, "preset": preset, "run": run, "skipped": schedule.count("S") if skipped is None else skipped,
               "computed": computed, "sampling s": f"{seconds:.3f}", "ms / step": f"{seconds / steps * 1e3:.1f}",
               "x uncached": f"{seconds / uncached_s:.3f}",
               "peak GiB": f"{max(r['peak'] for r in results) / GiB:.2f}",
               "cache MiB": f"{max(r['cache_bytes'] for r in results) / 2**20:.0f}",
               "_s": seconds, "_all_s": [round(r["s"], 4) for r in results], "_schedule": schedule}
        log(out)
        return out

    for run, results in runs.items():
        rows.append(row(run, results))
    for skipped in skips:
        config = StepCacheConfig(forced=forced_schedule(steps, skipped))
        rows.append(row(f"forced {skipped}", [sample_once(setup, pipe, steps, cfg, config, rows_in)], skipped))
    return rows


def unmake_compiled(dit: ErnieDiT) -> None:
    for block in dit.layers:
        block._compiled_call_impl = None
    torch._dynamo.reset()


def combination_rows(setup: Setup, fmt: str, budget_gb: Optional[float], modes: list[str], repeats: int,
                     log: Callable) -> list[dict]:
    from ernie_image.runtime.model.compile import compile_available, compile_blocks

    placement_label = "resident" if budget_gb is None else (f"{budget_gb:g} GiB" if not setup.smoke else "streamed")
    rows: list[dict] = []
    dit = build_dit(setup, fmt)
    placement, plan = place(setup, dit, fmt, budget_gb)
    streamed = placement is not None and placement.streamer is not None
    total = torch.cuda.get_device_properties(setup.device).total_memory if setup.device.type == "cuda" else 0
    try:
        if budget_gb is not None and setup.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.set_per_process_memory_fraction(min(1.0, budget_gb * GiB / total), _index(setup.device))
        for mode in modes:
            if mode == "compiled" and not compile_available(setup.device):
                continue
            if mode == "graphs" and (setup.device.type != "cuda" or streamed):
                mode = "eager"
            if any(r["mode"] == mode for r in rows):
                continue
            labels = {"placement": placement_label + (f" ({len(plan.streamed)} streamed)" if streamed else ""),
                      "format": fmt, "mode": mode}
            if mode == "compiled":
                compile_blocks(dit)
            pipe = make_pipe(setup, dit, mode)
            try:
                for preset in setup.presets:
                    rows += preset_rows(setup, pipe, labels, preset, repeats, log)
            except Exception as error:  # one failing combination must not hide the others
                rows.append({**labels, "error": f"{type(error).__name__}: {error}"[:160]})
                log(rows[-1])
            finally:
                pipe.parts.dit = None
                if mode == "compiled":
                    unmake_compiled(dit)
    finally:
        if placement is not None:
            placement.release()
        dit = placement = None
        gc.collect()
        if setup.device.type == "cuda":
            torch.cuda.set_per_process_memory_fraction(1.0, _index(setup.device))
            torch.cuda.empty_cache()
    return rows


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def overhead_summary(rows: list[dict]) -> list[dict]:
    """Per combination and preset: the never-skipping cache's cost per step over uncached, and the sync's part."""
    out = []
    keys = {(r["placement"], r["format"], r["mode"], r["preset"]) for r in rows if "_s" in r}
    for key in sorted(keys):
        found = {r["run"]: r["_s"] for r in rows if (r["placement"], r["format"], r["mode"], r["preset"]) == key
                 and "_s" in r}
        if not {"uncached", "never skips", "never skips, no sync"} <= set(found):
            continue
        base = found["uncached"]
        saved = {}
        for run, seconds in found.items():
            if run.startswith("forced ") and int(run.split()[1]) > 0:
                saved[int(run.split()[1])] = seconds
        forced0 = found.get("forced 0")
        per_skip = ""
        if saved and forced0:
            most = max(saved)
            per_skip = f"{(forced0 - saved[most]) / most * 1e3:.1f}"
        out.append({"placement": key[0], "format": key[1], "mode": key[2], "preset": key[3],
                    "uncached s": f"{base:.3f}",
                    "never skips": f"{(found['never skips'] / base - 1) * 100:+.2f}%",
                    "no sync": f"{(found['never skips, no sync'] / base - 1) * 100:+.2f}%",
                    "sync part": f"{(found['never skips'] - found['never skips, no sync']) / base * 100:+.2f}%",
                    "ms saved / skipped step": per_skip})
    return out


def main(argv: Optional[list[str]] = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for step_cache.json")
    parser.add_argument("--smoke", action="store_true", help="CPU smoke run with a tiny DiT (seconds)")
    parser.add_argument("--placements", default="resident,budget", help="resident and/or budget")
    parser.add_argument("--budget", type=float, default=12.0, help="VRAM budget in GiB for the 'budget' placement")
    parser.add_argument("--formats", default="bf16,fp8", help="bf16 and/or fp8")
    parser.add_argument("--modes", default="compiled,graphs", help="compiled and/or graphs (streamed: eager)")
    parser.add_argument("--base-skips", default="0,5,10,15,20,25,30,35,40", help="skipped steps of Base's 50")
    parser.add_argument("--turbo-skips", default="0,1,2,3,4,5,6", help="skipped steps of Turbo's 8")
    parser.add_argument("--skip-turbo", action="store_true")
    parser.add_argument("--repeats", type=int, default=3, help="alternated runs of the overhead rows (median)")
    parser.add_argument("--negative-tokens", type=int, default=8, help="text tokens of the negative prompt")
    args = parser.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("bench/step_cache.py needs a CUDA GPU (or --smoke for the CPU run)")
    setup = Setup.of(args)
    if setup.smoke:
        torch.set_num_threads(1)  # a tiny DiT only loses to threading overhead
    env = environment()
    print("# " + json.dumps(env), flush=True)
    started = time.perf_counter()
    rows: list[dict] = []

    def log(row: dict) -> None:
        print("# " + json.dumps({k: v for k, v in row.items() if not k.startswith("_") or k == "_all_s"}),
              flush=True)

    placements = [p.strip() for p in args.placements.split(",") if p.strip()]
    for fmt in [f.strip() for f in args.formats.split(",") if f.strip()]:
        for placement in placements:
            budget = None if placement == "resident" else args.budget
            rows += combination_rows(setup, fmt, budget, [m.strip() for m in args.modes.split(",")],
                                     1 if args.smoke else args.repeats, log)
    summary = overhead_summary(rows)
    title = (f"Step cache, {setup.size}x{setup.size}, {setup.text_tokens} prompt tokens (negative "
             f"{setup.negative_tokens}), {env['gpu']}, torch {env['torch']}" + (" -- SMOKE RUN, tiny DiT" if setup.smoke else ""))
    print("\n" + title)
    print(table(rows, COLUMNS))
    print("\nThe cache's own cost (threshold 0, every step measured, none skipped) over uncached, per run")
    print(table(summary, ["placement", "format", "mode", "preset", "uncached s", "never skips", "no sync",
                          "sync part", "ms saved / skipped step"]))
    record = {"environment": env, "title": title,
              "config": {"size": setup.size, "text_tokens": setup.text_tokens, "negative_tokens": setup.negative_tokens,
                         "presets": {k: {"steps": v[0], "cfg": v[1], "skips": v[2]} for k, v in setup.presets.items()},
                         "dit": dataclasses.asdict(setup.dit), "dtype": str(setup.dtype), "smoke": setup.smoke,
                         "budget_gib": args.budget, "repeats": args.repeats, "argv": sys.argv[1:] if argv is None else argv},
              "rows": [{k.lstrip("_"): v for k, v in r.items()} for r in rows], "overhead": summary,
              "seconds": round(time.perf_counter() - started, 1)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "step_cache.json").write_text(json.dumps(record, indent=1))
    return record


if __name__ == "__main__":
    main()
