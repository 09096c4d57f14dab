"""Triton kernels: FP8 activations quantised to e4m3 per row, each read once (loaded by triton_loader): the MLP's
gelu(gate) * up, a block's adaLN input (with the gated residual before it, or without), any bf16 activation.

A program holds a row (or a few) in registers, takes its absolute maximum and writes the e4m3 row and its scale.
Every step rounds where the torch forms (fp8_gated.py, fp8_modulated.py, fp8_rows.py) round: each bf16 result to
bf16, the scale to bf16, the quotient to bf16, then e4m3 (round to nearest even after the clamp). GELU is the exact
(erf) form, as F.gelu's default.

ADDRESSES: the tensors are given as their integer addresses, 16-byte aligned, not as tensors. Triton checks a
tensor's address with the driver before a launch, which fails for memory a CUDA graph being captured under
cudaMallocAsync allocated itself (it is mapped only when the graph runs); an integer is taken as it is.
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
def _at(address, dtype: tl.constexpr):
    """An integer address as a pointer to `dtype` values, 16-byte aligned (which keeps loads and stores vectorised)."""
    return tl.multiple_of(address.to(tl.pointer_type(dtype)), 16)


@triton.jit
def _larger(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _plus(a, b):
    return a + b


@triton.jit
def _gelu_product(g, u):
    """bf16(u * bf16(gelu(g))) in fp32, gelu the exact (erf) form as F.gelu's default."""
    gelu = _bf16(0.5 * g * (1.0 + tl.math.erf(g * 0.7071067811865476)))
    return _bf16(u * gelu)


@triton.jit
def _row_scale(amax):
    """The row's bf16 scale from its absolute maximum. NaN propagates as in torch's amax and clamp (Triton's
    min/max drop it by default): a non-finite value makes its row's scale NaN or inf and reaches the non-finite
    check downstream."""
    return _bf16(tl.maximum(amax / E4M3_MAX, MIN_SCALE, propagate_nan=tl.PropagateNan.ALL))


@triton.jit
def _quantised(values, row_scale):
    """values (bf16 held in fp32) / row_scale, rounded to bf16, clamped to +-448, in e4m3."""
    quotient = _bf16(values / row_scale)
    quotient = tl.minimum(tl.maximum(quotient, -E4M3_MAX, propagate_nan=tl.PropagateNan.ALL), E4M3_MAX,
                          propagate_nan=tl.PropagateNan.ALL)
    return _e4m3(quotient)


@triton.jit
def _absmax(values, mask, axis: tl.constexpr = 0):
    # Not tl.max: a jit function of triton's own, which the interpreter cannot run where triton was imported
    # before TRITON_INTERPRET was set.
    return tl.reduce(tl.where(mask, tl.abs(values), 0.0), axis, _larger)


@triton.jit
def _gelu_chunk(gate, up, row, gate_row_stride, up_row_stride, start, cols, n):
    """A chunk of a row's gelu(gate) * up (bf16 values in fp32) and its mask."""
    mask = start + cols < n
    g = tl.load(gate + row * gate_row_stride + start + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up + row * up_row_stride + start + cols, mask=mask, other=0.0).to(tl.float32)
    return _gelu_product(g, u), mask


@triton.jit
def gelu_mul_quantize_kernel(gate, up, out, scale, gate_row_stride, up_row_stride, n, CHUNK: tl.constexpr,
                             ADDRESSES: tl.constexpr = False):
    """One program a row of at most 3 * CHUNK values, held in registers as three chunks: a 12288-value row is
    three 4096-value chunks, where one power-of-two block would pad it to 16384 lanes."""
    if ADDRESSES:
        gate, up, out, scale = _at(gate, tl.bfloat16), _at(up, tl.bfloat16), _at(out, tl.float8e4nv), \
            _at(scale, tl.float32)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, CHUNK)
    first, first_mask = _gelu_chunk(gate, up, row, gate_row_stride, up_row_stride, 0, cols, n)
    second, second_mask = _gelu_chunk(gate, up, row, gate_row_stride, up_row_stride, CHUNK, cols, n)
    third, third_mask = _gelu_chunk(gate, up, row, gate_row_stride, up_row_stride, 2 * CHUNK, cols, n)
    largest = _larger(_larger(_absmax(first, first_mask), _absmax(second, second_mask)), _absmax(third, third_mask))
    row_scale = _row_scale(largest)
    tl.store(out + row * n + cols, _quantised(first, row_scale), mask=first_mask)
    tl.store(out + row * n + CHUNK + cols, _quantised(second, row_scale), mask=second_mask)
    tl.store(out + row * n + 2 * CHUNK + cols, _quantised(third, row_scale), mask=third_mask)
    tl.store(scale + row, row_scale)


