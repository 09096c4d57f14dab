"""Quantise a bf16 DiT on load or once to a file (`ernie-image quantize`).

Which weights are quantised: every 2-D `*.weight` whose input dim fits the format's block, except the
ones in KEEP_HIGH_PRECISION (patch embedder and final projection: tiny, and closest to the pixels).
Files written:
  fp8, nvfp4  ComfyUI comfy_quant safetensors (per-layer `.comfy_quant` JSON tensors plus
              `_quantization_metadata`), so ComfyUI loads them natively and this pack reloads them.
              FP8 files carry a per-tensor scale, the form ComfyUI's float8_e4m3fn layout expects.
  q8_0, q4_k  GGUF in the unsloth layout (diffusers names, 1-D tensors F32, other unquantised tensors in the
              source's precision: F32, F16, or BF16 from bf16; header `general.architecture = "wan"` because that
              is the name ComfyUI-GGUF accepts for these files; this pack recognises ERNIE by its keys).
Unpacked matrices keep their dtype in every format: an fp32 DiT's are never rounded to bf16 without a word.
Both record the DiT's variant (`ernie_image.variant`: base or turbo) when it is known, since the two releases
share every key and shape and a file name can be changed (runtime/core/variant.py reads it first).
Files are written under a hidden partial name and renamed over `out` when complete (runtime/files/output_files.py), so a
failure or Ctrl-C leaves nothing behind, and an existing file is replaced only by a complete one (as `generate`
replaces its PNG). The source must be the bf16 (or fp16/fp32) DiT: an FP8/NVFP4 or GGUF file is refused, since
re-quantising already-rounded weights only adds error.
"""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Iterator, Optional

import torch

from ..core.errors import ErnieImageError, InvalidInputError
from ..core.variant import METADATA_KEY, Variant, checked_variant_option
from ..files.output_files import atomic_output, error_number, write_error
from .fp8 import quantize_fp8
from .gguf_quantize import QUANTIZERS
from .nvfp4 import quantize_nvfp4
from .qweight import QuantizedWeight

WRITE_FORMATS = ("fp8", "q8_0", "q4_k", "nvfp4")
KEEP_HIGH_PRECISION = ("x_embedder.", "final_linear.")
_BLOCK = {"fp8": 16, "q8_0": 32, "q4_k": 256, "nvfp4": 16}


def quantize_weight(weight: torch.Tensor, fmt: str, per_row_fp8: bool = True) -> QuantizedWeight:
    """[out, in] float weight -> QuantizedWeight in `fmt` (fp8: e4m3 with a per-row scale by default)."""
    if fmt not in WRITE_FORMATS:
        raise InvalidInputError(f"unknown quantisation format {fmt!r}: choose one of {', '.join(WRITE_FORMATS)}")
    if weight.dim() != 2 or weight.shape[1] % _BLOCK[fmt] or (fmt == "nvfp4" and weight.shape[0] % 16):
        raise InvalidInputError(f"cannot quantise a weight of shape {tuple(weight.shape)} to {fmt}: "
                                f"needs a 2-D weight with in_features divisible by {_BLOCK[fmt]}")
    shape = tuple(weight.shape)
    if fmt == "fp8":
        data, scale = quantize_fp8(weight, per_row=per_row_fp8)
        return QuantizedWeight("fp8", "e4m3", data, shape, scale=scale, dtype=weight.dtype)
    if fmt == "nvfp4":
        data, blocked, tensor_scale = quantize_nvfp4(weight)
        return QuantizedWeight("nvfp4", "nvfp4", data, shape, scale=blocked, scale_2=tensor_scale, dtype=weight.dtype)
    qtype = fmt.upper()
    _, quantizer = QUANTIZERS[qtype]
    return QuantizedWeight("gguf", qtype, quantizer(weight), shape, dtype=weight.dtype)


def should_quantize(name: str, tensor: torch.Tensor, fmt: str) -> bool:
    if not name.endswith(".weight") or tensor.dim() != 2 or name.startswith(KEEP_HIGH_PRECISION):
        return False
    if not tensor.is_floating_point() or tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return False
    return tensor.shape[1] % _BLOCK[fmt] == 0 and (fmt != "nvfp4" or tensor.shape[0] % 16 == 0)


def quantize_state_dict(state: dict[str, torch.Tensor], fmt: str, per_row_fp8: bool = True
                        ) -> dict[str, torch.Tensor | QuantizedWeight]:
    """Quantise-on-load: every eligible Linear weight becomes a QuantizedWeight, the rest stays as is."""
    return {name: quantize_weight(t, fmt, per_row_fp8) if isinstance(t, torch.Tensor) and should_quantize(name, t, fmt)
            else t for name, t in state.items()}


# ---- writing ----------------------------------------------------------------------------------------

def _comfy_tensors(name: str, qweight: QuantizedWeight) -> dict[str, torch.Tensor]:
    layer = name[: -len(".weight")]
    comfy_format = "nvfp4" if qweight.format == "nvfp4" else "float8_e4m3fn"
    out = {f"{layer}.{k}": v.contiguous() for k, v in qweight.tensors().items()}
    out[f"{layer}.comfy_quant"] = torch.tensor(list(json.dumps({"format": comfy_format}).encode()), dtype=torch.uint8)
    return out


