"""Where the compiled FP8 DiT step's time goes, against its floors, and what each FP8 GEMM form costs per shape.

    python bench/fp8_step.py --out DIR [--batch 1 2]     # CUDA GPU (SM >= 8.9), full size, 1024x1024, 256 tokens

In one process, on one random full-size DiT:
1. per block GEMM shape (fused and unfused projections) at M = batch x 4352 rows: bf16 `mm`, FP8 `_scaled_mm` with
   row-wise scales (what runtime/quant/fp8.py runs), FP8 with one scale per tensor, and the compiled per-row
   activation quantisation alone; and gelu(gate) * up quantised, compiled and by the kernel (fp8_gated.py);
2. the floor: the step's FP8 GEMMs (row-wise) and bf16 attentions back to back, nothing else;
3. the FP8 step uncompiled and compiled, median ms and relative L2 against bf16: as a pipe loads it (quantised,
   then q/k/v and gate/up stacked with each row keeping its layer's scale), each projection apart, and fused before
   quantising (one scale for the stack); every activation quantised by its kernel ("one-pass": the MLP's product,
   runtime/quant/fp8_gated.py, the adaLN-fed inputs, fp8_modulated.py, the rest, fp8_rows.py), only the MLP's
   product by its kernel ("gelu-only"), or none ("two-pass": the compiler's); the pipe's form also replayed as one
   CUDA graph;
4. profiles of the pipe's compiled step at batch 1, launched and replayed as a graph: GPU time by kernel kind, the
   idle time between kernels and the 25 costliest kernels.
With --gelu-ab, only the pipe's compiled step, in alternating rounds with the MLP's product quantised by the shipped
kernel (a row as three chunks) and by the former one (a row as one 16384-lane block, bench/fp8_kernel_candidates.py).
With --bound, how near the step can come to its floor with its elementwise work in kernels of its own: the floor,
the floor with a device copy moving each elementwise kernel's bytes in its place (block order, the same count), those
copies alone, and the pipe's compiled step, in alternating rounds.
Writes DIR/fp8_step.json.
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from typing import Callable

import torch

from common import cuda_time_ms, environment, import_package, quantised_copy, table

import_package()

from speed import SEQ, build_ours, inputs  # noqa: E402

from ernie_image.runtime.model.compile import allow_cache_size, compile_blocks, fuse_projections  # noqa: E402
from ernie_image.runtime.quant.fp8 import quantize_activation, quantize_fp8  # noqa: E402
from ernie_image.runtime.quant import fp8_gated, fp8_matmul  # noqa: E402
from ernie_image.runtime.quant.fp8_rows import quantize_rows, quantize_rows_reference  # noqa: E402
from ernie_image.runtime.quant.fp8_gated import gelu_mul_quantize, gelu_mul_quantize_reference  # noqa: E402
from ernie_image.runtime.quant.triton_loader import kernels_for  # noqa: E402

# What each elementwise kernel of a block reads plus writes per token, in block order (bf16 2 bytes, e4m3 1, a row's
# fp32 scale 4): the adaLN input for q/k/v; q and k normalised and rotated; the attention's output quantised; the
# attention's gated residual with the MLP's adaLN input; gelu(gate) * up quantised; the MLP's gated residual.
ELEMENTWISE_BYTES_PER_TOKEN = (("adaLN -> e4m3", 2 * 4096 + 4096 + 4), ("q/k norm + RoPE", 2 * (2 + 2) * 4096),
                               ("attention output -> e4m3", 2 * 4096 + 4096 + 4),
                               ("gated residual, adaLN -> e4m3", (2 + 2) * 4096 + 2 * 4096 + 4096 + 4),
                               ("gelu(gate) * up -> e4m3", 2 * 2 * 12288 + 12288 + 4),
                               ("gated residual", (2 + 2) * 4096 + 2 * 4096))

SHAPES = {"qkv": (12288, 4096), "q|k|v|out": (4096, 4096), "gate_up": (24576, 4096), "gate|up": (12288, 4096),
          "down": (4096, 12288)}


def gemm_rows(batch: int) -> list[dict]:
    rows = []
    quantise = torch.compile(lambda x: quantize_activation(x, per_row=True))
    for name, (n, k) in SHAPES.items():
        m = batch * SEQ
        x = torch.randn((m, k), device="cuda", dtype=torch.bfloat16)
        w = torch.randn((n, k), device="cuda", dtype=torch.bfloat16) / k ** 0.5
        wq, w_scale = quantize_fp8(w)
        w_row = w_scale.reshape(1, -1).contiguous()
        xq, x_scale = quantise(x)
        one = torch.ones((), device="cuda")
        flops = 2 * m * n * k
        forms: dict[str, Callable[[], object]] = {
            "bf16 mm": lambda: torch.mm(x, w.t()),
            "fp8 row-wise": lambda: torch._scaled_mm(xq, wq.t(), scale_a=x_scale, scale_b=w_row,
                                                     out_dtype=torch.bfloat16, use_fast_accum=True),
            "fp8 per tensor": lambda: torch._scaled_mm(xq, wq.t(), scale_a=one, scale_b=one,
                                                       out_dtype=torch.bfloat16, use_fast_accum=True),
            "activation quant (compiled)": lambda: quantise(x),
        }
        for form, run in forms.items():
            ms = cuda_time_ms(run, warmup=5, iters=30)
            tflops = f"{flops / ms / 1e9:.0f}" if "quant" not in form else ""
            rows.append({"batch": batch, "shape": f"{name} {m}x{n}x{k}", "form": form, "ms": round(ms, 4),
                         "TFLOP/s": tflops})
            print(f"# {rows[-1]}", flush=True)
    m = batch * SEQ
    gate, up = torch.randn((m, 2 * 12288), device="cuda", dtype=torch.bfloat16).chunk(2, dim=-1)
    compiled_form = torch.compile(gelu_mul_quantize_reference)
    for form, run in (("gelu*up -> e4m3, compiled torch form", lambda: compiled_form(gate, up)),
                      ("gelu*up -> e4m3, kernel", lambda: gelu_mul_quantize(gate, up))):
        rows.append({"batch": batch, "shape": f"gate_up halves {m}x12288", "form": form,
                     "ms": round(cuda_time_ms(run, warmup=5, iters=30), 4), "TFLOP/s": ""})
        print(f"# {rows[-1]}", flush=True)
    kernels = kernels_for("triton_fp8_kernels", gate.device)
    for warps in (4, 8, 16, 32):
        run = lambda: fp8_gated.launch(kernels, gate, up, warps)  # noqa: E731
        rows.append({"batch": batch, "shape": f"gate_up halves {m}x12288", "form": f"kernel, {warps} warps",
                     "ms": round(cuda_time_ms(run, warmup=5, iters=30), 4), "TFLOP/s": ""})
        print(f"# {rows[-1]}", flush=True)
    return rows


def floor_blocks(fp8: torch.nn.Module, batch: int) -> list[Callable[[], None]]:
    """Per block, its four FP8 GEMMs (row-wise) and its bf16 attention, nothing else."""
    tokens = batch * SEQ
    x = torch.randn((tokens, 4096), device="cuda").bfloat16()
    hidden = torch.randn((tokens, 12288), device="cuda").bfloat16()
    xq, x_scale = quantize_activation(x, per_row=True)
    hq, h_scale = quantize_activation(hidden, per_row=True)
    q, k, v = (torch.randn((batch, 32, SEQ, 128), device="cuda").bfloat16() for _ in range(3))

    def mm(a, a_scale, layer):
        return torch._scaled_mm(a, layer.weight.t(), scale_a=a_scale, scale_b=layer.weight_scale_row,
                                out_dtype=torch.bfloat16, use_fast_accum=True)

    def block_run(qkv, out, gate_up, down) -> Callable[[], None]:
        def run() -> None:
            mm(xq, x_scale, qkv)
            torch.nn.functional.scaled_dot_product_attention(q, k, v)
            mm(xq, x_scale, out)
            mm(xq, x_scale, gate_up)
            mm(hq, h_scale, down)
        return run
    return [block_run(b.self_attention.to_qkv, b.self_attention.to_out[0], b.mlp.gate_up, b.mlp.linear_fc2)
            for b in fp8.layers]


def floor_run(fp8: torch.nn.Module, batch: int) -> Callable[[], None]:
    blocks = floor_blocks(fp8, batch)

    def run() -> None:
        for block in blocks:
            block()
    return run


def copies_run(batch: int, layers: int) -> Callable[[], None]:
    """For each block, a device-to-device copy per elementwise kernel moving the bytes it reads and writes (a copy
    of n bytes reads n and writes n), each from and to buffers of its own, as the step's kernels use tensors of
    their own."""
    pairs = copies_pairs(batch)

    def run() -> None:
        for _ in range(layers):
            for source, target in pairs:
                target.copy_(source)
    return run


def copies_pairs(batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A source and a target per elementwise kernel, each half the bytes the kernel reads and writes."""
    tokens = batch * SEQ
    return [(torch.empty(tokens * moved // 2, dtype=torch.uint8, device="cuda"),
             torch.empty(tokens * moved // 2, dtype=torch.uint8, device="cuda"))
            for _, moved in ELEMENTWISE_BYTES_PER_TOKEN]


def floor_with_copies_run(fp8: torch.nn.Module, batch: int) -> Callable[[], None]:
    """The floor's GEMMs and attention with each elementwise kernel's bytes copied where the kernel runs."""
    blocks = floor_blocks(fp8, batch)
    copies = copies_run(batch, layers=1)

    def run() -> None:
        for block in blocks:
            block()
            copies()
    return run


def bound_rows(model: torch.nn.Module, batch: int, rounds: int) -> tuple[list[dict], list[dict]]:
    """Median ms over alternating rounds of the floor, the floor with its elementwise bytes copied, those copies
    alone and the compiled step (`model`, compiled)."""
    args_b = inputs(batch)
    moved = sum(bytes_ for _, bytes_ in ELEMENTWISE_BYTES_PER_TOKEN) * batch * SEQ * len(model.layers)
    forms = {"floor: FP8 GEMMs (row-wise) + bf16 attention": floor_run(model, batch),
             "floor + each elementwise kernel's bytes as a device copy": floor_with_copies_run(model, batch),
             "the elementwise kernels' bytes as device copies alone": copies_run(batch, len(model.layers)),
             "the step, as loaded, compiled": lambda: model(*args_b)}
    times: dict[str, list[float]] = {form: [] for form in forms}
    for _ in range(rounds):
        for form, run in forms.items():
            times[form].append(cuda_time_ms(run, warmup=2, iters=5))
    rows = [{"batch": batch, "what": form, "ms": round(sorted(ms)[len(ms) // 2], 2),
             "rounds_ms": [round(t, 2) for t in ms]} for form, ms in times.items()]
    copies_ms = rows[2]["ms"]
    rows[2]["what"] += f" ({moved / 1e9:.1f} GB, {moved / copies_ms / 1e9:.2f} TB/s)"
    for row in rows:
        print(f"# bound {row}", flush=True)
    for (kernel, per_token), (source, target) in zip(ELEMENTWISE_BYTES_PER_TOKEN, copies_pairs(batch)):
        ms = cuda_time_ms(lambda: [target.copy_(source) for _ in model.layers], warmup=2, iters=5)
        rows.append({"batch": batch, "what": f"{kernel}'s bytes as {len(model.layers)} copies", "ms": round(ms, 2),
                     "TB/s": round(per_token * batch * SEQ * len(model.layers) / ms / 1e9, 2)})
        print(f"# bound {rows[-1]}", flush=True)
    floors, steps = rows[:3] + rows[4:], rows[3:4]
    return floors, [{"model": row["what"], "batch": batch, "ms": row["ms"], "rounds_ms": row["rounds_ms"]}
                    for row in steps]


def one_pass(model: torch.nn.Module, on: bool, adaln: bool = True) -> None:
    """The MLP's product quantised by the one-pass kernel (on) or as the torch form (an instance attribute None
    hides the layer's `from_factors`); the adaLN-fed projections' inputs and the other activations quantised by
    their kernels too (on and `adaln`) or by the torch forms."""
    for block in model.layers:
        for layer, wanted in ((block.mlp.linear_fc2, on), (block.self_attention.to_qkv, on and adaln),
                              (block.mlp.gate_up, on and adaln)):
            if layer is None:
                continue
            if wanted:
                layer.__dict__.pop("from_factors", None)
            else:
                layer.from_factors = None
    fp8_matmul.quantize_rows = quantize_rows if on and adaln else quantize_rows_reference


def graph_row(model: torch.nn.Module, label: str, reference: torch.Tensor
              ) -> tuple[torch.cuda.CUDAGraph | None, dict]:
    """The compiled batch-1 step replayed as one CUDA graph: what the host's launch gaps cost the step."""
    static = inputs(1)
    row = {"model": f"{label}, one CUDA graph", "batch": 1}
    graph = None
    try:
        model(*static)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = model(*static)
        row.update(ms=round(cuda_time_ms(graph.replay, warmup=3, iters=10), 2),
                   rel_l2_vs_bf16=round(relative_l2(out, reference), 5))
    except Exception as error:  # reported as the row
        row["error"] = f"{type(error).__name__}: {error}"[:200]
        graph = None
    print(f"# step {row}", flush=True)
    return graph, row


OUR_TRITON_KERNELS = {"gelu_mul_quantize_kernel", "rms_modulate_quantize_kernel", "row_quantize_kernel"}


def kernel_kind(name: str) -> str:
    lowered = name.lower()
    if any(w in lowered for w in ("flash", "fmha", "attention", "sdpa")):
        return "attention"
    if any(w in lowered for w in ("gemm", "cublas", "cutlass", "xmma", "nvjet", "f8f8bf16")):
        return "gemm"
    if lowered.startswith("triton") or lowered in OUR_TRITON_KERNELS:
        return "fused (triton)"
    return "other"


def profile(run: Callable[[], object]) -> dict:
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    kinds: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    kernels: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    first = last = None
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            ms = event.device_time / 1000.0
            for bucket in (kinds[kernel_kind(event.name)], kernels[event.name[:110]]):
                bucket[0] += ms
                bucket[1] += 1
            start = event.time_range.start
            end = event.time_range.end
            first = start if first is None else min(first, start)
            last = end if last is None else max(last, end)
    busy = sum(v[0] for v in kinds.values())
    span = (last - first) / 1000.0 if first is not None else 0.0
    top = sorted(kernels.items(), key=lambda item: -item[1][0])[:25]
    return {"by_kind": {k: {"ms": round(v[0], 2), "kernels": int(v[1])} for k, v in kinds.items()},
            "span_ms": round(span, 2), "idle_ms": round(span - busy, 2),
            "top_kernels": [{"kernel": name, "ms": round(v[0], 3), "count": int(v[1])} for name, v in top]}


def relative_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


def gelu_ab(model: torch.nn.Module, batch: int, rounds: int) -> list[dict]:
    """The compiled step's median ms per kernel form over `rounds` alternating rounds: the custom op's eager
    implementation calls `fp8_gated.launch` at each call, so swapping it swaps the kernel inside the compiled
    graphs."""
    import fp8_kernel_candidates as candidates

    shipped = fp8_gated.launch
    forms = {"three chunks (shipped)": shipped,
             "one 16384-lane block (former)": lambda kernels, gate, up, num_warps=None, addresses=False:
             candidates.launch_gelu_one_block(gate, up, 8)}
    args_b = inputs(batch)
    times: dict[str, list[float]] = {form: [] for form in forms}
    outputs: dict[str, torch.Tensor] = {}
    try:
        for _ in range(rounds):
            for form, launch in forms.items():
                fp8_gated.launch = launch
                outputs[form] = model(*args_b)
                times[form].append(cuda_time_ms(lambda: model(*args_b), warmup=2, iters=5))
    finally:
        fp8_gated.launch = shipped
    first, second = outputs.values()
    rows = [{"model": f"as loaded, compiled, gelu kernel: {form}", "batch": batch,
             "ms": round(sorted(ms)[len(ms) // 2], 2), "rounds_ms": [round(t, 2) for t in ms]}
            for form, ms in times.items()]
    rows[0]["same_output_as_former"] = bool(torch.equal(first, second))
    for row in rows:
        print(f"# step {row}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--fastest-warps", action="store_true",
                        help="run the steps with the gelu kernel's fastest warp count in the sweep")
    parser.add_argument("--one-pass-only", action="store_true",
                        help="only the compiled one-pass steps: as loaded and each projection apart")
    parser.add_argument("--uncompiled-only", action="store_true", help="only the uncompiled steps (and the profile)")
    parser.add_argument("--no-gemms", action="store_true", help="leave out the per-shape GEMM rows")
    parser.add_argument("--gelu-ab", type=int, default=0, metavar="ROUNDS",
                        help="only the pipe's compiled step, the gelu kernel's two forms in alternating rounds")
    parser.add_argument("--bound", type=int, default=0, metavar="ROUNDS",
                        help="only the floor, the floor with the elementwise kernels' bytes as copies, and the step")
    args = parser.parse_args()
    allow_cache_size()
    report: dict = {"environment": environment(), "gemms": [], "steps": [], "floors": []}
    with torch.inference_mode():
        for batch in [] if args.no_gemms else args.batch:
            report["gemms"] += gemm_rows(batch)
        if report["gemms"]:
            print(table(report["gemms"], ["batch", "shape", "form", "ms", "TFLOP/s"]), flush=True)
        if args.fastest_warps:
            sweep = [r for r in report["gemms"] if r["form"].startswith("kernel, ")]
            best = min(sweep, key=lambda r: r["ms"])
            report["steps_warps"] = int(best["form"].split(", ")[1].split()[0])
            fp8_gated.default_warps = lambda block: report["steps_warps"]
            print(f"# steps run the kernel with {report['steps_warps']} warps", flush=True)

        ours = build_ours()
        as_loaded = quantised_copy(ours, "fp8")  # the order a pipe loads in: quantised, then stacked (per-row scales)
        fuse_projections(as_loaded)
        if args.bound:
            ours = None
            torch.cuda.empty_cache()
            one_pass(as_loaded, True)
            compile_blocks(as_loaded)
            for batch in args.batch:
                floors, steps = bound_rows(as_loaded, batch, args.bound)
                report["floors"] += floors
                report["steps"] += steps
            args_1 = inputs(1)
            report["profile_b1_as_loaded"] = profile(lambda: as_loaded(*args_1))
            print_profiles(report)
            write(report, args.out)
            return
        if args.gelu_ab:
            ours = None
            torch.cuda.empty_cache()
            report["floors"] = [{"batch": batch, "what": "FP8 GEMMs (row-wise) + bf16 attention",
                                 "ms": round(cuda_time_ms(floor_run(as_loaded, batch), warmup=2, iters=5), 2)}
                                for batch in args.batch]
            one_pass(as_loaded, True)
            compile_blocks(as_loaded)
            for batch in args.batch:
                report["steps"] += gelu_ab(as_loaded, batch, args.gelu_ab)
            write(report, args.out)
            return
        apart = quantised_copy(ours, "fp8")  # each projection its own GEMM
        fuse_projections(ours)
        fused = quantised_copy(ours, "fp8")
        references = {batch: ours(*inputs(batch)) for batch in args.batch}
        ours = None
        torch.cuda.empty_cache()
        for batch in args.batch:
            ms = cuda_time_ms(floor_run(fused, batch), warmup=2, iters=5)
            report["floors"].append({"batch": batch, "what": "FP8 GEMMs (row-wise) + bf16 attention", "ms": round(ms, 2)})
            print(f"# floor {report['floors'][-1]}", flush=True)
        variants = (("as loaded", as_loaded, "one-pass"),
                    ("fused before quantising, product quantised by the compiler", fused, "two-pass"),
                    ("fused before quantising", fused, "one-pass"))
        uncompiled = (("fused before quantising", fused, "two-pass"), ("fused before quantising", fused, "one-pass"),
                      ("as loaded", as_loaded, "one-pass"), ("as loaded", as_loaded, "gelu-only"),
                      ("each projection apart", apart, "one-pass"))
        for projections, model, quantiser in uncompiled:  # before any compile
            one_pass(model, quantiser != "two-pass", adaln=quantiser == "one-pass")
            for batch in args.batch:
                args_b = inputs(batch)
                out = model(*args_b)
                ms = cuda_time_ms(lambda: model(*args_b), warmup=2, iters=5)
                report["steps"].append({"model": f"uncompiled, {projections}, {quantiser} quantisation",
                                        "batch": batch, "ms": round(ms, 2),
                                        "rel_l2_vs_bf16": round(relative_l2(out, references[batch]), 5)})
                print(f"# step {report['steps'][-1]}", flush=True)
        if args.uncompiled_only:
            variants = ()
        elif args.one_pass_only:
            variants = variants[:1] + (("each projection apart", apart, "one-pass"),)
        for label, model, quantiser in variants:
            one_pass(model, quantiser != "two-pass", adaln=quantiser == "one-pass")
            torch._dynamo.reset()
            compile_blocks(model)
            for batch in args.batch:
                args_b = inputs(batch)
                out = model(*args_b)
                ms = cuda_time_ms(lambda: model(*args_b), warmup=3, iters=10)
                report["steps"].append({"model": f"{label}, {quantiser} quantisation", "batch": batch,
                                        "ms": round(ms, 2),
                                        "rel_l2_vs_bf16": round(relative_l2(out, references[batch]), 5)})
                print(f"# step {report['steps'][-1]}", flush=True)
            if model is as_loaded and quantiser == "one-pass":
                graph, row = graph_row(model, label, references[1])
                report["steps"].append(row)
                report["profile_b1_as_loaded_graph"] = profile(graph.replay) if graph is not None else None
        one_pass(as_loaded, True)
        args_1 = inputs(1)
        report["profile_b1_as_loaded"] = profile(lambda: as_loaded(*args_1))
    print_profiles(report)
    write(report, args.out)


def print_profiles(report: dict) -> None:
    for key in ("profile_b1_as_loaded", "profile_b1_as_loaded_graph"):
        prof = report.get(key)
        if prof:
            print(f"{key}: {prof['by_kind']} span {prof['span_ms']} ms, idle {prof['idle_ms']} ms")
            for row in prof["top_kernels"]:
                print(f"{row['ms']:9.3f} ms {row['count']:5d}x {row['kernel']}")


def write(report: dict, out_dir: str) -> None:
    print(table(report["floors"], ["batch", "what", "ms", "TB/s"]))
    print(table(report["steps"], ["model", "batch", "ms", "rel_l2_vs_bf16", "error"]))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fp8_step.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
