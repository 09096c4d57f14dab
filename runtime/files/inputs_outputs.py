"""Inputs are never outputs: a command never writes over a file it reads (the init image, a mask, a weight file,
a key file), however the two names reach it: the same path, a symbolic link, a hard link, or a batch name that
`--out` gives (`shot.png` writes `shot_1.png`). Nor do two of its outputs name one file (`--out` and
`--step-cache-compare`, batch names included), where one would replace the other. Checked before any work starts, on
what the names point at (device and inode), so spelling, links and case-insensitive file systems cannot hide a match.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Optional

from ..core.errors import InvalidInputError
from .identity import files_under

Input = tuple[str, Optional[Path]]  # (the option that names it, its path; None when not given)
Output = tuple[str, Path, Path]  # (the option, the path given, a path the command will write from it)


def _identity(path: Path) -> Optional[tuple[int, int]]:
    try:
        info = os.stat(path)  # through links: a link to the input is the input
    except (OSError, ValueError):  # not there (a new output), or a name the system refuses: nothing to match
        return None
    return info.st_dev, info.st_ino


def _output_key(path: Path) -> tuple:
    """What an output names: the file it points at where one exists, else its name in its folder (as the folder's
    device and inode, so `a/../b.png` and `b.png` agree)."""
    identity = _identity(path)
    if identity is not None:
        return identity
    folder = _identity(path.parent)
    return (folder, path.name) if folder is not None else (os.path.abspath(path),)


def _naming(option: str, given: Path, path: Path) -> str:
    return f"{option} {given}" + ("" if path == given else f" (its batch name {path.name})")


def refuse_colliding_outputs(outputs: Iterable[Output]) -> None:
    """One line naming both options when two files the command writes are one file (one would replace the other);
    the fix names the later option, the one a user adds to a working command."""
    written: dict[tuple, tuple[str, Path, Path]] = {}
    for option, given, path in outputs:
        key = _output_key(Path(path))
        if key in written:
            raise InvalidInputError(f"{_naming(option, Path(given), Path(path))} is the file "
                                    f"{_naming(*written[key])} writes: one would replace the other; give another "
                                    f"{option}")
        written[key] = (option, Path(given), Path(path))


def _files_read(path: Path) -> list[Path]:
    """Every file under an input folder (a model folder, a transformer folder; hidden ones too), else the input
    itself, whether or not it exists yet."""
    return files_under(path, hidden=True) if path.is_dir() else [path]


def refuse_outputs_over_inputs(inputs: Iterable[Input], outputs: Iterable[Output]) -> None:
    """One line naming both names and the fix when a file the command would write is one it reads."""
    written = {}
    for option, given, path in outputs:
        identity = _identity(path)
        if identity is not None:
            written.setdefault(identity, (option, Path(given), Path(path)))
    if not written:
        return  # no output exists yet: none can be an input
    for in_option, in_path in inputs:
        if in_path is None:
            continue
        for file in _files_read(Path(in_path)):
            match = written.get(_identity(file))
            if match is None:
                continue
            out_option, given, path = match
            writes = f"{out_option} {given}" + ("" if path == given else f" writes {path.name} (a batch name), which")
            reads = (f"the file {in_option} {in_path} reads" if file == Path(in_path)
                     else f"{file}, a file of the {in_option} folder {in_path}")
            raise InvalidInputError(f"{writes} is {reads}: writing it would replace that input; give another "
                                    f"{out_option}")
