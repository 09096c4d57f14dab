"""A missing or damaged config.json (transformer/, text_encoder/, vae/ of a diffusers folder, and of the demo model's
cache) is one line naming the file and the fix, before any work starts: never a JSONDecodeError, AttributeError or
TypeError traceback."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from ernie_image.runtime.cli.commands import main


def _cli(capsys, *argv: str) -> str:
    assert main(list(argv)) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines  # no notice, no step: nothing ran
    return lines[0]


def _cut_short(config: Path) -> None:
    config.write_text(config.read_text()[:40])


def _a_list(config: Path) -> None:
    config.write_text("[1, 2]")


def _wrong_type(key: str):
    def damage(config: Path) -> None:
        values = json.loads(config.read_text())
        section = values.get("text_config", values)
        section[key] = "two"
        config.write_text(json.dumps(values))
    damage.__name__ = f"{key}_two"
    return damage


DAMAGES = [
    ("transformer", _cut_short, "is not valid JSON (JSONDecodeError: "),
    ("transformer", _a_list, "holds a JSON list, not a config (a JSON object)"),
    ("transformer", _wrong_type("num_layers"), "does not describe an ERNIE-Image DiT ("),
    ("text_encoder", _cut_short, "is not valid JSON (JSONDecodeError: "),
    ("text_encoder", _a_list, "holds a JSON list, not a config (a JSON object)"),
    ("text_encoder", _wrong_type("hidden_size"), "does not describe an ERNIE-Image text encoder ("),
    ("vae", _cut_short, "is not valid JSON (JSONDecodeError: "),
    ("vae", _a_list, "holds a JSON list, not a config (a JSON object)"),
    ("vae", _wrong_type("layers_per_block"), "does not describe an ERNIE-Image VAE ("),
]
IDS = [f"{component} {damage.__name__.strip('_').replace('_', ' ')}" for component, damage, _ in DAMAGES]


@pytest.fixture
def model(tmp_path, tiny_turbo_folder) -> Path:
    return Path(shutil.copytree(tiny_turbo_folder, tmp_path / "model"))


@pytest.mark.parametrize("component, damage, says", DAMAGES, ids=IDS)
def test_a_damaged_config_is_one_line_naming_the_file(capsys, tmp_path, model, component, damage, says):
    config = model / component / "config.json"
    damage(config)
    out = tmp_path / "x.png"
    line = _cli(capsys, "generate", "--model-dir", str(model), "--steps", "1", "--device", "cpu", "--out", str(out))
    assert line.startswith(f"error: {config} ") and says in line and line.endswith("re-download it"), line
    assert not out.exists()


def test_a_missing_vae_config_the_shapes_cannot_replace_is_named(capsys, tmp_path, model):
    (model / "vae" / "config.json").unlink()
    line = _cli(capsys, "generate", "--model-dir", str(model), "--device", "cpu", "--out", str(tmp_path / "x.png"))
    assert line.startswith(f"error: the config inferred for {model / 'vae'} (it has no config.json) does not "
                           "describe an ERNIE-Image VAE (") and line.endswith("put the model's config.json there")


@pytest.mark.parametrize("component, damage, says", DAMAGES[::3] + [("text_encoder", "missing", "text encoder width")],
                         ids=[*IDS[::3], "text_encoder missing"])
def test_a_damaged_demo_cache_says_delete_it_and_it_is_rebuilt(capsys, tmp_path, monkeypatch, tiny_turbo_folder,
                                                               component, damage, says):
    from ernie_image.runtime.demo.cached_model import demo_model_folder

    monkeypatch.setenv("ERNIE_IMAGE_CACHE", str(tmp_path / "cache"))
    cached = Path(shutil.copytree(tiny_turbo_folder, demo_model_folder("turbo")))  # what the demo builds
    (cached / ".complete").write_text("ok")
    config = cached / component / "config.json"
    config.unlink() if damage == "missing" else damage(config)
    line = _cli(capsys, "generate", "--device", "cpu", "--out", str(tmp_path / "x.png"))
    assert line.startswith(f"error: the demo model in {cached} is damaged (") and says in line, line
    assert line.endswith("delete that folder and run again: it is rebuilt"), line


def test_each_part_given_as_the_file_inside_its_folder_is_built_from_the_config_beside_it(tiny_turbo_folder):
    """--dit/--text-encoder/--vae naming the weights inside a diffusers folder's transformer/, text_encoder/ and vae/:
    each part is built from its own config.json there (the tiny VAE's norm groups and the tiny text encoder's
    width are in no released config), and the image is the folder's."""
    from ernie_image.runtime.core.host import NullHost
    from ernie_image.runtime.core.request import GenerationRequest
    from ernie_image.runtime.formats.sources import ModelSources
    from ernie_image.runtime.local.options import LoadOptions
    from ernie_image.runtime.local.pipe import LocalPipe

    files = ModelSources(dit=tiny_turbo_folder / "transformer" / "diffusion_pytorch_model.safetensors",
                         text_encoder=tiny_turbo_folder / "text_encoder" / "model.safetensors",
                         vae=tiny_turbo_folder / "vae" / "diffusion_pytorch_model.safetensors",
                         tokenizer=tiny_turbo_folder / "tokenizer")
    request = GenerationRequest(prompt="a fox", width=256, height=256, steps=1, seed=3)
    options = LoadOptions(device="cpu")
    from_files = LocalPipe.load(files, options).generate(request, NullHost()).images
    from_folder = LocalPipe.load(ModelSources(model_dir=tiny_turbo_folder), options).generate(request, NullHost()).images
    assert torch.equal(from_files, from_folder)
