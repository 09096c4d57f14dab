"""Which version of a file on disk something was read from: its size, modification time, status-change time, inode
and device as opened.

A model's weights are read through memory maps, lazily and again after each release, so a file replaced, rewritten,
cut or deleted under a loaded model would be read as other bytes (or fault on a page past a cut). The status-change
time (ctime) is kept because no user tool can set it: a file copied over in place keeping its size and modification
time (`cp -p`, `touch -r`, `rsync -t`) still moves it. Whoever holds a file's identity asks `change()` before
reading it again; a front end fingerprints the files it would read (`fingerprint`) to tell whether they are still the
ones it loaded.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Iterable, Optional


@dataclass(frozen=True)
class FileIdentity:
    path: str
    size: int
    mtime_ns: int
    ctime_ns: int
    inode: int
    device: int

    @classmethod
    def of(cls, path: Path) -> "FileIdentity":
        return cls._from(path, os.stat(path))

    @classmethod
    def of_open(cls, path: Path, handle: IO[bytes]) -> "FileIdentity":
        """The file `handle` has open, whatever `path` names by now."""
        return cls._from(path, os.fstat(handle.fileno()))

    @classmethod
    def _from(cls, path: Path, found: os.stat_result) -> "FileIdentity":
        return cls(str(path), found.st_size, found.st_mtime_ns, found.st_ctime_ns, found.st_ino, found.st_dev)

    def change(self) -> Optional[str]:
        """What is different on disk now ("size 1000 -> 500 bytes", "replaced by another file", ...); None: nothing."""
        try:
            now = FileIdentity.of(Path(self.path))
        except FileNotFoundError:
            return "deleted or moved"
        except OSError as error:
            return f"it cannot be read now: {error.strerror or error}"
        if (now.inode, now.device) != (self.inode, self.device):
            return "replaced by another file"
        if now.size != self.size:
            return f"size {self.size} -> {now.size} bytes"
        if now.mtime_ns != self.mtime_ns:
            return "its modification time changed (same size): it may have been rewritten"
        if now.ctime_ns != self.ctime_ns:
            return "its status time changed (same size and modification time): it may have been rewritten"
        return None


def files_under(path: Path, hidden: bool = False) -> list[Path]:
    """`path` if it is a file; the files in it and its subfolders if it is a folder (sorted; hidden ones, such as a
    download tool's .cache/ of locks, left out unless `hidden`); [] if it is neither."""
    path = Path(path)
    if path.is_dir():
        return sorted(found for found in path.rglob("*") if found.is_file()
                      and (hidden or not any(part.startswith(".") for part in found.relative_to(path).parts)))
    return [path] if path.is_file() else []


def fingerprint(paths: Iterable[Optional[Path]]) -> str:
    """One string for the identities of every file under `paths` (None entries skipped): it changes when any of
    them is replaced, rewritten, cut, added or removed."""
    digest = hashlib.sha256()
    for path in paths:
        if path is None:
            continue
        files = files_under(Path(path))
        if not files:
            digest.update(f"absent {path}\n".encode(errors="surrogateescape"))
        for file in files:
            try:
                identity = FileIdentity.of(file)
            except OSError:
                digest.update(f"unreadable {file}\n".encode(errors="surrogateescape"))
                continue
            digest.update(f"{identity}\n".encode(errors="surrogateescape"))
    return digest.hexdigest()
