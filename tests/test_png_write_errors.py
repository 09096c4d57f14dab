"""An output PNG that cannot be written: a full disk is said to be full (no other path in that folder would help),
and the words follow the caller: `out` from Python, `--out` from the CLI. The full disk is real: a 16 KiB tmpfs
mounted in a private mount namespace (`unshare -rm`), skipped where the system allows none."""
from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from full_disk import needs_namespaces, on_a_full_disk


def _on_a_full_disk(tmp_path: Path, argv: list[str], disk: Path) -> subprocess.CompletedProcess:
    return on_a_full_disk(tmp_path, argv, disk)[0]


@needs_namespaces
def test_save_pngs_on_a_full_disk_says_the_disk_is_full_naming_out(tmp_path):
    disk = tmp_path / "disk"
    code = textwrap.dedent(f"""
        import torch
        from ernie_image import ErnieImageError, save_pngs
        try:
            save_pngs(torch.rand(1, 256, 256, 3), {str(disk / "x.png")!r}, {{}})
        except ErnieImageError as error:
            print(error)
    """)
    done = _on_a_full_disk(tmp_path, [sys.executable, "-c", code], disk)
    assert done.stdout.strip() == (f"out {disk / 'x.png'} cannot be written: the disk is full (No space left on "
                                   "device): free space on it, or give a path on another disk"), done.stderr


@needs_namespaces
def test_the_cli_on_a_full_disk_says_the_disk_is_full_naming_its_flag(tmp_path, tiny_turbo_folder):
    disk = tmp_path / "disk"
    done = _on_a_full_disk(tmp_path, [sys.executable, "-m", "ernie_image", "generate", "--model-dir",
                                      str(tiny_turbo_folder), "--width", "256", "--height", "256", "--steps", "1",
                                      "--prompt", "a fox", "--out", str(disk / "x.png")], disk)
    assert done.returncode != 0
    assert done.stderr.strip().splitlines()[-1] == (
        f"error: --out {disk / 'x.png'} cannot be written: the disk is full (No space left on device): free space on "
        "it, or give a path on another disk"), done.stderr


@pytest.mark.parametrize("code, expected", [
    (errno.EDQUOT, "the disk quota is used up (Disk quota exceeded): free space on it, or give a path on another "
                   "disk"),
    (errno.EACCES, "(Permission denied): give a path in a writable folder"),
])
def test_each_write_failure_names_its_own_fix(code, expected):
    from ernie_image.runtime.files.png_output import write_error

    message = str(write_error(Path("/data/x.png"), OSError(code, os.strerror(code))))
    assert message.startswith("out /data/x.png cannot be written") and message.endswith(expected), message




# On the (empty) disk: earlier files at every target (argv[2], JSON {name: text}), then `generate` (argv[3:]); prints
# the command's exit code and what every file on the disk holds.
_OVER_EARLIER_FILES = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    from ernie_image.runtime.cli import main

    disk = Path(sys.argv[1])
    for name, text in json.loads(sys.argv[2]).items():
        (disk / name).write_text(text)
    code = main(sys.argv[3:])
    print(json.dumps({"code": code, "files": {path.name: path.read_text(errors="replace")
                                              for path in disk.iterdir()}}))
""")


def _generate_with_comparison(model: Path, out: Path, compare: Path, batch: int) -> list[str]:
    return ["generate", "--model-dir", str(model), "--width", "256", "--height", "256", "--steps", "2", "--batch",
            str(batch), "--prompt", "a fox", "--step-cache", "fbcache", "--step-cache-compare", str(compare),
            "--out", str(out)]


@needs_namespaces
@pytest.mark.parametrize("batch, failing", [(1, 1), (2, 1), (2, 2), (2, 3)])
def test_a_command_writes_its_images_and_comparison_all_or_none_whichever_file_fills_the_disk(
        tmp_path, tiny_turbo_folder, batch, failing):
    """`generate --out --step-cache-compare` writes every file it makes (each image of the batch, then each
    side-by-side) or none: the disk filling up at any file after the first leaves every file they would replace as
    it was and no partial file, and one line names the option whose file could not be written."""
    from ernie_image.runtime.cli import main
    from ernie_image.runtime.files.png_output import png_paths

    reference = tmp_path / "reference"
    reference.mkdir()
    assert main(_generate_with_comparison(tiny_turbo_folder, reference / "x.png", reference / "c.png", batch)) == 0
    written = [*png_paths(reference / "x.png", batch), *png_paths(reference / "c.png", batch)]
    pages = [-(-path.stat().st_size // 4096) for path in written]
    earlier = {path.name: f"the {path.name} of an earlier run" for path in written}  # a page each
    room = 4096 * (len(earlier) + sum(pages[:failing]) + pages[failing] // 2)  # the failing file gets half its size
    disk = tmp_path / "disk"
    argv = [sys.executable, "-c", _OVER_EARLIER_FILES, str(disk), json.dumps(earlier),
            *_generate_with_comparison(tiny_turbo_folder, disk / "x.png", disk / "c.png", batch)]
    done, left = on_a_full_disk(tmp_path, argv, disk, size=str(room))
    after = json.loads(done.stdout.strip().splitlines()[-1])
    assert after["code"] != 0 and after["files"] == earlier and left == sorted(earlier), done.stderr
    option, given = ("--out", disk / "x.png") if failing < batch else ("--step-cache-compare", disk / "c.png")
    assert done.stderr.strip().splitlines()[-1] == (
        f"error: {option} {given} cannot be written: the disk is full (No space left on device): free space on it, "
        "or give a path on another disk"), done.stderr
