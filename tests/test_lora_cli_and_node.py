"""LoRAs from the command line (`--lora PATH[:STRENGTH]`, repeatable) and from the ERNIE-Image LoRA node (files from
ComfyUI's `loras` folder, chainable): the same image as the Python API, recorded in the PNG, bad input refused
before any weights are read."""
from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest
import torch
from PIL import Image

import lora_files as lf
from ernie_image.nodes.lora import ErnieImageLoRA
from ernie_image.nodes.sampler import ErnieImageTurboSampler
from ernie_image.runtime.cli.commands import main as cli_main
from ernie_image.runtime.core.errors import InvalidInputError, ModelFileError
from ernie_image.runtime.core.host import NullHost
from ernie_image.runtime.core.request import GenerationRequest
from ernie_image.runtime.formats.sources import ModelSources
from ernie_image.runtime.local import parts as local_parts
from ernie_image.runtime.local.options import LoadOptions
from ernie_image.runtime.local.pipe import LocalPipe
from ernie_image.runtime.remote.backend import RemotePipe

REQUEST = GenerationRequest(prompt="a red fox", width=256, height=256, steps=2, cfg=1.0, seed=4)

pytestmark = pytest.mark.usefixtures("one_thread", "no_comfy_modules_left_behind")  # tiny models: one thread



