"""GGUF (llama.cpp) block formats dequantised in plain torch, on whatever device the bytes live on.

Every kernel takes the packed bytes as a uint8 tensor of shape [n_blocks, type_size] and returns float32
[n_blocks, block_size]. The arithmetic mirrors gguf-py's numpy reference (`gguf.quants`) operation by
operation in float32, so on the CPU the result is bit-identical to `gguf.quants.dequantize`; on a GPU the
same ops run as separate kernels (also exact) or, when `torch.compile`d, may fuse a multiply-add into an
FMA (a difference of at most one float32 ulp, far below the bf16 rounding that follows).

No Python loop runs over blocks: each kernel is a fixed handful of vectorised tensor ops, so it runs per
layer per step on the GPU.
"""
from __future__ import annotations

from typing import Callable

import torch

QK_K = 256

# (block_size in values, type_size in bytes) for the types this module dequantises.
BLOCK_GEOMETRY: dict[str, tuple[int, int]] = {
    "Q4_0": (32, 18),
    "Q4_1": (32, 20),
    "Q5_0": (32, 22),
    "Q5_1": (32, 24),
    "Q8_0": (32, 34),
    "Q2_K": (QK_K, 84),
    "Q3_K": (QK_K, 110),
    "Q4_K": (QK_K, 144),
    "Q5_K": (QK_K, 176),
    "Q6_K": (QK_K, 210),
    "IQ4_NL": (32, 18),
    "IQ4_XS": (QK_K, 136),
}

# Byte offsets of each type's fp16 scale fields inside a block (d, and dmin where the type has one).
FP16_SCALE_OFFSETS: dict[str, tuple[int, ...]] = {
    "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q2_K": (80, 82), "Q3_K": (108,),
    "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_NL": (0,), "IQ4_XS": (0,),
}

# Types stored as plain floats in a GGUF file: passed through, never dequantised.
FLOAT_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}

_IQ4_NL_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
_lut_cache: dict[torch.device, torch.Tensor] = {}


def _iq4_values(device: torch.device) -> torch.Tensor:
    lut = _lut_cache.get(device)
    if lut is None:
        lut = torch.tensor(_IQ4_NL_VALUES, dtype=torch.float32, device=device)
        _lut_cache[device] = lut
    return lut


def _f16(raw: torch.Tensor) -> torch.Tensor:
    """[n, 2] little-endian bytes -> [n, 1] float32 (exact)."""
    return raw.contiguous().view(torch.float16).to(torch.float32)


def _fields(raw: torch.Tensor, width: int, group: int = 32) -> torch.Tensor:
    """Split bytes [n, k] into `width`-bit fields, per run of `group` bytes: [n, k/group, 8/width, group] uint8,
    the lowest field of every byte first (the order all llama.cpp formats pack sub-byte values in)."""
    shifts = torch.arange(0, 8, width, dtype=torch.uint8, device=raw.device).reshape(1, 1, -1, 1)
    return (raw.reshape(raw.shape[0], -1, 1, group) >> shifts) & ((1 << width) - 1)


def _nibbles(qs: torch.Tensor, group: int) -> torch.Tensor:
    """[n, k] bytes -> [n, k/group, 2, group]: each run's low nibbles, then its high nibbles."""
    return _fields(qs, 4, group)


def _bits(raw: torch.Tensor) -> torch.Tensor:
    """[n, k] bytes -> [n, 8k] single bits, bit 0 of byte 0 first (a little-endian bit field)."""
    return _fields(raw, 1, 1).reshape(raw.shape[0], -1)


def dequant_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks[:, :2])
    q = blocks[:, 2:].contiguous().view(torch.int8).to(torch.float32)
    return q * d


