"""The native FP8 matmul (SM >= 8.9), from each kind of input a layer can be handed.

The activation is quantised to e4m3 dynamically (per row when the output is bf16, which cuBLASLt's row-wise
scaling needs; per tensor otherwise) and `torch._scaled_mm` multiplies it with the e4m3 weight. A per-tensor
weight scale is broadcast to a [1, out] row so both kinds of file use the same row-wise kernel (QuantLinear builds
that row once, see linear.py). A file's static `input_scale` is ignored: the dynamic scale is never less accurate.

A bf16 activation is quantised per row by one kernel (fp8_rows.py); an input handed over as the factors it is made
of brings e4m3 rows of its own, made in one kernel from them (model/layer_inputs.py: gelu(gate) * up by
fp8_gated.py, a block's adaLN output from the residual stream by fp8_modulated.py), which `fp8_rows_native`
multiplies.
"""
from __future__ import annotations

import torch

from .fp8 import quantize_activation
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
        return fp8_rows_native(*quantize_rows(x2d), weight, weight_scale_row, bias, x.shape[:-1])
    if weight_scale is not None and weight_scale.numel() != 1:
        raise RuntimeError("per-row FP8 weights need bf16 activations for the native path")
    xq, x_scale = quantize_activation(x2d, per_row=False)
    y = torch._scaled_mm(xq, weight.t(), scale_a=x_scale.reshape(()), scale_b=weight_scale_row[:, :1].reshape(()),
                         out_dtype=x.dtype)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.reshape(*x.shape[:-1], out_features)


def fp8_rows_native(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale_row: torch.Tensor,
                  bias: torch.Tensor | None, lead: torch.Size) -> torch.Tensor:
    """The row-wise scaled GEMM of e4m3 rows [rows, in] and their fp32 [rows, 1] scales with the weight, in bf16,
    shaped [*lead, out]: a layer's input quantised by a kernel of its own (model/layer_inputs.py) or by
    fp8_linear_native."""
    y = torch._scaled_mm(xq, weight.t(), scale_a=x_scale, scale_b=weight_scale_row, out_dtype=torch.bfloat16,
                         use_fast_accum=True)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.reshape(*lead, weight.shape[0])
