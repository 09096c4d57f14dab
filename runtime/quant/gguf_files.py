"""Read GGUF files: the ERNIE DiT in the unsloth layout and a Ministral-3B text encoder.

Tensors stay memory-mapped: the uint8 / float views come straight from `gguf.GGUFReader`'s np.memmap,
so opening an 8 GB file costs page-cache, not a copy. GGUF lists dims fastest-first (a [out, in] Linear
weight appears as [in, out] in the header); the logical torch shape is that list reversed.
"""
from __future__ import annotations

import re
import warnings
from pathlib import Path

import numpy as np
import torch

from ..core.errors import ModelFileError, one_line
from ..files.cut_files import REDOWNLOAD
from .gguf_blocks import BLOCK_GEOMETRY, FLOAT_TYPES
from .gguf_layout import check_whole_gguf
from .qweight import QuantizedWeight

DIT_PREFIXES = ("model.diffusion_model.", "diffusion_model.", "transformer.")
DIT_MARKER_KEYS = ("layers.0.self_attention.norm_k.weight", "final_linear.weight")
PACK_FIELD_PREFIX = "ernie_image."


def _open_reader(path: Path):
    import gguf
    try:
        check_whole_gguf(path)  # an empty or cut file named as such, before gguf's reader trips over it
        return gguf.GGUFReader(str(path), "r")
    except (ValueError, OSError, KeyError, IndexError) as err:
        raise ModelFileError(f"{path.name} is not a readable GGUF file ({one_line(err)}): {REDOWNLOAD}") from None


def _field_str(reader, key: str) -> str | None:
    field = reader.fields.get(key)
    if field is None:
        return None
    try:
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    except (IndexError, UnicodeDecodeError):
        return None


def pack_fields(path: str | Path) -> dict[str, str]:
    """The `ernie_image.*` string fields this pack writes into a GGUF header (the DiT's variant, its component)."""
    reader = _open_reader(Path(path))
    fields = {key: _field_str(reader, key) for key in reader.fields if key.startswith(PACK_FIELD_PREFIX)}
    return {key: value for key, value in fields.items() if value is not None}


def _field_int(reader, key: str) -> int | None:
    field = reader.fields.get(key)
    if field is None:
        return None
    return int(field.parts[field.data[0]][0])


def _as_torch(array: np.ndarray) -> torch.Tensor:
    with warnings.catch_warnings():  # the memmap is read-only; nothing here writes to it
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(array)


# Plain arrays gguf reads in their own numpy dtype, besides FLOAT_TYPES: float64 is cast to the run's dtype on load, as
# diffusers casts it; integers are refused where the part's tensor is floating point (model/dtype_fit.py), naming
# the file, rather than here as a block type this pack cannot dequantise.
PLAIN_TYPES = ("F64", "I8", "I16", "I32", "I64")


def _tensor_entry(reader_tensor, name: str) -> torch.Tensor | QuantizedWeight:
    qtype = reader_tensor.tensor_type.name
    shape = tuple(int(d) for d in reversed(reader_tensor.shape.tolist()))
    if qtype in FLOAT_TYPES or qtype in PLAIN_TYPES:
        data = _as_torch(reader_tensor.data)
        if qtype == "BF16":  # gguf-py exposes BF16 as raw bytes
            data = data.view(torch.bfloat16)
        return data.reshape(shape)
    if qtype not in BLOCK_GEOMETRY:
        raise ModelFileError(
            f"GGUF tensor {name!r} uses block type {qtype}, which this pack cannot dequantise; "
            f"supported: {', '.join(sorted(BLOCK_GEOMETRY))}, F32/F16/BF16 (use another quantisation)")
    block_size, type_size = BLOCK_GEOMETRY[qtype]
    if shape[-1] % block_size:
        raise ModelFileError(f"GGUF tensor {name!r}: last dim {shape[-1]} is not a multiple of {qtype}'s "
                             f"block of {block_size}; the file is corrupt")
    rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    data = _as_torch(reader_tensor.data).reshape(rows, shape[-1] // block_size * type_size)
    return QuantizedWeight("gguf", qtype, data, shape)


def strip_dit_prefix(name: str) -> str:
    """`model.diffusion_model.layers.0...` (ComfyUI), `transformer.layers.0...` -> `layers.0...`."""
    for prefix in DIT_PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix):]
    return name


