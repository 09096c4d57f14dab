"""Filling a model built on the meta device from its file, tensor by tensor: no random init is ever materialised
and host RAM stays near one copy of the weights. Linears take packed weights where the file is quantised or a
format is asked for on load (QUANT_ON_LOAD_FORMATS)."""
from __future__ import annotations

from typing import Optional

import torch

from ..core.errors import ModelFileError
from .dtype_fit import check_built_dtypes, floating_tensors

QUANT_ON_LOAD_FORMATS = ("fp8", "q8_0", "q4_k", "nvfp4")


def fill_from_file(module: torch.nn.Module, component, device: torch.device, dtype: torch.dtype, quant: str = "none",
                   quant_device: Optional[torch.device] = None, keep_fp32: tuple[str, ...] = ()) -> torch.nn.Module:
    """Fill a meta-device module from `component` (packed Linears when the file is quantised or `quant` asks),
    then check that nothing is left on the meta device. A file holding integers where the module's weights are
    floating point is refused first, in one line (dtype_fit.py)."""
    check_built_dtypes(component, floating_tensors(module))
    if component.quantized or quant in QUANT_ON_LOAD_FORMATS:
        module = _build_quantized(module, component, device, dtype, quant, quant_device or device)
    else:
        module = _fill_module(module, component, device, dtype, keep_fp32)
    for name, tensor in list(module.named_parameters()) + list(module.named_buffers()):
        if tensor.is_meta:
            raise ModelFileError(f"{component.path}: {name} was not filled from the file: report this as a bug")
    return module


def _fill_module(module: torch.nn.Module, component, device: torch.device, dtype: torch.dtype,
                 keep_fp32: tuple[str, ...] = ()) -> torch.nn.Module:
    """Load every parameter and buffer of a meta-device module from `component`, one tensor at a time."""
    expected = dict(module.state_dict(keep_vars=True))
    missing = [key for key in expected if key not in component.keys]
    if missing:
        raise ModelFileError(
            f"{component.path} is missing {len(missing)} {component.kind} tensors (e.g. {missing[0]}): "
            f"the file is incomplete or not an ERNIE-Image {component.kind}"
        )
    loaded: dict[str, torch.Tensor] = {}
    for key, target in expected.items():
        tensor = component.tensor(key)
        _refuse_another_shape(component, key, tensor, target)
        if not tensor.is_floating_point():
            want = tensor.dtype
        else:
            want = torch.float32 if any(key.endswith(k) for k in keep_fp32) else dtype
        loaded[key] = tensor.to(device=device, dtype=want)
        if loaded[key].data_ptr() != tensor.data_ptr() and hasattr(component, "release"):
            component.release(key)  # a converted copy exists: the mapped file pages need not stay in RAM
    module.load_state_dict(loaded, strict=True, assign=True)
    return module.eval().requires_grad_(False)


def _build_quantized(module: torch.nn.Module, component, device: torch.device, dtype: torch.dtype,
                     quant: str, quant_device: torch.device) -> torch.nn.Module:
    """Fill a meta module whose Linears take packed weights: from a quantised file (GGUF, comfy_quant FP8/NVFP4)
    and/or by quantising bf16 weights on load (`quant` in QUANT_ON_LOAD_FORMATS), one tensor at a time."""
    from ..quant.linear import quantize_linears
    from ..quant.qweight import QuantizedWeight
    from ..quant.writer import quantize_weight, should_quantize

    linear_weights = {f"{name}.weight" for name, child in module.named_modules() if isinstance(child, torch.nn.Linear)}
    expected = module.state_dict(keep_vars=True)
    state: dict[str, object] = {}
    for key in expected:
        if key not in component.keys:
            raise ModelFileError(f"{component.path} has no tensor {key!r}: the file is not a complete ERNIE-Image "
                                 f"{component.kind}")
        value = component.tensor(key)
        _refuse_another_shape(component, key, value, expected[key])  # a packed weight by the shape it unpacks to
        if isinstance(value, QuantizedWeight) and key not in linear_weights:
            value = value.dequantize(dtype, key)  # e.g. a quantised embedding table: used by lookup, not matmul
        elif (quant in QUANT_ON_LOAD_FORMATS and key in linear_weights and isinstance(value, torch.Tensor)
              and should_quantize(key, value, quant)):
            packed = quantize_weight(value.to(quant_device, dtype), quant)
            value = _moved(packed, device)
        state[key] = value
    replaced = quantize_linears(module, state, dtype)
    for name in replaced:
        module.get_submodule(name).to(device)
    plain = {}
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            raise ModelFileError(f"{component.path}: {key} is quantised but is not a Linear weight here")
        plain[key] = value.to(device=device, dtype=dtype if value.is_floating_point() else value.dtype)
    module.load_state_dict(plain, strict=False, assign=True)
    return module.eval().requires_grad_(False)


def _refuse_another_shape(component, key: str, tensor, target: torch.Tensor) -> None:
    """`tensor`: a torch.Tensor, or a QuantizedWeight (its `shape` is the one it unpacks to)."""
    if tuple(tensor.shape) != tuple(target.shape):
        raise ModelFileError(
            f"{component.path}: tensor {key} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}: "
            f"the file does not match the ERNIE-Image {component.kind} configuration; re-download it, or write it "
            "again from sound weights"
        )


def _moved(packed, device: torch.device):
    import dataclasses

    fields = ("data", "scale", "scale_2", "input_scale")
    return dataclasses.replace(packed, **{name: getattr(packed, name).to(device) for name in fields
                                          if getattr(packed, name) is not None})
