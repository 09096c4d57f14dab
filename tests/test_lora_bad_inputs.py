"""Every bad LoRA input is refused in one line naming the cause and the fix, before anything runs, and leaves
the loaded base model as it was (same DiT object, same image)."""
from __future__ import annotations

import math
import pickle
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import lora_files as lf
from conftest import LoggingHost
from ernie_image.runtime.core.errors import ErnieImageError, InvalidInputError, ModelFileError
from ernie_image.runtime.core.host import NullHost
from ernie_image.runtime.core.request import GenerationRequest
from ernie_image.runtime.formats.sources import ModelSources
from ernie_image.runtime.local.options import LoadOptions
from ernie_image.runtime.local.pipe import LocalPipe
from ernie_image.runtime.cli.lora_args import parse_lora_argument
from ernie_image.runtime.lora import LoraEntry

REQUEST = GenerationRequest(prompt="a fox", width=256, height=256, steps=1, cfg=1.0, seed=2)

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: threads only add overhead


@pytest.fixture(scope="module")
def pipe(tiny_turbo_folder):
    return LocalPipe.load(ModelSources(model_dir=tiny_turbo_folder), LoadOptions(device="cpu", dtype="fp32"))


@pytest.fixture(scope="module")
def base_image(pipe):
    return pipe.generate(REQUEST, NullHost()).images


@pytest.fixture(scope="module")
def shapes(tiny_turbo_folder):
    return lf.linear_shapes(lf.dit_weights(tiny_turbo_folder))


@pytest.fixture(scope="module")
def good_lora(shapes, tmp_path_factory) -> Path:
    return lf.write_ai_toolkit(tmp_path_factory.mktemp("good") / "good.safetensors", lf.random_lora(shapes, 2, seed=1))


def refused(pipe, base_image, path: Path, match: str, error=ModelFileError, strength: float = 1.0) -> str:
    dit = pipe.parts.dit
    with pytest.raises(error, match=match) as caught:
        pipe.with_loras([(path, strength)]).generate(REQUEST, NullHost())
    message = str(caught.value)
    assert "\n" not in message and len(message) < 400
    assert pipe.parts.dit is dit  # nothing released, nothing reloaded
    assert torch.equal(pipe.generate(REQUEST, NullHost()).images, base_image)
    return message


def lora_like(prefix: str, modules: list[str], shape=(64, 64)) -> dict[str, torch.Tensor]:
    state = {}
    for module in modules:
        state[f"{prefix}{module}.lora_A.weight"] = torch.zeros((2, shape[1]))
        state[f"{prefix}{module}.lora_B.weight"] = torch.zeros((shape[0], 2))
    return state


def test_a_model_file_is_not_a_lora(pipe, base_image, tiny_turbo_folder):
    path = Path(tiny_turbo_folder) / "transformer" / "diffusion_pytorch_model.safetensors"
    message = refused(pipe, base_image, path, "is not a LoRA file")
    assert "model checkpoint: load it as the DiT (dit)" in message  # the library names its argument


@pytest.mark.parametrize("model, keys", [
    ("FLUX", lora_like("diffusion_model.", ["double_blocks.0.img_attn.qkv", "single_blocks.3.linear1"])),
    ("SDXL", {"lora_unet_input_blocks_4_1_proj_in.lora_down.weight": torch.zeros(2, 8),
              "lora_unet_input_blocks_4_1_proj_in.lora_up.weight": torch.zeros(8, 2)}),
    ("Qwen-Image", lora_like("transformer.", ["transformer_blocks.0.attn.to_q", "transformer_blocks.0.img_mod.1"])),
    ("Z-Image", lora_like("diffusion_model.", ["layers.0.attention.to_q", "layers.0.feed_forward.w1"])),
    ("Wan", lora_like("diffusion_model.", ["blocks.0.self_attn.q", "blocks.0.cross_attn.k"])),
])
def test_a_lora_for_another_model_names_that_model(pipe, base_image, tmp_path, model, keys):
    path = tmp_path / f"{model}.safetensors"
    save_file(keys, str(path))
    message = refused(pipe, base_image, path, f"is for {model}")
    assert "not ERNIE-Image" in message


def test_keys_that_match_nothing_name_the_style_and_a_few_keys(pipe, base_image, tmp_path):
    path = tmp_path / "odd.safetensors"
    save_file({"lora_unet_foo_bar.lora_down.weight": torch.zeros(2, 8),
               "lora_unet_foo_bar.lora_up.weight": torch.zeros(8, 2)}, str(path))
    message = refused(pipe, base_image, path, r"names no ERNIE-Image DiT layer")
    assert "kohya (lora_unet_)" in message and "lora_unet_foo_bar.lora_down.weight" in message


def test_some_keys_unmatched_are_warned_about_with_a_few_named(pipe, shapes, tmp_path):
    state = lf.peft_keys(lf.random_lora(shapes, 2, seed=3), "diffusion_model.")
    state["diffusion_model.layers.0.not_a_layer.lora_A.weight"] = torch.zeros(2, 64)
    state["lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_down.weight"] = torch.zeros(2, 8)
    path = tmp_path / "partly.safetensors"
    save_file(state, str(path))
    host = LoggingHost()
    pipe.with_loras([path]).generate(REQUEST, host)
    assert any("1 key(s) name no ERNIE-Image DiT layer" in m and "not_a_layer" in m for m in host.messages)
    assert any("1 text-encoder key(s) were skipped" in m for m in host.messages)


