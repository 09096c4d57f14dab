"""The uncompiled DiT step (no Triton, compile off) against the compiled one, in one run on the same random weights.

    python bench/eager_graphs.py --out DIR          # full size on a CUDA GPU, ~2 minutes on an H200
    python bench/eager_graphs.py --tiny --out DIR   # CPU smoke test of the same code (no graphs on a CPU)

1024x1024, 256 text tokens, batch 1 and 2. Rows: eager as before this change (plain `.float()` ... `.to()`
expressions), eager with the cast-folded kernels (dit.py), that replayed as CUDA graphs (dit_graphs.py), CFG's two
length groups (256 and 77 tokens) eager and graphed (eager as shipped: the fewer-pass forms on CUDA, dit.py's
`fast_eager`; the bit-identical forms are their own row), an FP8 DiT eager and graphed, the compiled step, and the
eager step streamed at a 12 GiB budget. Asserted in the same run: graph output == eager output bit for bit (every
batch, CFG groups, FP8), the bit-identical forms == plain eager bit for bit, the shipped eager within 2e-3
relative L2 of plain eager, compiled within 1e-2, streamed == resident bit for bit. Prints a
markdown table with each row's ratio to the compiled step of its batch and writes DIR/eager_graphs.json.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

from common import (BenchRun, cuda_time_ms, dit_config, environment, import_package, quantised_copy, randomise_dit_,
                    table)

import_package()

from ernie_image.runtime.model import fused_kernels  # noqa: E402
from ernie_image.runtime.model.arithmetic import Arithmetic  # noqa: E402
from ernie_image.runtime.model.compile import compile_available, compile_blocks, fuse_projections  # noqa: E402
from ernie_image.runtime.model.dit import DiTConfig, ErnieDiT  # noqa: E402
from ernie_image.runtime.model.dit_graphs import DiTGraphs  # noqa: E402
from ernie_image.runtime.sampling.euler import length_grouped_denoiser  # noqa: E402

TINY = {"hidden_size": 256, "num_attention_heads": 2, "num_layers": 3, "ffn_hidden_size": 512, "text_in_dim": 96,
        "rope_axes_dim": [32, 48, 48]}


class Bench(BenchRun):
    def __init__(self, device: torch.device, tiny: bool, iters: int) -> None:
        super().__init__(device)
        self.tiny, self.iters = tiny, iters
        self.size = 128 if tiny else 1024
        self.text_tokens = 16 if tiny else 256
        self.dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
        self.label = "fp32" if device.type == "cpu" else "bf16"

    def time_ms(self, run: Callable[[], object], warmup: int = 2) -> float:
        if self.device.type == "cuda":
            return cuda_time_ms(run, warmup, self.iters)
        for _ in range(warmup):
            run()
        times = []
        for _ in range(self.iters):
            started = time.perf_counter()
            run()
            times.append((time.perf_counter() - started) * 1e3)
        return statistics.median(times)

    def measure(self, variant: str, batch: int, run: Callable[[], object], **extra) -> None:
        try:
            ms = self.time_ms(run)
            self.rows.append({"variant": variant, "batch": batch, "ms": round(ms, 2), **extra})
            print(f"# {variant} b{batch}: {ms:.1f} ms", flush=True)
        except Exception as error:  # one failing row must not hide the others
            self.rows.append({"variant": variant, "batch": batch, "ms": None,
                              "error": f"{type(error).__name__}: {error}"[:200]})
            print(f"# {variant} b{batch}: FAILED {type(error).__name__}: {error}"[:300], flush=True)

    def inputs(self, batch: int, text_tokens: int | None = None):
        generator = torch.Generator().manual_seed(batch)
        grid = self.size // 16
        latents = torch.randn((batch, 128, grid, grid), generator=generator).to(self.device, self.dtype)
        timestep = torch.full((batch,), 500.0).to(self.device, self.dtype)
        tokens = text_tokens or self.text_tokens
        text_dim = TINY["text_in_dim"] if self.tiny else 3072
        text = torch.randn((batch, tokens, text_dim), generator=generator).to(self.device, self.dtype)
        return latents, timestep, text, [tokens] * batch


def build(bench: Bench) -> ErnieDiT:
    """The DiT at the bench's size and dtype, random weights, projections fused."""
    model = build_unfused(bench)
    fuse_projections(model)
    return model


