"""The native FP8 matmul (SM >= 8.9), from each kind of input a layer can be handed.

The activation is quantised to e4m3 dynamically (per row when the output is bf16, which cuBLASLt's row-wise
scaling needs; per tensor otherwise) and `torch._scaled_mm` multiplies it with the e4m3 weight. A per-tensor
weight scale is broadcast to a [1, out] row so both kinds of file use the same row-wise kernel (QuantLinear builds
that row once, see linear.py). A file's static `input_scale` is ignored: the dynamic scale is never less accurate.

A bf16 activation is quantised per row by one kernel (fp8_rows.py); a layer may instead be handed the factors
its input is made of, and then one kernel makes the e4m3 input from them: gelu(gate) * up (fp8_gated.py), or a
block's adaLN output from the residual stream (fp8_modulated.py).
"""
from __future__ import annotations

import torch

from .fp8 import quantize_activation
from .fp8_gated import gelu_mul_quantize
from .fp8_modulated import norm_modulate_quantize, residual_norm_modulate_quantize
from .fp8_rows import quantize_rows


def fp8_linear_native(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None,
                      weight_scale_row: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """y = x @ (weight * weight_scale).T + bias with one FP8 GEMM. Needs SM >= 8.9, in/out % 16 == 0.

    `weight_scale_row`: the same scale as a contiguous fp32 [1, out] row (1.0 where `weight_scale` is None)."""
    out_features, in_features = weight.shape
    x2d = x.reshape(-1, in_features)
    if x2d.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        x2d = x2d.to(torch.bfloat16)
    if x.dtype == torch.bfloat16:  # row-wise scaling
        return _times_weight(*quantize_rows(x2d), weight, weight_scale_row, bias, x.shape[:-1])
    if weight_scale is not None and weight_scale.numel() != 1:
        raise RuntimeError("per-row FP8 weights need bf16 activations for the native path")
    xq, x_scale = quantize_activation(x2d, per_row=False)
    y = torch._scaled_mm(xq, weight.t(), scale_a=x_scale.reshape(()), scale_b=weight_scale_row[:, :1].reshape(()),
                         out_dtype=x.dtype)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.reshape(*x.shape[:-1], out_features)


def fp8_gelu_gated_native(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor, weight_scale_row: torch.Tensor,
                          bias: torch.Tensor | None) -> torch.Tensor:
    """(up * gelu(gate)) @ weight.T (+ bias) as one FP8 GEMM, gate and up [..., n] bf16 (views of one tensor
    may be given). Needs SM >= 8.9."""
    hq, h_scale = gelu_mul_quantize(gate.reshape(-1, gate.shape[-1]), up.reshape(-1, up.shape[-1]))
    return _times_weight(hq, h_scale, weight, weight_scale_row, bias, gate.shape[:-1])


def fp8_norm_modulated_native(x: torch.Tensor, norm_weight: torch.Tensor, one_plus_scale: torch.Tensor,
                              shift: torch.Tensor, eps: float, residual: tuple[torch.Tensor, torch.Tensor] | None,
                              weight: torch.Tensor, weight_scale_row: torch.Tensor, bias: torch.Tensor | None
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(modulate(RMSNorm(x)) @ weight.T (+ bias) as one FP8 GEMM, x), x [B, S, D] bf16 first x + gate * update
    where `residual` is (update, gate) (fp8_modulated.py has the forms). Needs SM >= 8.9."""
    if residual is None:
        xq, x_scale = norm_modulate_quantize(x, norm_weight, one_plus_scale, shift, eps)
    else:
        x, xq, x_scale = residual_norm_modulate_quantize(x, *residual, norm_weight, one_plus_scale, shift, eps)
    return _times_weight(xq, x_scale, weight, weight_scale_row, bias, x.shape[:-1]), x


def _times_weight(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale_row: torch.Tensor,
                  bias: torch.Tensor | None, lead: torch.Size) -> torch.Tensor:
    """The row-wise scaled GEMM of e4m3 rows and their scales with the weight, in bf16, shaped [*lead, out]."""
    y = torch._scaled_mm(xq, weight.t(), scale_a=x_scale, scale_b=weight_scale_row, out_dtype=torch.bfloat16,
                         use_fast_accum=True)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.reshape(*lead, weight.shape[0])
