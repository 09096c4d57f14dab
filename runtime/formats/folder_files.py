"""A weight path's .safetensors files opened (headers only), and which of them each tensor is read from.

A file is its own. A folder (a diffusers or transformers component: one file or several shards) is read as its index
(`*.safetensors.index.json`, whose `weight_map` names each tensor's file) says, as diffusers and transformers read
it: only the files the index names, each tensor from the file it names (a file it leaves out that holds more of the
model's tensors is refused: the index is out of date with its shards). A folder without an index is read whole, and
a tensor held by two of its files is refused: which copy won would depend on the files' names (an all-zero copy
left beside the weights would be read without a word).
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from ..core.errors import ModelFileError
from ..core.json_text import JSON_ERRORS, json_trouble, load_json
from ..core.phrases import counted
from ..files.file_kind import refuse_special_file
from .detect import sample_keys
from .safetensors_reader import SafetensorsFile, open_safetensors

INDEX_SUFFIX = ".safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".ckpt", ".pth")


@dataclass(frozen=True)
class OpenWeights:
    readers: tuple[SafetensorsFile, ...]  # every weight file opened, in reading order
    owner: dict[str, SafetensorsFile]  # each tensor (its name as stored) -> the file it is read from
    indexes: tuple[Path, ...]  # the index files that placed the tensors (none: a file, or a folder without one)
    unread: tuple[str, ...] = ()  # a line for each file beside an index holding this model's tensors and not read


def open_weights(path: Path, pick: str) -> OpenWeights:
    """`path`'s weight files opened and each tensor's file (module docstring); `pick`: what a folder holding no
    .safetensors file is told to give instead."""
    if path.is_file():
        reader = open_safetensors(path)
        return OpenWeights((reader,), dict.fromkeys(reader.keys(), reader), ())
    indexes = _plain_indexes(sorted(path.glob("*" + INDEX_SUFFIX)))
    if indexes:
        return _indexed(path, indexes)
    files = _weight_files(path, pick)
    readers = tuple(open_safetensors(file) for file in files)
    return OpenWeights(readers, _sole_owners(path, readers, {}), (), _variants_read(path, files))


def _weight_files(folder: Path, pick: str) -> list[Path]:
    """The .safetensors files a folder without an index is read from: all but macOS's AppleDouble companions
    (`._name`, left by a copy through exFAT or a network share) and, beside the weights under their plain names,
    diffusers' variant copies (`diffusion_pytorch_model.fp16.safetensors`), which diffusers reads only when a variant
    is asked for. A shard whose siblings are not all there is refused by name."""
    files = sorted(file for file in folder.glob("*.safetensors") if not file.name.startswith("._"))
    plain = {match["stem"] for match in map(_SHARD_OR_PLAIN.fullmatch, (file.name for file in files)) if match}
    files = [file for file in files if not _variant_copy(file.name, plain)]
    _refuse_missing_shards(folder, files)
    if files:
        return files
    names = sorted(found.name for found in folder.iterdir())
    found = ", ".join(names[:8]) or "nothing"
    if any(name.endswith(PICKLE_SUFFIXES) for name in names):
        raise ModelFileError(f"{folder} holds only PyTorch pickle weights ({found}), which this pack never loads: "
                             f"use the .safetensors release")
    raise ModelFileError(f"{folder} holds no .safetensors weights (found {found}): {pick}")


def _variants_read(folder: Path, files: list[Path]) -> tuple[str, ...]:
    """A line where the weights read are diffusers' variant copies, the folder holding no plain ones: diffusers reads
    them only when that variant is asked for."""
    variants = [file.name for file in files if (match := _VARIANT_COPY.fullmatch(file.name))
                and match["stem"] in ("diffusion_pytorch_model", "model")]
    if not variants:
        return ()
    return (f"{folder.name}/ holds its weights only as a diffusers variant ({', '.join(variants[:2])}"
            f"{', ...' if len(variants) > 2 else ''}): they are read, as diffusers reads them when that variant is "
            "asked for",)


_SHARD_OR_PLAIN = re.compile(r"(?P<stem>[^.]+?)(-\d{5}-of-\d{5})?\.safetensors")
_VARIANT_COPY = re.compile(r"(?P<stem>[^.]+)\.[A-Za-z0-9_]+(-\d{5}-of-\d{5})?\.safetensors")
_SHARD = re.compile(r"(?P<stem>.+)-(?P<number>\d{5})-of-(?P<count>\d{5})\.safetensors")


def _plain_indexes(indexes: list[Path]) -> tuple[Path, ...]:
    """A folder's indexes but diffusers' variant indexes (`NAME.fp16.safetensors.index.json`) beside the plain one
    (`NAME.safetensors.index.json`): diffusers reads a variant's only when that variant is asked for."""
    plain = {index.name[:-len(INDEX_SUFFIX)] for index in indexes if "." not in index.name[:-len(INDEX_SUFFIX)]}
    return tuple(index for index in indexes
                 if not _variant_copy(index.name[:-len(INDEX_SUFFIX)] + ".safetensors", plain))