def load_dit_gguf(path: str | Path, require_dit: bool = True) -> dict[str, torch.Tensor | QuantizedWeight]:
    """An ERNIE-Image DiT GGUF -> {diffusers key: tensor | QuantizedWeight}.

    The header's `general.architecture` is ignored (unsloth's files say `wan`): ERNIE is recognised by
    its keys (`require_dit=False` skips that check). 1-D and float tensors come back as plain tensors
    (mmap-backed, in the file's dtype).
    """
    path = Path(path)
    reader = _open_reader(path)
    state: dict[str, torch.Tensor | QuantizedWeight] = {}
    for tensor in reader.tensors:
        name = strip_dit_prefix(tensor.name)
        entry = _tensor_entry(tensor, name)
        orig_shape = _orig_shape(reader, tensor.name)
        if orig_shape is not None and isinstance(entry, torch.Tensor):
            entry = entry.reshape(orig_shape)
        state[name] = entry
    missing = [k for k in DIT_MARKER_KEYS if k not in state]
    if missing and require_dit:
        arch = _field_str(reader, "general.architecture")
        raise ModelFileError(
            f"{path.name} is not an ERNIE-Image DiT GGUF (header says {arch!r}; missing {missing}; first keys: "
            f"{sorted(state)[:4]}): pick an ERNIE-Image DiT file such as unsloth's ernie-image-*.gguf")
    return state


def _orig_shape(reader, name: str) -> tuple[int, ...] | None:
    """ComfyUI-GGUF stores the true shape of reshaped tensors (e.g. conv kernels) under this key."""
    field = reader.fields.get(f"comfy.gguf.orig_shape.{name}")
    if field is None:
        return None
    return tuple(int(field.parts[i][0]) for i in field.data)


# ---- text encoder (llama.cpp names) -------------------------------------------------------------

_TE_LAYER_MAP = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TE_TOP_MAP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAME = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


def llama_permute(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """What llama.cpp's converter (LlamaModel.permute) applies to HF q/k rows: split-half -> interleaved."""
    rows = weight.shape[0]
    return weight.reshape(n_head, 2, rows // n_head // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def llama_unpermute(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of `llama_permute`: GGUF (interleaved) q/k rows -> Hugging Face rotate-half order.

    Works on packed GGUF rows too (whole rows move; the blocks run along the input dim).
    """
    rows = weight.shape[0]
    return weight.reshape(n_head, rows // n_head // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _unpermute_entry(entry: torch.Tensor | QuantizedWeight, n_head: int) -> torch.Tensor | QuantizedWeight:
    if isinstance(entry, QuantizedWeight):
        return QuantizedWeight(entry.format, entry.qtype, llama_unpermute(entry.data, n_head).contiguous(),
                               entry.shape, dtype=entry.dtype)
    return llama_unpermute(entry, n_head).contiguous()


def load_text_encoder_gguf(path: str | Path) -> dict[str, torch.Tensor | QuantizedWeight]:
    """A Ministral-3B (llama / mistral3 arch) GGUF -> Hugging Face text-model keys (`model.layers.N...`).

    llama.cpp's converter permutes q_proj/k_proj rows for its interleaved RoPE (LlamaModel and its
    Ministral3 subclass have `undo_permute = True`); this undoes it using the header's head counts. The
    q/k weights come back as contiguous copies (the rest stays memory-mapped).
    """
    path = Path(path)
    reader = _open_reader(path)
    arch = _field_str(reader, "general.architecture") or ""
    n_head = _field_int(reader, f"{arch}.attention.head_count")
    n_kv = _field_int(reader, f"{arch}.attention.head_count_kv") or n_head
    if arch not in ("llama", "mistral3", "mistral") or n_head is None:
        raise ModelFileError(
            f"{path.name} is not a Ministral/llama text-encoder GGUF (architecture {arch!r}, head_count "
            f"{n_head}): pick the Ministral-3-3B text-encoder GGUF")
    state: dict[str, torch.Tensor | QuantizedWeight] = {}
    for tensor in reader.tensors:
        match = _BLOCK_NAME.match(tensor.name)
        if tensor.name in _TE_TOP_MAP:
            name = _TE_TOP_MAP[tensor.name]
        elif match and match.group(2) in _TE_LAYER_MAP:
            name = f"model.layers.{match.group(1)}.{_TE_LAYER_MAP[match.group(2)]}.{match.group(3)}"
        else:
            continue  # rope_freqs and other llama.cpp-only tensors
        entry = _tensor_entry(tensor, name)
        if match and match.group(2) == "attn_q":
            entry = _unpermute_entry(entry, n_head)
        elif match and match.group(2) == "attn_k":
            entry = _unpermute_entry(entry, n_kv)
        state[name] = entry
    if "model.layers.0.self_attn.q_proj.weight" not in state:
        raise ModelFileError(f"{path.name} has no blk.0.attn_q.weight: not a llama-style text encoder GGUF")
    return state
