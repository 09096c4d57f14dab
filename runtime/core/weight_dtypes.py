"""Weights in a type this model's weights never have are refused in one line naming the file, the type, the first
tensors and the fix, when the files are read.

A model's weights are floating point: integers or bool where a weight, norm, bias or scale belongs mean a damaged
file or another model's, and loading it would otherwise fail deep inside PyTorch (a traceback of one line per tensor)
or turn the integers into floats without a word. Float64 is floating point: it is cast to the run's dtype, as
diffusers casts it. Packed files hold their packed data in their format's own types (GGUF blocks and NVFP4 pairs in
uint8, FP8 in float8) beside floating-point scales; each reader says which (quant/), and the parts built from the
files say which of their tensors are floating point (model/dtype_fit.py).
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Iterable, Mapping, Union

import torch

from .errors import ModelFileError

FLOATING = "weights are floating point"
DAMAGED_OR_OTHER = "the file is damaged or not this model's; re-download it"
SHOWN_KEYS = 3


def dtype_name(dtype: torch.dtype) -> str:
    """"int16", "bool", "float8_e4m3fn": a dtype as a message names it."""
    return str(dtype).removeprefix("torch.")


def _shown_keys(keys: Iterable[str]) -> str:
    """The first few names, the first layer's before later layers' ones, and how many there are in all."""
    keys = sorted(keys, key=lambda key: (bool(re.search(r"\.([1-9]\d*)\.", key)), key))
    shown = ", ".join(keys[:SHOWN_KEYS])
    return shown + (f" ({len(keys)} tensors in all)" if len(keys) > SHOWN_KEYS else "")


def wrong_dtypes(file: Union[str, Path], found: Mapping[str, torch.dtype], where: str = FLOATING) -> ModelFileError:
    """The one-line refusal of `file`, whose tensors `found` (name -> dtype) are in types `where` says they are not
    ("weights are floating point", "FP8 weights are float8_e4m3fn or float8_e5m2")."""
    dtypes = " and ".join(sorted({dtype_name(dtype) for dtype in found.values()}))
    return ModelFileError(f"{file} holds {dtypes} tensors ({_shown_keys(found)}) where {where}: {DAMAGED_OR_OTHER}")


def refuse_non_floating(tensors: Mapping[str, object], file: Union[str, Path]) -> None:
    """Refuse `file` (wrong_dtypes) where any of `tensors` that is a torch tensor is not floating point."""
    found = {name: tensor.dtype for name, tensor in tensors.items()
             if isinstance(tensor, torch.Tensor) and not tensor.is_floating_point()}
    if found:
        raise wrong_dtypes(file, found)
