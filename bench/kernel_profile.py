"""One profiled call on a CUDA device, its GPU time grouped two ways: by kernel kind (GEMM, attention, other) and
by the PyTorch operator that launched it (with input shapes), so each elementwise pass can be named.

    python bench/kernel_profile.py dit --out DIR [--batch 1] [--quant fp8]   # one uncompiled DiT step, 1024x1024
    python bench/kernel_profile.py pe --out DIR                              # one prompt-enhancer decode step

Writes DIR/kernel_profile_<what>.json.
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from typing import Callable

import torch

from common import environment, import_package, quantise_block_linears_

import_package()


def kind(kernel: str) -> str:
    lowered = kernel.lower()
    if any(word in lowered for word in ("gemm", "cublas", "cutlass", "xmma", "nvjet", "gemv", "splitk")):
        return "gemm"
    if any(word in lowered for word in ("flash", "fmha", "cudnn", "attention", "sdpa")):
        return "attention"
    return "other"


def profile(run: Callable[[], object]) -> dict:
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities, record_shapes=True) as prof:
        run()
        torch.cuda.synchronize()
    kinds: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            group = kinds[kind(event.name)]
            group[0] += event.device_time / 1000.0
            group[1] += 1
    operators = []
    for average in prof.key_averages(group_by_input_shape=True):
        ms = average.self_device_time_total / 1000.0
        if ms > 0 and not average.key.startswith("cuda"):
            operators.append({"op": average.key, "shapes": str(average.input_shapes)[:120], "calls": average.count,
                              "ms": round(ms, 3)})
    operators.sort(key=lambda row: -row["ms"])
    return {"by_kind": {k: {"ms": round(v[0], 2), "kernels": int(v[1])} for k, v in kinds.items()},
            "by_operator": operators[:30]}


def dit_step(batch: int, quant: str) -> Callable[[], object]:
    from eager_graphs import Bench, build

    bench = Bench(torch.device("cuda"), tiny=False, iters=1)
    model = build(bench)
    if quant != "none":
        quantise_block_linears_(model, quant)
    run_args = bench.inputs(batch)
    return lambda: model(*run_args)


def pe_step() -> Callable[[], object]:
    from enhancer import full_size_pe
    from ernie_image.runtime.text.static_decoder import StaticCacheDecoder

    model, _ = full_size_pe(torch.device("cuda"))
    decoder = StaticCacheDecoder(model, 512, use_graph=False)
    decoder.prefill(list(range(1, 129)))
    return lambda: decoder.next_logits(7) if decoder.length < 500 else None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("what", choices=["dit", "pe"])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--quant", choices=["none", "fp8"], default="none")
    args = parser.parse_args()
    with torch.inference_mode():
        run = dit_step(args.batch, args.quant) if args.what == "dit" else pe_step()
        result = profile(run)
    label = f"{args.what}_b{args.batch}_{args.quant}" if args.what == "dit" else "pe"
    print(f"{label}: {result['by_kind']}")
    for row in result["by_operator"][:22]:
        print(f"{row['ms']:8.2f} ms {row['calls']:5d}x {row['op']:34s} {row['shapes']}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"kernel_profile_{label}.json").write_text(json.dumps({"environment": environment(), **result}, indent=1))


if __name__ == "__main__":
    main()
