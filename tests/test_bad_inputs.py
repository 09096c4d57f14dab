"""Every bad input fails early with one line that names the cause and the fix (ModelFileError / InvalidInputError)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from ernie_image.runtime.errors import InvalidInputError, ModelFileError
from ernie_image.runtime.formats import open_component
from ernie_image.runtime.formats.comfy_files import tiny_tekken_bytes
from ernie_image.runtime.formats.tekken import tokenizer_from_tekken_json
from ernie_image.runtime.request import GenerationRequest, validate_size
from ernie_image.runtime.text.encoder import token_ids
from ernie_image.runtime.tiny import BOS_ID, build_tiny_model


@pytest.fixture(scope="module")
def comfy(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("comfy"), layout="comfy", variant="base")


def _error(path, kind) -> str:
    with pytest.raises(ModelFileError) as caught:
        open_component(path, kind)
    message = str(caught.value)
    assert "\n" not in message and len(message) < 600
    return message


def _write(path: Path, tensors: dict[str, tuple[int, ...]]) -> Path:
    save_file({key: torch.zeros(shape) for key, shape in tensors.items()}, str(path))
    return path


@pytest.mark.parametrize("kind", ["dit", "text_encoder", "vae", "pe"])
def test_missing_file(kind, tmp_path):
    message = _error(tmp_path / "nowhere.safetensors", kind)
    assert "nowhere.safetensors does not exist" in message and "check the path" in message


def test_header_cut(comfy, tmp_path):
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(comfy.dit.read_bytes()[:100])
    message = _error(cut, "dit")
    assert "cut inside its header" in message and "download it again" in message


def test_data_cut(comfy, tmp_path):
    data = comfy.dit.read_bytes()
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(data[: len(data) - 1000])
    message = _error(cut, "dit")
    assert "truncated" in message and "download it again" in message


def test_file_shorter_than_a_header(tmp_path):
    tiny = tmp_path / "tiny.safetensors"
    tiny.write_bytes(b"\x10\x00")
    assert "too short" in _error(tiny, "vae")


def test_corrupt_header(comfy, tmp_path):
    data = bytearray(comfy.vae.read_bytes())
    data[8:20] = b"\x00garbage!!\xff\xfe"
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(bytes(data))
    assert "corrupt safetensors header" in _error(bad, "vae")


def test_not_a_safetensors_file_at_all(tmp_path):
    text = tmp_path / "notes.safetensors"
    text.write_text("these are not weights, just a text file that is long enough")
    message = _error(text, "dit")
    assert "not a safetensors file" in message


def test_pickle_checkpoints_are_refused(tmp_path):
    path = tmp_path / "model.safetensors"
    torch.save({"w": torch.zeros(2)}, path)  # a zip pickle, whatever its name says
    message = _error(path, "dit")
    assert "pickle" in message and "never loads" in message


def test_flux_transformer_where_a_dit_is_expected(tmp_path):
    path = _write(tmp_path / "flux1-dev.safetensors", {
        "double_blocks.0.img_attn.qkv.weight": (6, 2), "double_blocks.0.img_attn.proj.weight": (2, 2),
        "img_in.weight": (2, 4), "final_layer.linear.weight": (4, 2)})
    message = _error(path, "dit")
    assert message.startswith("flux1-dev.safetensors is not an ERNIE-Image transformer: it looks like a FLUX.1 transformer")
    assert "found keys like double_blocks.0.img_attn.proj.weight" in message
    assert "diffusion_models/ernie-image.safetensors" in message


def test_sd_unet_where_a_dit_is_expected(tmp_path):
    path = _write(tmp_path / "sdxl.safetensors", {
        "model.diffusion_model.input_blocks.0.0.weight": (4, 4, 3, 3), "model.diffusion_model.out.2.weight": (4, 4)})
    assert "Stable Diffusion (SD1/SD2/SDXL) UNet" in _error(path, "dit")


def test_text_encoder_where_a_dit_is_expected(comfy):
    message = _error(comfy.text_encoder, "dit")
    assert "is not an ERNIE-Image transformer: it is the ERNIE-Image text encoder" in message
    assert "give it as the text encoder" in message


def test_dit_where_a_text_encoder_is_expected(comfy):
    message = _error(comfy.dit, "text_encoder")
    assert "is not an ERNIE-Image text encoder: it is the ERNIE-Image transformer (DiT)" in message


def test_vae_where_a_dit_is_expected(comfy):
    assert "it is the ERNIE-Image VAE (the FLUX.2 VAE (BFL names)" in _error(comfy.vae, "dit")


def test_flux1_vae_where_the_flux2_vae_is_expected(tmp_path):
    path = _write(tmp_path / "ae.safetensors", {"decoder.conv_in.weight": (512, 16, 3, 3),
                                                  "decoder.up.0.block.0.conv1.weight": (128, 256, 3, 3)})
    message = _error(path, "vae")
    assert "FLUX.1 / SD3 VAE" in message and "vae/flux2-vae.safetensors" in message


def test_flux2_text_encoder_where_ministral_is_expected(tmp_path):
    path = _write(tmp_path / "mistral_3_small.safetensors", {
        "model.embed_tokens.weight": (8, 5120), "model.layers.0.self_attn.q_proj.weight": (4, 5120)})
    message = _error(path, "text_encoder")
    assert "Mistral-Small 24B (FLUX.2's text encoder" in message and "ministral-3-3b" in message


def test_unknown_layout_lists_what_was_found(tmp_path):
    path = _write(tmp_path / "mystery.safetensors", {"alpha.weight": (2,), "beta.0.bias": (2,), "gamma": (1,)})
    message = _error(path, "dit")
    assert "layout is unknown (3 tensors, found keys like alpha.weight, beta.0.bias, gamma)" in message


def test_folder_without_weights(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert "holds no .safetensors weights (found config.json)" in _error(tmp_path, "vae")


def test_gguf_that_is_not_readable(tmp_path):
    path = tmp_path / "ernie-image-Q4_K_M.gguf"
    path.write_bytes(b"GGUF" + b"\x00" * 64)
    message = _error(path, "dit")
    assert message.startswith("ernie-image-Q4_K_M.gguf is not a readable GGUF file (") and "re-download it" in message


@pytest.mark.parametrize("width,suggestion", [(1000, 1008), (250, 256), (5000, 4096),
                                              (1030, 1024), (1001, 1008)])
def test_size_not_allowed_suggests_the_nearest_valid_one(width, suggestion):
    with pytest.raises(InvalidInputError, match=f"width {width} is not allowed: .*; use {suggestion}$"):
        validate_size(width, 1024)
    with pytest.raises(InvalidInputError, match=f"use {suggestion}"):
        GenerationRequest(prompt="x", width=width).validate()


def test_empty_prompt_is_valid_and_is_one_bos_token():
    GenerationRequest(prompt="").validate()
    assert token_ids(tokenizer_from_tekken_json(tiny_tekken_bytes()), "") == [BOS_ID]