@triton.jit(do_not_specialize=["rows", "rows_per_batch"])  # one compiled form whatever the token count
def rms_modulate_quantize_kernel(x, update, gate, x_out, weight, one_plus_scale, shift, out, scale, rows,
                                 rows_per_batch, n, eps, BLOCK: tl.constexpr, ROWS: tl.constexpr,
                                 RESIDUAL: tl.constexpr, ADDRESSES: tl.constexpr = False):
    """A block's adaLN input in e4m3, ROWS rows a program, x's rows contiguous: RMSNorm as RMSNorm.forward rounds
    it (fp32 normalised, bf16, times the bf16 weight, bf16), modulated as `modulate` (fp32 x * (1 + scale) +
    shift, bf16), then quantised per row as quantize_activation. `one_plus_scale` and `shift` are fp32
    [batches, n], a batch every `rows_per_batch` rows. RESIDUAL: x is first x + bf16(gate * update) (bf16 update,
    fp32 gate [batches, n]: the gated residual's plain form), written to x_out."""
    if ADDRESSES:
        x, update, gate, x_out = _at(x, tl.bfloat16), _at(update, tl.bfloat16), _at(gate, tl.float32), \
            _at(x_out, tl.bfloat16)
        weight, one_plus_scale, shift = _at(weight, tl.bfloat16), _at(one_plus_scale, tl.float32), \
            _at(shift, tl.float32)
        out, scale = _at(out, tl.float8e4nv), _at(scale, tl.float32)
    first = tl.program_id(0).to(tl.int64) * ROWS
    row = first + tl.arange(0, ROWS)[:, None]
    cols = tl.arange(0, BLOCK)[None, :]
    mask = (row < rows) & (cols < n)
    batch_offset = (row // rows_per_batch) * n + cols
    values = tl.load(x + row * n + cols, mask=mask, other=0.0).to(tl.float32)
    if RESIDUAL:
        gated = _bf16(tl.load(gate + batch_offset, mask=mask, other=0.0)
                      * tl.load(update + row * n + cols, mask=mask, other=0.0).to(tl.float32))
        values = _bf16(values + gated)
        tl.store(x_out + row * n + cols, values.to(tl.bfloat16), mask=mask)
    mean_square = tl.reduce(values * values, 1, _plus)[:, None] / n
    normed = _bf16(values * tl.math.rsqrt(mean_square + eps))
    normed = _bf16(normed * tl.load(weight + cols, mask=cols < n, other=0.0).to(tl.float32))
    factor = tl.load(one_plus_scale + batch_offset, mask=mask, other=0.0)
    offset = tl.load(shift + batch_offset, mask=mask, other=0.0)
    modulated = _bf16(normed * factor + offset)
    row_scale = _row_scale(_absmax(modulated, mask, 1))[:, None]
    tl.store(out + row * n + cols, _quantised(modulated, row_scale), mask=mask)
    tl.store(scale + row, row_scale, mask=row < rows)


@triton.jit(do_not_specialize=["rows"])
def row_quantize_kernel(x, out, scale, x_row_stride, rows, n, BLOCK: tl.constexpr, ROWS: tl.constexpr,
                        ADDRESSES: tl.constexpr = False):
    """quantize_activation(x, per_row=True) for bf16 rows, ROWS rows a program."""
    if ADDRESSES:
        x, out, scale = _at(x, tl.bfloat16), _at(out, tl.float8e4nv), _at(scale, tl.float32)
    first = tl.program_id(0).to(tl.int64) * ROWS
    row = first + tl.arange(0, ROWS)[:, None]
    cols = tl.arange(0, BLOCK)[None, :]
    mask = (row < rows) & (cols < n)
    values = tl.load(x + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    row_scale = _row_scale(_absmax(values, mask, 1))[:, None]
    tl.store(out + row * n + cols, _quantised(values, row_scale), mask=mask)
    tl.store(scale + row, row_scale, mask=row < rows)
