"""NaN or infinite values are named by the part of the model that produced them, with where its weights are.

NaN spreads through every later part (NaN text embeddings make NaN latents, which decode to NaN pixels), so each
part's output is checked as it is made: the first part whose output is not finite is the one named, not the last.
"""
from __future__ import annotations

from typing import Callable, Iterable, Union

import torch

from .errors import ModelFileError

Tensors = Union[torch.Tensor, Iterable[torch.Tensor]]


def _count(values: Tensors) -> tuple[int, int]:
    """(non-finite, all) values in a tensor or tensors."""
    tensors = [values] if isinstance(values, torch.Tensor) else list(values)
    bad = sum(int((~torch.isfinite(tensor)).sum()) for tensor in tensors if tensor.is_floating_point())
    return bad, sum(tensor.numel() for tensor in tensors)


def refuse_non_finite(values: Tensors, part: str, weights: Union[object, Callable[[], object]],
                      what: str = "values") -> None:
    """A ModelFileError naming `part` ("text encoder", "DiT", "VAE decoder", ...) and its `weights` (a path, or a
    function giving it, asked only then) when `values` hold NaN or inf; nothing otherwise."""
    bad, total = _count(values)
    if not bad:
        return
    where = weights() if callable(weights) else weights
    raise ModelFileError(f"the {part} produced {bad} non-finite {what} (NaN/inf) of {total}: its weights in "
                         f"{where} are likely damaged or mis-quantised; re-download or re-quantise them from the "
                         "bf16 weights (in fp16, try bf16 or fp32)")


def refuse_non_finite_weights(state: dict, source: str, fix: str) -> None:
    """Weights read from `source` (named in the message) with NaN or inf in a tensor are refused, naming the first
    such tensor and `fix`: whatever is made from them gives black or noise images."""
    for name, tensor in state.items():
        if isinstance(tensor, torch.Tensor) and tensor.is_floating_point():
            bad, total = _count(tensor)
            if bad:
                raise ModelFileError(f"{source}: tensor {name} holds {bad} NaN/inf values of {total}: the weights are "
                                     f"damaged; {fix}")
