"""Where the keys file lies: how messages name it, and whether only its owner can decide what it holds.

Naming: the command line names the keys file and its folders in full (its user typed them or knows them). Inside
ComfyUI an error goes to the node, the log and /history, which anyone with the page can read, so the file and its
folders are named relative to ComfyUI's user folder ("ComfyUI's user/ernie_image/keys.json"), else to the home
folder ("~/.config/ernie-image/keys.json"): never the install or home path itself.

Trust, as ssh's StrictModes checks a key file: whoever can write the keys file decides where the keys go, and so
does whoever can replace it, that is, rename or remove entries in its folder or any folder above it. The file
and each of those folders up to / must belong to the user or root, and no folder may be writable by its group or
others unless it has the sticky bit (as /tmp: others may not rename or remove what is yours in it) or its group is
its owner's private group (Debian OpenSSH's user-group-modes, for umask 002 systems such as Fedora: the owner's
primary group, with no other member and no other user's primary group). Both the path as given and the one it
leads to (through symbolic links) are checked; every folder others can change is named in one line.
"""
from __future__ import annotations

import os
import shlex
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

from ..core.errors import InvalidInputError

COMFY_USER_FOLDER = "ComfyUI's user"


class UntrustedKeysFile(InvalidInputError):
    """Someone else than the user could change the keys file, put another in its place, or read a key written in
    it: the file is not used, and only a server that needs it is refused."""


@dataclass(frozen=True)
class Accounts:
    """Who has which primary group and which groups list which members: enough to tell a private group."""

    primary_gids: tuple[tuple[int, int], ...] = ()  # (uid, primary gid) of every user
    names: tuple[tuple[int, str], ...] = ()  # (uid, name)
    members: tuple[tuple[int, tuple[str, ...]], ...] = field(default=())  # (gid, listed members)

    @classmethod
    def of_system(cls) -> "Accounts":
        import grp
        import pwd

        users = pwd.getpwall()
        return cls(tuple((u.pw_uid, u.pw_gid) for u in users), tuple((u.pw_uid, u.pw_name) for u in users),
                   tuple((g.gr_gid, tuple(g.gr_mem)) for g in grp.getgrall()))

    def private_group(self, owner: int, gid: int) -> bool:
        """`gid` is `owner`'s primary group, lists no other member, and is no other user's primary group."""
        if (owner, gid) not in self.primary_gids:
            return False
        name = dict(self.names).get(owner)
        listed = [member for group, names in self.members if group == gid for member in names]
        if any(member != name for member in listed):
            return False
        return all(uid == owner for uid, primary in self.primary_gids if primary == gid)


def writable_by_others(info: os.stat_result, accounts: Accounts, *, folder: bool) -> bool:
    """Whether someone else than the owner may write the file, or rename or remove entries in the folder."""
    if folder and info.st_mode & stat.S_ISVTX:
        return False
    if info.st_mode & stat.S_IWOTH:
        return True
    return bool(info.st_mode & stat.S_IWGRP) and not accounts.private_group(info.st_uid, info.st_gid)


def shell_fix(names: list[str]) -> str:
    """`chmod go-w` on the folders as messages name them: a shell command where each name is a path (full or
    below ~), else in words (ComfyUI's user folder is no path a shell knows)."""
    if all(name.startswith("/") or name == "~" or name.startswith("~/") for name in names):
        quoted = [name if name == "~" else "~/" + shlex.quote(name[2:]) if name.startswith("~/") else shlex.quote(name)
                  for name in names]
        return "run chmod go-w " + " ".join(quoted)
    return "run chmod go-w on " + ", ".join(_in_words(name) for name in names)


def _in_words(name: str) -> str:
    if name == COMFY_USER_FOLDER:
        return "ComfyUI's user folder"
    if name.startswith(COMFY_USER_FOLDER + "/.."):
        ups = name[len(COMFY_USER_FOLDER):].count("..")
        return "ComfyUI's folder" if ups == 1 else f"the folder {ups - 1} above ComfyUI's folder"
    if name.startswith(COMFY_USER_FOLDER + "/"):
        return f"{name} folder"
    return name


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

    def require_trusted(self, accounts: Optional[Accounts] = None) -> None:
        """UntrustedKeysFile, one line naming the file or folders and the fix, when someone else than the user (or
        root) could change the keys file or put another in its place. POSIX only."""
        if os.name != "posix":
            return
        accounts = accounts or Accounts.of_system()
        user = os.getuid()
        mode = os.stat(self.path)
        if mode.st_uid not in (user, 0):
            raise UntrustedKeysFile(f"the keys file {self.shown} belongs to another user (uid {mode.st_uid}), who "
                                    f"decides where your keys go: write your own keys file (see the README)")
        if writable_by_others(mode, accounts, folder=False):
            raise UntrustedKeysFile(f"the keys file {self.shown} can be changed by other users, who could send your "
                                    f"keys elsewhere: run chmod 600 {self.shown}")
        open_folders: list[str] = []
        for folder in self._folders():
            info = os.stat(folder)
            shown = self.names(folder)
            if info.st_uid not in (user, 0):
                raise UntrustedKeysFile(
                    f"the folder {shown} holding the keys file belongs to another user (uid {info.st_uid}), who "
                    f"could put another keys file in its place and send your keys elsewhere: keep the keys file in "
                    f"a folder of your own")
            if writable_by_others(info, accounts, folder=True):
                open_folders.append(shown)
        if len(open_folders) == 1:
            raise UntrustedKeysFile(
                f"the folder {open_folders[0]} holding the keys file can be changed by other users, who could put "
                f"another keys file in its place and send your keys elsewhere: {shell_fix(open_folders)}")
        if open_folders:
            raise UntrustedKeysFile(
                f"the folders {', '.join(open_folders)} above the keys file can be changed by other users, who could "
                f"put another keys file in their place and send your keys elsewhere: {shell_fix(open_folders)}")

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
