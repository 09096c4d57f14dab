"""Triton kernels: packed quantised bytes -> dense weight in one pass (loaded lazily by triton_dequant).

This module imports triton at the top; only `triton_dequant` imports it, on first use, so the pack never
needs triton. Every kernel mirrors the torch reference (gguf_blocks.py / nvfp4.py) operation by operation
in float32, then rounds once to the output dtype. The products of a scale and a quant are exact in fp32
(fp16 scale: 11 significant bits, 6-bit sub-scale, <= 7-bit quant: <= 24 bits), so a multiply-add that the
compiler contracts into an FMA rounds exactly like the separate ops: results are bit-identical.

Addressing: a GGUF weight is rows of whole blocks, contiguous, so the kernels see a flat run of blocks and
write each block's values to out[block * BLOCK_SIZE : ...]. One program handles BLOCKS blocks as a
[BLOCKS, groups, lanes] tile whose last axis walks contiguous output (vectorised bf16 stores); the per-block
and per-sub-block scales are decoded once on a [BLOCKS, groups, 1] slice and broadcast.
"""
from __future__ import annotations

import os

import triton
import triton.language as tl

# This module is loaded once per mode (see triton_dequant._load_kernel_module), with the env var set.
SOFTWARE_BF16_ROUNDING = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")


@triton.jit
def _byte(ptr, offset, mask):
    return tl.load(ptr + offset, mask=mask, other=0).to(tl.int32)


