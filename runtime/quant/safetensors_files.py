"""Read quantised safetensors files into {key: tensor | QuantizedWeight}.

Recognised per layer (a layer = a `<name>.weight` key), by tensors and metadata, never by file name:
  * ComfyUI comfy_quant: `<name>.comfy_quant` (JSON as uint8) or the file metadata
    `_quantization_metadata` = {"layers": {name: {"format": ...}}}; formats float8_e4m3fn, float8_e5m2,
    nvfp4 (packed hi-first, blocked e4m3 `weight_scale`, fp32 `weight_scale_2`).
  * ComfyUI legacy scaled fp8: root key `scaled_fp8`, fp8 `weight` + `<name>.scale_weight`.
  * ModelOpt / diffusers-BFL: uint8 `weight` + e4m3 `weight_scale` [N, K/16] + `weight_scale_2` (NVFP4),
    or fp8 `weight` + fp32 `weight_scale` (per tensor or per row).
  * Plain fp8 weights without a scale (ComfyUI's unscaled fp8 files).
Everything else comes back as plain tensors. A packed layer's tensors in another type than its format holds (an
integer weight, scale or comfy_quant entry, an FP8 weight in the other float8 type than the file declares) are
refused in one line naming the file before any is read as packed; so are scales missing, in another shape than
their weight needs, or holding values no quantiser makes (packed_scales.py).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ..core.errors import ModelFileError, one_line
from ..core.json_text import JSON_ERRORS, json_fault, load_json
from ..core.weight_dtypes import dtype_name, wrong_dtypes
from .nvfp4 import from_modelopt
from .packed_scales import refuse_damaged_scales
from .qweight import QuantizedWeight

_FP8_DTYPES = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}
_AUX_SUFFIXES = (".comfy_quant", ".weight_scale", ".weight_scale_2", ".input_scale", ".scale_weight",
                 ".scale_input")


def read_safetensors_file(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """({key: tensor} in the file's dtypes, metadata); an unreadable file is a one-line ModelFileError."""
    from safetensors import SafetensorError, safe_open
    try:
        with safe_open(str(path), framework="pt") as handle:
            return {k: handle.get_tensor(k) for k in handle.keys()}, dict(handle.metadata() or {})
    except (SafetensorError, OSError) as err:
        raise ModelFileError(f"{path.name} is not a readable safetensors file ({one_line(err)}): the file is damaged "
                             f"or was not fully downloaded: re-download it") from None


def _layer_formats(raw: dict[str, torch.Tensor], metadata: dict[str, str], path: Path) -> dict[str, str]:
    formats: dict[str, str] = {}
    if "_quantization_metadata" in metadata:
        try:
            layers = load_json(metadata["_quantization_metadata"]).get("layers", {})
            formats.update({name: conf["format"] for name, conf in layers.items()})
        except JSON_ERRORS as err:
            raise ModelFileError(f"{path.name}: unreadable _quantization_metadata ({json_fault(err)}); re-export the "
                                 "file") from None
        except (KeyError, TypeError, AttributeError) as err:
            raise ModelFileError(f"{path.name}: unreadable _quantization_metadata ({err}); re-export the file") from err
    for key, tensor in raw.items():
        if key.endswith(".comfy_quant"):
            try:
                formats[key[: -len(".comfy_quant")]] = json.loads(bytes(tensor.tolist()).decode("utf-8"))["format"]
            except (ValueError, KeyError, TypeError) as err:
                raise ModelFileError(f"{path.name}: unreadable {key} ({err}); re-export the file") from err
    return formats


def _comfy_weight(layer: str, fmt: str, raw: dict[str, torch.Tensor], path: Path) -> QuantizedWeight:
    weight = raw[f"{layer}.weight"]
    input_scale = raw.get(f"{layer}.input_scale")
    if fmt in ("float8_e4m3fn", "float8_e5m2"):
        return QuantizedWeight("fp8", _FP8_DTYPES[weight.dtype], weight, tuple(weight.shape),
                               scale=_in_float32(raw.get(f"{layer}.weight_scale")),
                               input_scale=_in_float32(input_scale))
    if fmt == "nvfp4":
        scale, scale_2 = raw[f"{layer}.weight_scale"], raw[f"{layer}.weight_scale_2"]  # there: packed_scales.py
        shape = (weight.shape[0], weight.shape[1] * 2)
        return QuantizedWeight("nvfp4", "nvfp4", weight, shape, scale=scale.view(torch.float8_e4m3fn),
                               scale_2=_in_float32(scale_2), input_scale=_in_float32(input_scale))
    raise ModelFileError(f"{path.name}: layer {layer} uses comfy_quant format {fmt!r}, which this pack does not "
                         f"load (supported: float8_e4m3fn, float8_e5m2, nvfp4); use an fp8/nvfp4/GGUF file")


def _in_float32(scale: torch.Tensor | None) -> torch.Tensor | None:
    """A scale as the GEMMs take it, whatever float type the file stores it in."""
    return None if scale is None else scale.to(torch.float32)


def _detect_weight(layer: str, raw: dict[str, torch.Tensor], legacy_fp8: bool) -> QuantizedWeight | None:
    weight = raw[f"{layer}.weight"]
    if weight.dim() != 2:
        return None
    if weight.dtype in _FP8_DTYPES:
        scale = raw.get(f"{layer}.scale_weight") if legacy_fp8 else None
        if scale is None:
            scale = raw.get(f"{layer}.weight_scale")
        return QuantizedWeight("fp8", _FP8_DTYPES[weight.dtype], weight, tuple(weight.shape),
                               scale=_in_float32(scale),
                               input_scale=_in_float32(raw.get(f"{layer}.input_scale", raw.get(f"{layer}.scale_input"))))
    if weight.dtype == torch.uint8 and f"{layer}.weight_scale_2" in raw and f"{layer}.weight_scale" in raw:
        data, blocked = from_modelopt(weight, raw[f"{layer}.weight_scale"])
        return QuantizedWeight("nvfp4", "nvfp4", data, (weight.shape[0], weight.shape[1] * 2), scale=blocked,
                               scale_2=_in_float32(raw[f"{layer}.weight_scale_2"]),
                               input_scale=_in_float32(raw.get(f"{layer}.input_scale")))
    return None


# What each packed layer's tensors may be, as a refusal says it (core/weight_dtypes.py), checked in this order.
COMFY_QUANT = "comfy_quant entries are uint8 (JSON text)"
FP8_WEIGHTS = "FP8 weights are float8_e4m3fn or float8_e5m2"
NVFP4_WEIGHTS = "NVFP4 weights are uint8 (packed pairs)"
NVFP4_BLOCK_SCALES = "NVFP4 block scales are float8_e4m3fn"
SCALES = "scales are floating point"
DECLARED = "the file's comfy_quant metadata says {}"  # an FP8 weight in the other float8 type
_NVFP4_BLOCK_SCALE_DTYPES = (torch.float8_e4m3fn, torch.uint8)  # uint8: the same bytes, viewed as e4m3
_SCALE_SUFFIXES = (".weight_scale", ".weight_scale_2", ".input_scale", ".scale_weight", ".scale_input")

WrongDtypes = dict[str, dict[str, torch.dtype]]  # what they should be (a phrase above) -> {tensor: its dtype}


def _is_nvfp4(layer: str, raw: dict[str, torch.Tensor], formats: dict[str, str]) -> bool:
    """The layer is NVFP4: so its file says (comfy_quant), or its tensors do (ModelOpt: uint8 weight, two scales)."""
    if layer in formats:
        return formats[layer] == "nvfp4"
    weight = raw.get(f"{layer}.weight")
    return weight is not None and weight.dtype == torch.uint8 and f"{layer}.weight_scale_2" in raw


def _comfy_quant_dtypes(raw: dict[str, torch.Tensor]) -> WrongDtypes:
    """comfy_quant entries in another type than uint8: read before any layer's format is."""
    wrong = {key: tensor.dtype for key, tensor in raw.items()
             if key.endswith(".comfy_quant") and tensor.dtype != torch.uint8}
    return {COMFY_QUANT: wrong} if wrong else {}


def _packed_dtypes(raw: dict[str, torch.Tensor], formats: dict[str, str]) -> WrongDtypes:
    """Each packed layer's tensors in another type than its format holds: the packed weight in float8 (FP8) or uint8
    (NVFP4), NVFP4's block scales in float8_e4m3fn, every other scale in floating point. Tensors beside the packed
    layers (norms, biases, unpacked weights) are the part's to check against its own (model/dtype_fit.py)."""
    wrong: WrongDtypes = {}
    for layer, fmt in formats.items():
        weight = raw.get(f"{layer}.weight")
        if weight is None:
            continue
        if fmt in ("float8_e4m3fn", "float8_e5m2") and weight.dtype not in _FP8_DTYPES:
            wrong.setdefault(FP8_WEIGHTS, {})[f"{layer}.weight"] = weight.dtype
        elif fmt in ("float8_e4m3fn", "float8_e5m2") and dtype_name(weight.dtype) != fmt:
            wrong.setdefault(DECLARED.format(fmt), {})[f"{layer}.weight"] = weight.dtype
        elif fmt == "nvfp4" and weight.dtype != torch.uint8:
            wrong.setdefault(NVFP4_WEIGHTS, {})[f"{layer}.weight"] = weight.dtype
    for key, tensor in raw.items():
        suffix = next((suffix for suffix in _SCALE_SUFFIXES if key.endswith(suffix)), None)
        if suffix is None:
            continue
        if suffix == ".weight_scale" and _is_nvfp4(key[: -len(suffix)], raw, formats):
            if tensor.dtype not in _NVFP4_BLOCK_SCALE_DTYPES:
                wrong.setdefault(NVFP4_BLOCK_SCALES, {})[key] = tensor.dtype
        elif not tensor.is_floating_point():
            wrong.setdefault(SCALES, {})[key] = tensor.dtype
    return wrong


def _refuse(wrong: WrongDtypes, path: Path) -> None:
    """One line for the first kind of tensor (in the order above, then FP8 weights against their declared types)
    held in a type its layout never holds."""
    for where in (COMFY_QUANT, FP8_WEIGHTS, NVFP4_WEIGHTS, NVFP4_BLOCK_SCALES, SCALES, *sorted(wrong)):
        if where in wrong:
            raise wrong_dtypes(path, wrong[where], where)


def load_quantized_safetensors(path: str | Path) -> dict[str, torch.Tensor | QuantizedWeight]:
    path = Path(path)
    raw, metadata = read_safetensors_file(path)
    _refuse(_comfy_quant_dtypes(raw), path)
    formats = _layer_formats(raw, metadata, path)
    _refuse(_packed_dtypes(raw, formats), path)
    legacy_fp8 = "scaled_fp8" in raw
    refuse_damaged_scales(raw, formats, legacy_fp8, path)
    state: dict[str, torch.Tensor | QuantizedWeight] = {}
    for key, tensor in raw.items():
        if key == "scaled_fp8" or key.endswith(_AUX_SUFFIXES):
            continue
        if not key.endswith(".weight"):
            state[key] = tensor
            continue
        layer = key[: -len(".weight")]
        if layer in formats:
            state[key] = _comfy_weight(layer, formats[layer], raw, path)
        else:
            state[key] = _detect_weight(layer, raw, legacy_fp8) or tensor
    return state
