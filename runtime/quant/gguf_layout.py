"""Where a GGUF file's header says its bytes end, read with struct before gguf's reader maps the file: an empty or
cut file is named as such in one line (gguf's reader trips over it as a reshape, dtype-view or index error).

The layout (versions 2 and 3): magic, version (u32), tensor count and key-value count (u64); the key-value pairs
(a string key, a u32 type, the value; strings and arrays carry a u64 length); the tensor infos (name, u32 dims,
u64 each dim, u32 type, u64 offset into the data); padding to `general.alignment` (default 32); the data.
"""
from __future__ import annotations

import mmap
import struct
from pathlib import Path

from ..core.errors import ModelFileError
from ..files.cut_files import REDOWNLOAD, cut_in_data, cut_in_header, empty_file

MAGIC = b"GGUF"
READABLE_VERSIONS = (2, 3)
SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUFValueType -> bytes
STRING, ARRAY, UINT32 = 8, 9, 4
DEFAULT_ALIGNMENT = 32
MAX_COUNT = 1 << 48  # no header lists more items or bytes than this (256 TiB)
KIND = "GGUF"


class _Cut(Exception):
    """The file ends where its header needs more bytes."""


class _Damaged(Exception):
    """A value no GGUF file holds (a count beyond any disk, an unknown value type)."""


class _Header:
    """A cursor over the mapped file, every read bounded by its size."""

    def __init__(self, data: mmap.mmap, order: str) -> None:
        self.data, self.order, self.at = data, order, 0

    def take(self, fmt: str) -> int:
        width = struct.calcsize(fmt)
        if self.at + width > len(self.data):
            raise _Cut
        (value,) = struct.unpack_from(self.order + fmt, self.data, self.at)
        self.at += width
        return value

    def count(self) -> int:
        """A u64 count or length: one no file could hold is damage, not a cut."""
        value = self.take("Q")
        if value >= MAX_COUNT:
            raise _Damaged(f"a count of {value} at byte {self.at - 8}")
        return value

    def skip(self, width: int) -> None:
        if self.at + width > len(self.data):
            raise _Cut
        self.at += width

    def string(self) -> bytes:
        width = self.count()
        start = self.at
        self.skip(width)
        return bytes(self.data[start:self.at])

    def value(self, kind: int) -> int | None:
        """Skip one value of `kind`; a u32 is returned (general.alignment is one)."""
        if kind == UINT32:
            return self.take("I")
        if kind in SCALAR_BYTES:
            self.skip(SCALAR_BYTES[kind])
        elif kind == STRING:
            self.skip(self.count())
        elif kind == ARRAY:
            item_kind = self.take("I")
            items = self.count()
            if item_kind in SCALAR_BYTES:
                self.skip(items * SCALAR_BYTES[item_kind])
            else:
                for _ in range(items):
                    self.value(item_kind)
        else:
            raise _Damaged(f"value type {kind} at byte {self.at - 4} is none of GGUF's")
        return None


def _tensor_bytes(dims: list[int], qtype: int) -> int:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        block, type_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
    except (ValueError, KeyError):
        return 0  # a type this gguf does not know: its reader names it
    elements = 1
    for dim in dims:
        elements *= dim
    return elements // block * type_bytes


def _described_end(header: _Header) -> int:
    """The byte the header says the file ends at (its last tensor's data)."""
    tensors = header.count()
    pairs = header.count()
    alignment = DEFAULT_ALIGNMENT
    for _ in range(pairs):
        key = header.string()
        found = header.value(header.take("I"))
        if key == b"general.alignment" and found:
            alignment = found
    spans = []  # (offset into the data, bytes, name) per tensor
    for _ in range(tensors):
        name = header.string()
        dims = [header.take("Q") for _ in range(header.take("I"))]
        qtype = header.take("I")
        offset = header.take("Q")
        spans.append((offset, _tensor_bytes(dims, qtype), name.decode("utf-8", "backslashreplace")))
    if not tensors:
        return header.at
    _check_spans(spans, alignment)
    return -(-header.at // alignment) * alignment + max(offset + size for offset, size, _ in spans)


def _check_spans(spans: list[tuple[int, int, str]], alignment: int) -> None:
    """Each tensor's data starts on the alignment and ends where padding to it brings the next one: a tensor whose
    type, shape or offset was changed in the header (a Q8_0 tensor labelled Q4_0) leaves bytes no tensor holds, or
    runs into the next one, and would be read as other numbers than were written."""
    if not all(size for _, size, _ in spans):
        return  # a type this gguf does not know: its reader names it, and no gap next to it can be judged
    ordered = sorted(spans)
    for (offset, size, name), (next_offset, _, next_name) in zip(ordered, [*ordered[1:], (None, 0, "")]):
        if offset % alignment:
            raise _Damaged(f"tensor {name}'s data starts at byte {offset} of the data, off the file's alignment of "
                           f"{alignment}")
        if next_offset is None:
            continue
        end = offset + size
        if end > next_offset:
            raise _Damaged(f"tensor {name}'s {size} bytes run into {next_name}'s: its type or shape does not match "
                           f"its data")
        if next_offset - end >= alignment:
            raise _Damaged(f"{next_offset - end} bytes after tensor {name} belong to no tensor (the next, "
                           f"{next_name}, starts at byte {next_offset}): a type, shape or offset in the header does "
                           "not match the data")


def check_whole_gguf(path: Path) -> None:
    """An empty GGUF file, or one that ends before its header or its data does, is refused in one line naming the
    file, its size and what its header promised. Files of versions this checks not (and damage that is no cut) are
    left to gguf's reader."""
    path = Path(path)
    with open(path, "rb") as handle:
        size = handle.seek(0, 2)
        if size == 0:
            raise ModelFileError(empty_file(path.name, KIND))
        if size < 8:
            raise ModelFileError(cut_in_header(path.name, KIND, size))
        with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
            if data[:4] != MAGIC:
                return
            order = "<" if struct.unpack_from("<I", data, 4)[0] & 0xFFFF else ">"
            if struct.unpack_from(order + "I", data, 4)[0] not in READABLE_VERSIONS:
                return
            header = _Header(data, order)
            header.skip(8)
            try:
                end = _described_end(header)
            except _Cut:
                raise ModelFileError(cut_in_header(path.name, KIND, size)) from None
            except _Damaged as damage:
                raise ModelFileError(f"{path.name} is not a readable GGUF file ({damage}): {REDOWNLOAD}") from None
    if end > size:
        raise ModelFileError(cut_in_data(path.name, KIND, end, size))
