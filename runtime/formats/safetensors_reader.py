"""A checked, memory-mapped view of one .safetensors file.

The file is opened and mapped once; every tensor is a zero-copy view of the mapping, so reading a tensor costs
page faults, not a copy, and a tensor that is never asked for is never read. The mapping is private
copy-on-write (the file is never written) and lives as long as any tensor still refers to it.
The header is validated before anything is returned, so a cut or corrupt file fails with one clear line
instead of a crash deep inside a load.
"""
from __future__ import annotations

import mmap
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import torch

from ..core.errors import ModelFileError
from ..core.json_text import JSON_ERRORS, json_fault, load_json
from ..files.cut_files import REDOWNLOAD, cut_in_data, cut_in_header, empty_file
from ..files.file_kind import refuse_special_file
from ..files.identity import FileIdentity

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
for _name, _attr in (("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64"), ("F8_E8M0", "float8_e8m0fnu")):
    if hasattr(torch, _attr):
        DTYPES[_name] = getattr(torch, _attr)

MAX_HEADER_BYTES = 100 * 1024 * 1024
GGUF_MAGIC = b"GGUF"
PICKLE_MAGICS = (b"PK\x03\x04", b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05")
SAFETENSORS_OPENING = 9  # bytes that tell a safetensors file: its header's length (8) and the header's "{"


def is_pickle(opening: bytes) -> bool:
    """Whether a file's first SAFETENSORS_OPENING bytes are a pickle's (a zip archive's, or protocol 2-5's). A
    safetensors file's first 8 bytes are its header's length, which can begin with the same bytes (a length of
    0x...0480 reads as protocol 4): its header's "{" after them tells it apart."""
    return any(opening.startswith(magic) for magic in PICKLE_MAGICS) and opening[8:9] != b"{"


@dataclass(frozen=True)
class TensorInfo:
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute byte offsets in the file
    end: int


class SafetensorsFile:
    """One open, mapped safetensors file: header facts without I/O, tensors as zero-copy views."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as handle:
            self.identity = FileIdentity.of_open(self.path, handle)  # the version of the file mapped here
            self.size = self.identity.size
            self.infos, self.metadata = _read_header(handle, self.path, self.size)
            self._mapping: Optional[mmap.mmap] = (
                mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY) if self.size else None
            )

    def keys(self) -> list[str]:
        return list(self.infos)

    def __contains__(self, key: str) -> bool:
        return key in self.infos

    def __iter__(self) -> Iterator[str]:
        return iter(self.infos)

    def shape(self, key: str) -> tuple[int, ...]:
        return self.infos[key].shape

    def nbytes(self) -> int:
        return sum(info.end - info.begin for info in self.infos.values())

    def tensor(self, key: str) -> torch.Tensor:
        info = self.infos[key]
        dtype = DTYPES[info.dtype]
        count = 1
        for dim in info.shape:
            count *= dim
        if count == 0:
            return torch.empty(info.shape, dtype=dtype)
        element = torch.empty((), dtype=dtype).element_size()
        if info.begin % element:
            # Misaligned data (a writer that did not pad its header): copy once rather than hand out a misaligned view.
            raw = torch.frombuffer(self._mapping, dtype=torch.uint8, count=info.end - info.begin, offset=info.begin)
            return raw.clone().view(dtype).view(info.shape)
        flat = torch.frombuffer(self._mapping, dtype=dtype, count=count, offset=info.begin)
        return flat.view(info.shape)


    def release(self, key: str) -> None:
        """Drop the pages holding `key` from this process's memory once a converted copy exists (the kernel
        re-reads them from the file if they are ever touched again). Only whole pages inside the tensor."""
        if self._mapping is None or not hasattr(self._mapping, "madvise"):
            return
        info = self.infos[key]
        page = mmap.PAGESIZE
        start = -(-info.begin // page) * page
        end = info.end // page * page
        if end > start:
            self._mapping.madvise(mmap.MADV_DONTNEED, start, end - start)


_PART_FOLDERS = ("transformer", "text_encoder", "vae", "pe")  # a diffusers folder's parts, each a folder


def _named(path: Path) -> str:
    """The file as messages name it: with its folder where that is named as a diffusers folder's parts are (vae/ and
    transformer/ hold files of one name; ComfyUI's models/vae/ reads the same), else by its name; never the
    machine's path."""
    return f"{path.parent.name}/{path.name}" if path.parent.name in _PART_FOLDERS else path.name


def is_gguf(path: Path) -> bool:
    """The file starts with GGUF's magic bytes (whatever its name says); one too short to hold them is told by its
    name, so an empty or cut .gguf file is named as the GGUF file it was meant to be."""
    try:
        with open(path, "rb") as handle:
            start = handle.read(len(GGUF_MAGIC))
    except OSError as error:  # a file the system lists but cannot read (an I/O error, /proc/self/mem)
        raise ModelFileError(f"{_named(Path(path))} cannot be read ({error.strerror or error}): check the file and "
                             "the disk it is on, or give another") from None
    if len(start) < len(GGUF_MAGIC):
        return Path(path).suffix.lower() == ".gguf"
    return start == GGUF_MAGIC


