"""An FP8 weight merged with a LoRA delta, put back in FP8: a scale of the layer's own layout and stochastic rounding.

Round-to-nearest would drop most of a LoRA: an element whose delta is below half an FP8 step (e4m3 has 3 mantissa
bits, so a step is 1/8 to 1/16 of the value) rounds straight back to the base weight. Stochastic rounding rounds
up or down with the probability that makes the expected value exact, so the delta survives on average over the
many elements a matmul sums; each element is off by less than one FP8 step (< 2^-3 of its value; below e4m3's
smallest normal, 2^-9 of the scale). ComfyUI merges LoRAs into FP8 weights the same way. The draws come from a
generator seeded per layer, so the same stack on the same device gives the same weights every time.
"""
from __future__ import annotations

import zlib

import torch

_MIN_SCALE = 1e-12


def layer_seed(name: str) -> int:
    return zlib.crc32(name.encode("utf-8"))


def stochastic_round_fp8(x: torch.Tensor, dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """fp32 `x` (already divided by the scale) -> `dtype` (float8_e4m3fn / float8_e5m2), rounded stochastically
    between the two representable neighbours; values beyond the format's largest are clamped to it.

    FP8 codes of one sign are ordered like their magnitudes, so the other neighbour of the nearest code is the
    code one up (|x| above it) or one down (|x| below it)."""
    largest = torch.finfo(dtype).max
    magnitude = x.abs().clamp(max=largest)
    nearest = magnitude.to(dtype)
    near = nearest.to(torch.float32)
    code = nearest.view(torch.uint8)
    above, below = magnitude > near, magnitude < near
    other_code = torch.where(above, code + 1, torch.where(below, code - 1, code))
    other = other_code.view(dtype).to(torch.float32)
    gap = (other - near).abs()
    chance = torch.where(gap > 0, (magnitude - near).abs() / torch.where(gap > 0, gap, 1.0), 0.0)
    draw = torch.rand(x.shape, generator=generator, device=x.device, dtype=torch.float32)
    chosen = torch.where(draw < chance, other_code, code)
    return (chosen | torch.where(x < 0, 0x80, 0).to(torch.uint8)).view(dtype)


def fp8_scale_for(merged_amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The scale that maps the merged weight's largest magnitude (per row or per tensor) onto the format's largest."""
    return (merged_amax.to(torch.float32) / torch.finfo(dtype).max).clamp(min=_MIN_SCALE)
