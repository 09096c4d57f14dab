"""Triton kernel: the MLP's gelu(gate) * up quantised to e4m3 per row, in one pass (loaded by triton_loader).

One program a row: it reads the row's gate and up halves once, holds the product in registers, takes its absolute
maximum and writes the e4m3 row and its scale. Every step rounds where the torch form (fp8_gated.py's reference)
rounds: gelu to bf16, the product to bf16, the scale to bf16, the quotient to bf16, then e4m3 (round to nearest
even after the clamp). GELU is the exact (erf) form, as F.gelu's default.
"""
from __future__ import annotations

import os

import triton
import triton.language as tl

E4M3_MAX = tl.constexpr(448.0)
MIN_SCALE = tl.constexpr(1e-12)
# This module is loaded once per mode (triton_loader.py), with the env var set.
SOFTWARE_ROUNDING = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")


@triton.jit
def _bf16(value):
    """fp32 rounded to the nearest bf16 (even on ties), kept in fp32. The interpreter's cast truncates, so there
    the rounding is done with integer ops, as torch does it."""
    if SOFTWARE_ROUNDING:
        bits = value.to(tl.uint32, bitcast=True)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        return rounded.to(tl.float32, bitcast=True)
    return value.to(tl.bfloat16).to(tl.float32)


@triton.jit
def _e4m3(value):
    """fp32 within +-448, or NaN -> e4m3, to nearest even. The interpreter's cast rounds ties up, flushes subnormals
    and saturates NaN, so there the value is first put on e4m3's grid with integer ops (3 mantissa bits) or, below
    2^-6, on the subnormals' 2^-9 steps (adding and taking away 1.5 * 2^14 rounds there), whose cast is exact, and
    NaN is written as its code."""
    if SOFTWARE_ROUNDING:
        bits = value.to(tl.uint32, bitcast=True)
        normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000).to(tl.float32, bitcast=True)
        magnitude = (tl.abs(value) + 24576.0) - 24576.0
        subnormal = (magnitude.to(tl.uint32, bitcast=True) | (bits & 0x80000000)).to(tl.float32, bitcast=True)
        on_grid = tl.where(tl.abs(value) >= 0.015625, normal, subnormal).to(tl.float8e4nv)
        nan = tl.full(value.shape, 0x7F, tl.uint8).to(tl.float8e4nv, bitcast=True)  # the cast saturates NaN too
        return tl.where(value != value, nan, on_grid)
    return value.to(tl.float8e4nv)


@triton.jit
def _larger(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def gelu_mul_quantize_kernel(gate, up, out, scale, gate_row_stride, up_row_stride, n, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    g = tl.load(gate + row * gate_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up + row * up_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    gelu = _bf16(0.5 * g * (1.0 + tl.math.erf(g * 0.7071067811865476)))
    product = _bf16(u * gelu)
    # Not tl.max: a jit function of triton's own, which the interpreter cannot run where triton was imported
    # before TRITON_INTERPRET was set.
    amax = tl.reduce(tl.where(mask, tl.abs(product), 0.0), 0, _larger)
    # NaN propagates as in torch's amax and clamp (Triton's min/max drop it by default): a non-finite product
    # makes its row's scale NaN or inf and reaches the non-finite check downstream.
    row_scale = _bf16(tl.maximum(amax / E4M3_MAX, MIN_SCALE, propagate_nan=tl.PropagateNan.ALL))
    quotient = _bf16(product / row_scale)
    quotient = tl.minimum(tl.maximum(quotient, -E4M3_MAX, propagate_nan=tl.PropagateNan.ALL), E4M3_MAX,
                          propagate_nan=tl.PropagateNan.ALL)
    tl.store(out + row * n + cols, _e4m3(quotient), mask=mask)
    tl.store(scale + row, row_scale)
