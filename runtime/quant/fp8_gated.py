"""gelu(gate) * up quantised to e4m3 per row in one kernel: the MLP's down projection's FP8 input.

The native FP8 GEMM needs its activation in e4m3 with a scale per row, and the MLP's activation is gelu(gate) * up,
12288 values a row. Left to torch.compile, the product, its row maximum and the quantisation are one looped
reduction that reads the gate/up GEMM's output twice; on the H200 it took ~10% of the compiled FP8 step. The
kernel (triton_fp8_kernels.py) reads it once from memory, a row held in registers as three chunks. `gelu_mul_quantize` is a custom op
(fp8_kernel_call.py); its torch form computes what the kernel computes, rounding for rounding.
"""
from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F

from ..core.rounding import power_of_two_at_least
from .fp8 import quantize_activation
from .fp8_kernel_call import (as_arguments, kernel_or_torch_form, on_device, placeholders, quantised_like,
                              registered_op)

_MAX_ROW = 1 << 15  # a row is held in registers: the DiT's 12288 fits with room


def gelu_mul_quantize_reference(gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 rows, fp32 [rows, 1] scales) of up * gelu(gate), both [rows, n] bf16: the torch form. Contiguous, as
    the kernel's outputs (and the op's declared ones) are, whatever the inputs' strides."""
    quantised, scale = quantize_activation(up * F.gelu(gate), per_row=True)
    return quantised.contiguous(), scale.contiguous()


def _kernel_takes(gate: torch.Tensor, up: torch.Tensor) -> bool:
    return gate.dtype == up.dtype == torch.bfloat16 and gate.dim() == up.dim() == 2 and gate.shape == up.shape \
        and gate.stride(1) == up.stride(1) == 1 and 0 < gate.shape[1] <= _MAX_ROW and gate.device == up.device


def _gelu_mul_quantize(gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return kernel_or_torch_form("gelu-product", gate.device, _kernel_takes(gate, up),
                                lambda kernels, addresses: launch(kernels, gate, up, addresses=addresses),
                                lambda: gelu_mul_quantize_reference(gate, up))


def default_warps(chunk: int) -> int:
    """Warps for a program holding a row as three chunks of `chunk` values: one per 512, 4 to 8. For the DiT's
    12288-value rows (three of 4096) 8 were the fastest on an H200 (115.8 us at 4352 rows; 16 warps 117.8, 4 warps
    144.9; the row as one 16384-lane block, the former kernel, 138.6; bench/fp8_kernels.py --candidates)."""
    return max(4, min(8, chunk // 512))


def launch(kernels: ModuleType, gate: torch.Tensor, up: torch.Tensor, num_warps: int | None = None,
           addresses: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel on inputs it takes (`_kernel_takes`), given their `addresses` or not (fp8_kernel_call.py);
    `num_warps` (default: `default_warps`) is for benchmarks."""
    rows, n = gate.shape
    out, scale = quantised_like(rows, n, gate.device)
    if rows:
        with on_device(gate.device):
            kernels.gelu_mul_quantize_kernel[(rows,)](*as_arguments((gate, up, out, scale), addresses), gate.stride(0),
                                                      up.stride(0), n, **_settings(n, addresses, num_warps))
    return out, scale


def _settings(n: int, addresses: bool, num_warps: int | None = None) -> dict:
    chunk = power_of_two_at_least(-(-n // 3))
    return dict(CHUNK=chunk, ADDRESSES=addresses, num_warps=num_warps or default_warps(chunk))


def compile_ahead(kernels: ModuleType, n: int, addresses: bool) -> None:
    """The kernel compiled for `launch` on rows of `n` values given as tensors or by their `addresses`, not run."""
    kernels.gelu_mul_quantize_kernel.warmup(
        *placeholders((torch.bfloat16, torch.bfloat16, torch.float8_e4m3fn, torch.float32), addresses), 2 * n, 2 * n,
        n, grid=(1,), **_settings(n, addresses))


def _shapes(gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return (gate.new_empty(gate.shape, dtype=torch.float8_e4m3fn),
            gate.new_empty((gate.shape[0], 1), dtype=torch.float32))


gelu_mul_quantize = registered_op("ernie_image::fp8_gelu_mul_quantize", "(Tensor gate, Tensor up) -> (Tensor, Tensor)",
                                  _gelu_mul_quantize, _shapes)
