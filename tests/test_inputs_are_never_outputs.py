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


# Every way an --out can name the DiT's weight file, given the transformer folder and that file: each is the input,
# and is refused as that, not as a new file inside the --dit folder.
SAME_FILE_NAMES = {
    "the file itself": lambda folder, weights: weights,
    "a symbolic link to it": lambda folder, weights: _symlink(folder.parent / "fp8.safetensors", weights),
    "a hard link to it": lambda folder, weights: _hard_link(folder.parent / "fp8.safetensors", weights),
    "its path spelled through ..": lambda folder, weights: folder / ".." / folder.name / weights.name,
    "its name in a link to the folder": lambda folder, weights: (_symlink(folder.parent / "linked", folder)
                                                                 / weights.name),
}


@pytest.mark.parametrize("given", ["the transformer folder", "the weight file"])
@pytest.mark.parametrize("name", SAME_FILE_NAMES)
def test_quantize_refuses_every_name_of_the_dit_weights_as_the_input_it_is(capsys, tmp_path, name, given):
    from safetensors.torch import save_file
    import torch

    folder = tmp_path / "transformer"
    folder.mkdir()
    weights = folder / "diffusion_pytorch_model.safetensors"
    save_file({"x": torch.zeros(2)}, str(weights))
    out = SAME_FILE_NAMES[name](folder, weights)
    dit = folder if given == "the transformer folder" else weights
    before = _contents(tmp_path)
    line = _cli(capsys, "quantize", "--dit", str(dit), "--format", "fp8", "--out", str(out))
    reads = f"{weights}, a file of the --dit folder {folder}" if dit == folder else f"the file --dit {weights} reads"
    assert line == f"error: --out {out} is {reads}: writing it would replace that input; give another --out"
    assert _contents(tmp_path) == before  # nothing written, replaced or left behind


# ---- every output, not only --out: --step-cache-compare writes a PNG (a batch of them) too -----------------------

def _model_folder(root: Path) -> Path:
    """A model folder as far as the checks look: a VAE weight file and a sample picture beside it."""
    from safetensors.torch import save_file
    import torch

    (root / "model" / "vae").mkdir(parents=True)
    (root / "model" / "assets").mkdir()
    save_file({"x": torch.zeros(2)}, str(root / "model" / "vae" / "diffusion_pytorch_model.safetensors"))
    _photo(root / "model" / "assets" / "sample.png")
    return root / "model"


def _lora_linked_as_png(root: Path) -> Path:
    from safetensors.torch import save_file
    import torch

    save_file({"x": torch.zeros(2)}, str(root / "style.safetensors"))
    os.link(root / "style.safetensors", root / "style.png")
    return root / "style.png"


