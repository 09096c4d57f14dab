"""Is fusing the MLP's gelu(gate) * up into its gate_up GEMM worth a hand-written kernel? (issue 8)

    python bench/fused_epilogue.py [--configs N]

The largest memory-bound kernel of a DiT block is gelu(gate) * up: it reads the gate_up GEMM's [S, 24576] output
and writes [S, 12288]. This script measures, on the H200's power-capped sustained clocks:

1. the ceiling: the step's 36 gate_up GEMMs (cuBLAS) alone, and with the compiled gelu * up after each; the
   difference is the most any epilogue fusion can save;
2. a Triton GEMM (TMA loads, wgmma) that computes gate and up tiles side by side and writes only gelu(gate) * up,
   for a few tile configurations, checked against the unfused maths first;
3. the whole compiled step with and without that kernel, alternated round by round so clock drift hits both.

The kernel lives here, not in the runtime, because it did not pay: see bench/NOTES.md.
"""
from __future__ import annotations

import argparse
import time
from typing import Callable, Optional

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from common import GpuSampler, cuda_time_ms, dit_flops, import_package, print_environment, table

import_package()

from speed import build_ours, inputs  # noqa: E402

from ernie_image.runtime.model import dit as dit_module  # noqa: E402
from ernie_image.runtime.model.compile import compile_blocks, fuse_projections  # noqa: E402

HIDDEN, FFN, LAYERS = 4096, 12288, 36
CONFIGS = [  # BM x BN output tile (per gate and per up), BK, grouped rows, warps, pipeline stages, persistent grid
    dict(BM=128, BN=128, BK=64, GROUP_M=8, warps=8, stages=4, persistent=False),
    dict(BM=128, BN=128, BK=64, GROUP_M=8, warps=8, stages=3, persistent=False),
    dict(BM=128, BN=128, BK=64, GROUP_M=16, warps=8, stages=3, persistent=True),
    dict(BM=128, BN=128, BK=64, GROUP_M=8, warps=8, stages=3, persistent=True, WS=True),
]


@triton.jit
def _gelu_times_up(acc_g, acc_u):
    # The eager rounding: gate and up leave the GEMM as bf16, gelu(gate) is rounded to bf16, then the product.
    g = acc_g.to(tl.bfloat16).to(tl.float32)
    u = acc_u.to(tl.bfloat16).to(tl.float32)
    gelu = (0.5 * g * (1.0 + tl.erf(g * 0.7071067811865476))).to(tl.bfloat16).to(tl.float32)
    return (u * gelu).to(tl.bfloat16)


