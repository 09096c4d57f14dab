"""A real full disk for tests: a small tmpfs mounted in a private mount namespace (`unshare -rm`), so no root is
needed and nothing outside the command sees it. Tests that use it are skipped where the system allows none."""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent


def on_a_full_disk(tmp_path: Path, argv: list[str], disk: Path, size: str = "16k",
                   env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess, list[str]]:
    """Run `argv` with `disk` a tmpfs of `size` of its own; also what is left on the disk afterwards (its paths,
    relative, sorted), listed inside the namespace before the disk goes away with it."""
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    if not (site / "ernie_image").exists():
        (site / "ernie_image").symlink_to(REPO_ROOT, target_is_directory=True)  # `-m ernie_image` runs this checkout
    disk.mkdir()
    listing = tmp_path / f"{disk.name}.left"
    script = (f"mount -t tmpfs -o size={size} tmpfs {shlex.quote(str(disk))} || exit 99; \"$@\"; code=$?; "
              f"cd {shlex.quote(str(disk))} && find . -mindepth 1 > {shlex.quote(str(listing))}; exit $code")
    env = {**os.environ, "PYTHONPATH": str(site), "ERNIE_IMAGE_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1",
           **(env or {})}
    done = subprocess.run(["unshare", "-rm", "sh", "-c", script, "sh", *argv], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode != 99, done.stderr  # the tmpfs could not be mounted
    left = sorted(line[2:] for line in listing.read_text().splitlines()) if listing.exists() else []
    return done, left


def _namespaces_allowed() -> bool:
    if shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode == 0


needs_namespaces = pytest.mark.skipif(not _namespaces_allowed(), reason="no unprivileged mount namespaces here")
