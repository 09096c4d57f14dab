"""One component's weights, whatever the layout, with canonical key names and lazy (memory-mapped) tensors.

Canonical key spaces:
- "dit": diffusers' ErnieImageTransformer2DModel names (`layers.0.self_attention.to_q.weight`, ...);
- "text_encoder" / "pe": transformers' MistralModel names (`embed_tokens.weight`, `layers.N...`, `norm.weight`),
  plus `lm_head.weight` for the PE where the file holds one (read only when the PE's head is not tied);
- "vae": diffusers' AutoencoderKLFlux2 names.

Layouts read: a diffusers folder (sharded or not: folder_files.py), a single safetensors file (Comfy-Org's files:
the DiT with or without `model.diffusion_model.`, the text encoder in Hugging Face `model.layers.N` names, the VAE in
BFL's or diffusers' names), and quantised files (GGUF, comfy_quant / scaled-fp8 safetensors), which are handed to
runtime/quant. What a file is comes from its keys and shapes (detect.py), never from its name.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Literal, Optional

import torch

from ..core.errors import ErnieImageError, ModelFileError, one_line
from ..core.variant import METADATA_KEY as VARIANT_METADATA_KEY
from ..files.identity import FileIdentity
from ..files.file_kind import not_there
from .config_json import config_there, origin_of, read_config
from .config_values import check_config_values
from .detect import Identity, copies, identify, sample_keys, text_model_role
from .folder_files import open_weights
from .safetensors_reader import SafetensorsFile, is_gguf
from .sources import component_folder
from .vae_keys import bfl_to_diffusers, config_from_shapes, num_up_blocks_bfl

Kind = Literal["dit", "text_encoder", "vae", "pe"]

LABELS: dict[str, str] = {
    "dit": "ERNIE-Image transformer",
    "text_encoder": "ERNIE-Image text encoder",
    "vae": "ERNIE-Image VAE",
    "pe": "ERNIE-Image prompt enhancer",
}
WHAT_TO_PICK: dict[str, str] = {
    "dit": "pick diffusion_models/ernie-image.safetensors or ernie-image-turbo.safetensors (or a diffusers "
           "ERNIE-Image folder's transformer/)",
    "text_encoder": "pick text_encoders/ministral-3-3b.safetensors (or a diffusers ERNIE-Image folder's text_encoder/)",
    "vae": "pick vae/flux2-vae.safetensors (or a diffusers ERNIE-Image folder's vae/)",
    "pe": "pick text_encoders/ernie-image-prompt-enhancer.safetensors (or a diffusers ERNIE-Image folder's pe/)",
}
ROLE: dict[str, str] = {"dit": "transformer (DiT)", "text_encoder": "text encoder", "vae": "VAE"}

# Weights text-to-image never uses: never given a loader, so never read.
SKIPPED: dict[str, tuple[str, ...]] = {
    "text_encoder": ("vision_tower.", "multi_modal_projector.", "lm_head.", "tekken_model"),
    "pe": ("vision_tower.", "multi_modal_projector.", "tekken_model"),
    "dit": (),
    "vae": (),
}
QUANT_MARKERS = (".comfy_quant", ".scale_weight", ".weight_scale", ".weight_scale_2", ".input_scale")

Loader = Callable[[], torch.Tensor]


@dataclass
class ComponentFile:
    kind: Kind
    layout: str  # "diffusers-folder", "single-file", "single-file-bfl", "gguf", "quantized-safetensors"
    path: Path
    config: Optional[dict]  # the component's config.json, one embedded in file metadata, or inferred; else None
    keys: list[str]
    _loaders: dict[str, Loader] = field(repr=False, default_factory=dict)
    metadata: dict[str, str] = field(default_factory=dict)
    quantized: bool = False  # tensors may be runtime.quant.QuantizedWeight (build through runtime/quant)
    _releasers: dict[str, Callable[[], None]] = field(repr=False, default_factory=dict)
    config_file: Optional[Path] = None  # the config.json `config` was read from (None: metadata, inferred or none)
    files: tuple[FileIdentity, ...] = ()  # every file read, as opened: weights and config.json (files/identity.py)
    _stored: dict[str, tuple[Path, str]] = field(repr=False, default_factory=dict)  # key -> (its file, its raw name)
    notices: tuple[str, ...] = ()  # what reading the files decided that the user may not expect (a file not read)

    def stored_as(self, key: str) -> tuple[Path, str]:
        """Where `key` is stored, for a message: the weight file holding it (a folder's shard, else the file given)
        and its name in that file (before prefixes are dropped and BFL names renamed)."""
        return self._stored.get(key, (self.path, key))

    def tensor(self, key: str) -> torch.Tensor:
        try:
            loader = self._loaders[key]
        except KeyError:
            raise ModelFileError(f"{self.path} has no tensor {key!r}: the file is not a complete {self.kind}") from None
        return loader()

    def release(self, key: str) -> None:
        """The caller holds its own converted copy of `key`: let the mapped file pages go from RAM."""
        releaser = self._releasers.get(key)
        if releaser is not None:
            releaser()


def open_component(path: Path, kind: Kind) -> ComponentFile:
    path = Path(path)
    if not path.exists():
        raise ModelFileError(f"{LABELS[kind]} not found: {path} {not_there(path)}, or {WHAT_TO_PICK[kind]}")
    if path.is_file() and is_gguf(path):
        return _open_quantized(path, kind, "gguf")
    opened = open_weights(path, WHAT_TO_PICK[kind])
    readers, owner = opened.readers, opened.owner
    shapes = {key: reader.shape(key) for key, reader in owner.items()}
    _refuse_two_variants(path, readers)
    _refuse_other_parts(path, kind, readers)
    metadata: dict[str, str] = {}
    for reader in readers:
        metadata.update(reader.metadata)
    if _is_quantized(owner, metadata):
        if path.is_dir():
            raise ModelFileError(f"{path} holds quantised weights in a folder: give the quantised .safetensors file itself")
        return _open_quantized(path, kind, "quantized-safetensors", metadata)
    identity = identify(shapes)
    _check_kind(identity, kind, path, shapes)
    _refuse_two_copies(path, identity, owner)
    loaders, bfl, releasers, stored = _canonical_loaders(kind, identity, owner)
    config, config_file = _read_config(path, kind, metadata)
    if kind == "vae" and config is None:
        config = config_from_shapes(_decoder_shapes(loaders), _released_vae_config())
    layout = "diffusers-folder" if path.is_dir() else ("single-file-bfl" if bfl else "single-file")
    files = tuple(reader.identity for reader in readers) + _identities(*opened.indexes, config_file)
    return ComponentFile(kind=kind, layout=layout, path=path, config=config, keys=sorted(loaders),
                         _loaders=loaders, metadata=metadata, _releasers=releasers, config_file=config_file,
                         files=files, _stored=stored, notices=opened.unread)


def _check_text_role(identity: Identity, kind: str, path: Path, shapes: dict) -> None:
    """The text encoder and the prompt enhancer have one geometry: a file of the other one is refused by its keys."""
    if kind not in ("text_encoder", "pe"):
        return
    role = text_model_role(shapes, identity.prefix)
    if role is None or role == kind:
        return
    if role == "pe":
        raise ModelFileError(
            f"{path.name} is the ERNIE-Image prompt enhancer, not the text encoder (a causal LM with a tied head and "
            f"no vision tower): give it as the prompt enhancer (pe), and {WHAT_TO_PICK[kind]}"
        ).naming("pe")
    raise ModelFileError(
        f"{path.name} is the ERNIE-Image text encoder (Ministral-3B with a vision tower or its own lm_head), not the "
        f"prompt enhancer: give it as the text encoder (text_encoder), and {WHAT_TO_PICK[kind]}"
    ).naming("text_encoder")


def _is_quantized(owner: dict[str, SafetensorsFile], metadata: dict[str, str]) -> bool:
    if "_quantization_metadata" in metadata or "scaled_fp8" in owner:
        return True
    if any(key.endswith(QUANT_MARKERS) for key in owner):
        return True
    return any(reader.infos[key].dtype.startswith("F8_") for key, reader in owner.items() if key.endswith(".weight"))


def _check_kind(identity: Identity, kind: str, path: Path, shapes: dict) -> None:
    wanted = "text_encoder" if kind == "pe" else kind
    if identity.kind == wanted:
        _check_text_role(identity, kind, path, shapes)
        return
    if not shapes:
        raise ModelFileError(f"{path.name} is not an {LABELS[kind]}: it holds no tensors at all: {WHAT_TO_PICK[kind]}")
    found = f"found keys like {sample_keys(shapes)}"
    if identity.kind is not None:
        details = "" if identity.kind == "dit" else identity.description + "; "
        raise ModelFileError(
            f"{path.name} is not an {LABELS[kind]}: it is the ERNIE-Image {ROLE[identity.kind]} ({details}{found}): "
            f"give it as the {ROLE[identity.kind]}, and {WHAT_TO_PICK[kind]}"
        )
    if identity.description == "of an unknown layout":
        raise ModelFileError(
            f"{path.name} is not an {LABELS[kind]}: its layout is unknown ({len(shapes)} tensors, {found}): "
            f"{WHAT_TO_PICK[kind]}"
        )
    raise ModelFileError(f"{path.name} is not an {LABELS[kind]}: it looks like {identity.description} ({found}): "
                         f"{WHAT_TO_PICK[kind]}")


def _view(reader: SafetensorsFile, raw_key: str, reshape=None) -> Loader:
    if reshape is None:
        return lambda: reader.tensor(raw_key)
    return lambda: reshape(reader.tensor(raw_key))


def _refuse_other_parts(path: Path, kind: str, readers: tuple[SafetensorsFile, ...]) -> None:
    """A file of another part among a folder's files (a VAE's left in transformer/) is named, rather than its
    tensors blamed on the folder's config or the folder taken for that part."""
    if len(readers) < 2:
        return
    wanted = "text_encoder" if kind == "pe" else kind
    for reader in readers:
        identity = identify({key: reader.shape(key) for key in reader.keys()})
        if identity.kind is not None and identity.kind != wanted:
            raise ModelFileError(f"{path.name}/ holds {reader.path.name}, {identity.description}, beside the "
                                 f"{LABELS[kind]}'s weights: remove it, or give it as the {ROLE[identity.kind]}")


