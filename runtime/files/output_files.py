"""Writing output files whole or not at all.

Each file is written under a hidden name unique to this process (`.<name>.<pid>.<n>.partial`, in the target's
folder) and renamed over the target only when complete. So a failure, a Ctrl-C or a second run writing the same
path at the same time never leaves a partial file or a mix of two runs; an existing file is replaced by a
complete new one. Files get the usual permissions (0666 less the umask, 0644 mostly).
"""
from __future__ import annotations

import contextlib
import errno
import itertools
import os
import re
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional, Sequence

from ..core.errors import ErnieImageError
from .uninterrupted import uninterrupted

_counter = itertools.count()
FULL_DISK = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is used up"}
FREE_SPACE_FIX = "free space on it, or give a path on another disk"
_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")  # how safetensors' and tokenizers' writers carry errno
# numpy's tofile (the GGUF writer's) reports a short write with no errno; to a regular file, only a disk (or quota)
# that ran out stops a write short.
_SHORT_WRITE = re.compile(r"^\d+ requested and \d+ written$")


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

    Targets renamed before a later rename fails are removed as well, so a batch is written whole or not at all (a
    write that fails, the full disk included, fails before any rename and leaves every target as it was; a rename
    failing after the folders were checked would leave the files the earlier renames replaced gone).
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


def error_number(error: BaseException) -> Optional[int]:
    """The errno of a failed write: an OSError's, or the one a Rust writer's message carries (safetensors)."""
    if isinstance(error, OSError) and error.errno:
        return error.errno
    if isinstance(error, OSError) and _SHORT_WRITE.match(str(error)):
        return errno.ENOSPC
    match = _RUST_OS_ERROR.search(str(error))
    return int(match.group(1)) if match else None


def full_disk(error: BaseException) -> Optional[str]:
    """'the disk is full (No space left on device)' (or its quota) when `error` is a write that ran out of space;
    None for any other error. No other path in the same folder would help: the fix is FREE_SPACE_FIX."""
    number = error_number(error)
    what = FULL_DISK.get(number or 0)
    return f"{what} ({os.strerror(number)})" if what is not None else None


def write_error(out: Path, error: BaseException, name: str = "out") -> ErnieImageError:
    """The one line for an output file that could not be written. It names the parameter `name` that gave `out`
    (the CLI shows its flag, --out: cli/names.py); a full disk or quota is said so, as no other path in the same
    folder would help."""
    full = full_disk(error)
    if full is not None:
        return ErnieImageError(f"{name} {out} cannot be written: {full}: {FREE_SPACE_FIX}").naming(name)
    reason = getattr(error, "strerror", None) or str(error)
    return ErnieImageError(f"{name} {out} cannot be written ({reason}): give a path in a writable folder"
                           ).naming(name)