def _write_comfy_safetensors(items: Iterator[tuple[str, torch.Tensor | QuantizedWeight]], path: Path,
                             recorded: dict[str, str]) -> None:
    from safetensors.torch import save_file
    tensors: dict[str, torch.Tensor] = {}
    layers: dict[str, dict[str, str]] = {}
    for name, entry in items:
        if isinstance(entry, QuantizedWeight):
            if entry.format == "gguf":
                raise InvalidInputError(f"{name} is a GGUF block weight: it cannot go into a comfy_quant file")
            tensors.update(_comfy_tensors(name, entry))
            layers[name[: -len(".weight")]] = {"format": "nvfp4" if entry.format == "nvfp4" else "float8_e4m3fn"}
        else:
            tensors[name] = entry.contiguous()
    metadata = {"_quantization_metadata": json.dumps({"format_version": "1.0", "layers": layers}), **recorded}
    save_file(tensors, str(path), metadata=metadata)


def _write_gguf(items: Iterator[tuple[str, torch.Tensor | QuantizedWeight]], path: Path,
                recorded: dict[str, str]) -> None:
    import gguf
    writer = gguf.GGUFWriter(str(path), arch="wan")
    writer.add_string("general.name", "ERNIE-Image DiT")
    writer.add_string("ernie_image.component", "dit")
    for key, value in recorded.items():
        writer.add_string(key, value)
    try:
        for name, entry in items:
            if isinstance(entry, QuantizedWeight):
                if entry.format != "gguf":
                    raise InvalidInputError(f"{name} is {entry.format}: only GGUF block weights go into a GGUF file")
                writer.add_tensor(name, entry.data.contiguous().numpy(),
                                  raw_dtype=gguf.GGMLQuantizationType[entry.qtype])
            elif entry.dim() <= 1 or entry.dtype in (torch.float32, torch.float16):
                # kept in the source's precision: an fp32 DiT's unpacked matrices are not rounded to BF16
                writer.add_tensor(name, (entry if entry.dim() > 1 else entry.to(torch.float32)).contiguous().numpy())
            else:
                raw = entry.to(torch.bfloat16).contiguous().view(torch.uint8).numpy()
                writer.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType.BF16)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()


def file_suffix(fmt: str) -> str:
    """ComfyUI and ComfyUI-GGUF pick their loader by the name: comfy_quant files are .safetensors, GGUF .gguf."""
    return ".safetensors" if fmt in ("fp8", "nvfp4") else ".gguf"


def checked_out_path(path: str | Path, overwrite: bool = True) -> Path:
    """The output path, refused in one line when it cannot be written (before any weights are read)."""
    path = Path(path)
    if path.is_dir():
        raise InvalidInputError(f"{path} is a folder: give a file name inside it")
    if path.exists() and not overwrite:
        raise InvalidInputError(f"{path} already exists: choose another path or delete it first")
    if not path.parent.is_dir():
        raise InvalidInputError(f"{path}: the folder {path.parent} does not exist: create it first")
    return path


def quantized_layer_counts(state: dict[str, torch.Tensor | QuantizedWeight], fmt: str) -> Counter[str]:
    """How many weights the file will hold per format: `fmt` for those quantised now, the format of those that
    already were, "kept" for eligible-looking 2-D weights left in high precision."""
    counts: Counter[str] = Counter()
    for name, entry in state.items():
        if isinstance(entry, QuantizedWeight):
            counts[entry.qtype.lower() if entry.format == "gguf" else entry.format] += 1
        elif should_quantize(name, entry, fmt):
            counts[fmt] += 1
        elif name.endswith(".weight") and entry.dim() == 2:
            counts["kept"] += 1
    return counts


def refuse_unpackable(counts: Counter[str], fmt: str, setting: str) -> None:
    """Writing a 'quantised' file with nothing quantised is an error, not a silent bf16 copy; so is quantising on
    load (`setting` "quant") to a format nothing packs in. `setting`: the option the fix names."""
    if counts[fmt] == 0:
        raise InvalidInputError(f"none of this DiT's {counts['kept']} weight matrices can be packed as {fmt} "
                                f"(it needs in_features divisible by {_BLOCK[fmt]}"
                                f"{' and out_features by 16' if fmt == 'nvfp4' else ''}): pick another {setting}, "
                                "e.g. q8_0 or fp8").naming(setting)


def write_quantized_file(state: dict[str, torch.Tensor | QuantizedWeight], fmt: str, path: str | Path,
                         overwrite: bool = True, variant: Optional[Variant] = None) -> Path:
    """Quantise what is still plain (eligible weights only) and write a file this pack and ComfyUI load.

    An existing file at `path` is replaced once the new one is complete (overwrite=False refuses it). `variant`:
    the DiT's ("base" or "turbo"), recorded in the file's metadata (None: nothing recorded)."""
    if fmt not in WRITE_FORMATS:
        raise InvalidInputError(f"unknown quantisation format {fmt!r}: choose one of {', '.join(WRITE_FORMATS)}")
    variant = checked_variant_option(variant)
    recorded = {} if variant is None else {METADATA_KEY: variant}
    path = checked_out_path(path, overwrite)
    per_row_fp8 = False  # ComfyUI's float8_e4m3fn layout takes a per-tensor scale

    def items() -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
        for name, entry in state.items():
            if isinstance(entry, torch.Tensor) and should_quantize(name, entry, fmt):
                entry = quantize_weight(entry, fmt, per_row_fp8)
            yield name, entry

    try:
        with atomic_output(path) as partial:
            if fmt in ("fp8", "nvfp4"):
                _write_comfy_safetensors(items(), partial, recorded)
            else:
                _write_gguf(items(), partial, recorded)
    except Exception as error:  # safetensors reports a failed write as its own SafetensorError
        if isinstance(error, ErnieImageError) or error_number(error) is None:
            raise
        raise write_error(path, error) from None  # a full disk said so, in one line; the partial file is gone
    return path