@triton.jit
def _one_tile(a_desc, w_desc, h_desc, tile, M, N, K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
              BK: tl.constexpr, GROUP_M: tl.constexpr):
    num_m = tl.cdiv(M, BM)
    per_group = GROUP_M * tl.cdiv(N, BN)
    first_m = (tile // per_group) * GROUP_M
    rows = tl.minimum(num_m - first_m, GROUP_M)
    off_m = (first_m + (tile % per_group) % rows) * BM
    off_n = ((tile % per_group) // rows) * BN
    acc_g = tl.zeros((BM, BN), dtype=tl.float32)
    acc_u = tl.zeros((BM, BN), dtype=tl.float32)
    for off_k in range(0, K, BK):
        a = a_desc.load([off_m, off_k])
        acc_g = tl.dot(a, w_desc.load([off_n, off_k]).T, acc_g)
        acc_u = tl.dot(a, w_desc.load([N + off_n, off_k]).T, acc_u)
    h_desc.store([off_m, off_n], _gelu_times_up(acc_g, acc_u))


@triton.jit
def _gate_up_gelu_kernel(a_desc, w_desc, h_desc, M, N, K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                         BK: tl.constexpr, GROUP_M: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
                         PERSISTENT: tl.constexpr, WS: tl.constexpr):
    if PERSISTENT:
        tiles = tl.cdiv(M, BM) * tl.cdiv(N, BN)
        for tile in tl.range(tl.program_id(0), tiles, NUM_PROGRAMS, flatten=True, warp_specialize=WS):
            _one_tile(a_desc, w_desc, h_desc, tile, M, N, K, BM, BN, BK, GROUP_M)
    else:
        _one_tile(a_desc, w_desc, h_desc, tl.program_id(0), M, N, K, BM, BN, BK, GROUP_M)


def gate_up_gelu(x: torch.Tensor, weight: torch.Tensor, config: dict) -> torch.Tensor:
    """x [M, K] bf16 and the fused weight [2N, K] (gate rows, then up rows) -> up * gelu(gate), [M, N] bf16."""
    m, k = x.shape
    n = weight.shape[0] // 2
    out = torch.empty((m, n), device=x.device, dtype=x.dtype)
    bm, bn, bk = config["BM"], config["BN"], config["BK"]
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    programs = min(torch.cuda.get_device_properties(x.device).multi_processor_count, tiles) \
        if config["persistent"] else tiles
    _gate_up_gelu_kernel[(programs,)](
        TensorDescriptor.from_tensor(x, [bm, bk]), TensorDescriptor.from_tensor(weight, [bn, bk]),
        TensorDescriptor.from_tensor(out, [bm, bn]), m, n, k, BM=bm, BN=bn, BK=bk, GROUP_M=config["GROUP_M"],
        NUM_PROGRAMS=programs, PERSISTENT=config["persistent"], WS=config.get("WS", False),
        num_warps=config["warps"], num_stages=config["stages"])
    return out


def unfused(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    gate, up = (x @ weight.t()).chunk(2, dim=-1)
    return up * torch.nn.functional.gelu(gate)


def config_name(config: dict) -> str:
    return "fused " + ",".join(f"{key}={value}" for key, value in config.items())


def check(config: dict, tokens: int) -> float:
    generator = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn((tokens, HIDDEN), device="cuda", generator=generator).bfloat16()
    weight = (torch.randn((2 * FFN, HIDDEN), device="cuda", generator=generator) / HIDDEN**0.5).bfloat16()
    reference = unfused(x, weight).float()
    error = ((gate_up_gelu(x, weight, config).float() - reference).norm() / reference.norm()).item()
    assert error < 1e-3, f"{config_name(config)} differs from the unfused maths: relative L2 {error:.2e}"
    return error


def checked_configs(configs: list[dict]) -> list[dict]:
    """The configurations that compile, each checked against the unfused maths (a full and a ragged M tile)
    before it is timed; one that compiles but computes something else stops the run."""
    usable = []
    for config in configs:
        try:
            differences = [(tokens, check(config, tokens)) for tokens in (4352, 300)]
        except AssertionError:
            raise
        except Exception as error:  # a tile configuration the compiler rejects is reported, not fatal
            print(f"# {config_name(config)}: {type(error).__name__}: {str(error)[:160]}", flush=True)
            continue
        for tokens, difference in differences:
            print(f"# check M={tokens} {config_name(config)}: relative L2 {difference:.2e}", flush=True)
        usable.append(config)
    return usable


def layer_rows(tokens: int, configs: list[dict], sampler: GpuSampler) -> list[dict]:
    """The step's 36 gate_up GEMMs back to back: cuBLAS alone, cuBLAS + compiled gelu * up, each fused kernel."""
    generator = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn((tokens, HIDDEN), device="cuda", generator=generator).bfloat16()
    weights = [(torch.randn((2 * FFN, HIDDEN), device="cuda", generator=generator) / HIDDEN**0.5).bfloat16()
               for _ in range(LAYERS)]
    gelu_up = torch.compile(lambda gu: gu[:, FFN:] * torch.nn.functional.gelu(gu[:, :FFN]))
    variants: dict[str, tuple[Callable[[], object], Optional[dict]]] = {  # name: (run, fused config or None)
        "cuBLAS gate_up alone (ceiling of any fusion)": (lambda: [x @ w.t() for w in weights], None),
        "cuBLAS gate_up + compiled gelu*up (today)": (lambda: [gelu_up(x @ w.t()) for w in weights], None),
    }
    for config in configs:
        variants[config_name(config)] = (lambda config=config: [gate_up_gelu(x, w, config) for w in weights], config)
    flops = 2 * tokens * HIDDEN * 2 * FFN * LAYERS
    rows = []
    for name, (run, config) in variants.items():
        try:
            with sampler.phase():
                ms = cuda_time_ms(run, warmup=2, iters=5)
        except Exception as error:  # a tile configuration the compiler rejects is reported, not fatal
            print(f"# M={tokens} {name}: {type(error).__name__}: {str(error)[:160]}", flush=True)
            continue
        rows.append({"what": f"M={tokens} x36 {name}", "ms": f"{ms:.2f}", "TFLOP/s": f"{flops / ms / 1e9:.0f}",
                     "clocks": sampler.summary(), "_ms": ms, "_tokens": tokens, "_config": config})
        print(f"# {rows[-1]['what']}: {ms:.2f} ms", flush=True)
    return rows


def step_rows(config: dict, sampler: GpuSampler, rounds: int) -> list[dict]:
    @torch.library.custom_op("ernie_bench::gate_up_gelu", mutates_args=())
    def fused_op(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return gate_up_gelu(x.reshape(-1, x.shape[-1]), weight, config).reshape(*x.shape[:-1], weight.shape[0] // 2)

    @fused_op.register_fake
    def _(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x.new_empty((*x.shape[:-1], weight.shape[0] // 2))

    plain_forward = dit_module.FeedForward.forward
    def fused_forward(self, x: torch.Tensor, arithmetic) -> torch.Tensor:
        return self.linear_fc2(fused_op(x, self.gate_up.weight))

    forwards = {"compiled step": plain_forward, "compiled step, fused gate_up": fused_forward}
    dit = build_ours()
    fuse_projections(dit)
    times: dict[tuple[int, str], list[tuple[float, str]]] = {}  # (batch, variant): (ms, clocks) per round
    try:
        for batch in (1, 2):
            lat, ts, txt, lens = inputs(batch)
            outputs = {}
            for _ in range(rounds):
                for name, forward in forwards.items():
                    dit_module.FeedForward.forward = forward
                    torch._dynamo.reset()
                    compile_blocks(dit)
                    run = lambda: dit(lat, ts, txt, lens)  # noqa: E731
                    outputs[name] = run().float()
                    with sampler.phase():
                        ms = cuda_time_ms(run, warmup=2, iters=10)
                    times.setdefault((batch, name), []).append((ms, sampler.summary()))
            plain, fused = outputs.values()
            assert torch.isfinite(fused).all(), "the fused step produced non-finite values"
            print(f"# b{batch} relative L2, fused against compiled step: "
                  f"{((plain - fused).norm() / plain.norm()).item():.2e}", flush=True)
    finally:
        dit_module.FeedForward.forward = plain_forward
    rows = []
    for (batch, name), rounds_timed in times.items():
        best, clocks = min(rounds_timed)
        every = ", ".join(f"{ms:.1f}" for ms, _ in rounds_timed)
        rows.append({"what": f"b{batch} {name} (best of {rounds}: {every})", "ms": f"{best:.2f}",
                     "TFLOP/s": f"{dit_flops() * batch / best / 1e9:.0f}", "clocks": clocks})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--configs", type=int, default=len(CONFIGS), help="how many of CONFIGS to time")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print_environment()
    configs = checked_configs(CONFIGS[: args.configs])
    sampler = GpuSampler()
    rows: list[dict] = []
    for tokens in (4352, 8704):
        rows += layer_rows(tokens, configs, sampler)
    fused_rows = [row for row in rows if row["_tokens"] == 4352 and row["_config"] is not None]
    if not fused_rows:
        print("\n" + table(rows, ["what", "ms", "TFLOP/s", "clocks"]))
        raise SystemExit("no fused configuration compiled: nothing to try in the step")
    best_config = min(fused_rows, key=lambda row: row["_ms"])["_config"]
    started = time.perf_counter()
    with torch.inference_mode():
        rows += step_rows(best_config, sampler, args.rounds)
    print(f"# step A/B took {time.perf_counter() - started:.0f} s with {config_name(best_config)}")
    print("\n" + table(rows, ["what", "ms", "TFLOP/s", "clocks"]))


if __name__ == "__main__":
    main()
