"""Writing output files whole or not at all.

Each file is written under a hidden name unique to this process and unguessable (`.<name>.<pid>.<random>.partial`,
in the target's folder, made anew where nothing was, so never through a link someone left there), checked to be
still a file of this user and not a link, and renamed over the target only when complete. So a failure, a Ctrl-C or
a second run writing the same path at the same time never leaves a partial file or a mix of two runs; an existing
file is replaced by a complete new one. A batch of files is replaced all or none: each file it replaces is kept
under a hidden name (`.<name>.<pid>.<random>.backup`) until every rename has succeeded, and put back if one fails.
A new file gets the usual permissions (0666 less the umask, 0644 mostly); a file that replaces one of this user's
is no more open than that one was. A process killed outright (SIGKILL, the out-of-memory killer) cleans up nothing:
the next write of the same target removes partial files that such a process left (this user's, its pid gone, the
file untouched for STALE_PARTIAL_S, so a writer in another PID namespace sharing the folder keeps its file); one
bearing this process's own pid that this process is not writing was left by an earlier process with the same pid
(a container's first process is pid 1 at every start) and goes by the same rule. A backup it left is the earlier
file itself and stays. Not on Windows, where no pid can be asked about safely
(signal 0 there is a Ctrl-C event).
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import secrets
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable, Iterable, Iterator, Optional, Sequence

from ..core.errors import ErnieImageError
from .uninterrupted import uninterrupted

_NO_FOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NO_WAIT = getattr(os, "O_NONBLOCK", 0)
_CLOSE_ON_EXEC = getattr(os, "O_CLOEXEC", 0)
FULL_DISK = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is used up"}
FREE_SPACE_FIX = "free space on it, or give a path on another disk"
# The file being written was swapped for a link or another's file (_seal, opened_partial).
TAMPERED_FIX = "someone else changed the folder while it was written: give a path in a folder only you can change"
# A rename over a file that is a mount point of its own (a file bind-mounted into a container) fails so.
MOUNTED_FIX = "give a path that is not a mount point (a file mounted on its own cannot be replaced)"
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


STALE_PARTIAL_S = 15 * 60  # a partial file being written is touched far more often than this
_PARTIAL_NAME = re.compile(r"^\.(?P<name>.+)\.(?P<pid>\d+)\.[0-9a-f]+\.partial$")
_WRITING: set[str] = set()  # the paths of this process's partial files, from made until renamed or removed


def remove_stale_partials(target: Path, now: Optional[float] = None) -> list[Path]:
    """Remove the partial files of `target` that a killed process left (module docstring); returns them."""
    removed: list[Path] = []
    if os.name == "nt":
        return removed
    try:
        entries = list(os.scandir(target.parent))
    except OSError:
        return removed
    now = time.time() if now is None else now
    stem = hidden_stem(target)
    for entry in entries:
        found = _PARTIAL_NAME.match(entry.name)
        if found is None or found["name"] != stem or os.path.abspath(entry.path) in _WRITING:
            continue
        if int(found["pid"]) != os.getpid() and _process_alive(int(found["pid"])):
            continue
        with contextlib.suppress(OSError):
            info = entry.stat(follow_symlinks=False)
            if stat.S_ISREG(info.st_mode) and info.st_uid == os.getuid() and now - info.st_mtime >= STALE_PARTIAL_S:
                os.unlink(entry.path)
                removed.append(Path(entry.path))
    return removed


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError):  # another user's process (EPERM), or a pid no process can have: kept
        return True
    return True


_TOKEN_BYTES = 6
# The characters a hidden name adds to its target's: ".", ".<pid>" (Linux pids have at most 7 digits),
# ".<token>" and ".partial" (the longer kind).
HIDDEN_NAME_EXTRA = 1 + 8 + 1 + 2 * _TOKEN_BYTES + len(".partial")
_CUT_MARK_BYTES = 1 + 16  # "~" and 16 hex digits of the whole name's hash, where a long name is cut


def hidden_name(path: Path, kind: str) -> Path:
    """A hidden name beside `path` for this process's `kind` ("partial", "backup") file: no one can plant a file
    or a link there in advance."""
    return path.with_name(f".{hidden_stem(path)}.{os.getpid()}.{secrets.token_hex(_TOKEN_BYTES)}.{kind}")


def hidden_stem(path: Path) -> str:
    """`path`'s name as its hidden names carry it: whole where they fit the folder's longest name, else cut to fit,
    with a hash of the whole name that tells two names cut alike apart. So an output name may be as long as the
    file system takes (255 bytes mostly), not that less the hidden name's extra characters."""
    name = os.fsencode(path.name)
    room = longest_name(path.parent) - HIDDEN_NAME_EXTRA
    if len(name) <= room:
        return path.name
    digest = hashlib.sha256(name).hexdigest()[:_CUT_MARK_BYTES - 1]
    return f"{os.fsdecode(name[:max(room - _CUT_MARK_BYTES, 1)])}~{digest}"