def _refuse_two_variants(path: Path, readers: tuple[SafetensorsFile, ...]) -> None:
    """A folder whose files record two variants (shards of a Base and of a Turbo download) is two models mixed:
    refused, where the file read last had decided."""
    first_saying: dict[str, str] = {}  # each variant recorded -> the first file recording it
    for reader in readers:
        if VARIANT_METADATA_KEY in reader.metadata:
            first_saying.setdefault(reader.metadata[VARIANT_METADATA_KEY], reader.path.name)
    if len(first_saying) > 1:
        (said, first), (other, second) = list(first_saying.items())[:2]
        raise ModelFileError(f"{path.name}/ mixes two models' files: {first} records {VARIANT_METADATA_KEY} {said} "
                             f"and {second} {other}: download the folder again")


def _refuse_two_copies(path: Path, identity: Identity, owner: dict[str, SafetensorsFile]) -> None:
    """The model's weights held twice under two prefixes (a ComfyUI-prefixed copy left beside a diffusers folder's
    weights) are refused: which copy was read would depend on which prefix is tried first."""
    found = copies({key: () for key in owner}, identity)
    if len(found) < 2:
        return
    probe = next(key[len(found[0]):] for key in owner
                 if key.startswith(found[0]) and found[1] + key[len(found[0]):] in owner)
    where = [f"{prefix + probe} in {owner[prefix + probe].path.name}" for prefix in found[:2]]
    raise ModelFileError(f"{path.name} holds its weights twice, as {where[0]} and as {where[1]}: remove the stray "
                         f"copy, or keep the one file with the model")


