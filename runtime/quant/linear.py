"""`QuantLinear`: an nn.Linear replacement whose weight stays packed in host and device memory.

Contract with the offloader (runtime/offload/) and anything else that moves modules around:
  * Every tensor the layer needs is an ordinary module buffer or parameter, found by
    `named_buffers()` / `named_parameters()`: buffers `weight` (the packed data), `weight_scale`,
    `weight_scale_2`, `input_scale` (those the format has; absent ones are not registered) and the
    parameter `bias` (or None). Dtypes are the file's packed dtypes (uint8, float8_e4m3fn, fp32).
  * A streamer may replace any of them by swapping `.data` (same shape and dtype, any device).
    Nothing else derived from them is cached: `forward` reads the tensors at call time and dequantises on
    the device where `weight` currently lives, so a block streamed in compressed is usable as is.
  * Format metadata (format, qtype, logical shape) are plain attributes and never move.
  * One derived tensor, built once: FP8 layers that may multiply natively also hold the non-persistent
    buffer `weight_scale_row` (the weight scale as the contiguous fp32 [1, out] row cuBLASLt's row-wise
    scaling takes), so no forward expands a per-tensor scale again. It streams like the others.

Forward: native FP8 GEMM on SM >= 8.9, native FP4 GEMM on SM >= 10, else dequantise this one layer's
weight to the activation dtype (one Triton kernel on CUDA where the type has one, else torch), `F.linear`,
and drop it (transient memory = one bf16 weight).
The choice is made per call: an activation the native kernels do not take (see `native_kernel_accepts`, e.g.
an fp32 one) is dequantised for that call only. Only a kernel error on an activation they do take turns native
off, for that layer and for good (one warning per distinct error); out-of-memory errors propagate.
"""
from __future__ import annotations

import logging
from typing import Callable, Protocol, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .fp8 import native_fp8_supported
from .fp8_matmul import fp8_linear_native, fp8_rows_native
from .nvfp4 import native_fp4_supported, nvfp4_linear_native
from .qweight import QuantizedWeight, dequantize_packed
from .triton_dequant import dequantize_triton, has_triton_kernel

log = logging.getLogger(__name__)

NATIVE_FORMATS = ("fp8", "nvfp4")
# Kernel errors already logged, as (format, message): the same torch limitation hits every layer alike.
_reported_native_errors: set[tuple[str, str]] = set()


def native_kernel_accepts(x: torch.Tensor, native_format: str | None, in_features: int,
                          per_tensor_fp8: bool = False) -> bool:
    """Whether the native GEMM for `native_format` ("fp8", "nvfp4"; None: the layer has none) takes activation `x`.

    Both take bf16; an FP8 weight with one per-tensor scale also takes fp16 (tensor-wise scaling writes fp16).
    An fp32 (or fp64) caller wants that precision, which quantising its activation to e4m3 or e2m1 would lose:
    it goes to the dequantise path. So does an input F.linear would reject anyway (wrong last dimension: the
    dequantise path raises the clear error) and an empty one. Devices are checked by the caller.
    """
    dtype_ok = x.dtype == torch.bfloat16 or (x.dtype == torch.float16 and native_format == "fp8" and per_tensor_fp8)
    return native_format in NATIVE_FORMATS and dtype_ok and x.dim() >= 1 and x.shape[-1] == in_features \
        and x.numel() > 0