def dequant_q4_0(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d = _f16(blocks[:, :2])
    q = _nibbles(blocks[:, 2:], 16).reshape(n, 32).to(torch.int8) - 8
    return d * q.to(torch.float32)


def dequant_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d = _f16(blocks[:, :2])
    m = _f16(blocks[:, 2:4])
    q = _nibbles(blocks[:, 4:], 16).reshape(n, 32).to(torch.float32)
    return (d * q) + m


def _q5_values(qh_raw: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    n = qs.shape[0]
    qh = _bits(qh_raw)
    ql = _nibbles(qs, 16).reshape(n, 32)
    return ql | (qh << 4)


def dequant_q5_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks[:, :2])
    q = _q5_values(blocks[:, 2:6], blocks[:, 6:]).to(torch.int8) - 16
    return d * q.to(torch.float32)


def dequant_q5_1(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks[:, :2])
    m = _f16(blocks[:, 2:4])
    q = _q5_values(blocks[:, 4:8], blocks[:, 8:]).to(torch.float32)
    return (d * q) + m


def dequant_q2_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    scales = blocks[:, :16]
    qs = blocks[:, 16:80]
    d = _f16(blocks[:, 80:82])
    dmin = _f16(blocks[:, 82:84])
    dl = (d * (scales & 0x0F).to(torch.float32)).reshape(n, 16, 1)
    ml = (dmin * (scales >> 4).to(torch.float32)).reshape(n, 16, 1)
    q = _fields(qs, 2).reshape(n, 16, 16).to(torch.float32)
    return (dl * q - ml).reshape(n, QK_K)


def dequant_q3_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    hmask = blocks[:, :32]
    qs = blocks[:, 32:96]
    scales = blocks[:, 96:108]
    d = _f16(blocks[:, 108:110])
    low = _nibbles(scales[:, :8], 8).reshape(n, 16)
    high = _fields(scales[:, 8:], 2, 4).reshape(n, 16)
    sc = ((low | (high << 4)).to(torch.int8) - 32).to(torch.float32)
    dl = (d * sc).reshape(n, 16, 1)
    ql = _fields(qs, 2).reshape(n, 16, 16)
    qh = _fields(hmask, 1).reshape(n, 16, 16) ^ 1
    q = (ql.to(torch.int8) - (qh << 2).to(torch.int8)).to(torch.float32)
    return (dl * q).reshape(n, QK_K)


def k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpack the 12-byte 6-bit scale/min field of Q4_K and Q5_K into two [n, 8] uint8 tensors."""
    n = scales.shape[0]
    s = scales.reshape(n, 3, 4)
    d, m, m_d = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat((d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)), dim=-1)
    mn = torch.cat((m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)), dim=-1)
    return sc, mn


def dequant_q4_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d = _f16(blocks[:, :2])
    dmin = _f16(blocks[:, 2:4])
    sc, mn = k_scale_min(blocks[:, 4:16])
    dl = (d * sc.to(torch.float32)).reshape(n, 8, 1)
    ml = (dmin * mn.to(torch.float32)).reshape(n, 8, 1)
    q = _nibbles(blocks[:, 16:], 32).reshape(n, 8, 32).to(torch.float32)
    return (dl * q - ml).reshape(n, QK_K)


def dequant_q5_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d = _f16(blocks[:, :2])
    dmin = _f16(blocks[:, 2:4])
    sc, mn = k_scale_min(blocks[:, 4:16])
    qh_raw = blocks[:, 16:48]
    qs = blocks[:, 48:]
    dl = (d * sc.to(torch.float32)).reshape(n, 8, 1)
    ml = (dmin * mn.to(torch.float32)).reshape(n, 8, 1)
    ql = _nibbles(qs, 32).reshape(n, 8, 32)
    qh = _fields(qh_raw, 1).reshape(n, 8, 32)
    q = (ql | (qh << 4)).to(torch.float32)
    return (dl * q - ml).reshape(n, QK_K)


def dequant_q6_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    ql_raw = blocks[:, :128]
    qh_raw = blocks[:, 128:192]
    scales = blocks[:, 192:208].contiguous().view(torch.int8).to(torch.float32)
    d = _f16(blocks[:, 208:210])
    dl = (d * scales).reshape(n, 16, 1)
    ql = _nibbles(ql_raw, 64).reshape(n, 8, 32)
    qh = _fields(qh_raw, 2).reshape(n, 8, 32)
    q = ((ql | (qh << 4)).to(torch.int8) - 32).reshape(n, 16, 16).to(torch.float32)
    return (dl * q).reshape(n, QK_K)


def dequant_iq4_nl(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d = _f16(blocks[:, :2])
    idx = _nibbles(blocks[:, 2:], 16).reshape(n, 32).to(torch.int64)
    return d * _iq4_values(blocks.device)[idx]


def dequant_iq4_xs(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    device = blocks.device
    d = _f16(blocks[:, :2])
    scales_h = blocks[:, 2:4].to(torch.int32)
    scales_h = scales_h[:, 0] | (scales_h[:, 1] << 8)
    scales_l = blocks[:, 4:8]
    qs = blocks[:, 8:]
    low = _nibbles(scales_l, 1).reshape(n, 8)  # sub-block 2i in the low nibble of byte i, 2i+1 in the high
    high = (scales_h.reshape(n, 1) >> (2 * torch.arange(8, dtype=torch.int32, device=device))) & 3
    sc = (low.to(torch.int32) | (high << 4)).to(torch.int8) - 32
    dl = (d * sc.to(torch.float32)).reshape(n, 8, 1)
    idx = _nibbles(qs, 16).reshape(n, 8, 32).to(torch.int64)
    return (dl * _iq4_values(device)[idx]).reshape(n, QK_K)


KERNELS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "Q4_0": dequant_q4_0,
    "Q4_1": dequant_q4_1,
    "Q5_0": dequant_q5_0,
    "Q5_1": dequant_q5_1,
    "Q8_0": dequant_q8_0,
    "Q2_K": dequant_q2_k,
    "Q3_K": dequant_q3_k,
    "Q4_K": dequant_q4_k,
    "Q5_K": dequant_q5_k,
    "Q6_K": dequant_q6_k,
    "IQ4_NL": dequant_iq4_nl,
    "IQ4_XS": dequant_iq4_xs,
}