@triton.jit
def _f16(ptr, offset, mask):
    """Little-endian fp16 at byte `offset` -> float32 (exact)."""
    lo = tl.load(ptr + offset, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(ptr + offset + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _to_output(value, out):
    """float32 -> out's dtype, rounding to nearest even (compiled: the hardware's cvt.rn). The interpreter's
    fp32 -> bf16 cast truncates, so there bf16 is rounded with integer ops, exactly as torch does."""
    result = value.to(out.dtype.element_ty)
    if SOFTWARE_BF16_ROUNDING:
        if out.dtype.element_ty == tl.bfloat16:
            bits = value.to(tl.uint32, bitcast=True)
            rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
            rounded = tl.where(value != value, 0x7FC0, rounded)  # NaN: torch's canonical quiet NaN
            result = rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return result


@triton.jit
def _program_blocks(data, out, n_blocks, BLOCKS: tl.constexpr, TYPE_SIZE: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """This program's BLOCKS blocks: (data and out advanced to its first block, each block's first byte and
    first output value as [B, 1, 1] offsets, valid mask [B, 1, 1]). The pointers move by the first block
    once, in 64-bit, so the per-element offsets stay 32-bit."""
    first = tl.program_id(0).to(tl.int64) * BLOCKS
    blk = tl.arange(0, BLOCKS)[:, None, None]
    return data + first * TYPE_SIZE, out + first * BLOCK_SIZE, blk * TYPE_SIZE, blk * BLOCK_SIZE, first + blk < n_blocks


@triton.jit
def q8_0_kernel(data, out, n_blocks, BLOCKS: tl.constexpr):
    data, out, base, dst, valid = _program_blocks(data, out, n_blocks, BLOCKS, 34, 32)
    t = tl.arange(0, 32)[None, None, :]
    d = _f16(data, base, valid)
    q = tl.load(data + base + 2 + t, mask=valid, other=0).to(tl.int8, bitcast=True).to(tl.float32)
    tl.store(out + dst + t, _to_output(d * q, out), mask=valid)


@triton.jit
def _nibble32(data, qs, valid):
    """The 32 4-bit quants of a Q4_0/Q4_1/Q5_0/Q5_1/IQ4_NL block as a [B, 2, 16] tile: low nibbles first."""
    h = tl.arange(0, 2)[None, :, None]
    i = tl.arange(0, 16)[None, None, :]
    return (_byte(data, qs + i, valid) >> (h * 4)) & 0xF, h * 16 + i


@triton.jit
def _high_bit32(data, qh, t, valid):
    """Bit t of the little-endian 32-bit field at byte offset `qh` (Q5_0 / Q5_1), shifted to bit 4."""
    return ((_byte(data, qh + (t >> 3), valid) >> (t & 7)) & 1) << 4


@triton.jit
def q4_0_kernel(data, out, n_blocks, BLOCKS: tl.constexpr):
    data, out, base, dst, valid = _program_blocks(data, out, n_blocks, BLOCKS, 18, 32)
    d = _f16(data, base, valid)
    nib, t = _nibble32(data, base + 2, valid)
    tl.store(out + dst + t, _to_output(d * (nib - 8).to(tl.float32), out), mask=valid)


@triton.jit
def q4_1_kernel(data, out, n_blocks, BLOCKS: tl.constexpr):
    data, out, base, dst, valid = _program_blocks(data, out, n_blocks, BLOCKS, 20, 32)
    d = _f16(data, base, valid)
    m = _f16(data, base + 2, valid)
    nib, t = _nibble32(data, base + 4, valid)
    tl.store(out + dst + t, _to_output(d * nib.to(tl.float32) + m, out), mask=valid)


@triton.jit
def q5_0_kernel(data, out, n_blocks, BLOCKS: tl.constexpr):
    data, out, base, dst, valid = _program_blocks(data, out, n_blocks, BLOCKS, 22, 32)
    d = _f16(data, base, valid)
    nib, t = _nibble32(data, base + 6, valid)
    q = nib | _high_bit32(data, base + 2, t, valid)
    tl.store(out + dst + t, _to_output(d * (q - 16).to(tl.float32), out), mask=valid)


@triton.jit
def q5_1_kernel(data, out, n_blocks, BLOCKS: tl.constexpr):
    data, out, base, dst, valid = _program_blocks(data, out, n_blocks, BLOCKS, 24, 32)
    d = _f16(data, base, valid)
    m = _f16(data, base + 2, valid)
    nib, t = _nibble32(data, base + 8, valid)
    q = nib | _high_bit32(data, base + 4, t, valid)
    tl.store(out + dst + t, _to_output(d * q.to(tl.float32) + m, out), mask=valid)


@triton.jit
def _iq4_value(idx):
    """IQ4_NL's 16-entry non-linear grid, as a branch-free select tree (no table in memory)."""
    lo = tl.where(idx < 4,
                  tl.where(idx < 2, tl.where(idx == 0, -127, -104), tl.where(idx == 2, -83, -65)),
                  tl.where(idx < 6, tl.where(idx == 4, -49, -35), tl.where(idx == 6, -22, -10)))
    hi = tl.where(idx < 12,
                  tl.where(idx < 10, tl.where(idx == 8, 1, 13), tl.where(idx == 10, 25, 38)),
                  tl.where(idx < 14, tl.where(idx == 12, 53, 69), tl.where(idx == 14, 89, 113)))
    return tl.where(idx < 8, lo, hi).to(tl.float32)


@triton.jit
def iq4_nl_kernel(data, out, n_blocks, BLOCKS: tl.constexpr):
    data, out, base, dst, valid = _program_blocks(data, out, n_blocks, BLOCKS, 18, 32)
    d = _f16(data, base, valid)
    nib, t = _nibble32(data, base + 2, valid)
    tl.store(out + dst + t, _to_output(d * _iq4_value(nib), out), mask=valid)


@triton.jit
def _k_scale_min(data, scales, j, valid):
    """Q4_K/Q5_K 12-byte field at `scales` -> (6-bit scale, 6-bit min) of sub-block j (a [B, 8, 1] tile)."""
    jm = j & 3
    a = _byte(data, scales + jm, valid)
    b = _byte(data, scales + 4 + jm, valid)
    c = _byte(data, scales + 8 + jm, valid)
    sc = tl.where(j < 4, a & 63, (c & 0xF) | ((a >> 2) & 0x30))
    mn = tl.where(j < 4, b & 63, (c >> 4) | ((b >> 2) & 0x30))
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def q4_k_kernel(data, out, n_blocks, BLOCKS: tl.constexpr):
    data, out, base, dst, valid = _program_blocks(data, out, n_blocks, BLOCKS, 144, 256)
    j = tl.arange(0, 8)[None, :, None]
    w = tl.arange(0, 32)[None, None, :]
    sc, mn = _k_scale_min(data, base + 4, j, valid)
    dl = _f16(data, base, valid) * sc
    ml = _f16(data, base + 2, valid) * mn
    q = (_byte(data, base + 16 + (j >> 1) * 32 + w, valid) >> ((j & 1) * 4)) & 0xF
    tl.store(out + dst + j * 32 + w, _to_output(dl * q.to(tl.float32) - ml, out), mask=valid)


@triton.jit
def q5_k_kernel(data, out, n_blocks, BLOCKS: tl.constexpr):
    data, out, base, dst, valid = _program_blocks(data, out, n_blocks, BLOCKS, 176, 256)
    j = tl.arange(0, 8)[None, :, None]
    w = tl.arange(0, 32)[None, None, :]
    sc, mn = _k_scale_min(data, base + 4, j, valid)
    dl = _f16(data, base, valid) * sc
    ml = _f16(data, base + 2, valid) * mn
    low = (_byte(data, base + 48 + (j >> 1) * 32 + w, valid) >> ((j & 1) * 4)) & 0xF
    high = ((_byte(data, base + 16 + w, valid) >> j) & 1) << 4
    q = (low | high).to(tl.float32)
    tl.store(out + dst + j * 32 + w, _to_output(dl * q - ml, out), mask=valid)


@triton.jit
def q6_k_kernel(data, out, n_blocks, BLOCKS: tl.constexpr):
    data, out, base, dst, valid = _program_blocks(data, out, n_blocks, BLOCKS, 210, 256)
    s = tl.arange(0, 16)[None, :, None]  # 16-value sub-block (one int8 scale each)
    t = s * 16 + tl.arange(0, 16)[None, None, :]
    half = t >> 7  # each 128-value half: 64 bytes of low nibbles, 32 bytes of 2-bit high parts
    r = t & 127
    low = (_byte(data, base + half * 64 + (r & 63), valid) >> ((r >> 6) * 4)) & 0xF
    high = (_byte(data, base + 128 + half * 32 + (r & 31), valid) >> ((r >> 5) * 2)) & 3
    scale = tl.load(data + base + 192 + s, mask=valid, other=0).to(tl.int8, bitcast=True).to(tl.float32)
    dl = _f16(data, base + 208, valid) * scale
    q = ((low | (high << 4)) - 32).to(tl.float32)
    tl.store(out + dst + t, _to_output(dl * q, out), mask=valid)


@triton.jit
def _with_sign(magnitude, sign_bit, shift: tl.constexpr):
    """Set the float sign from `sign_bit << shift` (bit 31). Not `-x`: Triton computes that as 0 - x, +0.0
    for x = 0, and E2M1 code 8 / an E4M3 scale 0x80 must give -0.0 as torch's conversion does."""
    bits = magnitude.to(tl.uint32, bitcast=True) | (sign_bit.to(tl.uint32) << shift)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _e2m1(code):
    """E2M1 code (sign in bit 3) -> float32: magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6; code 8 is -0.0."""
    mag = code & 7
    e = mag >> 1
    m = mag & 1
    twice = tl.where(e == 0, m, (2 + m) << tl.maximum(e - 1, 0))  # 2 * |value|, an integer
    return _with_sign(twice.to(tl.float32) * 0.5, code & 8, 28)


@triton.jit
def _e4m3fn(byte):
    """float8_e4m3fn bits (int32 0..255) -> float32, exactly as torch converts them (0x7F/0xFF are NaN)."""
    e = (byte >> 3) & 15
    m = byte & 7
    normal = tl.where((e == 15) & (m == 7), 0x7FC00000, ((e + 120) << 23) | (m << 20))  # 0x7FC00000: NaN
    magnitude = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal.to(tl.float32, bitcast=True))  # m * 2^-9
    return _with_sign(magnitude, byte & 128, 24)


@triton.jit
def nvfp4_kernel(data, scale, scale_2, out, n_rows, n_cols, scale_cols,
                 ROWS: tl.constexpr, COLS: tl.constexpr):
    """One [ROWS, COLS] tile of the [n_rows, n_cols] output, viewed as [ROWS, COLS/16, 16]."""
    first_row = tl.program_id(0).to(tl.int64) * ROWS
    data += first_row * (n_cols // 2)
    out += first_row * n_cols
    r = tl.arange(0, ROWS)[:, None, None]  # local row; first_row + r below where the global row is needed
    c = tl.program_id(1) * (COLS // 16) + tl.arange(0, COLS // 16)[None, :, None]  # 16-value block column
    e = tl.arange(0, 16)[None, None, :]
    valid = (first_row + r < n_rows) & (c < n_cols // 16)
    byte = _byte(data, r * (n_cols // 2) + c * 8 + (e >> 1), valid)
    code = (byte >> ((1 - (e & 1)) * 4)) & 0xF  # element 2i in the high nibble
    # cuBLAS blocked layout: 128x4 tiles, row-major over (rows/128, cols/4); inside one, row r of the tile
    # is stored at (r % 32, (r // 32) * 4 + col) of a 32x16 block.
    row = first_row + r
    blocked = ((row >> 7) * (scale_cols >> 2) + (c >> 2)) * 512 + (row & 31) * 16 + ((row >> 5) & 3) * 4 + (c & 3)
    block_scale = _e4m3fn(_byte(scale, blocked, valid)) * tl.load(scale_2)
    tl.store(out + r * n_cols + c * 16 + e, _to_output(_e2m1(code) * block_scale, out), mask=valid)


@triton.jit
def iq4_xs_kernel(data, out, n_blocks, BLOCKS: tl.constexpr):
    data, out, base, dst, valid = _program_blocks(data, out, n_blocks, BLOCKS, 136, 256)
    j = tl.arange(0, 8)[None, :, None]
    w = tl.arange(0, 32)[None, None, :]
    low = (_byte(data, base + 4 + (j >> 1), valid) >> ((j & 1) * 4)) & 0xF
    scales_h = _byte(data, base + 2, valid) | (_byte(data, base + 3, valid) << 8)
    sc = (low | (((scales_h >> (2 * j)) & 3) << 4)) - 32
    dl = _f16(data, base, valid) * sc.to(tl.float32)
    idx = (_byte(data, base + 8 + j * 16 + (w & 15), valid) >> ((w >> 4) * 4)) & 0xF
    tl.store(out + dst + j * 32 + w, _to_output(dl * _iq4_value(idx), out), mask=valid)


@triton.jit
def q2_k_kernel(data, out, n_blocks, BLOCKS: tl.constexpr):
    data, out, base, dst, valid = _program_blocks(data, out, n_blocks, BLOCKS, 84, 256)
    s = tl.arange(0, 16)[None, :, None]
    t = s * 16 + tl.arange(0, 16)[None, None, :]
    packed_scale = _byte(data, base + s, valid)
    dl = _f16(data, base + 80, valid) * (packed_scale & 0xF).to(tl.float32)
    ml = _f16(data, base + 82, valid) * (packed_scale >> 4).to(tl.float32)
    q = (_byte(data, base + 16 + (t >> 7) * 32 + (t & 31), valid) >> (((t >> 5) & 3) * 2)) & 3
    tl.store(out + dst + t, _to_output(dl * q.to(tl.float32) - ml, out), mask=valid)


@triton.jit
def q3_k_kernel(data, out, n_blocks, BLOCKS: tl.constexpr):
    data, out, base, dst, valid = _program_blocks(data, out, n_blocks, BLOCKS, 110, 256)
    s = tl.arange(0, 16)[None, :, None]
    t = s * 16 + tl.arange(0, 16)[None, None, :]
    low = (_byte(data, base + 96 + (s & 7), valid) >> ((s >> 3) * 4)) & 0xF
    high = (_byte(data, base + 104 + (s & 3), valid) >> ((s >> 2) * 2)) & 3
    dl = _f16(data, base + 108, valid) * ((low | (high << 4)) - 32).to(tl.float32)
    ql = (_byte(data, base + 32 + (t >> 7) * 32 + (t & 31), valid) >> (((t >> 5) & 3) * 2)) & 3
    qh = ((_byte(data, base + (t & 31), valid) >> (t >> 5)) & 1) ^ 1
    tl.store(out + dst + t, _to_output(dl * (ql - (qh << 2)).to(tl.float32), out), mask=valid)