class E4m3Factors(Protocol):
    """A layer's input as the factors it is made of, which can quantise themselves to e4m3 rows in one kernel
    (model/layer_inputs.py's FactoredInput)."""

    @property
    def given(self) -> torch.Tensor:
        """A tensor of the input's device, dtype and width: what decides whether a layer takes it."""

    @property
    def lead(self) -> torch.Size:
        """The input's shape before its last dimension."""

    def e4m3_rows(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The input's e4m3 rows [rows, width] and fp32 [rows, 1] scales, or None where it has no kernel for them."""


# Optional replacement for dequantize_packed, e.g. a torch.compile'd one (see `enable_compiled_dequant`).
_dequant_impl: Callable[..., torch.Tensor] = dequantize_packed
# On CUDA, a one-pass Triton kernel (triton_dequant.py) goes first for the types it covers; same result.
_triton_enabled = True


def enable_triton_dequant(enabled: bool = True) -> None:
    """Use the Triton dequant kernels on CUDA (the default) or always the torch path (for benchmarks)."""
    global _triton_enabled
    _triton_enabled = enabled


def _dequant_on_cuda_with_triton(*args: object) -> torch.Tensor | None:
    global _triton_enabled
    try:
        return dequantize_triton(*args)
    except Exception as err:  # e.g. a compile failure on an untested GPU: the torch path gives the same values
        _triton_enabled = False
        log.warning("Triton dequantisation failed (%s: %s); using the torch path from now on",
                    type(err).__name__, err)
        return None


def enable_compiled_dequant(enabled: bool = True) -> None:
    """Route per-layer dequantisation through `torch.compile` (fuses the unpack ops into one kernel).

    Trade-off: eager dequant runs ~5-15 kernels per layer through float32 temporaries (for the 8B DiT
    that is 100+ GB of memory traffic per step for K-quants); compiled, one kernel reads the packed bytes
    and writes the bf16 weight. Costs a compile per format on first use (a second one when the next weight
    shape makes the graph dynamic); nothing is cached between forwards, so it needs no extra memory.
    The fused kernel may contract a multiply-add into an FMA: within one float32 ulp of the exact result.
    """
    global _dequant_impl
    _dequant_impl = torch.compile(dequantize_packed) if enabled else dequantize_packed


class QuantLinear(nn.Module):
    def __init__(self, qweight: QuantizedWeight, bias: torch.Tensor | None = None,
                 compute_dtype: torch.dtype = torch.bfloat16, name: str = "") -> None:
        super().__init__()
        if len(qweight.shape) != 2:
            raise ValueError(f"{name or 'QuantLinear'}: expected a 2-D weight, got shape {qweight.shape}")
        self.out_features, self.in_features = qweight.shape
        self.format = qweight.format
        self.qtype = qweight.qtype
        self.shape = qweight.shape
        self.compute_dtype = compute_dtype
        self.layer_name = name
        self._native_failed = False
        for buffer_name, tensor in qweight.tensors().items():
            self.register_buffer(buffer_name, tensor)
        # Format, dtype and shape never change (a streamer swaps same-dtype data), so the GEMM a layer may use
        # natively and whether a Triton kernel covers its type are decided once; only the device is checked
        # per forward.
        self._native_format = self._native_candidate()
        self._triton_kernel = has_triton_kernel(self.format, self.qtype)
        self._per_tensor_fp8 = qweight.scale is None or qweight.scale.numel() == 1
        if self._native_format == "fp8":
            scale = qweight.scale if qweight.scale is not None else torch.ones((), device=qweight.data.device)
            row = scale.to(torch.float32).reshape(1, -1).expand(1, self.out_features).contiguous()
            self.register_buffer("weight_scale_row", row, persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias.to(compute_dtype), requires_grad=False)

    def stacked_with(self, others: Sequence["QuantLinear"]) -> "QuantLinear | None":
        """One layer giving this layer's outputs, then each of `others`' (layers of the same input), in one GEMM:
        where all are bias-free FP8 layers multiplying natively in bf16, their data stacked row-wise and each row
        keeping its own layer's scale, so every output is the product the separate layer computes. None otherwise
        (the caller keeps the separate layers)."""
        layers = [self, *others]
        if any(type(layer) is not QuantLinear or layer._native_format != "fp8" or layer.bias is not None
               or layer.compute_dtype != torch.bfloat16 or layer.in_features != self.in_features
               or layer.weight.dtype != self.weight.dtype or layer.weight.device != self.weight.device
               for layer in layers):
            return None
        data = torch.cat([layer.weight for layer in layers])
        scale = torch.cat([layer.weight_scale_row.reshape(-1) for layer in layers])
        names = "+".join(layer.layer_name.rpartition(".")[2] for layer in layers)
        prefix = self.layer_name.rpartition(".")[0]
        return QuantLinear(QuantizedWeight("fp8", self.qtype, data, tuple(data.shape), scale=scale),
                           compute_dtype=torch.bfloat16, name=f"{prefix}.{names}" if prefix else names)

    def dequantized_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        # No per-layer values (like the layer name) go in: a compiled impl would recompile for each one.
        args = (self.format, self.qtype, self.shape, self.weight, getattr(self, "weight_scale", None),
                getattr(self, "weight_scale_2", None), dtype or self.compute_dtype)
        if _triton_enabled and self._triton_kernel and self.weight.is_cuda:
            weight = _dequant_on_cuda_with_triton(*args)
            if weight is not None:
                return weight
        return _dequant_impl(*args)

    def _native_candidate(self) -> str | None:
        if self.format == "fp8" and self.weight.dtype == torch.float8_e4m3fn \
                and self.in_features % 16 == 0 and self.out_features % 16 == 0:
            return "fp8"
        if self.format == "nvfp4" and self.in_features % 32 == 0:
            return "nvfp4"
        return None

    def _native(self, x: torch.Tensor) -> torch.Tensor | None:
        """The native GEMM's output, or None: this call (or, after a kernel error, this layer) dequantises."""
        if self._native_format == "fp8":
            return self._run_native(x, lambda: fp8_linear_native(x, self.weight, getattr(self, "weight_scale", None),
                                                                 self.weight_scale_row, self.bias))
        return self._run_native(x, lambda: nvfp4_linear_native(x, self.weight, self.weight_scale,
                                                               self.weight_scale_2, self.shape, self.bias))

    def _run_native(self, x: torch.Tensor, multiply: Callable[[], torch.Tensor]) -> torch.Tensor | None:
        """`multiply()` where this layer's native GEMM takes `x` on its device, else None."""
        return self._guarded(x, multiply) if self._native_takes(x) else None

    def _native_takes(self, x: torch.Tensor) -> bool:
        if self._native_failed or not native_kernel_accepts(x, self._native_format, self.in_features,
                                                             self._per_tensor_fp8) \
                or self.weight.device != x.device:
            return False
        # The *_supported checks are False off CUDA and below the SM the kernel needs.
        supported = native_fp8_supported if self._native_format == "fp8" else native_fp4_supported
        return supported(x.device)

    def _guarded(self, x: torch.Tensor, multiply: Callable[[], torch.Tensor]) -> torch.Tensor | None:
        """`multiply()`, or None after the kernel rejected the input (this layer dequantises from then on)."""
        try:
            return multiply()
        except torch.cuda.OutOfMemoryError:  # says nothing about the kernel; dequantising would need more memory
            raise
        except (RuntimeError, TypeError) as err:  # the kernel rejects an input it should take: this torch lacks it
            self._native_failed = True
            if (self.format, str(err)) not in _reported_native_errors:
                _reported_native_errors.add((self.format, str(err)))
                log.warning("%s: native %s matmul failed on a %s input (%s: %s); this layer and any other "
                            "failing the same way dequantise per forward from now on",
                            self.layer_name or "QuantLinear", self.format, tuple(x.shape), type(err).__name__, err)
        return None

    def from_factors(self, factors: E4m3Factors) -> torch.Tensor | None:
        """self(factors.tensor()) as one FP8 GEMM of the e4m3 rows the factors make in one kernel of their own
        (model/layer_inputs.py), where this layer multiplies natively in FP8 and they can; None where not (the
        caller calls the layer on the tensor)."""
        if self._native_format != "fp8" or not self._native_takes(factors.given):
            return None
        rows = factors.e4m3_rows()
        if rows is None:
            return None
        return self._guarded(factors.given, lambda: fp8_rows_native(*rows, self.weight, self.weight_scale_row,
                                                                    self.bias, factors.lead))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._native(x)
        if y is not None:
            return y
        dtype = x.dtype if x.is_floating_point() else self.compute_dtype
        weight = self.dequantized_weight(dtype)
        bias = None if self.bias is None else self.bias.to(dtype)
        return F.linear(x, weight, bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, format={self.format}:{self.qtype}"


def _split_parent(root: nn.Module, name: str) -> tuple[nn.Module, str]:
    parent_name, _, child = name.rpartition(".")
    return (root.get_submodule(parent_name) if parent_name else root), child


def quantize_linears(module: nn.Module, state: dict[str, object], compute_dtype: torch.dtype = torch.bfloat16
                     ) -> list[str]:
    """Replace every nn.Linear whose `<name>.weight` in `state` is a QuantizedWeight by a QuantLinear.

    The `<name>.weight` / `<name>.bias` entries it uses are removed from `state`; plain tensors stay for the
    caller's `load_state_dict`. Returns the replaced module names. Called on a part of a DiT (a block), the
    caller bumps the DiT's `structure_version`.
    """
    replaced = []
    for name, child in list(module.named_modules()):
        qweight = state.get(f"{name}.weight")
        if not isinstance(child, nn.Linear) or not isinstance(qweight, QuantizedWeight):
            continue
        if tuple(qweight.shape) != (child.out_features, child.in_features):
            raise ValueError(f"{name}: quantised weight shape {qweight.shape} does not fit "
                             f"Linear({child.in_features}, {child.out_features})")
        bias = state.pop(f"{name}.bias", None)
        if bias is None and child.bias is not None:
            bias = child.bias.detach()
        parent, attr = _split_parent(module, name)
        setattr(parent, attr, QuantLinear(qweight, bias, compute_dtype, name))
        del state[f"{name}.weight"]
        replaced.append(name)
    if replaced and hasattr(module, "structure_version"):
        module.structure_version += 1  # new modules: captured forwards of a DiT (dit_graphs) are stale
    return replaced


def load_quantized_into(module: nn.Module, state: dict[str, object], compute_dtype: torch.dtype = torch.bfloat16
                        ) -> list[str]:
    """`quantize_linears`, then load every remaining plain tensor (strict: all keys must match)."""
    remaining = dict(state)
    replaced = quantize_linears(module, remaining, compute_dtype)
    leftovers = [k for k, v in remaining.items() if not isinstance(v, torch.Tensor)]
    if leftovers:
        raise ValueError(f"quantised weights for modules that are not nn.Linear: {leftovers[:5]}")
    missing, unexpected = module.load_state_dict(remaining, strict=False, assign=False)
    missing = [k for k in missing if not any(k.startswith(f"{r}.") for r in replaced)]
    if missing or unexpected:
        raise ValueError(f"state does not match the module: missing {missing[:5]}, unexpected {unexpected[:5]}")
    return replaced
