"""Loading is memory-mapped and tensor by tensor: each file is opened once per load, tensors are views of the
mapping, and weights text-to-image never uses (last text layer, final text norm, lm_head, vision tower) are never
even requested from the file."""
from __future__ import annotations

import pytest
import torch

from ernie_image.runtime.demo.tiny import TinySizes, build_tiny_model
from ernie_image.runtime.formats import open_component
from ernie_image.runtime.formats.safetensors_reader import SafetensorsFile
from ernie_image.runtime.model.builders import build_dit, build_text_tower, build_vae

LAYERS = TinySizes().text_layers


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    root = tmp_path_factory.mktemp("lazy")
    return {"diffusers folder": build_tiny_model(root / "d", layout="diffusers"),
            "comfy single files": build_tiny_model(root / "c", layout="comfy")}


def _recording(component) -> list[str]:
    requested: list[str] = []
    for key, loader in list(component._loaders.items()):
        def record(key=key, loader=loader):
            requested.append(key)
            return loader()
        component._loaders[key] = record
    return requested


@pytest.mark.parametrize("layout", ["diffusers folder", "comfy single files"])
def test_unused_text_weights_are_never_requested(layout, layouts):
    sources = layouts[layout]
    component = open_component(sources.component("text_encoder"), "text_encoder")
    requested = _recording(component)
    build_text_tower(component, torch.device("cpu"), torch.float32)
    last = f"layers.{LAYERS - 1}."
    assert requested and all(f"layers.{i}.self_attn.q_proj.weight" in requested for i in range(LAYERS - 1))
    assert not [key for key in requested if key.startswith(last) or key == "norm.weight"]
    # Never needed for text-to-image, so never even given a loader:
    assert not [key for key in component.keys if key.startswith(("lm_head", "vision_tower", "multi_modal_projector"))]
    assert "tekken_model" not in component.keys


def test_vae_encoder_is_never_requested(layouts):
    component = open_component(layouts["comfy single files"].vae, "vae")
    requested = _recording(component)
    build_vae(component, torch.device("cpu"), torch.float32)
    assert requested and not [key for key in requested if key.startswith(("encoder.", "quant_conv."))]


@pytest.mark.parametrize("layout", ["diffusers folder", "comfy single files"])
def test_each_file_is_opened_once_per_load(layout, layouts, monkeypatch):
    opened: list[str] = []
    real_init = SafetensorsFile.__init__

    def counting_init(self, path):
        opened.append(str(path))
        real_init(self, path)

    monkeypatch.setattr(SafetensorsFile, "__init__", counting_init)
    sources = layouts[layout]
    build_dit(open_component(sources.component("transformer"), "dit"), torch.device("cpu"), torch.float32)
    assert len(opened) == len(set(opened)) == 1


def test_tensors_are_views_of_the_file_mapping(layouts):
    component = open_component(layouts["comfy single files"].dit, "dit")
    first = component.tensor("final_linear.weight")
    again = component.tensor("final_linear.weight")
    assert first.data_ptr() == again.data_ptr()  # the same mapped bytes, no copy per read
    model = build_dit(component, torch.device("cpu"), torch.float32)
    assert model.final_linear.weight.data_ptr() == first.data_ptr()  # same dtype on the CPU: used in place
    model.final_linear.weight.data.mul_(0)  # a private mapping: writing never touches the file
    reread = open_component(layouts["comfy single files"].dit, "dit").tensor("final_linear.weight")
    assert reread.abs().sum() > 0