def test_rank_mismatch_inside_a_layer(pipe, base_image, tmp_path):
    path = tmp_path / "rank.safetensors"
    save_file({"diffusion_model.layers.0.mlp.linear_fc2.lora_A.weight": torch.zeros(4, 128),
               "diffusion_model.layers.0.mlp.linear_fc2.lora_B.weight": torch.zeros(64, 3)}, str(path))
    refused(pipe, base_image, path, r"has rank 4 in lora_A.weight but 3 in lora_B.weight")


def test_a_lora_for_a_model_of_another_size(pipe, base_image, tmp_path):
    path = tmp_path / "size.safetensors"
    save_file(lora_like("diffusion_model.", ["layers.0.self_attention.to_q"], shape=(3072, 3072)), str(path))
    refused(pipe, base_image, path, r"adapts a \[3072, 3072\] weight but ERNIE-Image's is \[64, 64\]")


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_nan_or_inf_inside(pipe, base_image, good_lora, tmp_path, bad):
    state = {k: v.clone() for k, v in lf.load_file(str(good_lora)).items()}
    next(iter(state.values()))[0, 0] = bad
    path = tmp_path / "nan.safetensors"
    save_file(state, str(path))
    refused(pipe, base_image, path, "has NaN or infinite values in")


class _Marker:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


@pytest.mark.parametrize("name", ["evil.pt", "evil.ckpt", "evil.bin", "evil.safetensors"])
def test_a_pickle_is_refused_and_never_unpickled(pipe, base_image, tmp_path, name):
    marker = tmp_path / "unpickled"
    path = tmp_path / name
    path.write_bytes(pickle.dumps({"lora": _Marker(str(marker))}, protocol=4))
    refused(pipe, base_image, path, "pickle")
    assert not marker.exists()


def test_a_missing_file(pipe, base_image, tmp_path):
    refused(pipe, base_image, tmp_path / "nowhere.safetensors", "does not exist: check the path")


def test_a_truncated_file(pipe, base_image, good_lora, tmp_path):
    path = tmp_path / "cut.safetensors"
    path.write_bytes(good_lora.read_bytes()[: good_lora.stat().st_size // 2])
    refused(pipe, base_image, path, "is truncated")


def test_dora_is_refused(pipe, base_image, good_lora, tmp_path):
    state = dict(lf.load_file(str(good_lora)))
    state["diffusion_model.layers.0.mlp.linear_fc2.dora_scale"] = torch.ones(1, 128)
    path = tmp_path / "dora.safetensors"
    save_file(state, str(path))
    refused(pipe, base_image, path, "is a DoRA")


@pytest.mark.parametrize("strength", [math.nan, math.inf, -math.inf, 10.5, -11.0])
def test_bad_strengths(pipe, base_image, good_lora, strength):
    refused(pipe, base_image, good_lora, "strength .* is not allowed: use a finite value from -10 to 10",
            error=InvalidInputError, strength=strength)


def test_a_bad_lora_at_load_time_fails_the_load(tiny_turbo_folder, tmp_path):
    with pytest.raises(ErnieImageError, match="does not exist"):
        LocalPipe.load(ModelSources(model_dir=tiny_turbo_folder), LoadOptions(device="cpu"),
                       loras=[tmp_path / "missing.safetensors"])


@pytest.mark.parametrize("text, path, strength", [
    ("a.safetensors", "a.safetensors", 1.0),
    ("a.safetensors:0.5", "a.safetensors", 0.5),
    ("dir/a.safetensors:-1.25", "dir/a.safetensors", -1.25),
    ("C:\\loras\\a.safetensors", "C:\\loras\\a.safetensors", 1.0),
    ("C:\\loras\\a.safetensors:0.8", "C:\\loras\\a.safetensors", 0.8),
    ("D:/x/a.safetensors:2e-1", "D:/x/a.safetensors", 0.2),
    ("c:\\loras\\a.safetensors:0.8", "c:\\loras\\a.safetensors", 0.8),
])
def test_lora_argument_parsing(text, path, strength):
    assert parse_lora_argument(text) == LoraEntry(Path(path), strength)


@pytest.mark.parametrize("windows, text, path, strength", [
    (True, "C:0.5", "C:0.5", 1.0),  # on Windows a single letter before the last colon is a drive, in either case
    (True, "c:0.5", "c:0.5", 1.0),
    (False, "C:0.5", "C", 0.5),  # elsewhere it is a file of that name
    (False, "c:0.5", "c", 0.5),
])
def test_a_single_letter_before_the_colon_is_a_drive_only_on_windows(windows, text, path, strength, monkeypatch):
    from ernie_image.runtime.cli import lora_args

    monkeypatch.setattr(lora_args, "DRIVE_LETTERS", windows)
    assert parse_lora_argument(text) == LoraEntry(Path(path), strength)


@pytest.mark.parametrize("text, match", [("a.safetensors:nan", "is not a number"), ("a.safetensors:12", "is not allowed"),
                                         ("a.safetensors:strong", "is not a number"), ("", "needs a file"),
                                         (":0.5", r"^--lora ':0.5' names no file before the colon: give --lora "
                                                  r"PATH:0.5 \(PATH: the LoRA .safetensors\)$"),
                                         (":", "names no file before the colon: give --lora PATH or --lora "
                                               "PATH:STRENGTH")])
def test_lora_argument_errors(text, match):
    with pytest.raises(InvalidInputError, match=match):
        parse_lora_argument(text)
