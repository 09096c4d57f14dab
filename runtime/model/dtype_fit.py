"""The dtypes a part's file holds against the tensors its config builds: where the part's tensor is floating point
(every weight, norm, bias and scale; not a counter such as BatchNorm's num_batches_tracked), the file's must be too.

Run at load on the part built on the meta device (beside tensor_fit.py's names and shapes), and again by fill.py
before any tensor is copied, so no path builds a part from integer or bool weights: one line (core/weight_dtypes.py)
names the file holding them, instead of PyTorch's refusal per tensor. Only dtypes are read: the tensors are views of
the mapped file. A packed weight (GGUF, FP8, NVFP4) is its reader's to check: its data's type is its format's, and
its reader refuses what the format does not hold.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable

import torch

from ..core.weight_dtypes import wrong_dtypes


def floating_tensors(module: torch.nn.Module) -> set[str]:
    """The names of a module's tensors (parameters and persistent buffers) that are floating point."""
    return {key for key, tensor in module.state_dict().items() if tensor.is_floating_point()}


def check_built_dtypes(component, floating: Iterable[str]) -> None:
    """Refuse, in one line naming the file, a part whose file holds a non-floating tensor where the part's tensor
    (one of `floating`) is floating point. Tensors the file lacks are tensor_fit's to name."""
    found: dict[Path, dict[str, torch.dtype]] = {}
    keys = set(component.keys)
    for key in floating:
        if key not in keys:
            continue
        entry = component.tensor(key)
        if isinstance(entry, torch.Tensor) and not entry.is_floating_point():
            file, name = _stored_as(component, key)
            found.setdefault(Path(file), {})[name] = entry.dtype
    if found:
        file = min(found)
        raise wrong_dtypes(file, found[file])



def _stored_as(component, key: str) -> tuple[Path, str]:
    """The file holding `key` and its name there (formats' ComponentFile.stored_as; the part's path for others)."""
    stored_as = getattr(component, "stored_as", None)
    return stored_as(key) if stored_as is not None else (component.path, key)
