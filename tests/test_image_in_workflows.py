"""The image-in example workflows (example_workflows/: img2img, inpainting, hires fix) agree with the pack's node
definitions and with the ComfyUI v0.8.0 core nodes they use, in UI format and in their API twins
(workflows/api/). The helpers are test_workflows.py's; the core nodes below are v0.8.0's nodes.py."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ernie_image.nodes import NODE_CLASS_MAPPINGS
from ernie_image.runtime.image_in import denoise_sigmas
from test_workflows import CORE_NODES, check_widget_value, sockets_and_widgets, types_match, ui_widget_names

EXAMPLES = Path(__file__).resolve().parent.parent / "example_workflows"
API_TWINS = Path(__file__).resolve().parent.parent / "workflows" / "api"
SCENARIOS = {"ernie_image_turbo_img2img", "ernie_image_turbo_inpaint", "ernie_image_turbo_hires_fix"}
MAX_RESOLUTION = 16384  # nodes.py

# ComfyUI v0.8.0 nodes.py: LoadImage (line 1647), ImageScale (1796), LatentUpscaleBy (1298), SetLatentNoiseMask
# (1477), VAEEncode (340), VAEDecode.
IMAGE_CORE_NODES: dict[str, dict[str, Any]] = {
    **CORE_NODES,
    "LoadImage": {"input": {"required": {"image": (["example.png"], {"image_upload": True})}},
                  "output": ("IMAGE", "MASK"), "upload_slot": True},
    "ImageScale": {"input": {"required": {
        "image": ("IMAGE",), "upscale_method": (["nearest-exact", "bilinear", "area", "bicubic", "lanczos"],),
        "width": ("INT", {"default": 512, "min": 0, "max": MAX_RESOLUTION, "step": 1}),
        "height": ("INT", {"default": 512, "min": 0, "max": MAX_RESOLUTION, "step": 1}),
        "crop": (["disabled", "center"],)}}, "output": ("IMAGE",)},
    "LatentUpscaleBy": {"input": {"required": {
        "samples": ("LATENT",), "upscale_method": (["nearest-exact", "bilinear", "area", "bicubic", "bislerp"],),
        "scale_by": ("FLOAT", {"default": 1.5, "min": 0.01, "max": 8.0, "step": 0.01})}}, "output": ("LATENT",)},
    "SetLatentNoiseMask": {"input": {"required": {"samples": ("LATENT",), "mask": ("MASK",)}}, "output": ("LATENT",)},
}


def definition(class_type: str) -> dict[str, Any]:
    if class_type in IMAGE_CORE_NODES:
        return IMAGE_CORE_NODES[class_type]
    cls = NODE_CLASS_MAPPINGS.get(class_type)
    assert cls is not None, f"unknown node type {class_type}"
    return {"input": cls.INPUT_TYPES(), "output": tuple(cls.RETURN_TYPES)}


def widget_slots(spec: dict[str, Any]) -> list[tuple[str, tuple]]:
    slots = ui_widget_names(spec)
    if spec.get("upload_slot"):  # Load Image's upload button keeps a widgets_values slot of its own
        slots.append(("upload", (["image"],)))
    return slots


def load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8"))


UI_FILES = sorted(EXAMPLES.glob("*.json"))
API_FILES = [API_TWINS / f"{p.stem}.json" for p in UI_FILES if (API_TWINS / f"{p.stem}.json").exists()]


def test_each_scenario_ships_in_both_formats() -> None:
    assert {p.stem for p in UI_FILES} == {p.stem for p in API_FILES} == SCENARIOS


@pytest.mark.parametrize("path", UI_FILES, ids=lambda p: p.stem)
def test_ui_workflow_matches_the_definitions(path: Path) -> None:
    ui = load(path)
    nodes = {node["id"]: node for node in ui["nodes"]}
    assert len(nodes) == len(ui["nodes"]) and ui["last_node_id"] >= max(nodes)
    for node in ui["nodes"]:
        where = f"{path.name} node {node['id']} ({node['type']})"
        spec = definition(node["type"])
        slots = widget_slots(spec)
        assert len(node["widgets_values"]) == len(slots), f"{where}: widget values for {[n for n, _ in slots]}"
        for (name, widget), value in zip(slots, node["widgets_values"]):
            check_widget_value(where, name, widget, value)
        sockets, _, required = sockets_and_widgets(spec)
        assert [s["name"] for s in node["inputs"]] == list(sockets), f"{where}: input sockets differ"
        for socket in node["inputs"]:
            assert socket["type"] == sockets[socket["name"]]
            if socket["name"] in required:
                assert socket["link"] is not None, f"{where}: required input {socket['name']} is not connected"
        assert [o["type"] for o in node["outputs"]] == list(spec["output"]), f"{where}: outputs differ"
    for link_id, source, slot, target, target_slot, link_type in ui["links"]:
        output, socket = nodes[source]["outputs"][slot], nodes[target]["inputs"][target_slot]
        assert link_id in output["links"] and socket["link"] == link_id, f"{path.name}: link {link_id} one-way"
        assert output["type"] == link_type and types_match(link_type, socket["type"])


@pytest.mark.parametrize("path", API_FILES, ids=lambda p: p.stem)
def test_api_twin_is_the_same_graph_and_validates(path: Path) -> None:
    api = load(path)
    ui = load(EXAMPLES / path.name)
    links = {link[0]: link for link in ui["links"]}
    for node in ui["nodes"]:
        if node["type"] == "Note":
            continue
        entry = api[str(node["id"])]
        assert entry["class_type"] == node["type"]
        slots = [name for name, _ in widget_slots(definition(node["type"]))]
        widgets = {name: value for name, value in zip(slots, node["widgets_values"])
                   if name not in ("control_after_generate", "upload")}
        wired = {s["name"]: [str(links[s["link"]][1]), links[s["link"]][2]] for s in node["inputs"] if s["link"]}
        assert entry["inputs"] == {**widgets, **wired}, f"{path.name} node {node['id']}"
    for node_id, node in api.items():
        spec = definition(node["class_type"])
        sockets, widgets, required = sockets_and_widgets(spec)
        assert required <= set(node["inputs"]), f"{path.name} node {node_id}: missing inputs"
        for name, value in node["inputs"].items():
            if name in sockets:
                source = api[value[0]]
                assert types_match(definition(source["class_type"])["output"][value[1]], sockets[name])
        validate = getattr(NODE_CLASS_MAPPINGS.get(node["class_type"]), "VALIDATE_INPUTS", None)
        if validate is not None:
            assert validate(resolution=node["inputs"]["resolution"], width=node["inputs"]["width"],
                            height=node["inputs"]["height"]) is True


def samplers(name: str) -> list[dict[str, Any]]:
    api = load(API_TWINS / f"{name}.json")
    return [node for node in api.values() if node["class_type"] == "ErnieImageTurboSampler"]


def test_img2img_starts_from_load_image_at_a_partial_denoise() -> None:
    (sampler,) = samplers("ernie_image_turbo_img2img")
    assert "image" in sampler["inputs"] and 0 < sampler["inputs"]["denoise"] < 1
    assert len(denoise_sigmas(sampler["inputs"]["steps"], 4.0, sampler["inputs"]["denoise"])) == 9


def test_inpainting_takes_load_images_mask_and_composites() -> None:
    (sampler,) = samplers("ernie_image_turbo_inpaint")
    image, mask = sampler["inputs"]["image"], sampler["inputs"]["mask"]
    assert image[0] == mask[0] and (image[1], mask[1]) == (0, 1)  # Load Image's IMAGE and MASK
    assert sampler["inputs"]["composite"] is True


def test_hires_fix_is_a_second_turbo_pass_at_2048_inside_12_gb() -> None:
    api = load(API_TWINS / "ernie_image_turbo_hires_fix.json")
    first, second = samplers("ernie_image_turbo_hires_fix")
    assert (first["inputs"]["width"], first["inputs"]["denoise"]) == (1024, 1.0)
    assert 0.3 <= second["inputs"]["denoise"] <= 0.5
    scale = api[second["inputs"]["image"][0]]
    assert scale["class_type"] == "ImageScale" and (scale["inputs"]["width"], scale["inputs"]["height"]) == (2048, 2048)
    loader = api[second["inputs"]["pipe"][0]]
    assert loader["inputs"]["vram_budget_gb"] == 12.0
