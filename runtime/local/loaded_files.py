"""The files a LocalPipe reads its parts from, each with its identity as first opened, checked before each run and
each phase that reads them again.

The weights are memory-mapped and read lazily, and read again after every release, so a file replaced, rewritten,
cut or deleted under a loaded pipe would otherwise make a picture from other bytes, blame a NaN on the wrong part,
or end the process with SIGBUS on a mapped page past a cut. A changed file is refused in one line naming it, what
changed and the fix: load the model again (each front end says how: `LocalPipe.load` is named as a setting, so the
CLI and the nodes word it as their own).
"""
from __future__ import annotations

from typing import Iterable, Optional

from ..core.errors import ModelFileError
from ..files.identity import FileIdentity

RELOAD = "LocalPipe.load"  # the library's way to load the model again; a front end names its own (errors.worded)


def changed(path: str, what: str) -> ModelFileError:
    return ModelFileError(f"{path} changed on disk since the model was loaded ({what}): load the model again "
                          f"({RELOAD})").naming(RELOAD)


class LoadedFiles:
    """Per part ("dit", "text_encoder", "vae", "pe"): the files it was first opened from, as opened."""

    def __init__(self) -> None:
        self._parts: dict[str, tuple[FileIdentity, ...]] = {}

    def opened(self, part: str, files: Iterable[FileIdentity]) -> None:
        """`part` was opened from `files` (their identities as opened): the first time, recorded; after that, refused
        where they are not the files recorded."""
        files = tuple(files)
        recorded = self._parts.setdefault(part, files)
        if recorded == files:
            return
        now = {identity.path: identity for identity in files}
        for identity in recorded:
            if now.get(identity.path) != identity:
                raise changed(identity.path, identity.change() or "replaced by another file")
        added = sorted(set(now) - {identity.path for identity in recorded})
        raise changed(added[0], "added beside the files the model was loaded from")

    def check(self, parts: Optional[Iterable[str]] = None) -> None:
        """Every recorded file of `parts` (None: all) is as it was opened, else refused (module docstring)."""
        for part in self._parts if parts is None else parts:
            for identity in self._parts.get(part, ()):
                what = identity.change()
                if what is not None:
                    raise changed(identity.path, what)
