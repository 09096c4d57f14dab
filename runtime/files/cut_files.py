"""How a file that is empty or cut short is named, whatever its kind (safetensors, GGUF, JSON): by its kind, its
size and what its header promised, with one fix. Each reader finds the cut its own way and says it in these words."""
from __future__ import annotations

from typing import Optional

REDOWNLOAD = "the file is damaged or was not fully downloaded: download it again"


def empty_file(shown: str, kind: str) -> str:
    """`shown` (the name a message gives the file) holds no byte at all."""
    return f"{shown} is an empty {kind} file (0 bytes): {REDOWNLOAD}"


def cut_in_header(shown: str, kind: str, size: int, needed: Optional[int] = None) -> str:
    """The file ends inside its header (`needed`: the bytes the header itself needs, where its start says)."""
    header = f", its header needs {needed}" if needed is not None else ""
    return f"{shown} is truncated inside its {kind} header ({size} bytes{header}): {REDOWNLOAD}"


def cut_in_data(shown: str, kind: str, described: int, size: int) -> str:
    """The header describes `described` bytes of data, the file holds `size`."""
    return (f"{shown} is truncated: its {kind} header describes {described} bytes but the file has {size} "
            f"({100 * size // described}%): {REDOWNLOAD}")