def _read_header(handle, path: Path, size: int) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    opening = handle.read(SAFETENSORS_OPENING)
    start = opening[:8]
    handle.seek(len(start))
    if start.startswith(GGUF_MAGIC):
        raise ModelFileError(f"{_named(path)} is a GGUF file, not safetensors: load it through the GGUF path")
    if is_pickle(opening):
        raise ModelFileError(
            f"{_named(path)} is a PyTorch pickle checkpoint, which this pack never loads (pickles can run code): "
            f"use the .safetensors release of the model"
        )
    try:
        header, data_start = _header_object(handle, path, size, start)
    except ModelFileError:
        if path.suffix.lower() != ".gguf":
            raise
        # Named .gguf, it holds neither GGUF's magic nor a safetensors header: it is not what its name says.
        raise ModelFileError(f"{_named(path)} is not a GGUF file (it does not start with GGUF's magic bytes): "
                             f"{REDOWNLOAD}") from None
    metadata = header.pop("__metadata__", None) or {}
    infos: dict[str, TensorInfo] = {}
    data_end = data_start
    for key, entry in header.items():
        try:
            dtype, shape, (begin, end) = entry["dtype"], tuple(int(d) for d in entry["shape"]), entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise ModelFileError(f"{_named(path)} has a corrupt header entry for {key!r}: {REDOWNLOAD}") from None
        if dtype == "C64":
            raise ModelFileError(f"{_named(path)}: tensor {key!r} holds complex numbers (C64), which no model or LoRA "
                                 f"weights are: the file is not a weights file or is damaged; use the model's or "
                                 f"LoRA's .safetensors release")
        if dtype not in DTYPES:
            raise ModelFileError(f"{_named(path)}: tensor {key!r} has dtype {dtype}, which this PyTorch cannot hold: "
                                 f"update PyTorch or use a file in bf16/fp16/fp32")
        count = 1
        for dim in shape:
            count *= dim
        expected = count * torch.empty((), dtype=DTYPES[dtype]).element_size()
        if end - begin != expected or begin < 0:
            raise ModelFileError(f"{_named(path)}: tensor {key!r} spans {end - begin} bytes but shape {shape} in "
                                 f"{dtype} needs {expected}: {REDOWNLOAD}")
        infos[key] = TensorInfo(dtype, shape, data_start + int(begin), data_start + int(end))
        data_end = max(data_end, data_start + int(end))
    if data_end > size:
        raise ModelFileError(cut_in_data(_named(path), "safetensors", data_end, size))
    _check_coverage(infos, data_start, size, path)
    return infos, {str(k): str(v) for k, v in metadata.items()}


def _header_object(handle, path: Path, size: int, start: bytes) -> tuple[dict, int]:
    """The safetensors header's JSON object, read after its 8-byte length `start`, and where the data begins."""
    if not start:
        raise ModelFileError(empty_file(_named(path), "safetensors"))
    header_len = int.from_bytes(start.ljust(8, b"\0"), "little")  # a cut-short length: its bytes so far
    if header_len > MAX_HEADER_BYTES:
        raise ModelFileError(f"{_named(path)} is not a safetensors file (its first bytes are not a safetensors "
                             f"header): it is damaged, or another kind of file under that name: download it again")
    if len(start) < 8:
        raise ModelFileError(cut_in_header(_named(path), "safetensors", size))
    if 8 + header_len > size:
        raise ModelFileError(cut_in_header(_named(path), "safetensors", size, 8 + header_len))
    try:
        header = load_json(handle.read(header_len).decode("utf-8"))
    except JSON_ERRORS as err:  # a key twice among them: the safetensors library refuses it too
        raise ModelFileError(f"{_named(path)} has a corrupt safetensors header ({json_fault(err)}): "
                             f"{REDOWNLOAD}") from None
    if not isinstance(header, dict):
        raise ModelFileError(f"{_named(path)} has a corrupt safetensors header (it is not a JSON object): "
                             f"{REDOWNLOAD}")
    return header, 8 + header_len


def _check_coverage(infos: dict[str, TensorInfo], data_start: int, size: int, path: Path) -> None:
    """The tensors' bytes tile the data section exactly, in order, as the safetensors format requires (and its own
    library checks): overlapping tensors or bytes after the last one are a damaged or forged file."""
    position = data_start
    for key, info in sorted(infos.items(), key=lambda item: (item[1].begin, item[1].end)):
        if info.begin != position:
            raise ModelFileError(f"{_named(path)}: tensor {key!r} starts at byte {info.begin - data_start} of the data "
                                 f"where {position - data_start} was expected (tensors overlap or leave gaps): "
                                 f"{REDOWNLOAD}")
        position = info.end
    if position != size:
        raise ModelFileError(f"{_named(path)} has {size - position} bytes after its last tensor (the header does not "
                             f"cover the file): {REDOWNLOAD}")


def open_safetensors(path: Path) -> SafetensorsFile:
    refuse_special_file(Path(path), _named(Path(path)), "remove it, or give the .safetensors file")
    try:
        return SafetensorsFile(path)
    except PermissionError:
        raise ModelFileError(f"{path} cannot be read (permission denied): fix the file's permissions") from None
    except IsADirectoryError:
        raise ModelFileError(f"{path} is a folder, not a weight file: give the .safetensors file") from None
    except OSError as err:
        raise ModelFileError(f"{path} cannot be read ({os.strerror(err.errno) if err.errno else err}): "
                             f"check the disk and the path") from None
