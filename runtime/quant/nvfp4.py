"""NVFP4 weights: E2M1 values in pairs, an E4M3 scale per 16 values, an fp32 scale per tensor.

In-memory layout = ComfyUI's comfy_quant "nvfp4" layout (comfy-kitchen):
  data    uint8 [N, K/2]; element 2i in the HIGH nibble, 2i+1 in the low nibble ("hi_first").
  scale   float8_e4m3fn [roundup(N,128), roundup(K/16,4)], cuBLAS's blocked layout (`to_blocked`).
  scale_2 fp32 scalar; value = e2m1 * e4m3(block) * scale_2.
ModelOpt / diffusers-BFL files store the even element in the LOW nibble and plain [N, K/16] scales;
`from_modelopt` converts them once at load time.

The native SM >= 10 path hands these bytes to `torch._scaled_mm` as float4_e2m1fn_x2. cuBLAS reads
element 2i from the low nibble, so both operands are read with each byte's pair swapped; the activation
is packed with the same hi-first convention, the swap is the same permutation of K on both sides, and the
dot products are unchanged (block scales cover whole bytes, so they still line up).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .gpu_support import cuda_capability

E2M1_MAX = 6.0
E4M3_MAX = 448.0
BLOCK = 16
# Code -> value; codes 8..15 are the negatives of 0..7 (sign bit = bit 3).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# Midpoints between neighbouring magnitudes, and whether a tie rounds up (to the even code).
_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))
_lut_cache: dict[torch.device, torch.Tensor] = {}


def _roundup(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def _byte_pair_lut(device: torch.device) -> torch.Tensor:
    """[256, 2] float32: the two E2M1 values of every byte, hi-first order (one gather per byte)."""
    lut = _lut_cache.get(device)
    if lut is None:
        values = torch.tensor(E2M1_VALUES, dtype=torch.float32)
        byte = torch.arange(256)
        lut = torch.stack((values[byte >> 4], values[byte & 0x0F]), dim=-1).to(device)
        _lut_cache[device] = lut
    return lut


def to_blocked(scales: torch.Tensor) -> torch.Tensor:
    """[R, C] block scales -> cuBLAS blocked layout, shape [roundup(R,128), roundup(C,4)] (zero padded).

    Each 128x4 tile is stored as 32 rows of 16: row r of the tile lands at (r % 32, (r // 32) * 4 + c).
    Tiles are ordered row-major over (R/128, C/4), as torch's and ComfyUI's `to_blocked`.
    """
    rows, cols = scales.shape
    pr, pc = _roundup(rows, 128), _roundup(cols, 4)
    padded = scales.new_zeros((pr, pc))
    padded[:rows, :cols] = scales
    tiles = padded.view(pr // 128, 128, pc // 4, 4).permute(0, 2, 1, 3)
    tiles = tiles.reshape(-1, 4, 32, 4).transpose(1, 2)
    return tiles.reshape(pr, pc)


def from_blocked(blocked: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of `to_blocked`: -> [rows, cols]."""
    pr, pc = _roundup(rows, 128), _roundup(cols, 4)
    tiles = blocked.reshape(pr // 128, pc // 4, 32, 4, 4).transpose(2, 3)
    plain = tiles.reshape(pr // 128, pc // 4, 128, 4).permute(0, 2, 1, 3).reshape(pr, pc)
    return plain[:rows, :cols]


def encode_e2m1(values: torch.Tensor) -> torch.Tensor:
    """float values already in [-6, 6] -> uint8 codes 0..15, round to nearest, ties to even."""
    mag = values.abs()
    code = torch.zeros(values.shape, dtype=torch.uint8, device=values.device)
    for midpoint, tie_up in _MIDPOINTS:  # 7 fixed thresholds, each one vectorised op
        code += (mag >= midpoint if tie_up else mag > midpoint).to(torch.uint8)
    return code | (torch.signbit(values).to(torch.uint8) << 3)


def pack_pairs_hi_first(codes: torch.Tensor) -> torch.Tensor:
    return (codes[..., 0::2] << 4) | codes[..., 1::2]


def unpack_pairs_hi_first(data: torch.Tensor) -> torch.Tensor:
    return torch.stack((data >> 4, data & 0x0F), dim=-1).reshape(*data.shape[:-1], -1)


def quantize_nvfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, K] float (K % 16 == 0) -> (packed uint8 [N, K/2], blocked e4m3 scales, fp32 per-tensor scale)."""
    n, k = weight.shape
    w = weight.to(torch.float32).reshape(n, k // BLOCK, BLOCK)
    tensor_scale = (w.abs().amax() / (E2M1_MAX * E4M3_MAX)).clamp(min=1e-12)
    block_amax = w.abs().amax(dim=-1)
    block_scale = (block_amax / E2M1_MAX / tensor_scale).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    total = block_scale.to(torch.float32) * tensor_scale
    safe_total = torch.where(total == 0, torch.ones_like(total), total)
    scaled = (w / safe_total.unsqueeze(-1)).clamp(-E2M1_MAX, E2M1_MAX)
    codes = encode_e2m1(scaled).reshape(n, k)
    return pack_pairs_hi_first(codes), to_blocked(block_scale), tensor_scale


def block_scales_plain(scale: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    n, k = shape
    return from_blocked(scale, n, k // BLOCK)


def dequantize_nvfp4(data: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor,
                     shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    n, k = shape
    values = F.embedding(data.to(torch.int32), _byte_pair_lut(data.device))  # [n, k/2, 2]
    block = block_scales_plain(scale, shape).to(torch.float32) * scale_2.to(data.device, torch.float32)
    return (values.reshape(n, k // BLOCK, BLOCK) * block.unsqueeze(-1)).reshape(n, k).to(dtype)


def from_modelopt(weight: torch.Tensor, weight_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ModelOpt layout (even element in the low nibble, plain [N, K/16] scales) -> this module's layout."""
    swapped = (weight << 4) | (weight >> 4)
    return swapped, to_blocked(weight_scale.view(torch.float8_e4m3fn))


def to_modelopt(data: torch.Tensor, scale: torch.Tensor, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    return (data << 4) | (data >> 4), block_scales_plain(scale, shape).contiguous()


def native_fp4_supported(device: torch.device) -> bool:
    if device.type != "cuda" or not hasattr(torch, "float4_e2m1fn_x2"):
        return False
    return cuda_capability(device) >= (10, 0)


def nvfp4_linear_native(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor,
                        shape: tuple[int, ...], bias: torch.Tensor | None) -> torch.Tensor:
    """y = x @ W.T with one FP4 GEMM (SM >= 10): the activation is quantised to NVFP4 per call.

    Not exercised on the machines this was written on (no Blackwell GPU); the layout round trip it relies on
    is tested on the CPU.
    """
    n, k = shape
    x2d = x.reshape(-1, k)
    xq, x_blocked, x_scale = quantize_nvfp4(x2d)
    y = torch._scaled_mm(
        xq.view(torch.float4_e2m1fn_x2), data.view(torch.float4_e2m1fn_x2).t(),
        scale_a=x_blocked.reshape(-1), scale_b=scale.reshape(-1), out_dtype=torch.bfloat16)
    y = (y.to(torch.float32) * (x_scale * scale_2.to(torch.float32))).to(x.dtype)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.reshape(*x.shape[:-1], n)
