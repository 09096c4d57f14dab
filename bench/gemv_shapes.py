"""Achieved bandwidth of the prompt enhancer's one-token matrix products (bf16, M=1), alone and with weights stacked.

    python bench/gemv_shapes.py --out DIR

The decode step is bound by reading 6.86 GB of weights a token; each row is one weight shape of the 3.43B PE
(hidden 3072, 32 query heads and 8 kv heads of 128, MLP 9216, vocabulary 131072), timed back to back in a CUDA graph
so launch gaps do not count. Writes DIR/gemv_shapes.json.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from common import environment, table

SHAPES = {  # name: (out_features, in_features)
    "q_proj": (4096, 3072), "k_proj / v_proj": (1024, 3072), "q+k+v stacked": (6144, 3072),
    "o_proj": (3072, 4096), "gate / up": (9216, 3072), "gate+up stacked": (18432, 3072),
    "down_proj": (3072, 9216), "lm_head": (131072, 3072),
}


def graph_ms(run, repeats: int = 50) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeats):
            run()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / (5 * repeats)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    rows = []
    with torch.inference_mode():
        for name, (out_features, in_features) in SHAPES.items():
            weight = torch.randn(out_features, in_features, device="cuda", dtype=torch.bfloat16)
            x = torch.randn(1, in_features, device="cuda", dtype=torch.bfloat16)
            out = torch.empty(1, out_features, device="cuda", dtype=torch.bfloat16)
            for variant, run in (("F.linear", lambda: torch.nn.functional.linear(x, weight)),
                                 ("mm out=", lambda: torch.mm(x, weight.t(), out=out)),
                                 ("W @ x (gemv)", lambda: torch.mv(weight, x[0]))):
                ms = graph_ms(run)
                rows.append({"shape": name, "variant": variant, "us": round(ms * 1000, 1),
                             "TB/s": round(weight.numel() * 2 / (ms / 1000) / 1e12, 2)})
            del weight
    print(table(rows, ["shape", "variant", "us", "TB/s"]))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gemv_shapes.json").write_text(json.dumps({"environment": environment(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