def longest_name(folder: Path) -> int:
    """The longest file name `folder`'s file system takes, in bytes (255 where it does not say)."""
    try:
        return os.pathconf(folder, "PC_NAME_MAX")
    except (OSError, ValueError):
        return 255


def _new_partial(target: Path) -> Path:
    """A new, empty file of this process beside `target` (mode 0600 until it is complete), made where nothing was."""
    while True:
        path = hidden_name(target, "partial")
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NO_FOLLOW | _CLOSE_ON_EXEC, 0o600))
        except FileExistsError:  # the one case a random name meets: try another
            continue
        _WRITING.add(os.path.abspath(path))
        return path


@contextlib.contextmanager
def opened_partial(partial: Path) -> Iterator[BinaryIO]:
    """The partial file opened for writing without following a link: a link swapped in at its name since it was
    made is refused (ELOOP) before a byte is written, and a swap after the open leaves the writes in this file.
    Writers that take a file object (PIL) use this; those that take only a name (safetensors, gguf) cannot."""
    fd = os.open(partial, os.O_WRONLY | os.O_TRUNC | _NO_FOLLOW | _CLOSE_ON_EXEC | _NO_WAIT)
    if hasattr(os, "set_blocking"):
        os.set_blocking(fd, True)  # opened without waiting (a FIFO swapped in fails at once), written as usual
    with os.fdopen(fd, "wb") as handle:
        yield handle


def _seal(partial: Path, mode: int) -> None:
    """Give the complete partial file its mode, once sure the name holds a file of this user, not a link: in a folder
    others may write to, the file could have been swapped for a link or someone else's file while a writer had it
    by name; then the output fails here instead of being renamed into place. (Not the same inode: some writers,
    safetensors' among them, put a new file at the name themselves.)"""
    replaced = OSError(errno.EEXIST, "the file being written was replaced by another while it was written",
                       str(partial))
    try:
        fd = os.open(partial, os.O_RDONLY | _NO_FOLLOW | _CLOSE_ON_EXEC | _NO_WAIT)  # a FIFO: no wait for a writer
    except OSError as error:
        if error.errno == errno.ELOOP:  # a link now stands at the name
            raise replaced from None
        raise
    try:
        info = os.fstat(fd)
        ours = not hasattr(os, "getuid") or info.st_uid == os.getuid()
        if not stat.S_ISREG(info.st_mode) or not ours:
            raise replaced
        if hasattr(os, "fchmod"):
            os.fchmod(fd, mode)
        else:  # Windows: no links to follow here
            os.chmod(partial, mode)
    finally:
        os.close(fd)


_commit_hook: Optional[Callable[[], None]] = None  # the running CLI command's (see set_commit_hook)


def set_commit_hook(hook: Optional[Callable[[], None]]) -> None:
    """Run `hook` before the first rename of every atomic output from now on (None: no hook). The CLI sets its
    interrupt handling here while a command runs, so that for every command that writes files a signal after the
    first rename no longer cancels."""
    global _commit_hook
    _commit_hook = hook


class OutputNotReplaced(OSError):
    """A complete new file could not be renamed over its target (`target`): errno and strerror are the rename's.
    Raised after every target of its batch was put back as it was and every partial and backup file removed (a
    backup that could not be put back stays, named in `kept`; a new file that could not be removed, in a folder
    turned read-only say, stays, named in `left`)."""

    def __init__(self, target: Path, error: OSError, kept: Sequence[Path] = (), left: Sequence[Path] = ()) -> None:
        super().__init__(error.errno, error.strerror or str(error), str(target))
        self.target = Path(target)
        self.kept = tuple(kept)  # earlier files that could not be put back, under their backup names
        self.left = tuple(left)  # unfinished new files that could not be removed


@dataclass
class _Replacing:
    """One target of a batch being committed, with the second name its earlier file has while the batch commits."""
    target: Path
    partial: Path
    backup: Optional[Path] = None  # None: the target had no earlier file (or the batch has not reached it)


@contextlib.contextmanager
def atomic_outputs(paths: Sequence[Path]) -> Iterator[list[Path]]:
    """Yield one partial path per target; once the block ends, rename them all over their targets, or, on any
    exception (Ctrl-C too), remove them and leave every target as it was.

    All or none holds through the renames too: each existing target gets a second, hidden name (a hard link, or it is
    renamed aside where the file system takes no links) before its new file replaces it, and if a later rename fails
    every target replaced so far gets its earlier file back. The failure is an OutputNotReplaced naming its target.
    The commit hook (set_commit_hook) runs just before the first rename: from there the batch replaces the targets
    (the CLI stops taking Ctrl-C as a cancel at that point, so a cancel never lands between two renames)."""
    targets = [Path(p) for p in paths]
    for target in targets:
        remove_stale_partials(target)
    partials: list[Path] = []
    try:
        try:
            for target in targets:
                try:
                    partials.append(_new_partial(target))
                except OSError as error:  # named by its target, as a failed rename is
                    raise OutputNotReplaced(target, error) from None
            yield partials
            mode = new_file_mode()
            for partial, target in zip(partials, targets):  # made 0600 until complete
                try:
                    _seal(partial, _mode_kept(target, mode))
                except OSError as error:
                    raise OutputNotReplaced(target, error) from None
            if _commit_hook is not None:
                _commit_hook()
        except BaseException as error:
            with uninterrupted():  # a second Ctrl-C cannot stop it half way
                left = _remove(partials)
            if isinstance(error, OutputNotReplaced):
                error.left = tuple(left)
            raise
        _replace_all([_Replacing(target, partial) for target, partial in zip(targets, partials)])
    finally:
        _WRITING.difference_update(os.path.abspath(partial) for partial in partials)


