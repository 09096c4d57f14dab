"""One component's weights, whatever the layout, with canonical key names and lazy (memory-mapped) tensors.

Canonical key spaces:
- "dit": diffusers' ErnieImageTransformer2DModel names (`layers.0.self_attention.to_q.weight`, ...);
- "text_encoder" / "pe": transformers' MistralModel names (`embed_tokens.weight`, `layers.N...`, `norm.weight`),
  plus `lm_head.weight` for the PE when it is not tied;
- "vae": diffusers' AutoencoderKLFlux2 names.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Literal, Optional

import torch
from safetensors import safe_open

from ..errors import ModelFileError

Kind = Literal["dit", "text_encoder", "vae", "pe"]

# Prefixes stripped to reach the canonical names, tried in order.
PREFIXES: dict[str, tuple[str, ...]] = {
    "dit": ("model.diffusion_model.", "diffusion_model.", "transformer.", ""),
    "text_encoder": ("model.language_model.", "language_model.model.", "language_model.", "model.", ""),
    "pe": ("model.", ""),
    "vae": ("vae.", ""),
}
# Weights the runtime never uses for text-to-image; never materialised.
SKIPPED_PREFIXES: dict[str, tuple[str, ...]] = {
    "text_encoder": ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.",
                     "lm_head.", "tekken_model"),
    "pe": ("tekken_model",),
    "dit": (),
    "vae": (),
}


@dataclass
class ComponentFile:
    kind: Kind
    layout: str  # e.g. "diffusers-folder", "single-file"
    path: Path
    config: Optional[dict]  # the component's config.json (or one embedded in file metadata), if any
    keys: list[str]
    _loaders: dict[str, Callable[[], torch.Tensor]] = field(repr=False, default_factory=dict)
    metadata: dict[str, str] = field(default_factory=dict)

    def tensor(self, key: str) -> torch.Tensor:
        try:
            return self._loaders[key]()
        except KeyError:
            raise ModelFileError(f"{self.path} has no tensor {key!r}: the file is not a complete {self.kind}") from None


def _safetensors_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        found = ", ".join(sorted(p.name for p in path.iterdir())[:8]) or "nothing"
        raise ModelFileError(f"{path} holds no .safetensors weights (found {found}): give the component's folder or file")
    return files


def _canonical_name(kind: Kind, raw_keys: list[str]) -> Callable[[str], Optional[str]]:
    probe = {"dit": "final_linear.weight", "text_encoder": "embed_tokens.weight", "pe": "embed_tokens.weight",
             "vae": "decoder.conv_in.weight"}[kind]
    prefix = next((p for p in PREFIXES[kind] if p + probe in raw_keys), "")
    skipped = SKIPPED_PREFIXES[kind]

    def rename(key: str) -> Optional[str]:
        if any(key.startswith(s) for s in skipped) or not key.startswith(prefix):
            return None
        return key[len(prefix):]

    return rename


def open_component(path: Path, kind: Kind) -> ComponentFile:
    path = Path(path)
    if not path.exists():
        raise ModelFileError(f"{kind} weights not found at {path}: check the path")
    files = _safetensors_files(path)
    loaders: dict[str, Callable[[], torch.Tensor]] = {}
    raw_to_file: dict[str, Path] = {}
    metadata: dict[str, str] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            metadata.update(handle.metadata() or {})
            for key in handle.keys():
                raw_to_file[key] = file
    rename = _canonical_name(kind, list(raw_to_file))
    for raw_key, file in raw_to_file.items():
        name = rename(raw_key)
        if name is not None:
            loaders[name] = _lazy_tensor(file, raw_key)
    config = _read_config(path, metadata)
    layout = "diffusers-folder" if path.is_dir() else "single-file"
    return ComponentFile(kind=kind, layout=layout, path=path, config=config, keys=sorted(loaders),
                         _loaders=loaders, metadata=metadata)


def _lazy_tensor(file: Path, key: str) -> Callable[[], torch.Tensor]:
    def load() -> torch.Tensor:
        with safe_open(str(file), framework="pt") as handle:
            return handle.get_tensor(key)

    return load


def _read_config(path: Path, metadata: dict[str, str]) -> Optional[dict]:
    if path.is_dir() and (path / "config.json").exists():
        return json.loads((path / "config.json").read_text())
    if "config" in metadata:
        return json.loads(metadata["config"])
    return None
