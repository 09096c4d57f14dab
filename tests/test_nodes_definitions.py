"""What ComfyUI and its users see of every node, checked without ComfyUI installed."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from ernie_image.nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS
from ernie_image.nodes.sampler import RESOLUTION_CHOICES, ErnieImageSampler, ErnieImageTurboSampler, resolve_size
from ernie_image.runtime.core.errors import InvalidInputError
from ernie_image.runtime.core.request import RESOLUTION_PRESETS

REPO_ROOT = Path(__file__).resolve().parent.parent
CORE_NODE_IDS = {"KSampler", "CheckpointLoaderSimple", "UNETLoader", "CLIPLoader", "VAELoader", "SaveImage",
                 "EmptyLatentImage", "VAEDecode", "CLIPTextEncode", "EmptyFlux2LatentImage"}


def test_node_modules_import_no_comfyui_module() -> None:
    assert "comfy" not in sys.modules and "folder_paths" not in sys.modules and "server" not in sys.modules


def test_ids_are_prefixed_and_named() -> None:
    assert set(NODE_CLASS_MAPPINGS) == set(NODE_DISPLAY_NAME_MAPPINGS)
    for node_id in NODE_CLASS_MAPPINGS:
        assert node_id.startswith("ErnieImage") and node_id not in CORE_NODE_IDS
        assert NODE_DISPLAY_NAME_MAPPINGS[node_id].startswith("ERNIE-Image")


@pytest.mark.parametrize("node_id", sorted(NODE_CLASS_MAPPINGS))
def test_every_node_is_documented_and_every_input_has_a_tooltip(node_id: str) -> None:
    cls = NODE_CLASS_MAPPINGS[node_id]
    assert cls.CATEGORY == "ERNIE-Image"
    assert len(cls.DESCRIPTION) > 40
    assert callable(getattr(cls(), cls.FUNCTION))
    assert len(cls.RETURN_TYPES) == len(cls.RETURN_NAMES)
    inputs = cls.INPUT_TYPES()
    for section in ("required", "optional"):
        for name, spec in inputs.get(section, {}).items():
            assert len(spec) == 2 and spec[1].get("tooltip"), f"{node_id}.{name} has no tooltip"
    help_page = REPO_ROOT / "web" / "docs" / f"{node_id}.md"
    assert help_page.is_file() and help_page.read_text().startswith("# "), f"no help page for {node_id}"
    text = help_page.read_text()
    names = [name for section in ("required", "optional") for name in inputs.get(section, {})] + list(cls.RETURN_NAMES)
    undocumented = [name for name in names if not re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text)]
    assert not undocumented, f"the help page of {node_id} does not mention {undocumented}"


def test_file_dropdowns_fall_back_to_none_outside_comfyui() -> None:
    loader = NODE_CLASS_MAPPINGS["ErnieImageLoader"].INPUT_TYPES()["required"]
    for name in ("diffusers_folder", "diffusion_model", "text_encoder", "vae", "prompt_enhancer"):
        assert loader[name][0] == ["(none)"]
    assert NODE_CLASS_MAPPINGS["ErnieImageLoader"].INPUT_TYPES()["optional"]["quant_config"][0] == "ERNIE_QUANT"


def test_pipe_producers_and_consumers_share_one_socket_type() -> None:
    loader, remote = NODE_CLASS_MAPPINGS["ErnieImageLoader"], NODE_CLASS_MAPPINGS["ErnieImageRemoteBackend"]
    assert loader.RETURN_TYPES[0] == remote.RETURN_TYPES[0] == "ERNIE_PIPE"
    for sampler in (ErnieImageSampler, ErnieImageTurboSampler):
        assert sampler.INPUT_TYPES()["required"]["pipe"][0] == "ERNIE_PIPE"
        assert sampler.RETURN_TYPES == ("IMAGE", "LATENT", "STRING")


def test_sampler_defaults_are_baidus() -> None:
    base = ErnieImageSampler.INPUT_TYPES()["required"]
    turbo = ErnieImageTurboSampler.INPUT_TYPES()["required"]
    assert (base["steps"][1]["default"], base["cfg"][1]["default"]) == (50, 4.0)
    assert (turbo["steps"][1]["default"], turbo["cfg"][1]["default"]) == (8, 1.0)
    assert "negative_prompt" in base and "negative_prompt" not in turbo
    for inputs in (base, turbo):
        assert inputs["shift"][1]["default"] == 4.0 and inputs["use_pe"][1]["default"] is True
        assert inputs["seed"][1]["control_after_generate"] is True
        assert inputs["prompt"][1]["multiline"] is True
        assert inputs["width"][1]["step"] == 16 and inputs["height"][1]["step"] == 16


def test_resolution_presets_are_baidus_seven_and_win_over_width_height() -> None:
    assert [resolve_size(label, 512, 512) for label in RESOLUTION_CHOICES[:-1]] == list(RESOLUTION_PRESETS)
    assert RESOLUTION_CHOICES[-1] == "custom" and resolve_size("custom", 512, 768) == (512, 768)
    assert RESOLUTION_CHOICES[1] == "848x1264 (2:3)"
    with pytest.raises(InvalidInputError, match="not one of"):
        resolve_size("999x999", 512, 512)


def test_the_size_rule_is_checked_once_when_the_node_runs() -> None:
    """ComfyUI repeats a VALIDATE_INPUTS message for every input the method names (execution.validate_inputs),
    so no node validates its size there: resolve_size checks it, before anything is loaded or sampled. A node
    that validates at queue time names as few inputs as it must: the LoRA node's strength, and the URL inputs in
    which a password must be refused before the prompt is queued (else ComfyUI keeps it in /history)."""
    import inspect

    from ernie_image.nodes import NODE_CLASS_MAPPINGS

    validating = {name: inspect.getfullargspec(cls.VALIDATE_INPUTS).args[1:]
                  for name, cls in NODE_CLASS_MAPPINGS.items() if hasattr(cls, "VALIDATE_INPUTS")}
    assert validating == {"ErnieImageLoRA": ["strength"], "ErnieImagePromptEnhancer": ["pe_url"],
                          "ErnieImageRemoteBackend": ["server_urls", "pe_url"]}
    assert resolve_size("custom", 1024, 848) == (1024, 848)
    with pytest.raises(InvalidInputError) as refused:
        resolve_size("custom", 1000, 1024)
    assert str(refused.value) == ("width 1000 is not allowed: ERNIE-Image needs a multiple of 16 between 256 and "
                                  "4096; use 1008")
    with pytest.raises(InvalidInputError, match="height 8192"):
        resolve_size("custom", 1024, 8192)
    # A preset ignores the widgets.
    assert resolve_size(RESOLUTION_CHOICES[0], 1000, 1000) == (1024, 1024)


def test_web_extension_syncs_presets_on_every_node_with_a_resolution_widget() -> None:
    script = (REPO_ROOT / "web" / "ernie_image.js").read_text()
    listed = set(re.findall(r'"(ErnieImage\w+)"', re.search(r"const HAS_RESOLUTION = new Set\(\[([^\]]*)\]", script)[1]))
    with_resolution = {node_id for node_id, cls in NODE_CLASS_MAPPINGS.items() if "resolution" in cls.INPUT_TYPES()["required"]}
    assert listed == with_resolution == {"ErnieImageSampler", "ErnieImageTurboSampler", "ErnieImagePromptEnhancer"}


def test_web_extension_talks_only_to_the_packs_routes() -> None:
    script = (REPO_ROOT / "web" / "ernie_image.js").read_text()
    assert "registerExtension" in script
    assert re.findall(r'fetchApi\("([^"]+)"', script) == ["/ernie_image/test_connection"]
