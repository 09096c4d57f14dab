"""Packed prompt-enhancer weights: the decoder layers' Linears quantised on load (runtime/quant/).

The seven projections of each of the 26 layers (q, k, v, o, gate, up, down: 5.6 of the 6.86 GB in bf16) become
QuantLinears; the embeddings (and the head tied to them) and the norms stay in the model's dtype. FP8 (e4m3, one
scale per output row) multiplies natively on SM >= 8.9 (`torch._scaled_mm`, the activation quantised per row on the
fly) and is dequantised per layer elsewhere, so it works on every device; the text it gives differs from bf16's by
the change in logits `bench/pe_decode.py` measures.
"""
from __future__ import annotations

import torch
from torch import nn

from ..core.errors import InvalidInputError

PE_QUANT_FORMATS = ("fp8",)


def quantize_pe_layers_(model: nn.Module, fmt: str = "fp8") -> int:
    """Replace every nn.Linear of `model.model.layers` by a QuantLinear packed to `fmt`, on the weights' device, in
    place. Returns how many were packed."""
    from ..quant.linear import quantize_linears
    from ..quant.writer import quantize_weight

    if fmt not in PE_QUANT_FORMATS:
        raise InvalidInputError(f"prompt-enhancer quantisation {fmt!r} is not supported: use one of "
                                f"{', '.join(PE_QUANT_FORMATS)} or none")
    layers = model.model.layers
    dtype = model.get_input_embeddings().weight.dtype
    compute = dtype if dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
    packed = 0
    for index, layer in enumerate(layers):  # one layer at a time: transient memory stays one layer's fp32 copy
        state = {f"{name}.weight": quantize_weight(module.weight.detach(), fmt)
                 for name, module in layer.named_modules() if type(module) is nn.Linear}
        packed += len(quantize_linears(layer, state, compute_dtype=compute))
    return packed
