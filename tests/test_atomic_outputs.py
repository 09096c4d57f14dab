"""A batch of output files is written all or none, the renames included: files are written under hidden partial
names and renamed over their targets only once all are complete, each earlier file kept under a hidden backup name
until every rename has succeeded. A rename that fails half way (any errno, at any position) puts every earlier file
back byte for byte and leaves no partial or backup file; the error is one line naming the output whose file failed,
why, and the fix.

Renames are failed by fault injection (os.replace raising a real OSError with a real errno, as the kernel would),
and for real: a target that is a bind mount of its own (in a private mount namespace), which no rename can replace,
root or not; a target whose folder turns read-only after the checks (run as an ordinary user in a user namespace
where the tests run as root, as root's rights override permissions)."""
from __future__ import annotations

import errno
import json
import os
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Callable

import pytest
import torch
from full_disk import REPO_ROOT, needs_namespaces

from ernie_image.runtime.core.errors import ErnieImageError
from ernie_image.runtime.files import output_files
from ernie_image.runtime.files.output_files import (STALE_PARTIAL_S, OutputNotReplaced, atomic_outputs,
                                                     remove_stale_partials, write_error)
from ernie_image.runtime.files.png_output import PngOutput, png_paths, save_png_outputs

# (how many outputs, which one's rename fails, from 1): every position of batches of 1 to 4
POSITIONS = [(count, failing) for count in range(1, 5) for failing in range(1, count + 1)]
# Which targets had a file before the batch (by index)
EARLIER = {"all had a file": lambda index: True, "none had": lambda index: False,
           "every other had": lambda index: index % 2 == 0}
# What a rename can fail with after the folders were checked
RENAME_ERRORS = [errno.EXDEV, errno.EACCES, errno.ENOSPC, errno.EBUSY]


def folder_files(folder: Path) -> dict[str, bytes]:
    """Every file in `folder`, hidden ones included, with its bytes."""
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir())}


def earlier_files(folder: Path, count: int, had: Callable[[int], bool]) -> list[Path]:
    """`count` targets in `folder`, those that `had` one given an earlier file of their own bytes."""
    targets = [folder / f"out_{index}.png" for index in range(count)]
    for index, target in enumerate(targets):
        if had(index):
            target.write_bytes(f"the earlier out_{index}.png".encode())
    return targets


def write_batch(targets: list[Path]) -> None:
    with atomic_outputs(targets) as partials:
        for index, partial in enumerate(partials):
            partial.write_bytes(f"the new out_{index}.png".encode())


