"""Can the DiT's blocks compile on a thread of their own while the first steps run uncompiled, and what does the
switch to compiled blocks then cost? The measurement a background compile would rest on (docs/performance.md, the
first image after a restart: a Base FP8 first image with warm caches misses its target by the compile's cost).

    python bench/background_compile.py --out DIR [--format bf16|fp8] [--batch 2]   # CUDA GPU, full size
    python bench/background_compile.py --tiny --out DIR                            # CPU smoke test

Run it in a fresh process (a second run of the same command is the warm-cache case). In one process, on one random
DiT at 1024x1024 with 256 text tokens (CFG's two rows at --batch 2):
1. uncompiled: the whole DiT call, uncompiled, timed alone (median);
2. background: a thread compiles a twin of block 0 (a shallow copy sharing its weights, compiled as
   model/compile.py compiles every block) and runs it once on the job's tensors, while this thread runs uncompiled
   DiT calls back to back until the twin is done: the compile's wall seconds and the uncompiled calls' median
   meanwhile (how much the compile slows the steps it overlaps);
3. switch: every real block compiled as model/compile.py's compile_blocks does (with the run's backend) and the
   DiT's first call (near a compiled call if the twin's compile left what the blocks need in the compile caches; a
   whole compile if not), then compiled calls (median).
Asserted: the compiled output within 1e-2 relative L2 of the uncompiled one (the fast path's bound). `--tiny` runs
the same code on the CPU with a tiny DiT, compiled with the "eager" backend (no C++ compiler needed), to check the
script, not to measure. Writes DIR/background_compile.json and prints a table.
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import threading
import time
from pathlib import Path
from typing import Callable

import torch

from common import (BenchRun, dit_config, environment, import_package, quantised_copy, randomise_dit_, table,
                    wall_time)

import_package()

from ernie_image.runtime.model.compile import allow_cache_size, fuse_projections  # noqa: E402
from ernie_image.runtime.model.dit import DiTConfig, ErnieDiT  # noqa: E402

TINY = {"hidden_size": 256, "num_attention_heads": 2, "num_layers": 3, "ffn_hidden_size": 512, "text_in_dim": 96,
        "rope_axes_dim": [32, 48, 48]}


def build(device: torch.device, tiny: bool, fmt: str) -> ErnieDiT:
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = ErnieDiT(DiTConfig.from_dict(TINY if tiny else dit_config()))
    finally:
        torch.set_default_dtype(torch.float32)
    randomise_dit_(model)
    fuse_projections(model)
    model = model.eval().requires_grad_(False)
    return quantised_copy(model, fmt) if fmt != "bf16" else model


def job_inputs(model: ErnieDiT, device: torch.device, batch: int, tiny: bool) -> tuple:
    dtype = next(model.parameters()).dtype if device.type == "cpu" else torch.bfloat16
    generator = torch.Generator().manual_seed(batch)
    side, tokens = (128, 16) if tiny else (1024, 256)
    latents = torch.randn((batch, 128, side // 16, side // 16), generator=generator).to(device, dtype)
    timestep = torch.full((batch,), 500.0).to(device, dtype)
    text = torch.randn((batch, tokens, model.config.text_in_dim), generator=generator).to(device, dtype)
    return latents, timestep, text, [tokens] * batch


def timed(run: Callable[[], object], sync: Callable[[], None]) -> tuple[object, float]:
    """common.wall_time in milliseconds."""
    out, seconds = wall_time(run, sync)
    return out, seconds * 1e3


def compile_in_background(block: torch.nn.Module, x: torch.Tensor, ctx, backend: str,
                          sync: Callable[[], None]) -> tuple[threading.Thread, dict]:
    """A thread compiling a twin of `block` (its weights shared, its own compiled call) and running it once."""
    result: dict = {}
    twin = copy.copy(block)  # a new module object over the same parameter and submodule dicts

    def work() -> None:
        started = result["started"] = time.perf_counter()
        try:
            with torch.inference_mode():
                twin.compile(backend=backend)
                twin(x, ctx)
            sync()
        except Exception as error:  # reported as the row's error
            result["error"] = f"{type(error).__name__}: {error}"[:300]
        result["ended"] = time.perf_counter()
        result["seconds"] = result["ended"] - started

    return threading.Thread(target=work, name="background-compile", daemon=True), result


def run(args: argparse.Namespace) -> dict:
    device = torch.device("cpu" if args.tiny else "cuda")
    backend = "eager" if args.tiny else "inductor"
    bench = BenchRun(device)
    allow_cache_size()
    with bench.phase("build"):
        model = build(device, args.tiny, args.format)
    inputs = job_inputs(model, device, args.batch, args.tiny)
    call = lambda: model(*inputs)  # noqa: E731

    with torch.inference_mode():
        reference, _ = timed(call, bench.sync)
        alone = [timed(call, bench.sync)[1] for _ in range(args.iters)]
        x, ctx, _ = model.prepare(*inputs)
        thread, result = compile_in_background(model.layers[0], x, ctx, backend, bench.sync)
        started = time.perf_counter()
        thread.start()
        spans = []  # (start, end) of each uncompiled call made while the thread lives
        while not spans or thread.is_alive():
            call_started = time.perf_counter()
            timed(call, bench.sync)
            spans.append((call_started, time.perf_counter()))
        thread.join()
        overlapping = [(end - begin) * 1e3 for begin, end in spans
                       if begin < result.get("ended", 0.0) and end > result.get("started", float("inf"))]
        background_s = time.perf_counter() - started
        for block in model.layers:
            block.compile(backend=backend)
        compiled_out, first_ms = timed(call, bench.sync)
        compiled = [timed(call, bench.sync)[1] for _ in range(args.iters)]

    error = float((compiled_out.float() - reference.float()).norm() / reference.float().norm().clamp_min(1e-12))
    bench.check("compiled within 1e-2 relative L2 of uncompiled", error <= 1e-2, relative_l2=round(error, 6))
    bench.check("the background compile finished without error", "error" not in result, error=result.get("error"))
    rows = [
        {"row": "uncompiled call, alone", "ms": round(statistics.median(alone), 2), "calls": len(alone)},
        {"row": "uncompiled call, while the twin compiles",
         "ms": round(statistics.median(overlapping), 2) if overlapping else None, "calls": len(overlapping)},
        {"row": "background compile + first twin call (wall)", "ms": round(result["seconds"] * 1e3, 1),
         "calls": 1, "until_done_ms": round(background_s * 1e3, 1)},
        {"row": "first call after compile_blocks (the switch)", "ms": round(first_ms, 1), "calls": 1},
        {"row": "compiled call", "ms": round(statistics.median(compiled), 2), "calls": len(compiled)},
    ]
    print(table(rows, ["row", "ms", "calls"]), flush=True)
    report = {"environment": environment(), "format": args.format, "batch": args.batch, "tiny": args.tiny,
              "backend": backend, "rows": rows, "checks": bench.checks, "phases": bench.phases}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "background_compile.json").write_text(json.dumps(report, indent=2))
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder for background_compile.json")
    parser.add_argument("--format", default="bf16", choices=("bf16", "fp8"))
    parser.add_argument("--batch", type=int, default=2, help="DiT rows per call (2: CFG's two branches)")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--tiny", action="store_true", help="CPU smoke test with a tiny DiT")
    args = parser.parse_args()
    report = run(args)
    if not all(check["ok"] for check in report["checks"]):
        raise SystemExit("a check failed (see the table)")


if __name__ == "__main__":
    main()