# (what the command line gives, given the test folder t; the one error line, given t). Every case passes
# --step-cache dbcache and, unless it names its own, --out t/out.png.
COMPARE_PATH_CASES = {
    "the init image": (
        lambda t: ["--init-image", str(_photo(t / "keep.png")), "--step-cache-compare", str(t / "keep.png")],
        lambda t: f"error: --step-cache-compare {t / 'keep.png'} is the file --init-image {t / 'keep.png'} reads: "
                  "writing it would replace that input; give another --step-cache-compare"),
    "a batch name that is the init image": (
        lambda t: ["--init-image", str(_photo(t / "c_1.png")), "--batch", "2",
                   "--step-cache-compare", str(t / "c.png")],
        lambda t: f"error: --step-cache-compare {t / 'c.png'} writes c_1.png (a batch name), which is the file "
                  f"--init-image {t / 'c_1.png'} reads: writing it would replace that input; give another "
                  "--step-cache-compare"),
    "the mask": (
        lambda t: ["--init-image", str(_photo(t / "photo.png")), "--mask", str(_white_mask(t / "mask.png")),
                   "--step-cache-compare", str(t / "mask.png")],
        lambda t: f"error: --step-cache-compare {t / 'mask.png'} is the file --mask {t / 'mask.png'} reads: writing "
                  "it would replace that input; give another --step-cache-compare"),
    "a hard link to a LoRA file": (
        lambda t: ["--lora", str(t / "style.safetensors"), "--step-cache-compare", str(_lora_linked_as_png(t))],
        lambda t: f"error: --step-cache-compare {t / 'style.png'} is the file --lora {t / 'style.safetensors'} reads: "
                  "writing it would replace that input; give another --step-cache-compare"),
    "a model weight file": (
        lambda t: ["--model-dir", str(_model_folder(t)), "--step-cache-compare",
                   str(t / "model" / "vae" / "diffusion_pytorch_model.safetensors")],
        lambda t: f"error: --step-cache-compare {t / 'model' / 'vae' / 'diffusion_pytorch_model.safetensors'} is not "
                  "a .png file name: give e.g. --step-cache-compare diffusion_pytorch_model.png"),
    "a .png file of the model folder": (
        lambda t: ["--model-dir", str(_model_folder(t)), "--step-cache-compare",
                   str(t / "model" / "assets" / "sample.png")],
        lambda t: f"error: --step-cache-compare {t / 'model' / 'assets' / 'sample.png'} is "
                  f"{t / 'model' / 'assets' / 'sample.png'}, a file of the --model-dir folder {t / 'model'}: writing "
                  "it would replace that input; give another --step-cache-compare"),
    "a .jpg name": (
        lambda t: ["--step-cache-compare", str(t / "x.jpg")],
        lambda t: f"error: --step-cache-compare {t / 'x.jpg'} is not a .png file name: give e.g. "
                  "--step-cache-compare x.png"),
    "a .txt name": (
        lambda t: ["--step-cache-compare", str(t / "x.txt")],
        lambda t: f"error: --step-cache-compare {t / 'x.txt'} is not a .png file name: give e.g. "
                  "--step-cache-compare x.png"),
    "the --out file": (
        lambda t: ["--out", str(t / "same.png"), "--step-cache-compare", str(t / "same.png")],
        lambda t: f"error: --step-cache-compare {t / 'same.png'} is the file --out {t / 'same.png'} writes: one "
                  "would replace the other; give another --step-cache-compare"),
    "the --out batch names": (
        lambda t: ["--batch", "2", "--out", str(t / "b.png"), "--step-cache-compare", str(t / "b.png")],
        lambda t: f"error: --step-cache-compare {t / 'b.png'} (its batch name b_0.png) is the file --out "
                  f"{t / 'b.png'} (its batch name b_0.png) writes: one would replace the other; give another "
                  "--step-cache-compare"),
    "a symbolic link to the --out file": (
        lambda t: ["--step-cache-compare", str(_symlink(t / "link.png", _photo(t / "old.png"))), "--out",
                   str(t / "old.png")],
        lambda t: f"error: --step-cache-compare {t / 'link.png'} is the file --out {t / 'old.png'} writes: one "
                  "would replace the other; give another --step-cache-compare"),
    "a folder that does not exist": (
        lambda t: ["--step-cache-compare", str(t / "nonexist" / "x.png")],
        lambda t: f"error: --step-cache-compare {t / 'nonexist' / 'x.png'}: the folder {t / 'nonexist'} does not "
                  "exist: create it first"),
    "a folder": (
        lambda t: ["--step-cache-compare", str(_folder(t / "shots"))],
        lambda t: f"error: --step-cache-compare {t / 'shots'} is a folder: give a file name inside it, e.g. "
                  f"--step-cache-compare {t / 'shots' / 'compare.png'}"),
    "a batch name that is a folder": (
        lambda t: ["--batch", "2", "--step-cache-compare", str(_folder(t / "c_1.png").with_name("c.png"))],
        lambda t: f"error: --step-cache-compare {t / 'c.png'}: batch image {t / 'c_1.png'} is a folder: pick another "
                  "output name"),
}


def _white_mask(path: Path) -> Path:
    Image.fromarray(np.full((256, 256), 255, np.uint8)).save(path)
    return path


def _symlink(link: Path, target: Path) -> Path:
    link.symlink_to(target)
    return link


def _hard_link(link: Path, target: Path) -> Path:
    link.hardlink_to(target)
    return link


def _folder(path: Path) -> Path:
    path.mkdir()
    return path


def _contents(folder: Path) -> dict[str, bytes]:
    return {str(path.relative_to(folder)): (b"<folder>" if path.is_dir() else path.read_bytes())
            for path in sorted(folder.rglob("*"))}


@pytest.mark.parametrize("case", COMPARE_PATH_CASES)
def test_a_comparison_path_gets_every_check_an_out_gets_before_any_model_is_read(capsys, tmp_path, empty_cache,
                                                                                  monkeypatch, case):
    from ernie_image.runtime.demo import cached_model
    from ernie_image.runtime.local.pipe import LocalPipe

    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded before the arguments were refused")

    monkeypatch.setattr(cached_model, "load_demo_pipe", no_model)
    monkeypatch.setattr(LocalPipe, "load", no_model)
    given, error = COMPARE_PATH_CASES[case]
    argv = given(tmp_path)
    before = _contents(tmp_path)
    out = [] if "--out" in argv else ["--out", str(tmp_path / "out.png")]
    assert _cli(capsys, "generate", "--step-cache", "dbcache", *argv, *out) == error(tmp_path)
    assert _contents(tmp_path) == before and not empty_cache.exists()  # nothing written, replaced or left behind