def _canonical_loaders(kind: str, identity: Identity, owner: dict[str, SafetensorsFile]
                       ) -> tuple[dict[str, Loader], bool, dict[str, Callable[[], None]], dict[str, tuple[Path, str]]]:
    """Per canonical name: its loader, its releaser and where it is stored (its file, its raw name); and whether the
    VAE's names are BFL's."""
    prefix = identity.prefix
    loaders: dict[str, Loader] = {}
    releasers: dict[str, Callable[[], None]] = {}
    stored: dict[str, tuple[Path, str]] = {}
    if kind == "vae" and identity.layout == "bfl":
        inner = {key[len(prefix):]: reader for key, reader in owner.items() if key.startswith(prefix)}
        count = num_up_blocks_bfl(inner)
        for key, reader in inner.items():
            name, reshape = bfl_to_diffusers(key, count)
            if name is not None:
                loaders[name] = _view(reader, prefix + key, reshape)
                releasers[name] = lambda reader=reader, raw=prefix + key: reader.release(raw)
                stored[name] = (reader.path, prefix + key)
    else:
        for raw_key, reader in owner.items():
            if kind == "pe" and raw_key == "lm_head.weight":
                loaders["lm_head.weight"] = _view(reader, raw_key)
                releasers["lm_head.weight"] = lambda reader=reader, raw=raw_key: reader.release(raw)
                stored["lm_head.weight"] = (reader.path, raw_key)
                continue
            if not raw_key.startswith(prefix):
                continue
            name = raw_key[len(prefix):]
            if name.startswith(SKIPPED[kind]) or raw_key.startswith(SKIPPED[kind]):
                continue
            loaders[name] = _view(reader, raw_key)
            releasers[name] = lambda reader=reader, raw=raw_key: reader.release(raw)
            stored[name] = (reader.path, raw_key)
    if kind == "vae" and "bn.running_mean" in loaders and "bn.num_batches_tracked" not in loaders:
        # BatchNorm's step counter: in diffusers' state dict, absent from some files, unused at inference.
        loaders["bn.num_batches_tracked"] = lambda: torch.tensor(0, dtype=torch.int64)
    return loaders, kind == "vae" and identity.layout == "bfl", releasers, stored


