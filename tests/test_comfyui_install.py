"""The pack installed into a fresh ComfyUI the way ComfyUI-Manager installs it, then ComfyUI started.

ComfyUI-Manager (and a user following the README) clones the repository into ComfyUI's custom_nodes/ under the name
`git clone` gives it, pip-installs its requirements.txt into ComfyUI's own Python (`python -m pip install -r
requirements.txt`, in the pack's folder), runs the pack's install.py if it has one (it has none), and starts
ComfyUI. Here the clone is a copy of the files git tracks, as they are in this working tree: uncommitted edits are
tested, and a file git does not track, which a clone would not have, is left behind. The copy is a real folder, not
the link the other ComfyUI tests use, named after the repository URL in pyproject.toml.

Needs ERNIE_COMFYUI_DIR (a ComfyUI checkout) and ERNIE_COMFYUI_PYTHON (its Python, holding ComfyUI's requirements
and this pack's dependencies: pip then installs nothing, but it must succeed, and ComfyUI's torch must stay the one
it was).
"""
from __future__ import annotations

import shutil
import subprocess
import tomllib
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from comfyui_server import (COMFYUI_SUITE, COMFY_PYTHON, REPO_ROOT, Server, free_port, get_json, running)

NODE_IDS = ("ErnieImageLoader", "ErnieImageSampler", "ErnieImageTurboSampler", "ErnieImageQuantConfig",
            "ErnieImageRemoteBackend", "ErnieImagePromptEnhancer", "ErnieImageLoRA")
START_TIMEOUT_S = 180
PIP_TIMEOUT_S = 600

pytestmark = COMFYUI_SUITE


def clone_name() -> str:
    """The folder `git clone URL` makes, for the repository URL the project gives."""
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    return Path(urlsplit(project["urls"]["Repository"]).path).name.removesuffix(".git")


def tracked_files() -> list[str]:
    try:
        listed = subprocess.run(["git", "-C", str(REPO_ROOT), "ls-files", "-z"], capture_output=True, check=True)
    except (OSError, subprocess.CalledProcessError) as error:
        pytest.skip(f"the pack is copied as git would clone it: needs git and a checkout ({error})")
    return [name for name in listed.stdout.decode().split("\0") if name]


def copy_as_cloned(target: Path) -> None:
    """The tracked files of this working tree into `target`, as a clone holds them (a link stays a link)."""
    for name in tracked_files():
        source = REPO_ROOT / name
        if not source.exists() and not source.is_symlink():
            continue  # deleted here, not yet committed: a clone of the next commit would not have it
        destination = target / name
        destination.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, destination, follow_symlinks=False)


def comfy_python(*argv: str, cwd: Path, timeout_s: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([COMFY_PYTHON, *argv], cwd=cwd, capture_output=True, text=True, timeout=timeout_s)


def torch_of_comfyui(cwd: Path) -> str:
    """The version of the torch ComfyUI's Python imports, and where from."""
    found = comfy_python("-c", "import torch; print(torch.__version__, torch.__file__)", cwd=cwd)
    assert found.returncode == 0, found.stderr[-3000:]
    return found.stdout.strip()


@dataclass
class Installed(Server):
    pack: Path
    pip: subprocess.CompletedProcess
    torch_before: str
    torch_after: str


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory):
    base = tmp_path_factory.mktemp("comfy_installed")
    pack = base / "custom_nodes" / clone_name()
    copy_as_cloned(pack)
    torch_before = torch_of_comfyui(pack)
    pip = comfy_python("-m", "pip", "install", "--disable-pip-version-check", "-r", "requirements.txt", cwd=pack,
                       timeout_s=PIP_TIMEOUT_S)
    torch_after = torch_of_comfyui(pack)
    port = free_port()
    log_path = base / "comfyui.log"
    command = [COMFY_PYTHON, "main.py", "--cpu", "--listen", "127.0.0.1", "--port", str(port),
               "--base-directory", str(base)]
    with running(command, log_path, port, START_TIMEOUT_S, stop_timeout_s=20) as process:
        yield Installed(f"http://127.0.0.1:{port}", process, log_path, pack, pip, torch_before, torch_after)


def test_the_copy_is_a_folder_of_its_own_holding_what_a_clone_holds(installed: Installed) -> None:
    assert installed.pack.is_dir() and not installed.pack.is_symlink()
    assert (installed.pack / "__init__.py").is_file() and (installed.pack / "requirements.txt").is_file()
    assert not (installed.pack / "install.py").exists(), "ComfyUI-Manager would run an install.py: test it too"


def test_requirements_install_into_comfyuis_python_and_leave_its_torch_as_it_was(installed: Installed) -> None:
    assert installed.pip.returncode == 0, (installed.pip.stdout + installed.pip.stderr)[-3000:]
    assert installed.torch_after == installed.torch_before, installed.pip.stdout[-3000:]


def test_comfyui_imports_the_pack_without_a_failure(installed: Installed) -> None:
    log = installed.log()
    assert f"Cannot import {installed.pack}" not in log, log[-3000:]
    timing = [line for line in log.splitlines() if line.rstrip().endswith(str(installed.pack))]
    assert timing and "IMPORT FAILED" not in timing[0], log[-3000:]
    assert "the nodes could not be imported" not in log, log[-3000:]


async def test_every_node_is_served_from_the_installed_copy(installed: Installed) -> None:
    info = await get_json(installed, "/object_info")
    missing = [node_id for node_id in NODE_IDS if node_id not in info]
    assert not missing, f"{missing} missing from /object_info:\n{installed.log()[-3000:]}"
    modules = {info[node_id]["python_module"] for node_id in NODE_IDS}
    assert modules == {f"custom_nodes.{installed.pack.name}"}, modules
