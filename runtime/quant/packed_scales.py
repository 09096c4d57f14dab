"""Every packed layer's scales held against its weight when a quantised safetensors file is read: each scale the
layer's format needs is there, in the shape the weight needs, and holds values quantising a weight can make.

A scale in another shape would only fail inside the first matmul that reads it (a traceback in the middle of
sampling), and a missing, zero or non-finite one would run without a word and make a picture of noise, black or NaN.
Each is refused in one line naming the file, the tensor as the file names it, what is wrong and the fix, after the
tensors' types are checked (safetensors_files.py) and before any layer is built. Scales are small beside their
weights (NVFP4's block scales are a sixteenth of its packed pairs), so every value is read.

What each layer needs, by its format:
  FP8    a weight scale (`weight_scale`; legacy scaled-fp8 files: `scale_weight`): one value or one per output row.
         Required where the file's comfy_quant metadata declares the layer (ComfyUI's float8 layouts carry one), or
         where the file's other FP8 layers carry theirs; ComfyUI's unscaled fp8 files have none at all.
  NVFP4  block scales `weight_scale` (e4m3, one per 16 values: [roundup(N,128), roundup(K/16,4)] in the blocked
         layout comfy_quant files hold, [N, K/16] in ModelOpt's) and the per-tensor `weight_scale_2`.
  both   an optional activation scale (`input_scale`; legacy: `scale_input`): one value.
Values: finite and never negative; a single scale is never 0, and a row or block scale may be 0 (a row or block of
zeros) but never all of them.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from ..core.errors import ModelFileError
from .nvfp4 import BLOCK

DAMAGED = "the file is damaged: quantise it again, or download it again"
VALUES = "which quantising a weight never makes (scales are finite, never negative, never all 0)"
FP8_FORMATS = ("float8_e4m3fn", "float8_e5m2")
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
Shape = tuple[int, ...]
_CHUNK = 1 << 24  # block-scale bytes checked at once


def refuse_damaged_scales(raw: dict[str, torch.Tensor], formats: dict[str, str], legacy_fp8: bool,
                          path: Path) -> None:
    """Refuse `path` (one ModelFileError line) where a packed layer's scale is missing, in another shape than its
    weight needs, or holds a value no quantiser makes. `raw`: the file's tensors under its own names, their types
    already checked; `formats`: the comfy_quant formats the file declares per layer."""
    fp8, nvfp4 = _packed_layers(raw, formats)
    weight_scales = {layer: _fp8_weight_scale(layer, raw, legacy_fp8) for layer in fp8}
    others_scaled = any(key in raw for key in weight_scales.values())
    for layer in fp8:
        _check_fp8(path, raw, layer, weight_scales[layer], formats.get(layer), others_scaled)
    for layer in nvfp4:
        _check_nvfp4(path, raw, layer, blocked=layer in formats)


def _packed_layers(raw: dict[str, torch.Tensor], formats: dict[str, str]) -> tuple[list[str], list[str]]:
    """The file's FP8 and NVFP4 layers (names without `.weight`), as the reader takes them packed: declared by the
    file's comfy_quant metadata, else recognised by their tensors (2-D float8; uint8 with both NVFP4 scales)."""
    fp8: list[str] = []
    nvfp4: list[str] = []
    for key, weight in raw.items():
        if not key.endswith(".weight") or weight.dim() != 2:
            continue
        layer = key[: -len(".weight")]
        fmt = formats.get(layer)
        if fmt in FP8_FORMATS or (fmt is None and weight.dtype in FP8_DTYPES):
            fp8.append(layer)
        elif fmt == "nvfp4" or (fmt is None and weight.dtype == torch.uint8 and f"{layer}.weight_scale" in raw
                                and f"{layer}.weight_scale_2" in raw):
            nvfp4.append(layer)
    return fp8, nvfp4


def _fp8_weight_scale(layer: str, raw: dict[str, torch.Tensor], legacy_fp8: bool) -> str:
    """The key the reader takes an FP8 layer's weight scale from (safetensors_files.py); where it has none, the key
    the file's layout names it by (legacy scaled-fp8 files: `scale_weight`)."""
    if legacy_fp8 and (f"{layer}.scale_weight" in raw or f"{layer}.weight_scale" not in raw):
        return f"{layer}.scale_weight"
    return f"{layer}.weight_scale"


