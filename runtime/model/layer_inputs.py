"""A layer's input handed over as what it is made of, so that a layer quantising its input (an FP8 QuantLinear that
multiplies natively) gets e4m3 rows the factors make in one kernel of their own, and every other layer gets the
tensor.

`FactoredInput.into(layer)` is layer(input.tensor()), or the layer's `from_factors(input)` where its class offers that
method and it answers (quant/linear.py). A LoRA wrapper (lora/attach.py) offers none and gets the tensor. The kinds:
the MLP's gelu(gate) * up (`GeluGated`, quantised by quant/fp8_gated.py) and a block's adaLN output
(adaln.NormModulated, by quant/fp8_modulated.py).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..quant.fp8_gated import gelu_mul_quantize


class FactoredInput:
    """A layer's input by its factors: `tensor()` makes it, `e4m3_rows()` quantises it per row in one kernel."""

    @property
    def given(self) -> torch.Tensor:
        """A tensor of the input's device, dtype and width: what decides whether a layer takes it."""
        raise NotImplementedError

    @property
    def lead(self) -> torch.Size:
        """The input's shape before its last dimension."""
        return self.given.shape[:-1]

    def tensor(self) -> torch.Tensor:
        raise NotImplementedError

    def e4m3_rows(self) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """e4m3 [rows, width] and fp32 [rows, 1] scales of the input, quantised per row by one kernel from the
        factors; None where this input has no such kernel for them (the layer then gets the tensor)."""
        return None

    def into(self, layer: nn.Module) -> torch.Tensor:
        """layer(self.tensor()), computed from the factors where the layer takes them."""
        from_factors = getattr(layer, "from_factors", None)
        out = from_factors(self) if from_factors is not None else None
        return out if out is not None else layer(self.tensor())


class GeluGated(FactoredInput):
    """up * gelu(gate): the MLP's down projection's input, from the halves of the gate/up output (views of one
    tensor may be given)."""

    def __init__(self, gate: torch.Tensor, up: torch.Tensor) -> None:
        self.gate, self.up = gate, up

    @property
    def given(self) -> torch.Tensor:
        return self.gate

    def tensor(self) -> torch.Tensor:
        return self.up * F.gelu(self.gate)

    def e4m3_rows(self) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        gate, up = self.gate, self.up
        if gate.shape != up.shape or not gate.dtype == up.dtype == torch.bfloat16:
            return None
        return gelu_mul_quantize(gate.reshape(-1, gate.shape[-1]), up.reshape(-1, up.shape[-1]))
