"""Why a path a reader was given is no regular file to read, in the words a one-line error puts after its name."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from ..core.errors import ModelFileError


def not_a_regular_file(path: Path) -> Optional[str]:
    """None for a regular file (through links); else "is a folder", "is not a regular file (...)", "is a broken or
    looping symbolic link" or "does not exist". Checked before opening: a FIFO would block the read for ever."""
    path = Path(path)
    if path.is_file():
        return None
    if path.is_dir():
        return "is a folder"
    if path.exists():
        return "is not a regular file (a pipe, device or socket)"
    if path.is_symlink():
        return "is a broken or looping symbolic link"
    return "does not exist"


def refuse_special_file(path: Path, named: str, fix: str) -> None:
    """A path that names a pipe, device or socket (a FIFO would block its read for ever) or a broken link is refused
    in one line (`named`: how the message names it), before anything opens it; a folder or a missing path is left
    to the caller's own words."""
    why = not_a_regular_file(path)
    if why is not None and why not in ("is a folder", "does not exist"):
        raise ModelFileError(f"{named} {why}: {fix}")