def _check_fp8(path: Path, raw: dict[str, torch.Tensor], layer: str, scale_key: str, declared: str | None,
               others_scaled: bool) -> None:
    weight = raw[f"{layer}.weight"]
    rows = weight.shape[0]
    what = f"the {declared or 'FP8'} layer {layer} (weight {list(weight.shape)})"
    if scale_key in raw:
        _check_shape(path, scale_key, raw[scale_key], what, f"one scale ([]) or one per output row ([{rows}])",
                     lambda shape: _one_value(shape) or shape in ((rows,), (rows, 1)))
        _check_values(path, scale_key, raw[scale_key].to(torch.float32))
    elif declared is not None or others_scaled:
        why = "" if declared is not None else " (the file's other FP8 layers have theirs)"
        raise _missing(path, scale_key, f"the weight scale of its {declared or 'FP8'} layer {layer}{why}")
    _check_input_scales(path, raw, layer, what)


def _check_nvfp4(path: Path, raw: dict[str, torch.Tensor], layer: str, blocked: bool) -> None:
    weight = raw[f"{layer}.weight"]
    rows, width = weight.shape[0], weight.shape[1] * 2
    what = f"the NVFP4 layer {layer} (weight {list(weight.shape)}, {width} values a row)"
    if width % BLOCK:
        raise ModelFileError(f"{path}: {layer}.weight packs rows of {width} values, but NVFP4 packs whole blocks "
                             f"of {BLOCK}: {DAMAGED}")
    blocks = width // BLOCK
    need = (_roundup(rows, 128), _roundup(blocks, 4)) if blocked else (rows, blocks)
    for suffix, named in ((".weight_scale", "block scales"), (".weight_scale_2", "per-tensor scale")):
        if f"{layer}{suffix}" not in raw:
            raise _missing(path, f"{layer}{suffix}", f"the {named} of its NVFP4 layer {layer}")
    block_key, tensor_key = f"{layer}.weight_scale", f"{layer}.weight_scale_2"
    _check_shape(path, block_key, raw[block_key], what, f"block scales of shape {list(need)}",
                 lambda shape: shape == need)
    _check_block_values(path, block_key, raw[block_key])
    _check_shape(path, tensor_key, raw[tensor_key], what, "one scale ([])", _one_value)
    _check_values(path, tensor_key, raw[tensor_key].to(torch.float32))
    _check_input_scales(path, raw, layer, what)


def _check_input_scales(path: Path, raw: dict[str, torch.Tensor], layer: str, what: str) -> None:
    for key in (f"{layer}.input_scale", f"{layer}.scale_input"):
        if key in raw:
            _check_shape(path, key, raw[key], what, "one activation scale ([])", _one_value)
            _check_values(path, key, raw[key].to(torch.float32))


def _one_value(shape: Shape) -> bool:
    """A single scale, as writers store it: [], [1] or [1, 1]."""
    return all(size == 1 for size in shape)


def _check_shape(path: Path, key: str, scale: torch.Tensor, what: str, needs: str,
                 fits: Callable[[Shape], bool]) -> None:
    shape = tuple(scale.shape)
    if not fits(shape):
        raise ModelFileError(f"{path}: {key} has shape {list(shape)}, but {what} takes {needs}: {DAMAGED}")


def _check_values(path: Path, key: str, values: torch.Tensor) -> None:
    """A float32 scale's values: finite, never negative, not all 0."""
    bad = ~torch.isfinite(values) | (values < 0)
    if bool(bad.any()):
        raise ModelFileError(f"{path}: {key} holds {float(values[bad][0]):g}, {VALUES}: {DAMAGED}")
    if not bool(values.any()):
        raise ModelFileError(f"{path}: {key} is 0{'' if values.numel() == 1 else ' throughout'}, {VALUES}: {DAMAGED}")


def _check_block_values(path: Path, key: str, scales: torch.Tensor) -> None:
    """NVFP4's e4m3 block scales, read as their bytes (the fastest pass over the largest scales): NaN is 0x7F and
    0xFF (e4m3fn has no infinity), a set sign bit on anything but 0 is negative, and 0 bytes are blocks of zeros
    (and the blocked layout's padding), which may be many but never all."""
    data = (scales.view(torch.uint8) if scales.dtype != torch.uint8 else scales).reshape(-1)
    some_nonzero = False
    for start in range(0, data.numel(), _CHUNK):  # a chunk at a time: the temporaries stay small beside the file
        chunk = data[start:start + _CHUNK]
        bad = ((chunk & 0x7F) == 0x7F) | (chunk > 0x80)
        if bool(bad.any()):
            value = float(chunk[bad][:1].view(torch.float8_e4m3fn).float())
            raise ModelFileError(f"{path}: {key} holds {value:g}, {VALUES}: {DAMAGED}")
        some_nonzero = some_nonzero or bool((chunk & 0x7F).any())
    if not some_nonzero:
        raise ModelFileError(f"{path}: {key} is 0 throughout, {VALUES}: {DAMAGED}")


def _missing(path: Path, key: str, what: str) -> ModelFileError:
    return ModelFileError(f"{path} lacks {key}, {what}: {DAMAGED}")


def _roundup(n: int, m: int) -> int:
    return (n + m - 1) // m * m
