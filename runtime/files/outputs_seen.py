"""The files a command will write, as it found them when it started: which another process wrote meanwhile.

Two commands given one output path both write it, each whole (atomic_outputs), and the one that ends last wins. A
command says so when its output changed after it started, instead of replacing another run's image without a word:
judged once its own files are written, just before they replace their targets (a command ending while the other
encodes its PNGs is seen too).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Iterable, Optional

FileIdentity = Optional[tuple[int, int, int, int]]  # (device, inode, size, modified ns); None: no file there


def file_identity(path: Path) -> FileIdentity:
    try:
        info = os.stat(path)
    except OSError:
        return None
    return info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns


class OutputsSeen:
    def __init__(self, paths: Iterable[Path]) -> None:
        self._seen = {Path(path): file_identity(Path(path)) for path in paths}

    def written_since(self) -> list[Path]:
        """The outputs made, replaced or removed since this was made, in the order given."""
        return [path for path, identity in self._seen.items() if file_identity(path) != identity]

    def say_changed(self, log: Callable[[str], None]) -> None:
        """`log` the notice, where there is one: as PNG writers' `before_replacing`, so that the files are judged
        just before this command's replace them."""
        notice = self.notice()
        if notice:
            log(notice)

    def notice(self) -> Optional[str]:
        """One line naming the outputs another process wrote since, which this command's files are about to
        replace; None where none was."""
        changed = self.written_since()
        if not changed:
            return None
        names = ", ".join(str(path) for path in changed)
        it = "it" if len(changed) == 1 else "them"
        return (f"{names} changed while this command ran (another command writing the same output?): this "
                f"command's files replace {it}; give each command its own output to keep both")