class Renames:
    """os.replace with a fault injected: the rename of a complete new file over `failing` raises `error` (a real
    OSError, as the kernel's), or whatever `error` is; every other rename is real and the targets reached are
    recorded in order."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, failing: Path, error: BaseException) -> None:
        self.done: list[Path] = []
        real = os.replace

        def replace(source, destination, **kwargs) -> None:
            source, destination = Path(source), Path(destination)
            if source.name.endswith(".partial") and destination == failing:
                raise error
            real(source, destination, **kwargs)
            if source.name.endswith(".partial"):
                self.done.append(destination)

        monkeypatch.setattr(os, "replace", replace)


def rename_error(number: int, source: str = "", destination: str = "") -> OSError:
    return OSError(number, os.strerror(number), source, None, destination)


@pytest.mark.parametrize("number", RENAME_ERRORS, ids=errno.errorcode.get)
@pytest.mark.parametrize("had", EARLIER.values(), ids=EARLIER.keys())
@pytest.mark.parametrize("count, failing", POSITIONS, ids=lambda value: str(value))
def test_a_rename_failing_at_any_position_puts_every_earlier_file_back_and_leaves_nothing_else(
        tmp_path, monkeypatch, count, failing, had, number):
    targets = earlier_files(tmp_path, count, had)
    before = folder_files(tmp_path)
    renames = Renames(monkeypatch, targets[failing - 1], rename_error(number))
    with pytest.raises(OutputNotReplaced) as caught:
        write_batch(targets)
    assert renames.done == targets[:failing - 1]  # the renames before the failing one did replace their targets
    assert (caught.value.target, caught.value.errno, caught.value.strerror) == (
        targets[failing - 1], number, os.strerror(number))
    assert folder_files(tmp_path) == before  # earlier files byte for byte, no new file, no partial or backup file


@pytest.mark.parametrize("had", EARLIER.values(), ids=EARLIER.keys())
@pytest.mark.parametrize("count", [1, 2, 4])
def test_a_batch_that_succeeds_replaces_every_target_and_leaves_no_backup(tmp_path, count, had):
    targets = earlier_files(tmp_path, count, had)
    write_batch(targets)
    assert folder_files(tmp_path) == {f"out_{index}.png": f"the new out_{index}.png".encode() for index in range(count)}


@pytest.mark.parametrize("count, failing", POSITIONS, ids=lambda value: str(value))
def test_where_the_file_system_takes_no_hard_links_earlier_files_are_renamed_aside_and_back(
        tmp_path, monkeypatch, count, failing):
    """os.link refused (EPERM, as protected_hardlinks or a file system without links says it): each earlier file
    is renamed aside instead. A batch that fails at any position puts each back; one that succeeds keeps none."""
    def no_links(*args, **kwargs) -> None:
        raise rename_error(errno.EPERM)

    monkeypatch.setattr(os, "link", no_links)
    targets = earlier_files(tmp_path, count, EARLIER["all had a file"])
    before = folder_files(tmp_path)
    Renames(monkeypatch, targets[failing - 1], rename_error(errno.EACCES))
    with pytest.raises(OutputNotReplaced, match="Permission denied"):
        write_batch(targets)
    assert folder_files(tmp_path) == before
    monkeypatch.undo()
    monkeypatch.setattr(os, "link", no_links)
    write_batch(targets)
    assert folder_files(tmp_path) == {f"out_{index}.png": f"the new out_{index}.png".encode() for index in range(count)}


@pytest.mark.parametrize("count, failing", POSITIONS, ids=lambda value: str(value))
def test_keeping_an_earlier_file_that_fails_is_a_failed_output_too(tmp_path, monkeypatch, count, failing):
    """Neither a link nor a rename aside can keep the failing target's earlier file (a mount point of its own says
    EXDEV, then EBUSY): nothing of the batch stays, and the error names that target."""
    targets = earlier_files(tmp_path, count, EARLIER["all had a file"])
    before = folder_files(tmp_path)
    real_link, real_replace = os.link, os.replace

    def link(source, destination, **kwargs) -> None:
        if Path(source) == targets[failing - 1]:
            raise rename_error(errno.EXDEV, str(source), str(destination))
        real_link(source, destination, **kwargs)

    def replace(source, destination, **kwargs) -> None:
        if Path(source) == targets[failing - 1]:
            raise rename_error(errno.EBUSY, str(source), str(destination))
        real_replace(source, destination, **kwargs)

    monkeypatch.setattr(os, "link", link)
    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(OutputNotReplaced) as caught:
        write_batch(targets)
    assert (caught.value.target, caught.value.errno) == (targets[failing - 1], errno.EBUSY)
    assert folder_files(tmp_path) == before


def test_a_symlink_at_a_target_is_put_back_as_the_link_it_was(tmp_path, monkeypatch):
    """A target that is a symlink (to a file elsewhere) is replaced as a link, not written through, and a failed
    batch puts the link itself back, pointing where it did; the file it points to is never touched."""
    elsewhere = tmp_path / "elsewhere.png"
    elsewhere.write_bytes(b"the file the link points to")
    folder = tmp_path / "out"
    folder.mkdir()
    targets = [folder / "out_0.png", folder / "out_1.png"]
    targets[0].symlink_to(elsewhere)
    Renames(monkeypatch, targets[1], rename_error(errno.EACCES))
    with pytest.raises(OutputNotReplaced):
        write_batch(targets)
    assert [path.name for path in folder.iterdir()] == ["out_0.png"] and os.readlink(targets[0]) == str(elsewhere)
    monkeypatch.undo()
    write_batch(targets)
    assert not targets[0].is_symlink() and targets[0].read_bytes() == b"the new out_0.png"
    assert elsewhere.read_bytes() == b"the file the link points to"


@pytest.mark.parametrize("count, failing", POSITIONS, ids=lambda value: str(value))
def test_a_folder_at_a_target_is_never_moved_and_fails_the_batch(tmp_path, count, failing):
    """A folder where a file is to go (made after the checks) is left where it is, its files in it: no file replaces
    a folder, so the batch fails there (EISDIR) and every other target is as it was."""
    targets = earlier_files(tmp_path, count, EARLIER["every other had"])
    if targets[failing - 1].exists():
        targets[failing - 1].unlink()
    targets[failing - 1].mkdir()
    (targets[failing - 1] / "inside.txt").write_text("the user's")
    before = {path.name: path.read_bytes() for path in tmp_path.iterdir() if path.is_file()}
    with pytest.raises(OutputNotReplaced) as caught:
        write_batch(targets)
    assert (caught.value.target, caught.value.errno) == (targets[failing - 1], errno.EISDIR)
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted([*before, targets[failing - 1].name])
    assert {name: (tmp_path / name).read_bytes() for name in before} == before
    assert folder_files(targets[failing - 1]) == {"inside.txt": b"the user's"}


@pytest.mark.parametrize("count, failing", POSITIONS, ids=lambda value: str(value))
def test_a_ctrl_c_between_two_renames_puts_every_earlier_file_back(tmp_path, monkeypatch, count, failing):
    """A library caller's Ctrl-C (KeyboardInterrupt) as a rename starts: the batch is undone and the interrupt goes
    on (the CLI takes no cancel from the first rename: test_cli.py)."""
    targets = earlier_files(tmp_path, count, EARLIER["every other had"])
    before = folder_files(tmp_path)
    Renames(monkeypatch, targets[failing - 1], KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        write_batch(targets)
    assert folder_files(tmp_path) == before


def test_an_earlier_file_that_cannot_be_put_back_is_kept_and_named(tmp_path, monkeypatch):
    """The rename back fails too (the folder turned read-only between the two): that earlier file stays under its
    backup name, which the one-line error gives, so no file the user had is lost."""
    targets = earlier_files(tmp_path, 3, EARLIER["all had a file"])
    real = os.replace

    def replace(source, destination, **kwargs) -> None:
        source, destination = Path(source), Path(destination)
        if destination == targets[2] or source.name.endswith(".backup"):
            raise rename_error(errno.EROFS, str(source), str(destination))
        real(source, destination, **kwargs)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(OutputNotReplaced) as caught:
        write_batch(targets)
    kept = caught.value.kept
    assert [path.name.split(".")[1:3] for path in kept] == [["out_1", "png"], ["out_0", "png"]]
    assert [path.read_bytes() for path in kept] == [b"the earlier out_1.png", b"the earlier out_0.png"]
    assert folder_files(tmp_path) == {**{path.name: path.read_bytes() for path in kept},
                                      "out_0.png": b"the new out_0.png", "out_1.png": b"the new out_1.png",
                                      "out_2.png": b"the earlier out_2.png"}
    assert str(write_error(targets[2], caught.value)) == (
        f"out {targets[2]} cannot be written (Read-only file system): give a path in a writable folder; the files it "
        f"would replace are kept as {kept[0]}, {kept[1]}")


# -- as save_pngs reports it: the output whose file failed, in one line with the fix ---------------------------------
def images(count: int) -> torch.Tensor:
    return torch.linspace(0, 1, count * 8 * 8 * 3).reshape(count, 8, 8, 3)


@pytest.mark.parametrize("failing", range(5))
def test_save_png_outputs_names_the_output_whose_rename_failed(tmp_path, monkeypatch, failing):
    """Two outputs, a batch of three images (`out`) and two side-by-sides (`compare`): whichever file's rename
    fails, the line names its own output and path (not the last output written), why, and the fix."""
    outputs = [PngOutput(images(3), tmp_path / "x.png", {}, "out"),
               PngOutput(images(2), tmp_path / "c.png", {}, "compare")]
    files = [*png_paths(tmp_path / "x.png", 3), *png_paths(tmp_path / "c.png", 2)]
    for path in files:
        path.write_bytes(b"an earlier run's " + path.name.encode())
    before = folder_files(tmp_path)
    Renames(monkeypatch, files[failing], rename_error(errno.EACCES))
    with pytest.raises(ErnieImageError) as caught:
        save_png_outputs(outputs)
    name, given = ("out", tmp_path / "x.png") if failing < 3 else ("compare", tmp_path / "c.png")
    assert str(caught.value) == (f"{name} {given}: {files[failing].name} cannot be written (Permission denied): give "
                                 "a path in a writable folder")
    assert caught.value.settings == (name,)
    assert folder_files(tmp_path) == before


@pytest.mark.parametrize("number, fix", [
    (errno.EACCES, " (Permission denied): give a path in a writable folder"),
    (errno.EROFS, " (Read-only file system): give a path in a writable folder"),
    (errno.EBUSY, " (Device or resource busy): give a path that is not a mount point (a file mounted on its own cannot "
                  "be replaced)"),
    (errno.EXDEV, " (Invalid cross-device link): give a path that is not a mount point (a file mounted on its own "
                  "cannot be replaced)"),
    (errno.ENOSPC, ": the disk is full (No space left on device): free space on it, or give a path on another disk"),
    (errno.EDQUOT, ": the disk quota is used up (Disk quota exceeded): free space on it, or give a path on another "
                   "disk"),
], ids=lambda value: errno.errorcode.get(value) if isinstance(value, int) else None)
def test_each_failed_rename_names_its_own_fix(tmp_path, number, fix):
    target = tmp_path / "x.png"
    error = OutputNotReplaced(target, rename_error(number))
    assert str(write_error(target, error)) == f"out {target} cannot be written{fix}"


@pytest.mark.parametrize("left", [1, 2])
def test_unfinished_files_that_could_not_be_removed_are_named_with_the_fix(tmp_path, left):
    target = tmp_path / "x.png"
    partials = [tmp_path / f".x.png.1.{n}.partial" for n in range(left)]
    error = OutputNotReplaced(target, rename_error(errno.EACCES), left=partials)
    files = (f"its unfinished file {partials[0]} could not be removed: delete it" if left == 1 else
             f"its unfinished files {partials[0]}, {partials[1]} could not be removed: delete them")
    assert str(write_error(target, error)).endswith(f"give a path in a writable folder; {files}")


# -- for real ---------------------------------------------------------------------------------------------------------
# Inside a private mount namespace: earlier files at each of argv[2] targets in argv[1], the one at index argv[3] made a
# bind mount of its own, then save_pngs of that many images; prints the error and every file's bytes after.
_OVER_A_MOUNTED_FILE = textwrap.dedent("""
    import json, subprocess, sys
    from pathlib import Path
    import torch
    from ernie_image import ErnieImageError, save_pngs
    from ernie_image.runtime.files.png_output import png_paths

    folder, count, mounted = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    paths = png_paths(folder / "x.png", count)
    for path in paths:
        path.write_text("the earlier " + path.name)
    (folder.parent / "elsewhere").write_text("mounted over")
    subprocess.run(["mount", "--bind", str(folder.parent / "elsewhere"), str(paths[mounted])], check=True)
    try:
        save_pngs(torch.rand(count, 8, 8, 3), folder / "x.png", {})
        said = None
    except ErnieImageError as error:
        said = str(error)
    subprocess.run(["umount", str(paths[mounted])], check=True)
    files = {path.name: path.read_text(errors="replace") for path in sorted(folder.iterdir())}
    print(json.dumps({"said": said, "files": files}))