def _mode_kept(target: Path, new_mode: int) -> int:
    """The permissions a new file at `target` gets: `new_mode` (the umask's), narrowed to those of this user's file
    it replaces (a private file stays private; none is ever widened)."""
    try:
        info = os.lstat(target)
    except OSError:
        return new_mode
    own = not hasattr(os, "getuid") or info.st_uid == os.getuid()
    return stat.S_IMODE(info.st_mode) & new_mode if stat.S_ISREG(info.st_mode) and own else new_mode


def _replace_all(batch: list[_Replacing]) -> None:
    """Rename every partial over its target, keeping each earlier file until all are in place (atomic_outputs)."""
    current: Optional[_Replacing] = None
    try:
        for current in batch:
            _keep_earlier(current)
            os.replace(current.partial, current.target)
    except BaseException as error:
        with uninterrupted():  # a second Ctrl-C cannot stop it half way
            kept = [item.backup for item in reversed(batch) if not _put_back(item)]  # a path twice: last first
            left = _remove([item.partial for item in batch])
        if isinstance(error, OSError) and current is not None:
            raise OutputNotReplaced(current.target, error, kept, left) from error
        raise
    with uninterrupted():
        _remove([item.backup for item in batch if item.backup is not None])


def _keep_earlier(item: _Replacing) -> None:
    """Give the target's earlier file (if any) a second, hidden name: a hard link, else the file renamed aside. A
    folder at the target is left where it is (the rename over it fails: a file never replaces a folder)."""
    try:
        if stat.S_ISDIR(os.lstat(item.target).st_mode):
            return
    except FileNotFoundError:
        return
    item.backup = hidden_name(item.target, "backup")
    try:
        os.link(item.target, item.backup, follow_symlinks=False)  # a symlink is kept as the link it is
    except OSError:  # no hard links here (FAT, some network mounts) or not allowed (protected_hardlinks)
        os.replace(item.target, item.backup)


def _put_back(item: _Replacing) -> bool:
    """Undo one target's part of a batch, judged by the files (a Ctrl-C may land between a rename and the line
    after it): the earlier file back at the target, or the target removed where there was none. False where the
    earlier file could not be put back: it stays under its backup name, so it is not lost."""
    replaced = not os.path.lexists(item.partial)  # every partial exists until renamed over its target
    backup = item.backup if item.backup is not None and os.path.lexists(item.backup) else None
    try:
        if backup is not None and (replaced or not os.path.lexists(item.target)):  # new file in place, or aside
            os.replace(backup, item.target)
        elif backup is not None:  # linked, never replaced: the target still is the earlier file
            backup.unlink()
        elif replaced:
            item.target.unlink()
    except OSError:
        return backup is None
    return True


def _remove(paths: Iterable[Path]) -> list[Path]:
    """Remove each file; those still there after trying."""
    left = []
    for path in paths:
        with contextlib.suppress(OSError):
            path.unlink()
        if os.path.lexists(path):
            left.append(path)
    return left


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
    (the CLI shows its flag, --out: cli/names.py), and the file of its batch that failed where that is another
    (x_1.png of --out x.png); a full disk or quota is said so, as no other path in the same folder would help."""
    full = full_disk(error)
    target = getattr(error, "target", None)
    subject = f"{name} {out}" if target is None or Path(target) == Path(out) else f"{name} {out}: {Path(target).name}"
    if full is not None:
        line = f"{subject} cannot be written: {full}: {FREE_SPACE_FIX}"
    else:
        reason = getattr(error, "strerror", None) or str(error)
        number = error_number(error)
        fix = MOUNTED_FIX if number in (errno.EBUSY, errno.EXDEV) else TAMPERED_FIX if number in (
            errno.ELOOP, errno.EEXIST) else "give a path in a writable folder"
        line = f"{subject} cannot be written ({reason}): {fix}"
    kept = getattr(error, "kept", ())
    if kept:  # a rename back failed as well: the earlier file is not lost, only under a hidden name
        files = "the file it would replace is" if len(kept) == 1 else "the files it would replace are"
        line += f"; {files} kept as {', '.join(str(path) for path in kept)}"
    left = getattr(error, "left", ())
    if left:  # in a folder that turned read-only: only its owner can remove them now
        files, them = ("its unfinished file", "it") if len(left) == 1 else ("its unfinished files", "them")
        line += f"; {files} {', '.join(str(path) for path in left)} could not be removed: delete {them}"
    return ErnieImageError(line).naming(name)
