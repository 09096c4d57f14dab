"""FP8 (e4m3) weights and activations: quantise, dequantise, and whether the GPU has the native scaled matmul
(SM >= 8.9; the matmul itself: fp8_matmul.py)."""
from __future__ import annotations

import torch

from .gpu_support import cuda_capability

E4M3_MAX = 448.0
_MIN_SCALE = 1e-12


def quantize_fp8(weight: torch.Tensor, per_row: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float -> (float8_e4m3fn data, fp32 scale [out] or scalar); w ~= data * scale."""
    w = weight.to(torch.float32)
    amax = w.abs().amax(dim=1) if per_row else w.abs().amax()
    scale = (amax / E4M3_MAX).clamp(min=_MIN_SCALE)
    data = (w / (scale.unsqueeze(1) if per_row else scale)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return data, scale


def dequantize_fp8(data: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    w = data.to(torch.float32)
    if scale is not None:
        s = scale.to(device=w.device, dtype=torch.float32)
        w = w * (s.reshape(-1, 1) if s.numel() > 1 else s.reshape(()))
    return w.to(dtype)


def native_fp8_supported(device: torch.device) -> bool:
    if device.type != "cuda" or not hasattr(torch, "_scaled_mm"):
        return False
    return cuda_capability(device) >= (8, 9)


def quantize_activation(x2d: torch.Tensor, per_row: bool) -> tuple[torch.Tensor, torch.Tensor]:
    amax = x2d.abs().amax(dim=1, keepdim=True) if per_row else x2d.abs().amax()
    # The scale is rounded to the activation dtype first so the division and _scaled_mm see the same value.
    scale = (amax.to(torch.float32) / E4M3_MAX).clamp(min=_MIN_SCALE).to(x2d.dtype)
    xq = (x2d / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return xq, scale.to(torch.float32)