""")


@needs_namespaces
@pytest.mark.parametrize("count, failing", [(1, 1), (3, 1), (3, 2), (3, 3)], ids=lambda value: str(value))
def test_a_target_mounted_on_its_own_fails_the_batch_for_real_leaving_every_file_as_it_was(tmp_path, count, failing):
    """A bind-mounted file (an output path a container was given) cannot be replaced, by root either: the kernel
    says EXDEV to the link and EBUSY to the renames. The batch is undone, whichever image it is."""
    folder = tmp_path / "out"
    folder.mkdir()
    site = tmp_path / "site"
    site.mkdir()
    (site / "ernie_image").symlink_to(REPO_ROOT, target_is_directory=True)
    done = subprocess.run(["unshare", "-rm", sys.executable, "-c", _OVER_A_MOUNTED_FILE, str(folder), str(count),
                           str(failing - 1)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(site), "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    after = json.loads(done.stdout.strip().splitlines()[-1])
    which = "" if count == 1 else f": x_{failing - 1}.png"  # a batch's line names its file that failed
    assert after["said"] == (f"out {folder / 'x.png'}{which} cannot be written (Device or resource busy): give a path "
                             "that is not a mount point (a file mounted on its own cannot be replaced)")
    assert after["files"] == {path.name: f"the earlier {path.name}" for path in png_paths(folder / "x.png", count)}


# argv[1]: a folder holding folders a/ and b/, each with an earlier x.png; both replaced as one batch, b/ turned
# read-only once the new files are written. Prints the error's target, errno and each folder's files after.
_INTO_A_FOLDER_TURNED_READ_ONLY = textwrap.dedent("""
    import json, os, sys
    from pathlib import Path
    from ernie_image.runtime.files.output_files import OutputNotReplaced, atomic_outputs

    root = Path(sys.argv[1])
    targets = [root / "a" / "x.png", root / "b" / "x.png"]
    said = None
    try:
        with atomic_outputs(targets) as partials:
            for partial in partials:
                partial.write_bytes(b"new")
            os.chmod(root / "b", 0o555)
    except OutputNotReplaced as error:
        said = [str(error.target), error.errno, [str(path) for path in error.left]]
    finally:
        os.chmod(root / "b", 0o755)
    files = {name: {path.name: path.read_text() for path in sorted((root / name).iterdir())} for name in "ab"}
    print(json.dumps({"said": said, "files": files, "new": partials[1].name}))
