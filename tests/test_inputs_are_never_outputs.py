"""Inputs are never outputs: no command writes over a file it reads, however the names reach it (the same path, a
symbolic or hard link, a batch name derived from --out). Refused in one line naming both, before any work starts,
with the input left as it was."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from ernie_image.runtime.cli.commands import main


def _cli(capsys, *argv: str) -> str:
    assert main(list(argv)) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


@pytest.fixture
def empty_cache(tmp_path, monkeypatch) -> Path:
    cache = tmp_path / "cache"
    monkeypatch.setenv("ERNIE_IMAGE_CACHE", str(cache))
    return cache


def _photo(path: Path) -> Path:
    Image.fromarray((np.random.default_rng(0).random((256, 256, 3)) * 255).astype(np.uint8)).save(path)
    return path


def test_an_out_that_is_the_init_image_is_refused_and_the_image_kept(capsys, tmp_path, empty_cache):
    photo = _photo(tmp_path / "photo.png")
    before = photo.read_bytes()
    line = _cli(capsys, "generate", "--init-image", str(photo), "--denoise", "0.5", "--out", str(photo))
    assert line == (f"error: --out {photo} is the file --init-image {photo} reads: writing it would replace that "
                    "input; give another --out")
    assert photo.read_bytes() == before and not empty_cache.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["photo.png"]  # no scratch or partial file either


@pytest.mark.parametrize("link", ["symbolic", "hard"])
def test_an_out_that_links_to_the_init_image_is_refused(capsys, tmp_path, empty_cache, link):
    photo = _photo(tmp_path / "photo.png")
    before = photo.read_bytes()
    out = tmp_path / "other name.png"
    (out.symlink_to if link == "symbolic" else out.hardlink_to)(photo)
    line = _cli(capsys, "generate", "--init-image", str(photo), "--out", str(out))
    assert line.startswith(f"error: --out {out} is the file --init-image {photo} reads: ") and "give another --out" in line
    assert photo.read_bytes() == before


def test_a_batch_name_that_is_the_init_image_is_refused(capsys, tmp_path, empty_cache):
    photo = _photo(tmp_path / "shot_1.png")
    before = photo.read_bytes()
    line = _cli(capsys, "generate", "--init-image", str(photo), "--batch", "2", "--out", str(tmp_path / "shot.png"))
    assert line == (f"error: --out {tmp_path / 'shot.png'} writes shot_1.png (a batch name), which is the file "
                    f"--init-image {photo} reads: writing it would replace that input; give another --out")
    assert photo.read_bytes() == before


def test_an_out_that_is_the_mask_is_refused(capsys, tmp_path, empty_cache):
    photo = _photo(tmp_path / "photo.png")
    mask = tmp_path / "mask.png"
    Image.fromarray(np.full((256, 256), 255, np.uint8)).save(mask)
    line = _cli(capsys, "generate", "--init-image", str(photo), "--mask", str(mask), "--out", str(mask))
    assert f"is the file --mask {mask} reads" in line


def test_an_out_that_is_a_file_of_the_model_folder_is_refused(capsys, tmp_path, empty_cache):
    model = tmp_path / "model"
    (model / "assets").mkdir(parents=True)
    sample = _photo(model / "assets" / "sample.png")
    line = _cli(capsys, "generate", "--model-dir", str(model), "--out", str(sample))
    assert line.startswith(f"error: --out {sample} is {sample}, a file of the --model-dir folder {model}: ")


def test_an_out_that_is_the_api_key_file_is_refused(capsys, tmp_path, empty_cache):
    key = tmp_path / "key.png"
    key.write_text("secret")
    line = _cli(capsys, "generate", "--server", "http://127.0.0.1:9", "--api-key-file", str(key), "--out", str(key))
    assert f"is the file --api-key-file {key} reads" in line and key.read_text() == "secret"


def test_quantize_refuses_an_out_linked_to_a_file_of_the_dit_folder(capsys, tmp_path):
    from safetensors.torch import save_file
    import torch

    folder = tmp_path / "transformer"
    folder.mkdir()
    weights = folder / "diffusion_pytorch_model.safetensors"
    save_file({"x": torch.zeros(2)}, str(weights))
    out = tmp_path / "fp8.safetensors"
    os.link(weights, out)
    line = _cli(capsys, "quantize", "--dit", str(folder), "--format", "fp8", "--out", str(out))
    assert line == (f"error: --out {out} is {weights}, a file of the --dit folder {folder}: writing it would replace "
                    "that input; give another --out")
