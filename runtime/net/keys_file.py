"""Where the keys file lies: how messages name it, and whether only its owner can decide what it holds.

Naming: the command line names the keys file and its folders in full (its user typed them or knows them). Inside
ComfyUI an error goes to the node, the log and /history, which anyone with the page can read, so the file and its
folders are named relative to ComfyUI's user folder ("ComfyUI's user/ernie_image/keys.json"), else to the home
folder ("~/.config/ernie-image/keys.json"): never the install or home path itself.

Trust, as ssh's StrictModes checks a key file: whoever can write the keys file decides where the keys go, and so
does whoever can replace it, that is, rename or remove entries in its folder or any folder above it. The file
and each of those folders up to / must belong to the user or root, and no folder may be writable by its group or
others unless it has the sticky bit (as /tmp: others may not rename or remove what is yours in it). Both the path
as given and the one it leads to (through symbolic links) are checked.
"""
from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

from ..core.errors import InvalidInputError

COMFY_USER_FOLDER = "ComfyUI's user"


@dataclass(frozen=True)
class PathNames:
    """How messages name a path: in full, or relative to the first of `anchors` (a folder and its name in
    messages) that holds it or lies below it ("ComfyUI's user/.." for the folder above ComfyUI's user folder)."""

    anchors: tuple[tuple[Path, str], ...] = ()

    @classmethod
    def inside_comfyui(cls, comfy_user_dir: str) -> "PathNames":
        home = Path(os.path.abspath(os.path.expanduser("~")))
        return cls(((Path(os.path.abspath(comfy_user_dir)), COMFY_USER_FOLDER), (home, "~")))

    def __call__(self, path: Path) -> str:
        path = Path(os.path.abspath(path))
        for anchor, name in self.anchors:
            if path == anchor or anchor in path.parents:
                return "/".join((name, *path.relative_to(anchor).parts))
        for anchor, name in self.anchors:
            if path in anchor.parents:
                return "/".join((name, *[".."] * (len(anchor.parts) - len(path.parts))))
        return str(path)


@dataclass(frozen=True)
class KeysFile:
    """The keys file: where it is, and how messages name it."""

    path: Path
    names: PathNames = PathNames()

    @property
    def shown(self) -> str:
        return self.names(self.path)

    def require_trusted(self) -> None:
        """InvalidInputError, one line naming the file or folder and the fix, when someone else than the user (or
        root) could change the keys file or put another in its place. POSIX only."""
        if os.name != "posix":
            return
        user = os.getuid()
        mode = os.stat(self.path)
        if mode.st_uid not in (user, 0):
            raise InvalidInputError(f"the keys file {self.shown} belongs to another user (uid {mode.st_uid}), who "
                                    f"decides where your keys go: write your own keys file (see the README)")
        if mode.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise InvalidInputError(f"the keys file {self.shown} can be changed by other users, who could send your "
                                    f"keys elsewhere: run chmod 600 {self.shown}")
        for folder in self._folders():
            info = os.stat(folder)
            shown = self.names(folder)
            if info.st_uid not in (user, 0):
                raise InvalidInputError(
                    f"the folder {shown} holding the keys file belongs to another user (uid {info.st_uid}), who "
                    f"could put another keys file in its place and send your keys elsewhere: keep the keys file in "
                    f"a folder of your own")
            if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not info.st_mode & stat.S_ISVTX:
                raise InvalidInputError(
                    f"the folder {shown} holding the keys file can be changed by other users, who could put another "
                    f"keys file in its place and send your keys elsewhere: run chmod go-w {shown}")

    def _folders(self) -> Iterator[Path]:
        """The folders above the file, nearest first: along the path as given, then along the one it leads to."""
        seen: set[Path] = set()
        for path in (Path(os.path.abspath(self.path)), Path(os.path.realpath(self.path))):
            for folder in path.parents:
                if folder not in seen:
                    seen.add(folder)
                    yield folder


def keys_file_names(comfy_user_dir: Optional[str]) -> PathNames:
    """Inside ComfyUI (its user folder known): relative names; on the command line: full paths."""
    return PathNames.inside_comfyui(comfy_user_dir) if comfy_user_dir else PathNames()
