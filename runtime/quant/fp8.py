"""FP8 (e4m3) weights: quantise, dequantise, and the native scaled matmul on SM >= 8.9.

Native path: the activation is quantised to e4m3 dynamically (per row when the output is bf16, which
cuBLASLt's row-wise scaling needs; per tensor otherwise) and `torch._scaled_mm` multiplies it with the
e4m3 weight. A per-tensor weight scale is broadcast to a [1, out] row so both kinds of file use the same
row-wise kernel (QuantLinear builds that row once, see linear.py). A file's static `input_scale` is ignored: the
dynamic scale is never less accurate.
"""
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


def fp8_linear_native(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None,
                      weight_scale_row: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """y = x @ (weight * weight_scale).T + bias with one FP8 GEMM. Needs SM >= 8.9, in/out % 16 == 0.

    `weight_scale_row`: the same scale as a contiguous fp32 [1, out] row (1.0 where `weight_scale` is None)."""
    out_features, in_features = weight.shape
    x2d = x.reshape(-1, in_features)
    if x2d.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        x2d = x2d.to(torch.bfloat16)
    if x.dtype == torch.bfloat16:  # row-wise scaling
        xq, x_scale = quantize_activation(x2d, per_row=True)
        y = torch._scaled_mm(xq, weight.t(), scale_a=x_scale, scale_b=weight_scale_row,
                             out_dtype=torch.bfloat16, use_fast_accum=True)
    else:
        if weight_scale is not None and weight_scale.numel() != 1:
            raise RuntimeError("per-row FP8 weights need bf16 activations for the native path")
        xq, x_scale = quantize_activation(x2d, per_row=False)
        y = torch._scaled_mm(xq, weight.t(), scale_a=x_scale.reshape(()),
                             scale_b=weight_scale_row[:, :1].reshape(()), out_dtype=x.dtype)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.reshape(*x.shape[:-1], out_features)