def build_unfused(bench: Bench) -> ErnieDiT:
    config = DiTConfig.from_dict(TINY if bench.tiny else dit_config())
    torch.set_default_dtype(bench.dtype)
    try:
        with torch.device(bench.device):
            model = ErnieDiT(config)
    finally:
        torch.set_default_dtype(torch.float32)
    randomise_dit_(model)
    return model.eval().requires_grad_(False)


def graphs_rows(bench: Bench, model: ErnieDiT, label: str, reference: dict) -> None:
    """`label` eager and `label` + CUDA graphs at batch 1 and 2; the replay must equal the eager output."""
    for batch in (1, 2):
        args = bench.inputs(batch)
        eager_out = model(*args)
        reference[(label, batch)] = eager_out
        bench.measure(f"{label} eager", batch, lambda: model(*args))
        graphs = DiTGraphs(model)
        reserved = torch.cuda.memory_reserved() if bench.device.type == "cuda" else 0
        outs = [graphs(*args) for _ in range(3)]  # warm-up, capture + launch, replay
        pool_gb = (torch.cuda.memory_reserved() - reserved) / 1e9 if bench.device.type == "cuda" else 0.0
        if bench.device.type == "cuda":
            bench.check(f"{label} b{batch}: graph replay == eager, bit for bit",
                        graphs.captures == 1 and all(torch.equal(o, eager_out) for o in outs),
                        captures=graphs.captures, disabled=graphs.disabled_reason)
        bench.measure(f"{label} eager + CUDA graphs", batch, lambda: graphs(*args),
                      graph_pool_gb=round(pool_gb, 2), eager_reason=graphs.eager_reason(args[0]))
        graphs.invalidate()  # its pool goes back before the next batch captures
        outs = None


