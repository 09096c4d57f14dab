"""Packed Linears that share an input, stacked into one: one GEMM and one activation quantisation instead of two or
three (a DiT block's q/k/v and gate/up; on the H200 the compiled FP8 step 89.9 -> 88.2 ms, bench/fp8_step.py).

FP8 only: its rows are independent, each with its own scale, so the stack is the layers' rows one after another
and a layer's per-tensor scale becomes that scale on each of its rows. The stacked layer computes what the separate
ones computed, row for row (the native GEMM scales each output column by its row's scale; dequantising multiplies
each row by it). Stacked only where the layers multiply natively (their weights on a GPU with FP8 GEMMs): a layer
that dequantises per call would need the stacked weight's bf16 copy, two or three times the memory the VRAM plan
counts for its largest layer. GGUF and NVFP4 layers stay as they are.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn

from .fp8 import native_fp8_supported
from .linear import QuantLinear
from .qweight import QuantizedWeight


def fuse_packed(linears: Sequence[nn.Module], name: str) -> Optional[QuantLinear]:
    """One QuantLinear whose output is the outputs of `linears` side by side, or None where they cannot be stacked
    (not all FP8 QuantLinears of one input width, weight dtype, device and compute dtype, without bias, multiplying
    natively). `name`: the stacked layer's own name in its block ("to_qkv")."""
    if not linears or not all(_stackable(linear) for linear in linears):
        return None
    if not native_fp8_supported(linears[0].weight.device):
        return None
    first = linears[0]
    if len({(linear.in_features, linear.weight.dtype, linear.weight.device, linear.compute_dtype)
            for linear in linears}) != 1:
        return None
    data = torch.cat([linear.weight for linear in linears])
    scale = torch.cat([_row_scales(linear) for linear in linears])
    block = first.layer_name.rpartition(".")[0]
    qweight = QuantizedWeight("fp8", first.qtype, data, (data.shape[0], first.in_features), scale=scale,
                              dtype=first.compute_dtype)
    return QuantLinear(qweight, None, first.compute_dtype, f"{block}.{name}" if block else name)


def _stackable(linear: nn.Module) -> bool:
    return type(linear) is QuantLinear and linear.format == "fp8" and linear.bias is None \
        and linear.weight.dtype == torch.float8_e4m3fn


def _row_scales(linear: QuantLinear) -> torch.Tensor:
    """The layer's scale for each of its rows, fp32 [out]."""
    scale = getattr(linear, "weight_scale", None)
    if scale is None:
        return torch.ones(linear.out_features, dtype=torch.float32, device=linear.weight.device)
    scale = scale.to(device=linear.weight.device, dtype=torch.float32).reshape(-1)
    return scale.expand(linear.out_features).clone() if scale.numel() == 1 else scale
