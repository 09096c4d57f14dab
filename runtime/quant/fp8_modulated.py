"""A block's adaLN output quantised to e4m3 per row in one kernel, straight from the residual stream: the FP8
input of the projections the adaLN feeds (q/k/v, gate/up). Before the MLP's, the kernel also adds the attention's
gated residual and writes the new residual stream.

The torch form is the gated residual (x + bf16(gate * update)), RMSNorm (normalised in fp32, rounded to bf16,
times the bf16 weight), the modulation (fp32 x * (1 + scale) + shift, rounded to bf16), then the per-row
quantisation: model/adaln.py's plain expressions and fp8.quantize_activation. Compiled, it is looped reductions
that read the residual stream more than once; the kernel reads it once. It differs from the torch form in the order
the mean of squares is summed, which can move a normalised value to the neighbouring bf16 value, rarely, and on a
GPU in the modulation's fused multiply-add, which can move a value that nearly cancels by a code or two near zero.
"""
from __future__ import annotations

from types import ModuleType

import torch

from ..core.rounding import power_of_two_at_least
from .fp8 import quantize_activation
from .fp8_kernel_call import (as_arguments, kernel_or_torch_form, on_device, placeholders, quantised_like,
                              registered_op)
from .triton_loader import cdiv

_MAX_ROW = 1 << 14  # a row is held in registers


def norm_modulate_quantize_reference(x: torch.Tensor, weight: torch.Tensor, one_plus_scale: torch.Tensor,
                                     shift: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 [B * S, D], fp32 [B * S, 1] scales) of modulate(RMSNorm(x)): x [B, S, D] and the norm's weight [D] in
    bf16, `one_plus_scale` and `shift` fp32 [B, 1, D]."""
    variance = x.float().pow(2).mean(-1, keepdim=True)
    normed = (x * torch.rsqrt(variance + eps)).to(weight.dtype) * weight
    modulated = (normed.float() * one_plus_scale + shift).to(x.dtype)
    quantised, scale = quantize_activation(modulated.reshape(-1, x.shape[-1]), per_row=True)
    return quantised.contiguous(), scale.contiguous()


def residual_norm_modulate_quantize_reference(x: torch.Tensor, update: torch.Tensor, gate: torch.Tensor,
                                              weight: torch.Tensor, one_plus_scale: torch.Tensor, shift: torch.Tensor,
                                              eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x + bf16(gate * update), then its norm_modulate_quantize_reference), `update` as x, `gate` fp32 [B, 1, D]."""
    x = x + (gate * update.float()).to(x.dtype)
    return (x, *norm_modulate_quantize_reference(x, weight, one_plus_scale, shift, eps))


def _kernel_takes(x: torch.Tensor, weight: torch.Tensor, one_plus_scale: torch.Tensor, shift: torch.Tensor) -> bool:
    batch, _, width = x.shape
    factors = (batch, 1, width)
    return x.dtype == weight.dtype == torch.bfloat16 and one_plus_scale.dtype == shift.dtype == torch.float32 \
        and x.is_contiguous() and weight.is_contiguous() and weight.shape == (width,) \
        and one_plus_scale.shape == shift.shape == factors and one_plus_scale.is_contiguous() \
        and shift.is_contiguous() and 0 < width <= _MAX_ROW \
        and x.device == weight.device == one_plus_scale.device == shift.device


