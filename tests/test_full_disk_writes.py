"""A full disk while the demo model is built or while `quantize` writes is one line naming the place and the fix
(free space, or another disk), leaving no partial file or folder behind. The full disk is real (full_disk.py)."""
from __future__ import annotations

import errno
import sys

import pytest
from full_disk import needs_namespaces, on_a_full_disk

FREE_SPACE = "the disk is full (No space left on device): free space on"


@needs_namespaces
def test_a_full_disk_while_the_demo_model_is_built_is_one_line_and_leaves_nothing(tmp_path):
    disk = tmp_path / "disk"
    cache = disk / "cache"
    done, left = on_a_full_disk(tmp_path, [sys.executable, "-m", "ernie_image", "generate", "--steps", "1",
                                           "--out", str(tmp_path / "x.png")], disk, env={"ERNIE_IMAGE_CACHE": str(cache)})
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        f"error: cannot build the demo model in {cache / 'tiny-turbo-v1'}: {FREE_SPACE} that disk, or set "
        "ERNIE_IMAGE_CACHE to a folder on another disk, or give a real model (--model-dir)"), done.stderr
    assert "Traceback" not in done.stderr
    assert left == ["cache"]  # the cache folder itself, empty: no partial build
    assert not (tmp_path / "x.png").exists()


@needs_namespaces
@pytest.mark.parametrize("fmt, name", [("fp8", "q.safetensors"), ("q8_0", "q.gguf")])
def test_a_full_disk_while_quantize_writes_is_one_line_and_leaves_nothing(tmp_path, tiny_turbo_folder, fmt, name):
    disk = tmp_path / "disk"
    done, left = on_a_full_disk(tmp_path, [sys.executable, "-m", "ernie_image", "quantize", "--dit",
                                           str(tiny_turbo_folder / "transformer"), "--format", fmt,
                                           "--out", str(disk / name)], disk)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        f"error: --out {disk / name} cannot be written: {FREE_SPACE} it, or give a path on another disk"], done.stderr
    assert left == []  # no partial file


def test_write_errors_without_an_oserror_errno_are_read_for_what_they_say():
    from safetensors import SafetensorError

    from ernie_image.runtime.files.output_files import full_disk

    error = SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    assert full_disk(error) == "the disk is full (No space left on device)"
    assert full_disk(OSError(errno.EDQUOT, "Disk quota exceeded")) == "the disk quota is used up (Disk quota exceeded)"
    assert full_disk(OSError("26112 requested and 12352 written")) == "the disk is full (No space left on device)"
    assert full_disk(SafetensorError("Error while deserializing header: HeaderTooLarge")) is None
