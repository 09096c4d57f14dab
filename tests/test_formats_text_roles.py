"""The text encoder and the prompt enhancer share one geometry (Ministral-3B, 26 layers, width 3072); a file of one
given in the other's slot is refused when the Loader opens the files, in one line naming the slot it belongs in.

Told apart by what the files carry besides the layers (runtime/formats/detect.text_model_role): the text encoder
is a Mistral3Model (a vision tower and `language_model.` names in diffusers' text_encoder/; `model.` names, an
explicit lm_head and the embedded Tekken tokenizer in Comfy-Org's repack), the PE a Ministral3ForCausalLM with a
tied head (no lm_head stored, no vision tower), in diffusers' pe/ and Comfy-Org's file alike.
"""
from __future__ import annotations

import dataclasses

import pytest

from ernie_image.runtime.core.errors import ModelFileError
from ernie_image.runtime.demo.tiny import build_tiny_model
from ernie_image.runtime.formats import open_component
from ernie_image.runtime.local.options import LoadOptions
from ernie_image.runtime.local.pipe import LocalPipe


@pytest.fixture(scope="module", params=["comfy", "diffusers"])
def model(request, tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp(request.param), layout=request.param, variant="base", with_pe=True)


def test_each_file_opens_in_its_own_slot(model) -> None:
    assert open_component(model.component("text_encoder"), "text_encoder").kind == "text_encoder"
    assert open_component(model.component("pe"), "pe").kind == "pe"


def one_line_refusal(sources) -> str:
    with pytest.raises(ModelFileError) as refused:
        LocalPipe.load(sources, LoadOptions(device="cpu"))
    message = str(refused.value)
    assert "\n" not in message
    return message


def test_the_prompt_enhancer_given_as_the_text_encoder_is_refused_at_load(model) -> None:
    swapped = dataclasses.replace(model, text_encoder=model.component("pe"), model_dir=None,
                                  dit=model.component("transformer"), vae=model.component("vae"), pe=None)
    message = one_line_refusal(swapped)
    assert "is the ERNIE-Image prompt enhancer, not the text encoder" in message
    assert "give it as the prompt enhancer (pe)" in message
    assert "pick text_encoders/ministral-3-3b.safetensors" in message


def test_the_text_encoder_given_as_the_prompt_enhancer_is_refused_at_load(model) -> None:
    swapped = dataclasses.replace(model, pe=model.component("text_encoder"), model_dir=None,
                                  dit=model.component("transformer"), vae=model.component("vae"),
                                  text_encoder=model.component("text_encoder"))
    message = one_line_refusal(swapped)
    assert "is the ERNIE-Image text encoder (Ministral-3B" in message and "not the prompt enhancer" in message
    assert "give it as the text encoder (text_encoder)" in message
    assert "pick text_encoders/ernie-image-prompt-enhancer.safetensors" in message


def test_a_text_encoder_given_from_inside_a_diffusers_folder_finds_the_tokenizer_beside_its_folder(
        tiny_turbo_folder, tmp_path) -> None:
    from ernie_image.runtime.formats.sources import ModelSources
    from ernie_image.runtime.formats.tokenizer import load_tokenizer

    inside = next((tiny_turbo_folder / "text_encoder").glob("*.safetensors"))
    for given in (inside, inside.parent):
        tokenizer = load_tokenizer(ModelSources(text_encoder=given))
        assert tokenizer("a fox").input_ids == load_tokenizer(ModelSources(model_dir=tiny_turbo_folder))(
            "a fox").input_ids
    elsewhere = tmp_path / "encoders"  # the same file outside a diffusers folder: no tokenizer to find
    elsewhere.mkdir()
    (elsewhere / inside.name).symlink_to(inside)
    with pytest.raises(ModelFileError, match="no vocabulary for the text encoder found"):
        load_tokenizer(ModelSources(text_encoder=elsewhere / inside.name))
