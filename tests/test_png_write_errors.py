"""An output PNG that cannot be written: a full disk is said to be full (no other path in that folder would help),
and the words follow the caller: `out` from Python, `--out` from the CLI. The full disk is real: a 16 KiB tmpfs
mounted in a private mount namespace (`unshare -rm`), skipped where the system allows none."""
from __future__ import annotations

import errno
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

