"""A bf16 activation quantised to e4m3 per row in one kernel: the FP8 input of a layer whose input comes from
elsewhere (the attention's output projection). The torch form (fp8.quantize_activation) reads the activation
twice, for the row maxima and for the quotient; uncompiled it is five kernels."""
from __future__ import annotations

from types import ModuleType

import torch

from ..core.rounding import power_of_two_at_least
from .fp8 import quantize_activation
from .fp8_kernel_call import (as_arguments, kernel_or_torch_form, on_device, placeholders, quantised_like,
                              registered_op)
from .triton_loader import cdiv

_MAX_ROW = 1 << 14  # a row is held in registers


def quantize_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_activation(x, per_row=True), contiguous as the kernel's outputs are."""
    quantised, scale = quantize_activation(x, per_row=True)
    return quantised.contiguous(), scale.contiguous()


def _kernel_takes(x: torch.Tensor) -> bool:
    return x.dtype == torch.bfloat16 and x.dim() == 2 and x.stride(1) == 1 and 0 < x.shape[1] <= _MAX_ROW


def _quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return kernel_or_torch_form("row quantisation", x.device, _kernel_takes(x),
                                lambda kernels, addresses: launch(kernels, x, addresses=addresses),
                                lambda: quantize_rows_reference(x))


def default_warps(block: int) -> int:
    """Warps for a program holding `block` values of a row: one per 256, 4 to 16. For the DiT's 4096-value rows
    16 were the fastest on an H200 (bench/fp8_kernels.py, two runs, 4352 rows: 25-35 us; 8 warps 27-54, 4 warps
    29-57; two or four rows a program 31-33 us at 16 warps)."""
    return max(4, min(16, block // 256))


def launch(kernels: ModuleType, x: torch.Tensor, num_warps: int | None = None, rows_per_program: int = 1,
           addresses: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel on an input it takes (`_kernel_takes`), given by its `addresses` or not (fp8_kernel_call.py); the
    launch settings are for benchmarks."""
    rows, n = x.shape
    out, scale = quantised_like(rows, n, x.device)
    if rows:
        with on_device(x.device):
            kernels.row_quantize_kernel[(cdiv(rows, rows_per_program),)](
                *as_arguments((x, out, scale), addresses), x.stride(0), rows, n,
                **_settings(n, addresses, num_warps, rows_per_program))
    return out, scale


def _settings(n: int, addresses: bool, num_warps: int | None = None, rows_per_program: int = 1) -> dict:
    block = power_of_two_at_least(n)
    return dict(BLOCK=block, ROWS=rows_per_program, ADDRESSES=addresses, num_warps=num_warps or default_warps(block))


def compile_ahead(kernels: ModuleType, n: int, addresses: bool) -> None:
    """The kernel compiled for `launch` on contiguous rows of `n` values given as tensors or by their `addresses`,
    not run (the row count is not specialised on)."""
    kernels.row_quantize_kernel.warmup(*placeholders((torch.bfloat16, torch.float8_e4m3fn, torch.float32), addresses),
                                       n, 16, n, grid=(1,), **_settings(n, addresses))


def _shapes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x.new_empty(x.shape, dtype=torch.float8_e4m3fn), x.new_empty((x.shape[0], 1), dtype=torch.float32)


quantize_rows = registered_op("ernie_image::fp8_quantize_rows", "(Tensor x) -> (Tensor, Tensor)", _quantize_rows,
                              _shapes)
