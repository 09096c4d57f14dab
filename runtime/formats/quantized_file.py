"""`load_quantized_state_dict`: one entry point for a quantised (or plain) ERNIE-Image DiT file, GGUF or
safetensors, into packed QuantizedWeights (quant/) or plain tensors."""
from __future__ import annotations

from pathlib import Path

import torch

from ..core.errors import ModelFileError
from ..files.file_kind import not_there
from ..quant.gguf_files import DIT_MARKER_KEYS, load_dit_gguf, strip_dit_prefix
from ..quant.qweight import QuantizedWeight
from ..quant.safetensors_files import load_quantized_safetensors
from .safetensors_reader import is_gguf


def load_quantized_state_dict(path: str | Path, component: str = "dit"
                              ) -> dict[str, torch.Tensor | QuantizedWeight]:
    """A DiT weight file (GGUF, comfy_quant / scaled-fp8 / ModelOpt safetensors, or plain safetensors) ->
    {diffusers DiT key: plain tensor | QuantizedWeight}. `component="any"` skips the ERNIE key check."""
    path = Path(path)
    if not path.exists():
        raise ModelFileError(f"weight file {path} {not_there(path)}")
    if not path.is_file():
        raise ModelFileError(f"weight file {path} is not a file: give the quantised .safetensors or .gguf file")
    if is_gguf(path):
        return load_dit_gguf(path, require_dit=component == "dit")
    state = {strip_dit_prefix(key): value for key, value in load_quantized_safetensors(path).items()}
    if component == "dit":
        missing = [k for k in DIT_MARKER_KEYS if k not in state]
        if missing:
            raise ModelFileError(f"{path.name} is not an ERNIE-Image DiT (missing {missing}; first keys: "
                                 f"{sorted(state)[:4]}): pick an ERNIE-Image diffusion-model file")
    return state