@pytest.fixture(scope="module")
def lora_folder(tiny_turbo_folder, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("models") / "loras"
    folder.mkdir()
    shapes = lf.linear_shapes(lf.dit_weights(tiny_turbo_folder))
    lf.write_down_up(folder / "style.safetensors", lf.random_lora(shapes, 4, seed=21), 4.0, lf.kohya_name)
    lf.write_ai_toolkit(folder / "detail.safetensors", lf.random_lora(shapes, 2, seed=22))
    return folder


def expected_images(tiny_turbo_folder, loras) -> torch.Tensor:
    pipe = LocalPipe.load(ModelSources(model_dir=tiny_turbo_folder), LoadOptions(device="cpu"))
    return pipe.with_loras(loras).generate(REQUEST, NullHost()).images


def test_cli_lora_options_give_the_api_image_and_are_recorded_in_the_png(tiny_turbo_folder, lora_folder, tmp_path,
                                                                         capsys):
    out = tmp_path / "fox.png"
    style, detail = lora_folder / "style.safetensors", lora_folder / "detail.safetensors"
    assert cli_main(["generate", "--model-dir", str(tiny_turbo_folder), "--prompt", REQUEST.prompt, "--width", "256",
                     "--height", "256", "--steps", "2", "--seed", "4", "--device", "cpu", "--lora", f"{style}:0.7",
                     "--lora", str(detail), "--out", str(out)]) == 0
    settings = json.loads(Image.open(out).text["ernie-image"])
    assert settings["loras"] == [{"name": "style.safetensors", "strength": 0.7},
                                 {"name": "detail.safetensors", "strength": 1.0}]
    assert str(lora_folder) not in json.dumps(settings)  # file names only, never the full path
    pixels = torch.from_numpy(__import__("numpy").array(Image.open(out))).float() / 255
    expected = expected_images(tiny_turbo_folder, [(style, 0.7), (detail, 1.0)])[0]
    assert (pixels - expected).abs().max().item() <= 1 / 255 + 1e-6


@pytest.mark.parametrize("argument, message", [
    ("{folder}/nowhere.safetensors", "does not exist"),
    ("{folder}/style.safetensors:11", "strength 11.0 is not allowed"),
    ("{folder}/style.safetensors:loud", "is not a number"),
    ("{folder}/old.ckpt", "pickle"),
])
def test_cli_refuses_a_bad_lora_before_reading_any_weights(tiny_turbo_folder, lora_folder, tmp_path, capsys,
                                                           monkeypatch, argument, message):
    monkeypatch.setattr(local_parts, "build_dit", lambda *a, **k: pytest.fail("weights were read"))
    code = cli_main(["generate", "--model-dir", str(tiny_turbo_folder), "--device", "cpu", "--lora",
                     argument.format(folder=lora_folder), "--out", str(tmp_path / "x.png")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and message in err[0]
    assert not (tmp_path / "x.png").exists()


@pytest.fixture
def comfy_loras(lora_folder, monkeypatch):
    """ComfyUI's folder registry for the `loras` key, as folder_paths answers it (ComfyUI is not installed here)."""
    fake = types.ModuleType("folder_paths")
    fake.folder_names_and_paths = {"loras": ([str(lora_folder)], {".safetensors"})}
    fake.get_folder_paths = lambda key: list(fake.folder_names_and_paths[key][0])
    fake.get_filename_list = lambda key: sorted(p.name for p in lora_folder.iterdir())
    fake.get_full_path = lambda key, name: str(lora_folder / name) if (lora_folder / name).is_file() else None
    monkeypatch.setitem(sys.modules, "folder_paths", fake)
    return lora_folder


def test_chained_lora_nodes_give_the_api_image(tiny_turbo_folder, comfy_loras):
    assert ErnieImageLoRA.INPUT_TYPES()["required"]["lora_name"][0] == ["detail.safetensors", "style.safetensors"]
    pipe = LocalPipe.load(ModelSources(model_dir=tiny_turbo_folder), LoadOptions(device="cpu"))
    first = ErnieImageLoRA().apply(pipe=pipe, lora_name="style.safetensors", strength=0.7)
    assert first["ui"]["text"] == ["LoRA: style.safetensors (0.7)"]
    second = ErnieImageLoRA().apply(pipe=first["result"][0], lora_name="detail.safetensors", strength=1.0)
    stacked = second["result"][0]
    assert stacked.base is pipe  # one loaded model, however many LoRA nodes
    images, _, _ = ErnieImageTurboSampler().generate(pipe=stacked, prompt=REQUEST.prompt, resolution="custom",
                                                     width=256, height=256, steps=2, cfg=1.0, seed=4, batch_size=1,
                                                     shift=4.0, use_pe=False)["result"]
    expected = pipe.with_loras([(comfy_loras / "style.safetensors", 0.7), (comfy_loras / "detail.safetensors", 1.0)])
    assert torch.equal(images, expected.generate(REQUEST, NullHost()).images)
    base_images, _, _ = ErnieImageTurboSampler().generate(pipe=pipe, prompt=REQUEST.prompt, resolution="custom",
                                                          width=256, height=256, steps=2, cfg=1.0, seed=4,
                                                          batch_size=1, shift=4.0, use_pe=False)["result"]
    assert torch.equal(base_images, pipe.generate(REQUEST, NullHost()).images)
    assert not torch.equal(base_images, images)


def test_the_node_refuses_bad_input_in_one_line(tiny_turbo_folder, comfy_loras):
    pipe = LocalPipe.load(ModelSources(model_dir=tiny_turbo_folder), LoadOptions(device="cpu"))
    with pytest.raises(InvalidInputError, match="strength 12.0 is not allowed"):  # when the node runs
        ErnieImageLoRA().apply(pipe=pipe, lora_name="style.safetensors", strength=12.0)
    with pytest.raises(ModelFileError, match="LoRA file 'gone.safetensors' was not found"):
        ErnieImageLoRA().apply(pipe=pipe, lora_name="gone.safetensors", strength=1.0)
    (comfy_loras / "broken.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{}")
    try:
        with pytest.raises(ModelFileError, match="broken.safetensors"):
            ErnieImageLoRA().apply(pipe=pipe, lora_name="broken.safetensors", strength=1.0)
    finally:
        (comfy_loras / "broken.safetensors").unlink()
    with pytest.raises(InvalidInputError, match="not connected"):
        ErnieImageLoRA().apply(pipe=None, lora_name="style.safetensors", strength=1.0)


def test_a_remote_pipe_refuses_a_lora_in_one_line(comfy_loras):
    remote = RemotePipe(["http://127.0.0.1:9"])
    with pytest.raises(InvalidInputError, match=r"LoRAs run only on a local pipe: SGLang's /v1/set_lora") as caught:
        ErnieImageLoRA().apply(pipe=remote, lora_name="style.safetensors", strength=1.0)
    assert "\n" not in str(caught.value)


def test_a_lora_spec_with_no_file_before_its_strength_is_one_line_before_any_work(tiny_turbo_folder, tmp_path,
                                                                                  capsys):
    """`--lora :0.5` was read as a file named ':0.5' (then "does not exist")."""
    assert cli_main(["generate", "--model-dir", str(tiny_turbo_folder), "--lora", ":0.5",
                     "--out", str(tmp_path / "x.png")]) == 2
    assert capsys.readouterr().err.strip() == ("error: --lora ':0.5' names no file before the colon: give --lora "
                                               "PATH:0.5 (PATH: the LoRA .safetensors)")
    assert list(tmp_path.iterdir()) == []
