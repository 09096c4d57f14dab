"""The MLP's down projection in FP8 with its input gelu(gate) * up quantised in one pass.

The native FP8 GEMM needs its activation in e4m3 with a scale per row, and the MLP's activation is gelu(gate) * up,
12288 values a row. Left to torch.compile, the product, its row maximum and the quantisation are one looped
reduction that reads the gate/up GEMM's output twice; on the H200 it took ~10% of the compiled FP8 step. One Triton
program a row (triton_fp8_kernels.py) reads it once. `gelu_mul_quantize` is a custom op, so a compiled block calls
the kernel as it is; where Triton cannot run (no Triton, a CPU tensor) the torch form runs, which is what the
kernel computes, rounding for rounding.
"""
from __future__ import annotations

import contextlib
import logging

import torch
import torch.nn.functional as F

from .fp8 import quantize_activation
from .triton_loader import kernels_for

_OP_NAME = "ernie_image::fp8_gelu_mul_quantize"
_MAX_ROW = 1 << 15  # one program holds a row in registers: the DiT's 12288 fits with room
_failed: set[str] = set()  # device types where the kernel failed once: the torch form runs there from then on
log = logging.getLogger(__name__)


def gelu_mul_quantize_reference(gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 rows, fp32 [rows, 1] scales) of up * gelu(gate), both [rows, n] bf16: the torch form. Contiguous, as
    the kernel's outputs (and the op's declared ones) are, whatever the inputs' strides."""
    quantised, scale = quantize_activation(up * F.gelu(gate), per_row=True)
    return quantised.contiguous(), scale.contiguous()


def _kernel_takes(gate: torch.Tensor, up: torch.Tensor) -> bool:
    return gate.dtype == up.dtype == torch.bfloat16 and gate.dim() == up.dim() == 2 and gate.shape == up.shape \
        and gate.stride(1) == up.stride(1) == 1 and 0 < gate.shape[1] <= _MAX_ROW and gate.device == up.device


def _gelu_mul_quantize(gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    usable = _kernel_takes(gate, up) and gate.device.type not in _failed
    kernels = kernels_for("triton_fp8_kernels", gate.device) if usable else None
    if kernels is None:
        return gelu_mul_quantize_reference(gate, up)
    try:
        return launch(kernels, gate, up)
    except torch.cuda.OutOfMemoryError:
        raise
    except Exception as err:  # e.g. a compile failure on an untested GPU or Triton: the torch form is the same
        if _in_a_capture(gate):
            # Under cudaMallocAsync a graph's own allocations have no address Triton can check before the graph
            # runs: this graph holds the torch form, other calls keep the kernel.
            log.debug("the one-pass FP8 activation kernel cannot run inside this graph capture (%s: %s); the graph "
                      "holds the torch form", type(err).__name__, str(err)[:200])
            return gelu_mul_quantize_reference(gate, up)
        _failed.add(gate.device.type)
        log.warning("the one-pass FP8 activation kernel failed (%s: %s); using the torch form from now on",
                    type(err).__name__, str(err)[:300])
        return gelu_mul_quantize_reference(gate, up)


def _in_a_capture(tensor: torch.Tensor) -> bool:
    return tensor.is_cuda and torch.cuda.is_current_stream_capturing()


def default_warps(block: int) -> int:
    """Warps for a program holding `block` values of a row: one per 2048, 4 to 8. For the DiT's 12288-value rows 8
    were the fastest on an H200 (0.212 ms a block at 4352 rows; 16 warps 0.247, 32 warps 0.232, 4 warps 0.332;
    bench/fp8_step.py)."""
    return max(4, min(8, block // 2048))


def launch(kernels: object, gate: torch.Tensor, up: torch.Tensor, num_warps: int | None = None
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel on inputs it takes (`_kernel_takes`); `num_warps` (default: `default_warps`) is for benchmarks."""
    rows, n = gate.shape
    out = torch.empty((rows, n), dtype=torch.float8_e4m3fn, device=gate.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=gate.device)
    if rows:
        block = 1 << (n - 1).bit_length()
        warps = num_warps or default_warps(block)
        with torch.cuda.device(gate.device) if gate.is_cuda else contextlib.nullcontext():
            kernels.gelu_mul_quantize_kernel[(rows,)](gate, up, out, scale, gate.stride(0), up.stride(0), n,
                                                      BLOCK=block, num_warps=warps)
    return out, scale


def _register() -> object:
    """The custom op; another copy of the pack in the process (an installed one beside ComfyUI's) may have
    registered it already: that copy's op is used, which computes the same where both copies are one version."""
    namespace, name = _OP_NAME.split("::")
    try:
        return getattr(getattr(torch.ops, namespace), name)
    except (AttributeError, RuntimeError):
        pass
    op = torch.library.custom_op(_OP_NAME, mutates_args=(), schema="(Tensor gate, Tensor up) -> (Tensor, Tensor)")(
        _gelu_mul_quantize)

    @op.register_fake
    def _(gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (gate.new_empty(gate.shape, dtype=torch.float8_e4m3fn),
                gate.new_empty((gate.shape[0], 1), dtype=torch.float32))

    return op


gelu_mul_quantize = _register()


def fp8_gelu_gated_native(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor, weight_scale_row: torch.Tensor,
                          bias: torch.Tensor | None) -> torch.Tensor:
    """(up * gelu(gate)) @ weight.T (+ bias) as one FP8 GEMM, gate and up [..., n] bf16 (views of one tensor
    may be given). Needs SM >= 8.9."""
    out_features = weight.shape[0]
    lead = gate.shape[:-1]
    hq, h_scale = gelu_mul_quantize(gate.reshape(-1, gate.shape[-1]), up.reshape(-1, up.shape[-1]))
    y = torch._scaled_mm(hq, weight.t(), scale_a=h_scale, scale_b=weight_scale_row, out_dtype=torch.bfloat16,
                         use_fast_accum=True)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.reshape(*lead, out_features)
