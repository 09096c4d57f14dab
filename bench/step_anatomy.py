"""Where a compiled DiT step's time goes on the GPU, and the floors it is measured against.

    python bench/step_anatomy.py [--batch 1 2] [--tunableop] [--autotune] [--graph]
    python bench/step_anatomy.py --previews [--batch 1] [--steps 8]

1. Floors measured in this run on the model's own weights: the step's 144 block GEMMs back to back (cuBLAS), per
   shape and all together, and its 36 flash attentions; the SM clock and power are sampled while each runs.
2. The compiled step, profiled: kernel time summed by kind (GEMM, attention, fused Triton, other) and GPU idle time.
3. Options (flags): cuBLAS algorithms picked by TunableOp, inductor's Triton GEMM templates (max-autotune), and the
   whole step replayed as one CUDA graph.
4. --previews (alone): the sampler's step with latent previews on (a host that shows them) and with a host that
   wants none, against the DiT forward alone, `--steps` calls back to back, on the compiled DiT and on the
   uncompiled one replayed as CUDA graphs (dit_graphs.py). Target: previews on <= 1.01x the DiT alone.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Callable

import torch

from common import (BLOCK_GEMMS, GpuSampler, block_gemm_weights, block_matmuls, cuda_time_ms, dit_flops, import_package,
                    print_environment, table, wall_time)

import_package()

from speed import SEQ, build_ours, inputs  # noqa: E402

from ernie_image.runtime.core.host import NullHost  # noqa: E402
from ernie_image.runtime.model.compile import compile_blocks, fuse_projections  # noqa: E402
from ernie_image.runtime.model.dit import ErnieDiT  # noqa: E402
from ernie_image.runtime.model.dit_graphs import DiTGraphs  # noqa: E402
from ernie_image.runtime.sampling.euler import sample_euler  # noqa: E402
from ernie_image.runtime.sampling.preview_stream import PreviewStream  # noqa: E402


def timed(name: str, run: Callable[[], object], flops: float, sampler: GpuSampler, rows: list, iters: int = 10):
    with sampler.phase():
        ms = cuda_time_ms(run, warmup=2, iters=iters)
    rows.append({"what": name, "ms": f"{ms:.2f}", "TFLOP/s": f"{flops / ms / 1e9:.0f}" if flops else "",
                 "clocks": sampler.summary()})
    print(f"# {name}: {ms:.2f} ms  {sampler.summary()}", flush=True)
    return ms


def floors(dit: ErnieDiT, batch: int, sampler: GpuSampler, rows: list) -> None:
    tokens = SEQ * batch
    generator = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn((tokens, 4096), device="cuda", generator=generator).bfloat16()
    hidden = torch.randn((tokens, 12288), device="cuda", generator=generator).bfloat16()
    blocks = block_gemm_weights(dit)
    shapes = {role: [weights[role] for weights in blocks] for role in BLOCK_GEMMS}
    outs = {role: torch.empty((tokens, ws[0].shape[0]), device="cuda", dtype=torch.bfloat16)
            for role, ws in shapes.items()}

    def role_run(role: str):
        source = hidden if role == "down" else x

        def run():
            for weight in shapes[role]:
                torch.mm(source, weight.t(), out=outs[role])
        return run

    total_flops = 0.0
    for role, weights in shapes.items():
        flops = 2 * tokens * weights[0].shape[0] * weights[0].shape[1] * len(weights)
        total_flops += flops
        timed(f"b{batch} GEMM {role} x36 [{tokens}x{weights[0].shape[1]}]x[{weights[0].shape[1]}x{weights[0].shape[0]}]",
              role_run(role), flops, sampler, rows)

    timed(f"b{batch} all 144 block GEMMs", lambda: [role_run(role)() for role in shapes], total_flops, sampler, rows)
    q, k, v = (torch.randn((batch, 32, SEQ, 128), device="cuda", generator=generator).bfloat16() for _ in range(3))

    def attention():
        for _ in range(36):
            torch.nn.functional.scaled_dot_product_attention(q, k, v)

    timed(f"b{batch} 36 SDPA (no mask)", attention, 36 * 4 * SEQ * SEQ * 4096 * batch, sampler, rows)
    timed(f"b{batch} GEMMs + SDPA in block order (floor)", block_matmuls(dit, batch, SEQ), dit_flops() * batch,
          sampler, rows)


def profile_step(run: Callable[[], object], label: str) -> None:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    for _ in range(2):
        run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    if not kernels:
        print(f"# {label}: profiler saw no CUDA kernels")
        return
    spans = sorted((e.time_range.start, e.time_range.end) for e in kernels)
    busy, cursor_start, cursor_end = 0.0, spans[0][0], spans[0][1]
    for start, end in spans[1:]:
        if start > cursor_end:
            busy += cursor_end - cursor_start
            cursor_start, cursor_end = start, end
        else:
            cursor_end = max(cursor_end, end)
    busy += cursor_end - cursor_start
    window = spans[-1][1] - spans[0][0]
    kinds: dict[str, list[float]] = {}
    by_name: dict[str, list[float]] = {}
    for event in kernels:
        duration = event.time_range.end - event.time_range.start
        name = event.name
        lower = name.lower()
        if any(tag in lower for tag in ("flash", "fmha", "attention", "sdpa", "cudnn")):
            kind = "attention"
        elif any(tag in lower for tag in ("gemm", "nvjet", "xmma", "cutlass", "cublas", "matmul", "_mm_")):
            kind = "GEMM"
        elif lower.startswith("triton"):
            kind = "fused triton"
        else:
            kind = "other"
        kinds.setdefault(kind, []).append(duration)
        by_name.setdefault(f"[{kind}] {name[:110]}", []).append(duration)
    print(f"\n## profile {label}: window {window / 1e3:.2f} ms, kernels busy {busy / 1e3:.2f} ms, "
          f"idle {(window - busy) / 1e3:.2f} ms, {len(kernels)} kernels")
    for kind, durations in sorted(kinds.items(), key=lambda kv: -sum(kv[1])):
        print(f"#   {kind:13s} {sum(durations) / 1e3:8.2f} ms in {len(durations)} kernels")
    for name, durations in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:18]:
        print(f"#   {sum(durations) / 1e3:8.2f} ms  n={len(durations):4d}  avg {statistics.mean(durations):8.1f} us  {name}")


def step_rows(dit: ErnieDiT, batch: int, sampler: GpuSampler, rows: list, label: str) -> Callable[[], object]:
    lat, ts, txt, lens = inputs(batch)
    run = lambda: dit(lat, ts, txt, lens)  # noqa: E731
    print(f"# {label} b{batch} first call {wall_time(run)[1]:.1f} s", flush=True)
    timed(f"b{batch} step, {label}", run, dit_flops() * batch, sampler, rows)
    return run


def graph_rows(dit: ErnieDiT, batch: int, sampler: GpuSampler, rows: list) -> None:
    lat, ts, txt, lens = inputs(batch)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            dit(lat, ts, txt, lens)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dit(lat, ts, txt, lens)
    timed(f"b{batch} step, compiled, one CUDA graph", graph.replay, dit_flops() * batch, sampler, rows)
    del graph


class PreviewHost(NullHost):
    """A host that shows previews (as ComfyUI does with a preview method other than none); counts the pictures."""

    wants_previews = True

    def __init__(self) -> None:
        super().__init__()
        self.pictures = 0

    def progress(self, value: int, total: int, preview=None) -> None:
        self.pictures += preview is not None


def preview_rows(forward: Callable[..., torch.Tensor], label: str, batch: int, steps: int, sampler: GpuSampler,
                 rows: list) -> None:
    """`steps` sampler steps with previews on and with no previews against `steps` DiT forwards back to back: CUDA
    event time, so GPU time lost waiting for the host counts."""
    lat, ts, txt, lens = inputs(batch)
    noise = torch.randn(lat.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(2))
    denoise = lambda latents, timestep: forward(latents, timestep, txt, lens)  # noqa: E731
    flops = dit_flops() * batch * steps

    def alone() -> None:
        for _ in range(steps):
            forward(lat, ts, txt, lens)

    alone_ms = timed(f"b{batch} {label}: DiT forward x{steps}", alone, flops, sampler, rows)
    rows[-1]["vs DiT"] = "1.000x"
    shown = PreviewHost()
    for name, host, previews in (("sampler, previews on", shown, PreviewStream("cuda")),
                                 ("sampler, no previews", NullHost(), None)):
        run = lambda: sample_euler(denoise, noise, steps, 4.0, 1.0, torch.bfloat16, host, previews)  # noqa: E731
        ms = timed(f"b{batch} {label}: {name} x{steps}", run, flops, sampler, rows)
        rows[-1]["vs DiT"] = f"{ms / alone_ms:.3f}x"
    print(f"# {label}: {shown.pictures} previews handed to the host", flush=True)


def previews_main(batches: list[int], steps: int, sampler: GpuSampler) -> None:
    rows: list[dict] = []
    compiled = build_ours()
    fuse_projections(compiled)
    compile_blocks(compiled)
    eager = build_ours()
    fuse_projections(eager)
    with torch.inference_mode():
        for batch in batches:
            preview_rows(compiled, "compiled", batch, steps, sampler, rows)
            preview_rows(DiTGraphs(eager), "uncompiled, CUDA graphs", batch, steps, sampler, rows)
    print("\n" + table(rows, ["what", "ms", "vs DiT", "TFLOP/s", "clocks"]))


def tunableop_rows(dit: ErnieDiT, batches: list[int], sampler: GpuSampler, rows: list, out_dir: str) -> None:
    import torch.cuda.tunable as tunable

    tunable.enable(True)
    tunable.tuning_enable(True)
    tunable.set_max_tuning_duration(30)
    tunable.set_filename(os.path.join(out_dir, "tunableop_results%d.csv"))
    started = time.perf_counter()
    for batch in batches:
        floors(dit, batch, sampler, [])  # tunes every shape once
    print(f"# TunableOp tuning took {time.perf_counter() - started:.1f} s", flush=True)
    tunable.tuning_enable(False)
    for batch in batches:
        rows.append({"what": f"--- TunableOp b{batch} ---"})
        floors(dit, batch, sampler, rows)
        step_rows(dit, batch, sampler, rows, "compiled + TunableOp")
    tunable.write_file()
    tunable.enable(False)


def autotune_rows(dit: ErnieDiT, batch: int, sampler: GpuSampler, rows: list) -> None:
    import torch._inductor.config as inductor

    inductor.max_autotune_gemm_backends = "ATEN,TRITON"
    inductor.triton.enable_persistent_tma_matmul = True
    tokens = SEQ * batch
    generator = torch.Generator(device="cuda").manual_seed(0)
    for role in BLOCK_GEMMS:
        weight = block_gemm_weights(dit)[0][role]
        x = torch.randn((tokens, weight.shape[1]), device="cuda", generator=generator).bfloat16()
        torch._dynamo.reset()
        compiled = torch.compile(lambda a, w: a @ w.t(), mode="max-autotune-no-cudagraphs", dynamic=False)
        flops = 2 * tokens * weight.shape[0] * weight.shape[1]
        print(f"# autotune {role}: {wall_time(lambda: compiled(x, weight))[1]:.1f} s", flush=True)
        timed(f"b{batch} {role} max-autotune (ATEN,TRITON persistent TMA)", lambda: compiled(x, weight), flops,
              sampler, rows, iters=50)
        timed(f"b{batch} {role} cuBLAS", lambda: x @ weight.t(), flops, sampler, rows, iters=50)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--tunableop", action="store_true")
    parser.add_argument("--autotune", action="store_true")
    parser.add_argument("--graph", action="store_true")
    parser.add_argument("--previews", action="store_true")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    print_environment()
    sampler = GpuSampler()
    if args.previews:
        previews_main(args.batch, args.steps, sampler)
        return
    dit = build_ours()
    fuse_projections(dit)
    compile_blocks(dit)
    rows: list[dict] = []
    with torch.inference_mode():
        for batch in args.batch:
            floors(dit, batch, sampler, rows)
            run = step_rows(dit, batch, sampler, rows, "compiled")
            profile_step(run, f"compiled b{batch}")
            if args.graph:
                try:
                    graph_rows(dit, batch, sampler, rows)
                except Exception as error:
                    print(f"# CUDA graph b{batch}: {type(error).__name__}: {error}"[:300])
        print("\n" + table(rows, ["what", "ms", "TFLOP/s", "clocks"]), flush=True)
        if args.tunableop:
            try:
                tunableop_rows(dit, args.batch, sampler, rows, args.out)
            except Exception as error:
                print(f"# TunableOp: {type(error).__name__}: {error}"[:300])
        if args.autotune:
            try:
                autotune_rows(dit, args.batch[0], sampler, rows)
            except Exception as error:
                print(f"# autotune: {type(error).__name__}: {error}"[:300])
    print("\n" + table(rows, ["what", "ms", "TFLOP/s", "clocks"]))


if __name__ == "__main__":
    main()
