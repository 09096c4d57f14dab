"""A block's adaLN modulation: the residual stream normalised (RMSNorm) and modulated by the step's
(1 + scale, shift) into a layer's input, how that input reaches the layers it feeds (`NormModulated`), and the
gated residual that adds a layer's output back."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from ..quant.fp8_modulated import norm_modulate_quantize, residual_norm_modulate_quantize
from . import fused_kernels
from .arithmetic import Arithmetic
from .layer_inputs import FactoredInput

FAST = Arithmetic()


class RMSNorm(nn.Module):
    """diffusers' RMSNorm, same rounding: normalise in fp32, cast to the weight's dtype, then scale."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, arithmetic: Arithmetic = FAST) -> torch.Tensor:
        low_precision = self.weight.dtype in (torch.float16, torch.bfloat16)
        variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
        if low_precision and arithmetic.folds_casts():
            normed = torch.mul(x, torch.rsqrt(variance + self.eps), out=torch.empty_like(x, dtype=self.weight.dtype))
            return normed.mul_(self.weight)
        x = x * torch.rsqrt(variance + self.eps)
        if low_precision:
            x = x.to(self.weight.dtype)
        return x * self.weight


def norm_modulate(norm: RMSNorm, x: torch.Tensor, one_plus_scale: torch.Tensor, shift: torch.Tensor,
                  scale_raw: torch.Tensor, shift_raw: torch.Tensor, arithmetic: Arithmetic = FAST) -> torch.Tensor:
    """modulate(norm(x), ...). The fast path keeps every operand in x's dtype (mixed-dtype kernels take PyTorch's
    slow casting path): norm and weight in one kernel, then (normed * scale + shift) + normed, with the raw `scale`
    and `shift` whose fp32 forms are exact; or comfy-kitchen's one-pass kernel with the weight in the scale."""
    if arithmetic.fast_for(x) and norm.weight.dtype == x.dtype:
        # comfy-kitchen, one pass: rms(x) * (w (1 + scale)) + shift = rms(x) * (1 + scale') + shift
        if arithmetic.kitchen_adaln and fused_kernels.adaln_serves(x):
            folded_scale = torch.mul(norm.weight, one_plus_scale).sub_(1).to(x.dtype)  # fp32 until then: small
            return fused_kernels.rms_adaln(x, folded_scale, shift_raw, norm.eps)
        normed = F.rms_norm(x, (x.shape[-1],), weight=norm.weight, eps=norm.eps)
        return torch.addcmul(shift_raw, normed, scale_raw).add_(normed)
    return modulate(norm(x, arithmetic), one_plus_scale, shift, arithmetic)


def modulate(x: torch.Tensor, one_plus_scale: torch.Tensor, shift: torch.Tensor,
             arithmetic: Arithmetic = FAST) -> torch.Tensor:
    """(x.float() * one_plus_scale + shift).to(x.dtype); the fp32 factors are [B, 1, D]."""
    if arithmetic.folds_casts():
        return torch.add(torch.mul(x, one_plus_scale), shift, out=torch.empty_like(x))
    return (x.float() * one_plus_scale + shift).to(x.dtype)


def gated_residual(x: torch.Tensor, gate: torch.Tensor, update: torch.Tensor,
                   gate_raw: Optional[torch.Tensor] = None, arithmetic: Arithmetic = FAST) -> torch.Tensor:
    """x + (gate * update.float()).to(x.dtype), the gate fp32 [B, 1, D] (`gate_raw`: the same in x's dtype)."""
    if gate_raw is not None and arithmetic.fast_for(x):
        return torch.addcmul(x, update, gate_raw)
    if arithmetic.folds_casts():
        return torch.mul(gate, update, out=torch.empty_like(update, dtype=x.dtype)).add_(x)
    return x + (gate * update.float()).to(x.dtype)


@dataclass(frozen=True)
class Residual:
    """A gated residual still to be added: x + gate * update (gated_residual's arguments)."""
    update: torch.Tensor
    gate: torch.Tensor  # fp32 [B, 1, D]
    gate_raw: Optional[torch.Tensor] = None  # the same in x's dtype


class NormModulated(FactoredInput):
    """A block's adaLN output, norm_modulate(norm, x, ...), for the layers it feeds: `into(layer)` is
    layer(norm_modulate(...)). With a `residual`, x is first x + gate * update, which is then `source`, the
    residual stream from here on.

    Under the fast arithmetic its e4m3 rows come from one kernel reading x, and the residual
    (quant/fp8_modulated.py), for a layer taking factors (layer_inputs.py); every other layer gets the tensor, made
    once for all of them."""

    def __init__(self, norm: Optional[RMSNorm], x: torch.Tensor, one_plus_scale: Optional[torch.Tensor] = None,
                 shift: Optional[torch.Tensor] = None, scale_raw: Optional[torch.Tensor] = None,
                 shift_raw: Optional[torch.Tensor] = None, arithmetic: Optional[Arithmetic] = None,
                 residual: Optional[Residual] = None) -> None:
        """`arithmetic`: the model's (None only where `norm` is None: a tensor given as the input)."""
        self.norm, self.arithmetic = norm, arithmetic
        self.one_plus_scale, self.shift, self.scale_raw, self.shift_raw = one_plus_scale, shift, scale_raw, shift_raw
        self._before_residual, self._residual = x, residual
        self._source: Optional[torch.Tensor] = x if residual is None else None
        self._tensor: Optional[torch.Tensor] = None if norm is not None else x

    @classmethod
    def of(cls, x: Union[torch.Tensor, "NormModulated"]) -> "NormModulated":
        """`x` itself, or a tensor given as the layers' input already made (nothing to normalise)."""
        # No default Arithmetic passed: dynamo cannot build one inside a compiled caller.
        return x if isinstance(x, NormModulated) else cls(None, x)

    @property
    def source(self) -> torch.Tensor:
        """x, after the residual where there is one."""
        if self._source is None:
            residual = self._residual
            self._source = gated_residual(self._before_residual, residual.gate, residual.update, residual.gate_raw,
                                          self.arithmetic)
        return self._source

    @property
    def given(self) -> torch.Tensor:
        """x as given, before a pending residual: of the input's device, dtype and shape, without adding it."""
        return self._before_residual

    @property
    def shape(self) -> torch.Size:
        return self._before_residual.shape

    def tensor(self) -> torch.Tensor:
        if self._tensor is None:
            self._tensor = norm_modulate(self.norm, self.source, self.one_plus_scale, self.shift, self.scale_raw,
                                         self.shift_raw, self.arithmetic)
        return self._tensor

    def e4m3_rows(self) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """The kernel's rows under the fast arithmetic (its sums are not the reference's), adding a pending residual
        there and keeping the new stream as `source`."""
        norm = self.norm
        if norm is None or not self.arithmetic.fast or norm.weight.dtype != torch.bfloat16 \
                or self._before_residual.dim() != 3:
            return None
        if self._source is not None:
            return norm_modulate_quantize(self._source, norm.weight, self.one_plus_scale, self.shift, norm.eps)
        pending = self._residual
        self._source, quantised, scales = residual_norm_modulate_quantize(
            self._before_residual, pending.update, pending.gate, norm.weight, self.one_plus_scale, self.shift, norm.eps)
        return quantised, scales
