"""A LoRA file parsed for one DiT shape: its adapters by DiT Linear, cached by file path, size and mtime."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

from ..model.dit import DiTConfig
from .adapters import Adapter, Kron, LowRank, build_adapter, check_parts, peft_alphas, unread_adapter_config
from .files import FileStamp, LoraTensors, file_stamp, read_lora_tensors
from .keys import describe_unmatched, dit_linear_shapes, linear_names, map_keys

CACHE_SIZE = 8  # parsed files kept: switching among a few LoRAs reads none of them again


@dataclass
class ParsedLora:
    name: str
    stamp: FileStamp
    style: str  # key layout and adapter kinds, e.g. "kohya (lora_unet_) LoRA"
    adapters: dict[str, Adapter]  # by diffusers module path of the DiT
    notices: list[str] = field(default_factory=list)

    def branch_params(self) -> int:
        """Values the adapters add to the device (down + up of low-rank ones, both Kronecker factors)."""
        total = 0
        for adapter in self.adapters.values():
            if isinstance(adapter, LowRank):
                total += adapter.down.numel() + adapter.up.numel()
            else:
                total += adapter.w1.numel() + adapter.w2.numel()
        return total


_cache: "OrderedDict[tuple[FileStamp, DiTConfig], ParsedLora]" = OrderedDict()
_checked: "OrderedDict[FileStamp, LoraTensors]" = OrderedDict()  # checked by check_lora_file, not yet parsed
reads = 0  # files actually parsed since import (tests check that switching back reads nothing)


def check_lora_files(stack) -> None:
    """`check_lora_file` for every entry of a LoraStack, in order."""
    for entry in stack.entries:
        check_lora_file(entry.path)


def check_lora_file(path: Path) -> None:
    """What can be checked of a LoRA file before any model is opened: a safetensors file (not a pickle), complete,
    finite, with readable metadata, with LoRA weights of ERNIE-Image DiT layers (not another model's, not a text
    encoder's alone), each layer's parts complete, floating point, of one rank, not DoRA. One-line ModelFileError;
    its shapes are checked against the DiT when the pipe parses it (`load_lora`)."""
    stamp = file_stamp(path)
    if stamp in _checked or any(key[0] == stamp for key in _cache):
        return
    raw = read_lora_tensors(Path(path))
    mapped = map_keys(raw.name, raw.tensors, linear_names(list(raw.tensors)))
    for module, parts in mapped.layers.items():
        check_parts(raw.name, module, parts)
    _checked[stamp] = raw  # parsed next without reading the file again
    while len(_checked) > CACHE_SIZE:
        _checked.popitem(last=False)


def load_lora(path: Path, config: DiTConfig) -> ParsedLora:
    """The file's adapters for a DiT of `config`; one-line ModelFileError for anything unusable."""
    global reads
    key = (file_stamp(path), config)
    parsed = _cache.get(key)
    if parsed is not None:
        _cache.move_to_end(key)
        return parsed
    raw = _checked.pop(key[0], None) or read_lora_tensors(Path(path))
    targets = dit_linear_shapes(config)
    mapped = map_keys(raw.name, raw.tensors, targets)
    peft = peft_alphas(raw.metadata, raw.name)
    adapters = {module: build_adapter(raw.name, module, parts, targets[module], peft)
                for module, parts in mapped.layers.items()}
    kinds = sorted({_kind(parts) for parts in mapped.layers.values()})
    parsed = ParsedLora(raw.name, raw.stamp, f"{mapped.style} {'+'.join(kinds)}", adapters,
                        describe_unmatched(raw.name, mapped) + unread_adapter_config(Path(path), raw.tensors, peft))
    reads += 1
    _cache[key] = parsed
    while len(_cache) > CACHE_SIZE:
        _cache.popitem(last=False)
    return parsed


def _kind(parts: dict) -> str:
    if any(part.startswith("lokr_") for part in parts):
        return "LoKr"
    if any(part.startswith("hada_") for part in parts):
        return "LoHa"
    return "LoRA"


__all__ = ["ParsedLora", "check_lora_file", "check_lora_files", "load_lora", "Kron", "LowRank"]