def _decoder_shapes(loaders: dict[str, Loader]) -> dict:
    # Views are free (no data is read for a mapped tensor's shape), so ask the loaders.
    return {key: tuple(loader().shape) for key, loader in loaders.items() if key.startswith("decoder.")}


def _released_vae_config() -> dict:
    from .config_json import load_config

    return load_config("base", "vae")


def _open_quantized(path: Path, kind: str, layout: str, metadata: Optional[dict[str, str]] = None) -> ComponentFile:
    """A GGUF or quantised safetensors file; `metadata`: the safetensors header's (a GGUF's is read here)."""
    try:
        from .. import quant
        from .quantized_file import load_quantized_state_dict
    except ImportError as err:
        what = "GGUF" if layout == "gguf" else "quantised safetensors"
        raise ModelFileError(f"{what} support is not available ({err}): reinstall the pack with its runtime/quant "
                             f"module, or use the bf16 .safetensors file") from None
    if kind == "vae":
        raise ModelFileError(f"{path.name} is a quantised file, but the VAE is only read in bf16/fp32: "
                             f"{WHAT_TO_PICK['vae']}")
    try:
        identity = FileIdentity.of(path)  # before its reader maps it
        if kind == "dit":
            state = load_quantized_state_dict(path, "dit")
        else:
            state = quant.load_text_encoder_gguf(path) if layout == "gguf" else load_quantized_state_dict(path, "any")
        if layout == "gguf":
            from ..quant.gguf_files import pack_fields

            metadata = pack_fields(path)  # what this pack records in the GGUF files it writes (the DiT's variant)
    except ErnieImageError:
        raise
    except (IndexError, KeyError, ValueError, TypeError, OSError, struct.error) as err:
        # A damaged file can trip its reader anywhere (gguf's field parser, numpy views): name the file, not a traceback.
        what = "GGUF" if layout == "gguf" else "quantised safetensors"
        raise ModelFileError(f"{path.name} is not a readable {what} file ({one_line(err)}): the file is damaged "
                             "or was not fully downloaded: re-download it") from None
    if kind == "dit":
        prefix = ""
    else:
        shapes = {k: tuple(getattr(v, "shape", ())) for k, v in state.items()}
        identity = identify(shapes)
        _check_kind(identity, kind, path, shapes)
        prefix = identity.prefix
    loaders: dict[str, Loader] = {}
    for key, entry in state.items():
        if not key.startswith(prefix):
            continue
        name = key[len(prefix):]
        if name.startswith(SKIPPED[kind]) and not (kind == "pe" and name == "lm_head.weight"):
            continue
        loaders[name] = (lambda value=entry: value)
    config, config_file = _read_config(path, kind, {})
    return ComponentFile(kind=kind, layout=layout, path=path, config=config, keys=sorted(loaders), _loaders=loaders,
                         metadata=metadata or {}, quantized=True, config_file=config_file,
                         files=(identity, *_identities(config_file)))


def _identities(*files: Optional[Path]) -> tuple[FileIdentity, ...]:
    return tuple(FileIdentity.of(file) for file in files if file is not None)


def _read_config(path: Path, kind: str, metadata: dict[str, str]) -> tuple[Optional[dict], Optional[Path]]:
    """`_find_config`, its values checked (config_values.py) before any weight is read."""
    config, config_file = _find_config(path, kind, metadata)
    if config is not None:
        check_config_values(config, kind, *origin_of(path, config_file, config_file is None))
    return config, config_file


def _find_config(path: Path, kind: str, metadata: dict[str, str]) -> tuple[Optional[dict], Optional[Path]]:
    """The part's config and the config.json it came from: a folder's config.json, else one embedded in the file's
    metadata, else (a single file inside a diffusers component folder) the config.json beside the file when it is
    this part's config; (None, None) when there is none."""
    if path.is_dir() and config_there(path / "config.json"):
        return read_config(path / "config.json"), path / "config.json"
    if "config" in metadata:
        try:
            config = json.loads(metadata["config"])
        except (ValueError, RecursionError):
            config = None
        if not isinstance(config, dict):
            raise ModelFileError(f"{path.name} carries an unreadable 'config' in its metadata: re-export the file")
        return config, None
    folder = component_folder(path, kind)
    if folder is not None and config_there(folder / "config.json"):
        return read_config(folder / "config.json"), folder / "config.json"
    return None, None
