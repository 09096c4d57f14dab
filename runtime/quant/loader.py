"""`load_quantized_state_dict`: one entry point for a quantised (or plain) ERNIE-Image DiT file."""
from __future__ import annotations

from pathlib import Path

import torch

from ..errors import ModelFileError
from .gguf_files import DIT_MARKER_KEYS, DIT_PREFIXES, load_dit_gguf
from .qweight import QuantizedWeight
from .safetensors_files import load_quantized_safetensors

GGUF_MAGIC = b"GGUF"


def is_gguf(path: Path) -> bool:
    with open(path, "rb") as handle:
        return handle.read(4) == GGUF_MAGIC


def _strip_dit_prefix(state: dict[str, object]) -> dict[str, object]:
    for prefix in DIT_PREFIXES:
        if any(k.startswith(prefix) for k in state):
            return {(k[len(prefix):] if k.startswith(prefix) else k): v for k, v in state.items()}
    return state


def load_quantized_state_dict(path: str | Path, component: str = "dit"
                              ) -> dict[str, torch.Tensor | QuantizedWeight]:
    """A DiT weight file (GGUF, comfy_quant / scaled-fp8 / ModelOpt safetensors, or plain safetensors) ->
    {diffusers DiT key: plain tensor | QuantizedWeight}. `component="any"` skips the ERNIE key check."""
    path = Path(path)
    if not path.is_file():
        raise ModelFileError(f"weight file {path} does not exist: check the path")
    if is_gguf(path):
        return load_dit_gguf(path) if component == "dit" else _strip_dit_prefix(dict(_load_any_gguf(path)))
    state = _strip_dit_prefix(load_quantized_safetensors(path))
    if component == "dit":
        missing = [k for k in DIT_MARKER_KEYS if k not in state]
        if missing:
            raise ModelFileError(f"{path.name} is not an ERNIE-Image DiT (missing {missing}; first keys: "
                                 f"{sorted(state)[:4]}): pick an ERNIE-Image diffusion-model file")
    return state


def _load_any_gguf(path: Path) -> dict[str, torch.Tensor | QuantizedWeight]:
    from .gguf_files import _open_reader, _tensor_entry
    reader = _open_reader(path)
    return {t.name: _tensor_entry(t, t.name) for t in reader.tensors}