def _variant_copy(name: str, plain: set[str]) -> bool:
    """`stem.VARIANT.safetensors` (or its shards) where the folder holds `stem` under its plain name."""
    match = _VARIANT_COPY.fullmatch(name)
    return match is not None and match["stem"] in plain


def _refuse_missing_shards(folder: Path, files: list[Path]) -> None:
    """Shards named `NAME-00001-of-00003.safetensors` whose siblings are not all there: an incomplete download."""
    held: dict[tuple[str, int], set[int]] = {}
    for file in files:
        match = _SHARD.fullmatch(file.name)
        if match:
            held.setdefault((match["stem"], int(match["count"])), set()).add(int(match["number"]))
    for (stem, count), numbers in sorted(held.items()):
        missing = sorted(set(range(1, count + 1)) - numbers)
        if missing:
            first = f"{stem}-{missing[0]:05d}-of-{count:05d}.safetensors"
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise ModelFileError(f"{folder.name}/ holds {len(numbers)} of the {count} shards of {stem} and not "
                                 f"{first}{more}: the download is incomplete: download the folder again")


def _indexed(folder: Path, indexes: tuple[Path, ...]) -> OpenWeights:
    placed = _weight_map(folder, indexes)
    shards = {name: index for name, index in placed.values()}  # each file named -> an index naming it
    readers = {name: open_safetensors(_shard(folder, index, name)) for name, index in sorted(shards.items())}
    owner = _sole_owners(folder, tuple(readers.values()), placed)  # tensors the index leaves out
    for key, (name, index) in placed.items():
        if key not in readers[name]:
            raise ModelFileError(f"{_shown(folder, index)} places {key} in {name}, which does not hold it: the "
                                 f"folder is incomplete or mixed: download it again")
        owner[key] = readers[name]
    unread = _refuse_files_left_out(folder, indexes, set(readers), owner)
    return OpenWeights(tuple(readers.values()), owner, indexes, unread)


def _refuse_files_left_out(folder: Path, indexes: tuple[Path, ...], named: set[str],
                           owner: Mapping[str, SafetensorsFile]) -> tuple[str, ...]:
    """A .safetensors file beside the index that it does not name is not read, as diffusers does not read it; one
    holding more of this model's tensors (in the groups the named files' tensors are in: another layer's, another
    decoder block's), which no named file holds, is an index out of date with its shards, refused here rather than
    blamed later on the config or the layout. Any other is told in a line each (returned): the user may have meant
    it to be read (a complete single-file copy, a LoRA, another model's file). diffusers' variant copies
    (`diffusion_pytorch_model.fp16-00001-of-00002.safetensors`) and macOS's `._` files stay unread without a word."""
    groups = {_group(key) for key in owner}
    index = _shown(folder, indexes[0]) if len(indexes) == 1 else f"{folder.name}/'s indexes"
    plain = {match["stem"] for match in map(_SHARD_OR_PLAIN.fullmatch, named) if match}
    unread = []
    for file in sorted((*folder.glob("*.safetensors"), *folder.glob("*.gguf"))):
        if file.name in named or file.name.startswith("._") or _variant_copy(file.name, plain):
            continue
        unread.append(f"{folder.name}/{file.name} is not read: {index} names the files that are, as diffusers "
                      f"reads the folder; to run that file instead, give it as the part's file itself")
        if file.suffix != ".safetensors":
            continue
        try:
            keys = open_safetensors(file).keys()
        except ModelFileError:
            continue
        missing = {key: None for key in keys
                   if key not in owner and _group(key) in groups and "lora" not in key.lower()}
        if missing:
            raise ModelFileError(f"{index} leaves out {file.name}, which holds {counted(len(missing), 'more tensor')} "
                                 f"of this model ({sample_keys(missing, 2)}): download the folder's index again")
    return tuple(unread)


