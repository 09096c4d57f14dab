"""The Python API given the wrong kind of value: one line naming the parameter and what it takes, never an
AttributeError from deep inside (`'NoneType' object has no attribute 'check_cancel'`), and before any work."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ernie_image.runtime.core.errors import InvalidInputError, ModelFileError
from ernie_image.runtime.core.host import NullHost
from ernie_image.runtime.core.request import GenerationRequest
from ernie_image.runtime.files.png_output import save_pngs
from ernie_image.runtime.formats.sources import ModelSources
from ernie_image.runtime.local.options import LoadOptions
from ernie_image.runtime.local.pipe import LocalPipe
from ernie_image.runtime.remote.backend import RemotePipe

REQUEST = GenerationRequest(prompt="a red fox", width=256, height=256, seed=1)


@pytest.fixture(scope="module")
def local_pipe(tiny_turbo_folder):
    return LocalPipe.load(ModelSources(model_dir=tiny_turbo_folder), LoadOptions(device="cpu", dtype="fp32"))


def _pipes(local_pipe):
    return {"local": local_pipe, "LoRA view": local_pipe.with_loras([]),
            "remote": RemotePipe(["http://127.0.0.1:1"])}  # nothing listens: a call that got through would say so


@pytest.mark.parametrize("kind", ["local", "LoRA view", "remote"])
@pytest.mark.parametrize("request_, host, expected", [
    (REQUEST, None, "host None is not a Host: give ernie_image.NullHost() (or an object with progress, "
                    "check_cancel, make_room and log)"),
    ({"prompt": "a red fox"}, NullHost(),
     "request {'prompt': 'a red fox'} is not a GenerationRequest: give ernie_image.GenerationRequest(prompt=...) "
     "(a dict: GenerationRequest(**it))"),
    ("a red fox", NullHost(), "request 'a red fox' is not a GenerationRequest: give "
                              "ernie_image.GenerationRequest(prompt=...)"),
], ids=["host None", "request a dict", "request a str"])
def test_generate_with_the_wrong_kind_of_argument_says_what_it_takes(local_pipe, kind, request_, host, expected):
    with pytest.raises(InvalidInputError) as caught:
        _pipes(local_pipe)[kind].generate(request_, host)
    assert str(caught.value) == expected


def test_load_takes_a_model_folder_given_as_a_path_or_str(tiny_turbo_folder):
    for given in (tiny_turbo_folder, str(tiny_turbo_folder)):
        pipe = LocalPipe.load(given, LoadOptions(device="cpu", dtype="fp32"))
        assert pipe.sources == ModelSources(model_dir=Path(tiny_turbo_folder)) and pipe.variant == "turbo"


def test_load_with_something_that_is_not_model_sources_names_model_sources():
    with pytest.raises(InvalidInputError) as caught:
        LocalPipe.load(42)
    assert str(caught.value) == ("sources 42 is not a ModelSources: give ernie_image.ModelSources(model_dir=...) or "
                                 "the model folder's path")


def test_load_with_options_that_are_not_load_options_names_load_options(tiny_turbo_folder):
    with pytest.raises(InvalidInputError, match=r"^options \{'device': 'cpu'\} is not a LoadOptions: give "
                                                r"ernie_image\.LoadOptions\(\.\.\.\)"):
        LocalPipe.load(tiny_turbo_folder, {"device": "cpu"})


def test_a_model_folder_that_does_not_exist_is_named_as_missing(tmp_path):
    with pytest.raises(ModelFileError) as caught:
        LocalPipe.load(ModelSources(model_dir=tmp_path / "nonexist"))
    assert str(caught.value) == f"model folder {tmp_path / 'nonexist'} does not exist: check the path"


def test_a_model_folder_that_is_a_file_is_named_as_a_file(tmp_path):
    (tmp_path / "model").write_text("")
    with pytest.raises(ModelFileError, match=r"is a file, not a folder: give the diffusers ERNIE-Image folder"):
        LocalPipe.load(ModelSources(model_dir=tmp_path / "model"))


@pytest.mark.parametrize("images, expected", [
    (torch.rand(256, 256, 3), "images of shape (256, 256, 3) are not a batch [B, H, W, 3]: add the batch "
                              "dimension (images.unsqueeze(0))"),
    (torch.rand(1, 3, 16, 16), "images of shape (1, 3, 16, 16) are not a batch [B, H, W, 3]: give channels last "
                               "(images.permute(0, 2, 3, 1))"),
    (torch.randint(0, 255, (1, 16, 16, 3), dtype=torch.uint8), "images of dtype torch.uint8 are not floats in 0..1: "
                                                                "give images.float() / 255"),
    (torch.full((1, 16, 16, 3), float("nan")), "images hold NaN or infinite pixels: the run that made them failed "
                                               "numerically; nothing was written"),
    ([[0.5]], "images [[0.5]] is not a torch.Tensor: give a tensor [B, H, W, 3] of floats in 0..1"),
    (torch.zeros(0, 16, 16, 3), "images is an empty batch [0, H, W, 3]: nothing to write; give at least one image"),
], ids=["no batch", "channels first", "uint8", "NaN", "a list", "empty batch"])
def test_save_pngs_refuses_images_it_cannot_write_and_says_what_it_takes(tmp_path, images, expected):
    with pytest.raises(InvalidInputError) as caught:
        save_pngs(images, tmp_path / "x.png", {})
    assert str(caught.value) == expected
    assert list(tmp_path.iterdir()) == []


def test_save_pngs_refuses_settings_that_are_not_json_before_writing(tmp_path):
    with pytest.raises(InvalidInputError) as caught:
        save_pngs(torch.rand(1, 16, 16, 3), tmp_path / "x.png", {"when": object()})
    assert str(caught.value).startswith("settings cannot be written as JSON (Object of type object is not JSON "
                                        "serializable): give settings of str, int, float, bool, None, lists and dicts")
    with pytest.raises(InvalidInputError, match=r"^settings cannot be written as JSON \(Out of range float values"):
        save_pngs(torch.rand(1, 16, 16, 3), tmp_path / "x.png", {"cfg": float("nan")})
    assert list(tmp_path.iterdir()) == []


def test_save_pngs_still_writes_what_it_always_wrote(tmp_path):
    from ernie_image.runtime.files.png_output import read_png_settings

    paths = save_pngs(torch.rand(2, 16, 16, 3, dtype=torch.float64), tmp_path / "x.png", {"seed": 3})
    assert [read_png_settings(p) for p in paths] == [{"seed": 3, "batch_index": 0}, {"seed": 3, "batch_index": 1}]
    assert json.dumps(read_png_settings(paths[0]))