""")


def _without_root() -> list[str] | None:
    """A command prefix under which folder permissions bind this process: none needed for a user, a user namespace
    mapping root to an ordinary user (whose capabilities go at exec) for root; None where root has no such way."""
    if os.geteuid() != 0:
        return []
    prefix = ["unshare", "--user", "--map-user=1000", "--map-group=1000"]
    try:
        allowed = subprocess.run([*prefix, "true"], capture_output=True).returncode == 0
    except FileNotFoundError:
        return None
    return prefix if allowed else None


@pytest.mark.skipif(_without_root() is None, reason="root here, and no user namespace to drop its rights in: the "
                                                    "bind-mount and fault-injection tests cover the renames")
def test_a_folder_turned_read_only_after_the_checks_fails_the_batch_for_real(tmp_path):
    """The second target's folder loses its write permission once every file is written: keeping its earlier file
    and its rename fail with EACCES, and the first target gets its earlier file back. The new file written in that
    folder before it turned read-only is the one file left: nobody but the folder's owner can remove it now."""
    for name in "ab":
        (tmp_path / name).mkdir()
        (tmp_path / name / "x.png").write_text(f"the earlier {name}")
    site = tmp_path / "site"
    site.mkdir()
    (site / "ernie_image").symlink_to(REPO_ROOT, target_is_directory=True)
    done = subprocess.run([*_without_root(), sys.executable, "-c", _INTO_A_FOLDER_TURNED_READ_ONLY, str(tmp_path)],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(site), "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    after = json.loads(done.stdout.strip().splitlines()[-1])
    assert after["said"] == [str(tmp_path / "b" / "x.png"), errno.EACCES, [str(tmp_path / "b" / after["new"])]]
    assert after["files"] == {"a": {"x.png": "the earlier a"}, "b": {"x.png": "the earlier b", after["new"]: "new"}}


# ------------------------------------------------------------------------------- leftovers of a killed process
def dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(child.stdout)


def leftover(folder: Path, target: str, pid: int, age_s: float, kind: str = "partial", number: int = 0) -> Path:
    path = folder / f".{target}.{pid}.{number}.{kind}"
    path.write_bytes(b"half a file")
    old = path.stat().st_mtime - age_s
    os.utime(path, (old, old))
    return path


def test_the_next_write_removes_the_partial_files_a_killed_process_left_of_that_target(tmp_path):
    dead = dead_pid()
    stale = leftover(tmp_path, "a.png", dead, STALE_PARTIAL_S + 60)
    kept = {
        "written recently": leftover(tmp_path, "a.png", dead, 5, number=1),
        "a live process's": leftover(tmp_path, "a.png", os.getppid(), STALE_PARTIAL_S + 60),
        "another target's": leftover(tmp_path, "b.png", dead, STALE_PARTIAL_S + 60),
        "a backup (the earlier file itself)": leftover(tmp_path, "a.png", dead, STALE_PARTIAL_S + 60, "backup"),
    }
    with atomic_outputs([tmp_path / "a.png"]) as (partial,):
        partial.write_bytes(b"new")
    assert (tmp_path / "a.png").read_bytes() == b"new" and not stale.exists()
    assert [what for what, path in kept.items() if not path.exists()] == []


def test_a_partial_bearing_this_process_pid_that_it_is_not_writing_was_left_by_an_earlier_one(tmp_path,
                                                                                              monkeypatch):
    """A container's first process is pid 1 at every start: what a killed one left bears the next one's pid. Those
    this process is writing are kept however old, as are young ones; the target given relative to the folder."""
    monkeypatch.chdir(tmp_path)
    earlier = leftover(tmp_path, "a.png", os.getpid(), STALE_PARTIAL_S + 60)
    young = leftover(tmp_path, "a.png", os.getpid(), 5, number=1)
    with atomic_outputs([Path("a.png")]) as (ours,):
        old = time.time() - STALE_PARTIAL_S - 60
        os.utime(ours, (old, old))
        with atomic_outputs([Path("a.png")]) as (second,):
            second.write_bytes(b"second")
        assert ours.exists() and not earlier.exists() and young.exists()
        ours.write_bytes(b"first")
    assert (tmp_path / "a.png").read_bytes() == b"first"
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted(["a.png", young.name])


def test_a_long_names_hidden_names_are_cut_to_fit_and_its_leftovers_still_removed(tmp_path):
    """A 250-byte target: its partial name is cut to the folder's longest name with a hash of the whole name, which
    tells another long name cut alike apart; what a killed process left under it goes on the next write."""
    target, alike = tmp_path / ("d" * 246 + ".png"), tmp_path / ("d" * 246 + ".jpg.png")
    stem = output_files.hidden_stem(target)
    assert len(os.fsencode(f".{stem}.{9_999_999}.{'0' * 12}.partial")) <= 255
    assert stem != output_files.hidden_stem(alike)
    stale = leftover(tmp_path, stem, dead_pid(), STALE_PARTIAL_S + 60)
    other = leftover(tmp_path, output_files.hidden_stem(alike), dead_pid(), STALE_PARTIAL_S + 60)
    with atomic_outputs([target]) as (partial,):
        assert partial.name.startswith(f".{stem}.")
        partial.write_bytes(b"new")
    assert target.read_bytes() == b"new" and not stale.exists() and other.exists()


def test_a_folder_that_cannot_be_listed_still_takes_the_write(tmp_path, monkeypatch):
    def unlistable(path):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(os, "scandir", unlistable)
    with atomic_outputs([tmp_path / "a.png"]) as (partial,):
        partial.write_bytes(b"new")
    assert (tmp_path / "a.png").read_bytes() == b"new"


def test_a_link_or_folder_named_like_a_leftover_is_never_removed(tmp_path):
    dead = dead_pid()
    elsewhere = tmp_path / "elsewhere.png"
    elsewhere.write_bytes(b"someone's file")
    link = tmp_path / f".a.png.{dead}.0.partial"
    link.symlink_to(elsewhere)
    folder = tmp_path / f".a.png.{dead}.1.partial"
    folder.mkdir()
    old = elsewhere.stat().st_mtime - STALE_PARTIAL_S - 60
    for path in (link, folder):
        os.utime(path, (old, old), follow_symlinks=False)
    assert remove_stale_partials(tmp_path / "a.png") == []
    assert link.is_symlink() and folder.is_dir() and elsewhere.read_bytes() == b"someone's file"


# ------------------------------------------------------------------------------- names no one can plant
def test_a_link_planted_at_the_hidden_name_is_never_written_through(tmp_path, monkeypatch):
    """A name someone guessed and planted a link at is passed over: the file is written where nothing was."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    tokens = iter(["planted", "fresh"])
    monkeypatch.setattr(output_files.secrets, "token_hex", lambda size: next(tokens))
    (tmp_path / f".s.png.{os.getpid()}.planted.partial").symlink_to(victim)
    with atomic_outputs([tmp_path / "s.png"]) as (partial,):
        assert partial.name == f".s.png.{os.getpid()}.fresh.partial" and not partial.is_symlink()
        partial.write_bytes(b"new")
    assert victim.read_bytes() == b"precious" and (tmp_path / "s.png").read_bytes() == b"new"
    assert not (tmp_path / "s.png").is_symlink()


@pytest.mark.parametrize("swap", ["a link to another file", "a folder"])
def test_a_partial_swapped_while_written_fails_the_output_and_is_never_renamed_into_place(tmp_path, swap):
    """Someone who can write to the folder replaces the partial file while a writer has it by name: the check
    before the rename finds no file of this user there; the target stays as it was. (Someone else's file is
    refused by its owner, which this test, run as one user, cannot make.)"""
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    victim.chmod(0o600)
    target = tmp_path / "s.png"
    target.write_bytes(b"the earlier s.png")
    with pytest.raises(OutputNotReplaced) as caught:
        with atomic_outputs([target]) as (partial,):
            partial.unlink()
            if swap == "a folder":
                partial.mkdir()
            else:
                partial.symlink_to(victim)
    assert "was replaced by another while it was written" in str(caught.value) and caught.value.target == target
    assert target.read_bytes() == b"the earlier s.png" and not target.is_symlink()
    assert stat.S_IMODE(victim.stat().st_mode) == 0o600  # its mode is not touched either
    planted = {path.name for path in tmp_path.iterdir()} - {"s.png", "victim"}
    assert planted == (set() if swap != "a folder" else {partial.name})  # what someone else made there, kept


@pytest.mark.parametrize("umask, earlier_mode, expected", [
    (0o022, 0o600, 0o600), (0o022, 0o640, 0o640), (0o022, 0o664, 0o644), (0o022, 0o755, 0o644),
    (0o077, 0o666, 0o600), (0o002, 0o664, 0o664),
])
def test_a_replaced_file_is_never_more_open_than_it_was_or_than_the_umask_allows(tmp_path, monkeypatch, umask,
                                                                                    earlier_mode, expected):
    monkeypatch.setattr(output_files, "new_file_mode", lambda: 0o666 & ~umask)
    earlier = tmp_path / "private.png"
    earlier.write_bytes(b"old")
    earlier.chmod(earlier_mode)
    with atomic_outputs([earlier, tmp_path / "new.png"]) as partials:
        for partial in partials:
            partial.write_bytes(b"new")
    assert stat.S_IMODE(earlier.stat().st_mode) == expected
    assert stat.S_IMODE((tmp_path / "new.png").stat().st_mode) == 0o666 & ~umask


@pytest.mark.parametrize("swap", ["a link", "a FIFO"])
def test_a_png_is_never_written_through_what_was_swapped_in_after_its_file_was_made(tmp_path, monkeypatch, swap):
    """The PNG writer opens the partial file without following links and without waiting: a link someone put at
    its name between its making and the write is refused before a byte goes anywhere, and a FIFO fails at once
    instead of waiting for a reader for ever."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    made = output_files._new_partial

    def made_then_swapped(target):
        partial = made(target)
        partial.unlink()
        if swap == "a link":
            partial.symlink_to(victim)
        else:
            os.mkfifo(partial)
        return partial

    monkeypatch.setattr(output_files, "_new_partial", made_then_swapped)
    said = r"\(Too many levels of symbolic links\): someone else changed the folder" if swap == "a link" else ""
    with pytest.raises(ErnieImageError, match=rf"^out .*x\.png cannot be written {said}"):
        save_png_outputs([PngOutput(images(1), tmp_path / "x.png", {}, "out")])
    assert victim.read_bytes() == b"precious" and not (tmp_path / "x.png").exists()