def cfg_rows(bench: Bench, model: ErnieDiT) -> None:
    """CFG as Base runs it: one latent, the prompt (256 tokens) and a shorter negative (77) as two length groups."""
    generator = torch.Generator().manual_seed(7)
    text_dim = TINY["text_in_dim"] if bench.tiny else 3072
    short = max(1, bench.text_tokens * 77 // 256)
    rows = [torch.randn(short, text_dim, generator=generator).to(bench.device, bench.dtype),
            torch.randn(bench.text_tokens, text_dim, generator=generator).to(bench.device, bench.dtype)]
    latents, timestep, _, _ = bench.inputs(2)
    eager = length_grouped_denoiser(model, rows, bench.device, bench.dtype)
    graphs = DiTGraphs(model)
    graphed = length_grouped_denoiser(graphs, rows, bench.device, bench.dtype)
    want = eager(latents, timestep)
    outs = [graphed(latents, timestep) for _ in range(3)]
    if bench.device.type == "cuda":
        bench.check("CFG two length groups: replay == eager, bit for bit, two graphs",
                    graphs.captures == 2 and all(torch.equal(o, want) for o in outs), captures=graphs.captures)
    bench.measure(f"CFG step, two length groups ({bench.text_tokens} + {short} tokens) eager", 2,
                  lambda: eager(latents, timestep))
    bench.measure(f"CFG step, two length groups ({bench.text_tokens} + {short} tokens) eager + CUDA graphs", 2,
                  lambda: graphed(latents, timestep))
    graphs.invalidate()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tiny", action="store_true", help="CPU smoke test with a tiny DiT")
    parser.add_argument("--out", type=Path, required=True, help="folder for eager_graphs.json")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--skip-compile", action="store_true")
    args = parser.parse_args()
    started = time.perf_counter()
    device = torch.device("cpu" if args.tiny else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench/eager_graphs.py needs a CUDA GPU (or --tiny for the CPU smoke test)")
    bench = Bench(device, args.tiny, args.iters)
    env = environment()
    print("# " + json.dumps(env), flush=True)
    reference: dict = {}
    with torch.inference_mode():
        with bench.phase("build"):
            model = build(bench)
        with bench.phase("eager before (plain expressions)"):
            for batch in (1, 2):
                run_args = bench.inputs(batch)
                folded = model(*run_args)
                exact_model = model.with_arithmetic("exact")
                exact = exact_model(*run_args)
                bench.measure("eager, bit-identical forms (exact arithmetic)", batch, lambda: exact_model(*run_args))
                plain_model = model.with_arithmetic("plain")  # before the cast folding (what compiled blocks trace)
                plain = plain_model(*run_args)
                bench.measure("eager, plain expressions (before)", batch, lambda: plain_model(*run_args))
                bench.check(f"b{batch}: bit-identical eager forms == plain eager, bit for bit",
                            torch.equal(exact, plain))
                rel = ((folded.float() - plain.float()).norm() / plain.float().norm()).item()
                bench.check(f"b{batch}: eager as shipped (fewer-pass forms on CUDA) vs plain eager: relative L2 <= 2e-3",
                            rel <= 2e-3, rel_l2=f"{rel:.2e}")
        with bench.phase("bf16 eager and graphs"):
            graphs_rows(bench, model, bench.label, reference)
        if fused_kernels.cuda_backend() is not None:
            with bench.phase("comfy-kitchen kernels one by one"):
                kitchen_rows(bench, model)
        with bench.phase("CFG groups"):
            cfg_rows(bench, model)
        if device.type == "cuda":
            with bench.phase("FP8 eager and graphs"):
                try:
                    fp8 = quantised_copy(model, "fp8")
                    graphs_rows(bench, fp8, "FP8", reference)
                    del fp8
                except Exception as error:
                    bench.check("FP8 DiT built", False, error=f"{type(error).__name__}: {error}"[:200])
                gc.collect()
                torch.cuda.empty_cache()
        if not args.skip_compile and compile_available(device):
            with bench.phase("compiled"):
                compile_blocks(model)
                for batch in (1, 2):
                    run_args = bench.inputs(batch)
                    first = time.perf_counter()
                    out = model(*run_args)
                    bench.sync()
                    compile_s = time.perf_counter() - first
                    base = reference[(bench.label, batch)].float()
                    rel = ((out.float() - base).norm() / base.norm()).item()
                    bench.check(f"compiled b{batch} vs eager: relative L2 <= 1e-2", rel <= 1e-2, rel_l2=f"{rel:.2e}")
                    bench.measure("compiled", batch, lambda: model(*run_args), first_call_s=round(compile_s, 1))
                for block in model.layers:  # back to eager blocks for the streamed rows
                    block._compiled_call_impl = None
                torch._dynamo.reset()
        with bench.phase("streamed at 12 GiB"):
            try:
                streamed_rows(bench, model, reference)
            except Exception as error:
                bench.check("streamed at 12 GiB ran", False, error=f"{type(error).__name__}: {error}"[:200])
    compiled = {r["batch"]: r["ms"] for r in bench.rows if r["variant"] == "compiled" and r.get("ms")}
    before = {r["batch"]: r["ms"] for r in bench.rows if r["variant"].startswith("eager, plain") and r.get("ms")}
    for row in bench.rows:
        if row.get("ms") and row["batch"] in compiled:
            row["x compiled"] = round(row["ms"] / compiled[row["batch"]], 3)
        if row.get("ms") and row["batch"] in before:
            row["x eager before"] = round(row["ms"] / before[row["batch"]], 3)
    bench.phases["total"] = round(time.perf_counter() - started, 1)
    title = (f"DiT step, {bench.size}x{bench.size}, {bench.text_tokens} text tokens, "
             f"{str(bench.dtype).replace('torch.', '')}, {env['gpu']}, torch {env['torch']}")
    print("\n" + title)
    print(table(bench.rows, ["variant", "batch", "ms", "x compiled", "x eager before", "graph_pool_gb",
                             "first_call_s", "error"]))
    failed = [c for c in bench.checks if not c["ok"]]
    print(f"\nchecks: {len(bench.checks) - len(failed)} passed, {len(failed)} failed; phases (s): {bench.phases}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "eager_graphs.json").write_text(json.dumps(
        {"environment": env, "title": title, "rows": bench.rows, "checks": bench.checks, "phases_s": bench.phases,
         "comfy_kitchen": comfy_kitchen_status()}, indent=1))
    if failed:
        raise SystemExit(f"{len(failed)} check(s) failed: {[c['check'] for c in failed]}")


def streamed_rows(bench: Bench, model: ErnieDiT, reference: dict) -> None:
    """The eager step with blocks streamed at a 12 GiB budget (the planner's placement; graphs never serve it)."""
    from ernie_image.runtime.local.memory import measured_dit_size
    from ernie_image.runtime.offload.placement import DiTPlacement
    from ernie_image.runtime.offload.planner import GiB, plan_memory
    from ernie_image.runtime.offload.sizes import ModelSizes
    from ernie_image.runtime.offload.workspace import Job

    if bench.device.type != "cuda":
        print("# streamed rows: need a CUDA device (skipped)")
        return
    sizes = ModelSizes.released("base")
    sizes = dataclasses.replace(sizes, dit=measured_dit_size(model, sizes.dit.largest_linear_params))
    plan = plan_memory(12 * GiB, Job(bench.size, bench.size, 2, 1.0, bench.text_tokens), sizes).dit
    placement = DiTPlacement(model, plan, bench.device)
    try:
        graphs = DiTGraphs(model)
        for batch in (1, 2):
            run_args = bench.inputs(batch)
            out = graphs(*run_args)
            bench.check(f"streamed b{batch} == resident eager, bit for bit; graphs stay off",
                        torch.equal(out, reference[(bench.label, batch)]) and graphs.captures == 0,
                        eager_reason=graphs.eager_reason(run_args[0]))
            bench.measure(f"eager, streamed at 12 GiB ({len(plan.resident)} of {plan.layers} blocks resident)",
                          batch, lambda: graphs(*run_args))
    finally:
        placement.release()


def kitchen_rows(bench: Bench, model: ErnieDiT) -> None:
    """The eager step with comfy-kitchen's kernels off, each alone, and both (the shipped default when installed);
    every form within the fast forms' bound of the PyTorch forms."""
    settings = {"PyTorch forms (no comfy-kitchen)": (False, False), "comfy-kitchen q/k norm+RoPE only": (True, False),
                "comfy-kitchen adaLN norm only": (False, True), "comfy-kitchen both": (True, True)}
    for batch in (1, 2):
        args = bench.inputs(batch)
        outputs = {}
        for label, (rope, adaln) in settings.items():
            kernels = model.with_arithmetic(Arithmetic(kitchen_rope=rope, kitchen_adaln=adaln))
            outputs[label] = kernels(*args)
            bench.measure(f"bf16 eager, {label}", batch, lambda: kernels(*args))
        base = outputs["PyTorch forms (no comfy-kitchen)"].float()
        for label, out in outputs.items():
            rel = ((out.float() - base).norm() / base.norm()).item()
            bench.check(f"b{batch}: {label} vs PyTorch forms: relative L2 <= 2e-3", rel <= 2e-3, rel_l2=f"{rel:.2e}")


def comfy_kitchen_status() -> str:
    try:
        import comfy_kitchen  # noqa: F401
    except Exception as error:  # not installed: the PyTorch forms run
        return f"not importable: {type(error).__name__}"
    if fused_kernels.cuda_backend() is None:
        return "importable, its CUDA backend not available: not used"
    return f"{getattr(comfy_kitchen, '__version__', '?')}, used by the eager DiT (runtime/model/fused_kernels.py)"


if __name__ == "__main__":
    main()