def _norm_modulate_quantize(x: torch.Tensor, weight: torch.Tensor, one_plus_scale: torch.Tensor,
                            shift: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return kernel_or_torch_form(
        "adaLN", x.device, x.dim() == 3 and _kernel_takes(x, weight, one_plus_scale, shift),
        lambda kernels, addresses: launch(kernels, x, weight, one_plus_scale, shift, eps, addresses=addresses),
        lambda: norm_modulate_quantize_reference(x, weight, one_plus_scale, shift, eps))


def _residual_norm_modulate_quantize(x: torch.Tensor, update: torch.Tensor, gate: torch.Tensor,
                                     weight: torch.Tensor, one_plus_scale: torch.Tensor, shift: torch.Tensor,
                                     eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    takes = x.dim() == 3 and _kernel_takes(x, weight, one_plus_scale, shift) and update.shape == x.shape \
        and update.dtype == x.dtype and update.is_contiguous() and gate.shape == one_plus_scale.shape \
        and gate.dtype == torch.float32 and gate.is_contiguous() and update.device == gate.device == x.device
    return kernel_or_torch_form(
        "adaLN", x.device, takes,
        lambda kernels, addresses: launch(kernels, x, weight, one_plus_scale, shift, eps, (update, gate),
                                          addresses=addresses),
        lambda: residual_norm_modulate_quantize_reference(x, update, gate, weight, one_plus_scale, shift, eps))


def default_warps(block: int, residual: bool = False) -> int:
    """Warps for a program holding `block` values of a row (and, with the residual, its update): one per 512 or,
    with the residual, one per 256, 4 to 16. For the DiT's 4096-value rows on an H200 (bench/fp8_kernels.py, two
    runs, 4352 rows): alone 4 / 8 / 16 warps 37-56 / 42-47 / 39-56 us, with the residual 81 / 75 / 46 us."""
    return max(4, min(16, block // (256 if residual else 512)))


def launch(kernels: ModuleType, x: torch.Tensor, weight: torch.Tensor, one_plus_scale: torch.Tensor,
           shift: torch.Tensor, eps: float, residual: tuple[torch.Tensor, torch.Tensor] | None = None,
           num_warps: int | None = None, rows_per_program: int = 1, addresses: bool = False
           ) -> tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel on inputs it takes (`_kernel_takes`): (e4m3 rows, scales), and with `residual` (update, gate),
    (x + bf16(gate * update), e4m3 rows, scales). The inputs are given by their `addresses` or not
    (fp8_kernel_call.py); the launch settings are for benchmarks."""
    batch, length, width = x.shape
    rows = batch * length
    out, scale = quantised_like(rows, width, x.device)
    update, gate = residual if residual is not None else (x, one_plus_scale)
    x_out = torch.empty_like(x) if residual is not None else x
    if rows:
        with on_device(x.device):
            kernels.rms_modulate_quantize_kernel[(cdiv(rows, rows_per_program),)](
                *as_arguments((x, update, gate, x_out, weight, one_plus_scale, shift, out, scale), addresses), rows,
                length, width, eps, **_settings(width, residual is not None, addresses, num_warps, rows_per_program))
    return (out, scale) if residual is None else (x_out, out, scale)


def _settings(width: int, residual: bool, addresses: bool, num_warps: int | None = None,
              rows_per_program: int = 1) -> dict:
    block = power_of_two_at_least(width)
    return dict(BLOCK=block, ROWS=rows_per_program, RESIDUAL=residual, ADDRESSES=addresses,
                num_warps=num_warps or default_warps(block, residual))


_ARGUMENT_DTYPES = (torch.bfloat16, torch.bfloat16, torch.float32, torch.bfloat16, torch.bfloat16, torch.float32,
                    torch.float32, torch.float8_e4m3fn, torch.float32)  # as `launch` passes its tensors


def compile_ahead(kernels: ModuleType, width: int, residual: bool, addresses: bool) -> None:
    """The kernel compiled for `launch` on rows of `width` values, with the `residual` or without, given as tensors
    or by their `addresses`, not run (the row counts are not specialised on: any count takes this form)."""
    kernels.rms_modulate_quantize_kernel.warmup(*placeholders(_ARGUMENT_DTYPES, addresses), 16, 16, width, 1e-6,
                                                grid=(1,), **_settings(width, residual, addresses))


def _shapes(x: torch.Tensor, weight: torch.Tensor, one_plus_scale: torch.Tensor, shift: torch.Tensor,
            eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    rows = x.numel() // x.shape[-1]
    return (x.new_empty((rows, x.shape[-1]), dtype=torch.float8_e4m3fn),
            x.new_empty((rows, 1), dtype=torch.float32))


norm_modulate_quantize = registered_op(
    "ernie_image::fp8_norm_modulate_quantize",
    "(Tensor x, Tensor weight, Tensor one_plus_scale, Tensor shift, float eps) -> (Tensor, Tensor)",
    _norm_modulate_quantize, _shapes)


def _residual_shapes(x: torch.Tensor, update: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor,
                     one_plus_scale: torch.Tensor, shift: torch.Tensor, eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            *_shapes(x, weight, one_plus_scale, shift, eps))


residual_norm_modulate_quantize = registered_op(
    "ernie_image::fp8_residual_norm_modulate_quantize",
    "(Tensor x, Tensor update, Tensor gate, Tensor weight, Tensor one_plus_scale, Tensor shift, float eps) "
    "-> (Tensor, Tensor, Tensor)",
    _residual_norm_modulate_quantize, _residual_shapes)
