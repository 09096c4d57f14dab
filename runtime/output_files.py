"""Writing output files whole or not at all.

Each file is written under a hidden name unique to this process (`.<name>.<pid>.<n>.partial`, in the target's
folder) and renamed over the target only when complete. So a failure, a Ctrl-C or a second run writing the same
path at the same time never leaves a partial file or a mix of two runs; an existing file is replaced by a
complete new one. Files get the usual permissions (0666 less the umask, 0644 mostly).
"""
from __future__ import annotations

import contextlib
import itertools
import os
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional, Sequence

from .uninterrupted import uninterrupted

_counter = itertools.count()


def new_file_mode() -> int:
    """The mode `open()` gives a new file under this process's umask (0666 less the umask)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:  # Linux: read without changing it
            umask = next(int(line.split()[1], 8) for line in status if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError, IndexError):
        umask = os.umask(0o022)
        os.umask(umask)
    return 0o666 & ~umask


def give_usual_mode(paths: Iterable[Path]) -> None:
    """Give files the mode a new file gets (new_file_mode): for writers that make theirs 0600, as safetensors'
    save_file (and save_pretrained through it) does, which would keep a shared cache from other users."""
    mode = new_file_mode()
    for path in paths:
        os.chmod(path, mode)


def safetensors_under(folder: Path) -> list[Path]:
    return sorted(Path(folder).rglob("*.safetensors"))


def partial_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.{next(_counter)}.partial")


_commit_hook: Optional[Callable[[], None]] = None  # the running CLI command's (see set_commit_hook)


def set_commit_hook(hook: Optional[Callable[[], None]]) -> None:
    """Run `hook` before the first rename of every atomic output from now on (None: no hook). The CLI sets its
    interrupt handling here while a command runs, so that for every command that writes files a signal after the
    first rename no longer cancels."""
    global _commit_hook
    _commit_hook = hook


@contextlib.contextmanager
def atomic_outputs(paths: Sequence[Path]) -> Iterator[list[Path]]:
    """Yield one partial path per target; on success rename them all, on any exception (Ctrl-C too) remove them.

    Targets renamed before a later rename fails are removed as well, so a batch is written whole or not at all.
    The commit hook (set_commit_hook) runs just before the first rename: from there the batch replaces the targets
    (the CLI stops taking Ctrl-C as a cancel at that point, so a cancel never lands between two renames)."""
    partials = [partial_path(Path(p)) for p in paths]
    renamed: list[Path] = []
    try:
        yield partials
        mode = new_file_mode()
        for partial in partials:  # some writers (safetensors' save_file) make their file 0600, as a temp file
            os.chmod(partial, mode)
        if _commit_hook is not None:
            _commit_hook()
        for partial, target in zip(partials, paths):
            os.replace(partial, target)
            renamed.append(Path(target))
    except BaseException:
        with uninterrupted():  # a second Ctrl-C cannot stop it half way
            for leftover in (*partials, *renamed):
                with contextlib.suppress(OSError):
                    leftover.unlink()
        raise


@contextlib.contextmanager
def atomic_output(path: Path) -> Iterator[Path]:
    """`atomic_outputs` for one file."""
    with atomic_outputs([path]) as (partial,):
        yield partial
