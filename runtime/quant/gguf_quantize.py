"""Quantise float weights to GGUF blocks in torch: Q8_0 (byte-identical to gguf-py / ggml) and Q4_K.

Q4_K here is a plain min/max quantiser (no llama.cpp importance search): per 32-value sub-block a scale
(max - min)/15 and a min, both stored as 6-bit multiples of per-256 fp16 super-scales. It is good enough
for quantise-on-load and for the benchmark; users' Q4_K files from llama.cpp tools load just the same.
"""
from __future__ import annotations

import torch

from .gguf_blocks import QK_K


def _round_half_away(x: torch.Tensor) -> torch.Tensor:
    return torch.sign(x) * torch.floor(x.abs() + 0.5)


def _f16_bytes(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float16).contiguous().view(torch.uint8).reshape(x.shape[0], 2)


def quantize_q8_0(weight: torch.Tensor) -> torch.Tensor:
    """[rows, cols] (cols % 32 == 0) -> uint8 [rows, cols/32*34]."""
    rows, cols = weight.shape
    blocks = weight.to(torch.float32).reshape(-1, 32)
    d = blocks.abs().amax(dim=1, keepdim=True) / 127
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = _round_half_away(blocks * inv).to(torch.int8).view(torch.uint8)
    return torch.cat((_f16_bytes(d), q), dim=1).reshape(rows, cols // 32 * 34)


def _pack_k_scales(sc: torch.Tensor, mn: torch.Tensor) -> torch.Tensor:
    """Two [n, 8] 6-bit tensors -> the 12-byte Q4_K/Q5_K field (inverse of gguf_blocks.k_scale_min)."""
    first = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    second = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    third = (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)
    return torch.cat((first, second, third), dim=1)


def quantize_q4_k(weight: torch.Tensor) -> torch.Tensor:
    """[rows, cols] (cols % 256 == 0) -> uint8 [rows, cols/256*144]."""
    rows, cols = weight.shape
    x = weight.to(torch.float32).reshape(-1, 8, 32)
    n = x.shape[0]
    lo = x.amin(dim=-1).clamp(max=0)
    hi = x.amax(dim=-1)
    sub_scale = (hi - lo) / 15
    sub_min = -lo
    d = (sub_scale.amax(dim=-1, keepdim=True) / 63).to(torch.float16).to(torch.float32)
    dmin = (sub_min.amax(dim=-1, keepdim=True) / 63).to(torch.float16).to(torch.float32)
    safe_d = torch.where(d == 0, torch.ones_like(d), d)
    safe_dmin = torch.where(dmin == 0, torch.ones_like(dmin), dmin)
    sc = torch.round(sub_scale / safe_d).clamp(0, 63)
    mn = torch.round(sub_min / safe_dmin).clamp(0, 63)
    eff_scale = (d * sc).unsqueeze(-1)
    eff_min = (dmin * mn).unsqueeze(-1)
    safe_scale = torch.where(eff_scale == 0, torch.ones_like(eff_scale), eff_scale)
    q = torch.round((x + eff_min) / safe_scale).clamp(0, 15).to(torch.uint8)  # [n, 8, 32]
    q = q.reshape(n, 4, 2, 32)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(n, 128)
    scales = _pack_k_scales(sc.to(torch.uint8), mn.to(torch.uint8))
    blocks = torch.cat((_f16_bytes(d), _f16_bytes(dmin), scales, qs), dim=1)
    return blocks.reshape(rows, cols // QK_K * 144)


QUANTIZERS = {"Q8_0": (32, quantize_q8_0), "Q4_K": (QK_K, quantize_q4_k)}
