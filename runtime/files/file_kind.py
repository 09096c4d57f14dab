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


def not_there(path: Path) -> str:
    """How a one-line error goes on after naming a path that does not exist: a broken link (an incomplete download
    into a cache of links, a moved target) is told apart from a path given wrong, each with its own fix."""
    if Path(path).is_symlink():
        return "is a broken or looping symbolic link: mend the link, or download it again"
    return "does not exist: check the path"


def refuse_special_file(path: Path, named: str, fix: str) -> None:
    """A path that names a pipe, device or socket (a FIFO would block its read for ever) or a broken link is refused
    in one line (`named`: how the message names it), before anything opens it; a folder or a missing path is left
    to the caller's own words."""
    why = not_a_regular_file(path)
    if why is not None and why not in ("is a folder", "does not exist"):
        raise ModelFileError(f"{named} {why}: {fix}")


def is_there(path: Path, named: str, fix: str) -> bool:
    """Whether a file a reader looks for is there to be read (a folder in its place is, and the read names it);
    False only where nothing is there at all. A broken link (an incomplete download into a cache of links), a pipe,
    a device or a socket is refused (refuse_special_file), never taken for a file that is absent."""
    refuse_special_file(path, named, fix)
    return Path(path).exists()
