"""The tiny and demo models' files get the usual permissions (0666 less the umask), like every other file the
pack writes: safetensors' save_file makes its files 0600, which left a shared demo cache unreadable to other
users."""
from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from ernie_image.runtime.demo.cached_model import demo_model_sources
from ernie_image.runtime.demo.tiny import build_tiny_model
from ernie_image.runtime.demo.tiny_pe import build_tiny_pe_folder


@pytest.fixture(params=[0o022, 0o002], ids=["umask 022", "umask 002"])
def umask(request):
    previous = os.umask(request.param)
    yield request.param
    os.umask(previous)


def _modes(root: Path) -> dict[str, str]:
    return {str(path.relative_to(root)): oct(stat.S_IMODE(path.stat().st_mode))
            for path in root.rglob("*") if path.is_file()}


def _every_file_has_the_usual_mode(root: Path, umask: int) -> None:
    modes = _modes(root)
    assert any(name.endswith(".safetensors") for name in modes)
    assert modes == {name: oct(0o666 & ~umask) for name in modes}


@pytest.mark.parametrize("layout, with_pe", [("diffusers", True), ("comfy", True)])
def test_a_tiny_model_in_every_layout_is_readable_by_others(tmp_path, umask, layout, with_pe):
    build_tiny_model(tmp_path / layout, layout=layout, with_pe=with_pe)
    _every_file_has_the_usual_mode(tmp_path / layout, umask)


def test_a_tiny_prompt_enhancer_folder_is_readable_by_others(tmp_path, umask):
    _every_file_has_the_usual_mode(build_tiny_pe_folder(tmp_path / "pe-folder"), umask)


def test_the_demo_models_cache_is_readable_by_others(tmp_path, umask):
    folder = demo_model_sources("turbo", tmp_path / "cache").model_dir
    _every_file_has_the_usual_mode(folder, umask)