def _group(key: str) -> str:
    """The first two parts of a tensor's name, numbers masked: layers.7.mlp.w and layers.9.attn.w are one group,
    as are decoder.up_blocks.0.conv.w and decoder.up_blocks.2.norm.w."""
    return ".".join("#" if part.isdigit() else part for part in key.split(".")[:2])


def _weight_map(folder: Path, indexes: tuple[Path, ...]) -> dict[str, tuple[str, Path]]:
    """Each tensor -> (its file's name, the index naming it), every index merged; two indexes placing one tensor in
    two files are refused."""
    placed: dict[str, tuple[str, Path]] = {}
    for index in indexes:
        for key, name in _read_weight_map(folder, index).items():
            other, _ = placed.setdefault(key, (name, index))
            if other != name:
                raise ModelFileError(f"{folder.name}/ holds two indexes that place {key} in two files ({other}, "
                                     f"{name}): keep the one index the folder was downloaded with")
    if not placed:
        raise ModelFileError(f"{_shown(folder, indexes[0])} names no weight file: download the folder again")
    return placed


def _read_weight_map(folder: Path, index: Path) -> dict[str, str]:
    shown = _shown(folder, index)
    refuse_special_file(index, shown, "remove it, or download the folder's index again")
    try:
        data = load_json(index.read_text(encoding="utf-8"))
    except PermissionError:
        raise ModelFileError(f"{shown} cannot be read (permission denied): fix the file's permissions") from None
    except OSError as error:
        raise ModelFileError(f"{shown} cannot be read ({os.strerror(error.errno) if error.errno else error}): check "
                             f"the disk and the path") from None
    except JSON_ERRORS as error:
        raise ModelFileError(f"{shown} {json_trouble(error)}: download it again") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(name, str) for name in weight_map.values()):
        held = "holds no weight_map" if weight_map is None else "has a weight_map that is not an object of file names"
        raise ModelFileError(f"{shown} is not a safetensors index (it {held}): download it again")
    return weight_map


def _shard(folder: Path, index: Path, name: str) -> Path:
    """The file an index names: a .safetensors file in the folder itself, never a path out of it."""
    if Path(name).name != name or name in (".", ".."):
        raise ModelFileError(f"{_shown(folder, index)} names {name!r}, a path where an index names a file beside it in "
                             f"{folder.name}/: download the folder's index again")
    if not name.endswith(".safetensors"):
        raise ModelFileError(f"{_shown(folder, index)} names {name!r} as a weight file, which is no .safetensors "
                             f"file: download the folder's index again")
    if not (folder / name).is_file():
        raise ModelFileError(f"{_shown(folder, index)} names {name!r}, which is not a file in {folder.name}/: the "
                             f"download is incomplete: download the folder again")
    return folder / name


def _sole_owners(folder: Path, readers: tuple[SafetensorsFile, ...], placed: Mapping[str, object]
                 ) -> dict[str, SafetensorsFile]:
    """Each tensor `placed` leaves out -> the one file holding it; a tensor two files hold is refused (no weight has
    been read yet)."""
    owner: dict[str, SafetensorsFile] = {}
    twice: dict[str, tuple[SafetensorsFile, SafetensorsFile]] = {}
    for reader in readers:
        for key in reader.keys():
            if key in placed:
                continue
            if key in owner:
                twice.setdefault(key, (owner[key], reader))
            owner.setdefault(key, reader)
    if twice:
        raise _held_twice(folder, twice, bool(placed))
    return owner


def _held_twice(folder: Path, twice: dict[str, tuple[SafetensorsFile, SafetensorsFile]], indexed: bool
                ) -> ModelFileError:
    key = sample_keys(twice, 1)
    first, second = (reader.path.name for reader in twice[key])
    more = f" (and {len(twice) - 1} more tensors)" if len(twice) > 1 else ""
    if indexed:
        unsettled, fix = "its index does not place it", "remove the stray file, or download the folder's index again"
    else:
        unsettled = f"no *{INDEX_SUFFIX} says which to read"
        fix = "remove the stray file, or, for a sharded folder, download its index again"
    return ModelFileError(f"{folder.name}/ holds {key}{more} in two files, {first} and {second}, and {unsettled}: "
                          f"{fix}")


def _shown(folder: Path, index: Path) -> str:
    return f"{folder.name}/{index.name}"
