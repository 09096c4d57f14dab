"""Every example workflow agrees with the node definitions, without ComfyUI.

UI format (example_workflows/*.json, what the editor opens and ComfyUI's template browser lists; every file there
is checked, whoever added it): node types exist, positional widget values fit their
inputs (types, ranges, steps, combo choices), links join outputs to inputs of the same type, every required
socket is connected, and a Note names every model file the workflow expects.
API format (workflows/api/*.json, for POST /prompt): the same graph as its UI twin, every required input
given, links pointing at existing outputs of the right type, and the nodes' own VALIDATE_INPUTS accepting it.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ernie_image.nodes import NODE_CLASS_MAPPINGS
from ernie_image.nodes.comfy_env import NONE_CHOICE

ROOT = Path(__file__).resolve().parent.parent
TEMPLATES = ROOT / "example_workflows"
API_FOLDER = ROOT / "workflows" / "api"
UI_FILES = sorted(TEMPLATES.glob("*.json"))
API_FILES = sorted(API_FOLDER.glob("*.json"))
SCENARIOS = {
    "ernie_image_turbo_local", "ernie_image_base_prompt_enhancer", "ernie_image_turbo_12gb_budget",
    "ernie_image_turbo_gguf", "ernie_image_remote_sglang", "ernie_image_turbo_two_loras",
    "ernie_image_turbo_img2img", "ernie_image_turbo_inpaint", "ernie_image_turbo_hires_fix",
    "ernie_image_base_step_cache",
}
WIDGET_TYPES = {"INT", "FLOAT", "STRING", "BOOLEAN"}
CONTROL_AFTER_GENERATE = {"fixed", "increment", "decrement", "randomize"}
# Loader widgets whose choices are ComfyUI's model files (empty outside ComfyUI): the value is a file name.
FILE_WIDGETS = {"diffusers_folder", "diffusion_model", "text_encoder", "vae", "prompt_enhancer", "lora_name"}
MAX_RESOLUTION = 16384  # ComfyUI's nodes.py

# The ComfyUI core nodes the examples use, as ComfyUI v0.8.0 defines them (nodes.py: LoadImage, ImageScale,
# LatentUpscaleBy, SetLatentNoiseMask, SaveImage; nodes_preview_any.py). The e2e test runs the API workflows through
# a real ComfyUI, which checks these against the real thing. `upload_slot`: the editor saves Load Image's upload
# button as one more widgets_values entry, after the image name.
CORE_NODES: dict[str, dict[str, Any]] = {
    "SaveImage": {"input": {"required": {"images": ("IMAGE",), "filename_prefix": ("STRING", {"default": "ComfyUI"})}},
                  "output": ()},
    "PreviewAny": {"input": {"required": {"source": ("*",)}}, "output": ()},
    "Note": {"input": {"required": {"text": ("STRING", {"multiline": True})}}, "output": (), "virtual": True},
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
UPLOAD_SLOT = "upload"


def node_definition(class_type: str) -> dict[str, Any]:
    if class_type in CORE_NODES:
        return CORE_NODES[class_type]
    cls = NODE_CLASS_MAPPINGS.get(class_type)
    assert cls is not None, f"unknown node type {class_type}"
    return {"input": cls.INPUT_TYPES(), "output": tuple(cls.RETURN_TYPES)}


def is_widget(spec: tuple) -> bool:
    kind = spec[0]
    return isinstance(kind, list) or kind in WIDGET_TYPES


def sockets_and_widgets(definition: dict[str, Any]) -> tuple[dict[str, str], list[tuple[str, tuple]], set[str]]:
    sockets: dict[str, str] = {}
    widgets: list[tuple[str, tuple]] = []
    required: set[str] = set()
    for section in ("required", "optional"):
        for name, spec in definition["input"].get(section, {}).items():
            if section == "required":
                required.add(name)
            if is_widget(spec):
                widgets.append((name, spec))
            else:
                sockets[name] = spec[0]
    return sockets, widgets, required


def check_widget_value(where: str, name: str, spec: tuple, value: Any) -> None:
    kind, options = spec[0], (spec[1] if len(spec) > 1 else {})
    if isinstance(kind, list):
        assert isinstance(value, str), f"{where}: {name} must be a choice string, got {value!r}"
        if name in FILE_WIDGETS:
            assert value == NONE_CHOICE or "." in value or "/" not in value, f"{where}: {name} {value!r}"
        else:
            assert value in kind, f"{where}: {name} {value!r} is not one of {kind}"
        return
    if kind == "BOOLEAN":
        assert isinstance(value, bool), f"{where}: {name} must be true/false, got {value!r}"
        return
    if kind == "STRING":
        assert isinstance(value, str), f"{where}: {name} must be a string, got {value!r}"
        return
    if kind == "INT":
        assert isinstance(value, int) and not isinstance(value, bool), f"{where}: {name} must be an integer, got {value!r}"
    else:
        assert isinstance(value, (int, float)) and not isinstance(value, bool), f"{where}: {name} must be a number"
    assert options.get("min", value) <= value <= options.get("max", value), (
        f"{where}: {name} {value} outside {options.get('min')}..{options.get('max')}")
    if kind == "INT" and "step" in options:
        assert (value - options.get("min", 0)) % options["step"] == 0, f"{where}: {name} {value} off the step {options['step']}"


def types_match(output_type: str, input_type: str) -> bool:
    return output_type == input_type or "*" in (output_type, input_type)


def load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8"))


def ui_widget_names(definition: dict[str, Any]) -> list[tuple[str, tuple]]:
    """Widget slots in widgets_values order; a seed with control_after_generate and Load Image's upload button take
    one more slot each."""
    slots: list[tuple[str, tuple]] = []
    for name, spec in sockets_and_widgets(definition)[1]:
        slots.append((name, spec))
        if len(spec) > 1 and spec[1].get("control_after_generate"):
            slots.append(("control_after_generate", (list(CONTROL_AFTER_GENERATE),)))
    if definition.get("upload_slot"):
        slots.append((UPLOAD_SLOT, (["image"],)))
    return slots


def ui_to_api(ui: dict[str, Any]) -> dict[str, Any]:
    """What the editor's 'Export (API)' gives for a UI workflow (virtual nodes such as Note dropped)."""
    links = {link[0]: link for link in ui["links"]}
    api: dict[str, Any] = {}
    for node in ui["nodes"]:
        definition = node_definition(node["type"])
        if definition.get("virtual"):
            continue
        inputs: dict[str, Any] = {}
        for (name, _), value in zip(ui_widget_names(definition), node["widgets_values"]):
            if name not in ("control_after_generate", UPLOAD_SLOT):
                inputs[name] = value
        for socket in node["inputs"]:
            if socket.get("link") is not None:
                link = links[socket["link"]]
                inputs[socket["name"]] = [str(link[1]), link[2]]
        api[str(node["id"])] = {"class_type": node["type"], "inputs": inputs}
    return api


def test_every_scenario_ships_in_both_formats_and_every_api_file_has_a_ui_twin() -> None:
    assert SCENARIOS <= {p.stem for p in UI_FILES}
    assert SCENARIOS <= {p.stem for p in API_FILES}
    assert {p.stem for p in API_FILES} <= {p.stem for p in UI_FILES}, "an API workflow without its UI twin"


@pytest.mark.parametrize("path", UI_FILES, ids=lambda p: p.stem)
def test_ui_workflow_matches_node_definitions(path: Path) -> None:
    ui = load(path)
    nodes = {node["id"]: node for node in ui["nodes"]}
    assert len(nodes) == len(ui["nodes"]), "node ids must be unique"
    assert ui["last_node_id"] >= max(nodes) and ui["last_link_id"] >= max(link[0] for link in ui["links"])
    for node in ui["nodes"]:
        where = f"{path.name} node {node['id']} ({node['type']})"
        definition = node_definition(node["type"])
        slots = ui_widget_names(definition)
        assert len(node["widgets_values"]) == len(slots), f"{where}: {len(node['widgets_values'])} widget values for {[n for n, _ in slots]}"
        for (name, spec), value in zip(slots, node["widgets_values"]):
            check_widget_value(where, name, spec, value)
        sockets, widgets, required = sockets_and_widgets(definition)
        plain = [s for s in node["inputs"] if "widget" not in s]
        assert [s["name"] for s in plain] == list(sockets), f"{where}: input sockets differ from the definition"
        for socket in plain:
            assert socket["type"] == sockets[socket["name"]], f"{where}: socket {socket['name']} type"
            if socket["name"] in required:
                assert socket["link"] is not None, f"{where}: required input {socket['name']} is not connected"
        for socket in node["inputs"]:
            if "widget" in socket:  # a widget fed by a link (e.g. a prompt from the Prompt Enhancer)
                assert socket["widget"]["name"] == socket["name"] and socket["link"] is not None, f"{where}: {socket}"
                assert socket["type"] == dict(widgets)[socket["name"]][0], f"{where}: widget input {socket['name']} type"
        assert [o["type"] for o in node["outputs"]] == list(definition["output"]), f"{where}: outputs differ"
    for link_id, source, source_slot, target, target_slot, link_type in ui["links"]:
        output = nodes[source]["outputs"][source_slot]
        socket = nodes[target]["inputs"][target_slot]
        assert link_id in (output["links"] or []) and socket["link"] == link_id, f"{path.name}: link {link_id} is not wired both ways"
        assert output["type"] == link_type and types_match(link_type, socket["type"]), (
            f"{path.name}: link {link_id} joins {output['type']} to {socket['type']}")


@pytest.mark.parametrize("path", UI_FILES, ids=lambda p: p.stem)
def test_ui_workflow_names_the_files_it_expects_in_a_note(path: Path) -> None:
    ui = load(path)
    notes = " ".join(node["widgets_values"][0] for node in ui["nodes"] if node["type"] == "Note")
    assert notes, f"{path.name} has no Note"
    for node in ui["nodes"]:  # the Loader's model files and each LoRA's file
        slots = [name for name, _ in ui_widget_names(node_definition(node["type"]))]
        for name, value in zip(slots, node["widgets_values"]):
            if name in FILE_WIDGETS and value != NONE_CHOICE:
                assert value in notes, f"{path.name}: the Note does not name {name} file {value}"


@pytest.mark.parametrize("path", API_FILES, ids=lambda p: p.stem)
def test_api_workflow_is_its_ui_twin(path: Path) -> None:
    api = load(path)
    expected = ui_to_api(load(TEMPLATES / path.name))
    stripped = {node_id: {"class_type": n["class_type"], "inputs": n["inputs"]} for node_id, n in api.items()}
    assert stripped == expected


def check_api_workflow(label: str, api: dict[str, Any]) -> None:
    """Every node's inputs against its definition, every link against its source's output type, VALIDATE_INPUTS."""
    for node_id, node in api.items():
        where = f"{label} node {node_id} ({node['class_type']})"
        definition = node_definition(node["class_type"])
        sockets, widgets, required = sockets_and_widgets(definition)
        known = set(sockets) | {name for name, _ in widgets}
        assert set(node["inputs"]) <= known, f"{where}: unknown inputs {set(node['inputs']) - known}"
        assert required <= set(node["inputs"]), f"{where}: missing {required - set(node['inputs'])}"
        linked_widgets = {name: spec[0] for name, spec in widgets if isinstance(node["inputs"].get(name), list)}
        for name, spec in widgets:
            if name in node["inputs"] and name not in linked_widgets:
                check_widget_value(where, name, spec, node["inputs"][name])
        for name, value in node["inputs"].items():
            if name in sockets or name in linked_widgets:
                wanted = sockets.get(name) or linked_widgets[name]
                source_id, slot = value
                source = api[source_id]
                output_type = node_definition(source["class_type"])["output"][slot]
                assert types_match(output_type, wanted), f"{where}: {name} gets {output_type}, wants {wanted}"
        validate = getattr(NODE_CLASS_MAPPINGS.get(node["class_type"]), "VALIDATE_INPUTS", None)
        if validate is not None:
            import inspect

            wanted = inspect.signature(validate).parameters
            result = validate(**{k: v for k, v in node["inputs"].items() if k in wanted and not isinstance(v, list)})
            assert result is True, f"{where}: VALIDATE_INPUTS says {result}"


@pytest.mark.parametrize("path", API_FILES, ids=lambda p: p.stem)
def test_api_workflow_matches_node_definitions(path: Path) -> None:
    check_api_workflow(path.name, load(path))


def test_a_bad_api_workflow_is_caught() -> None:
    """The checks above are not vacuous: a wrong socket type, an off-step width and a missing input are reported."""
    import copy

    api = load(API_FOLDER / "ernie_image_turbo_local.json")
    check_api_workflow("shipped", api)
    sampler_id = next(k for k, n in api.items() if n["class_type"] == "ErnieImageTurboSampler")
    loader_id = api[sampler_id]["inputs"]["pipe"][0]

    wrong_socket = copy.deepcopy(api)
    wrong_socket[sampler_id]["inputs"]["pipe"] = [loader_id, 1]  # the Loader's memory_plan STRING
    with pytest.raises(AssertionError, match=r"^wrong socket node \w+ \(ErnieImageTurboSampler\): pipe gets STRING, wants ERNIE_PIPE"):
        check_api_workflow("wrong socket", wrong_socket)

    off_step = copy.deepcopy(api)
    off_step[sampler_id]["inputs"].update(resolution="custom", width=1000)
    with pytest.raises(AssertionError, match="width 1000 off the step"):
        check_api_workflow("off step", off_step)

    missing = copy.deepcopy(api)
    del missing[sampler_id]["inputs"]["seed"]
    with pytest.raises(AssertionError, match="missing {'seed'}"):
        check_api_workflow("missing input", missing)


# ------------------------------------------------------------------------------------------- the layout
TITLE_HEIGHT = 30  # LiteGraph.NODE_TITLE_HEIGHT: a node's pos is the top-left of its body; the title bar sits above
# The smallest body ComfyUI's editor gives each node (LGraphNode.computeSize() of a new node in frontend 1.58.1,
# this pack's fixed-height text boxes included); a saved size below it is enlarged when the workflow opens.
MIN_BODY: dict[str, tuple[int, int]] = {
    "ErnieImageLoader": (210, 386), "ErnieImageSampler": (210, 422), "ErnieImageTurboSampler": (228, 484),
    "ErnieImageQuantConfig": (219, 134), "ErnieImageRemoteBackend": (309, 422), "ErnieImagePromptEnhancer": (246, 466),
    "ErnieImageLoRA": (210, 82), "SaveImage": (210, 58), "PreviewAny": (210, 122), "Note": (210, 88),
    "LoadImage": (223, 102), "ImageScale": (210, 130),
    "ErnieImageStepCache": (210, 178),  # estimated (a socket row and 7 widgets, as the LoRA node's 82 for 3), not measured
}
# What a run adds below a node's widgets: the Samplers show the latent preview (124 px at 400 px wide, measured).
AFTER_RUN_EXTRA: dict[str, int] = {"ErnieImageSampler": 130, "ErnieImageTurboSampler": 130}
Rect = tuple[float, float, float, float]


def node_rect(node: dict[str, Any], after_run: bool) -> Rect:
    """The node's area on the canvas, title bar included, as the editor draws it (before or after a run)."""
    x, y = node["pos"]
    width, height = node["size"]
    min_width, min_height = MIN_BODY.get(node["type"], (0, 0))
    height = max(height, min_height + (AFTER_RUN_EXTRA.get(node["type"], 0) if after_run else 0))
    return (x, y - TITLE_HEIGHT, x + max(width, min_width), y + height)


def overlap(a: Rect, b: Rect) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def overlapping_pairs(ui: dict[str, Any], after_run: bool) -> list[str]:
    rects = [(f"{n['id']} ({n['type']})", node_rect(n, after_run)) for n in ui["nodes"]]
    return [f"{a} and {b}" for i, (a, ra) in enumerate(rects) for b, rb in rects[i + 1:] if overlap(ra, rb)]


@pytest.mark.parametrize("after_run", [False, True], ids=["opened", "after_a_run"])
@pytest.mark.parametrize("path", UI_FILES, ids=lambda p: p.stem)
def test_no_node_overlaps_another(path: Path, after_run: bool) -> None:
    assert overlapping_pairs(load(path), after_run) == []


def test_the_overlap_check_sees_title_bars_minimum_sizes_and_previews() -> None:
    node = {"id": 1, "type": "ErnieImageRemoteBackend", "pos": [0, 40], "size": [340, 300]}
    below = {"id": 2, "type": "PreviewAny", "pos": [0, 40 + 422 + TITLE_HEIGHT], "size": [340, 160]}
    assert overlapping_pairs({"nodes": [node, below]}, False) == []  # 422 px: its real height, not the saved 300
    below["pos"] = [0, 40 + 422 + TITLE_HEIGHT - 10]  # its title bar now covers the Remote Backend's last row
    assert overlapping_pairs({"nodes": [node, below]}, False) == ["1 (ErnieImageRemoteBackend) and 2 (PreviewAny)"]
    sampler = {"id": 3, "type": "ErnieImageTurboSampler", "pos": [0, 40], "size": [400, 300]}
    under = {"id": 4, "type": "PreviewAny", "pos": [0, 40 + 484 + 40], "size": [400, 160]}
    assert overlapping_pairs({"nodes": [sampler, under]}, False) == []
    assert overlapping_pairs({"nodes": [sampler, under]}, True) == ["3 (ErnieImageTurboSampler) and 4 (PreviewAny)"]


@pytest.mark.parametrize("path", UI_FILES, ids=lambda p: p.stem)
def test_every_template_has_its_thumbnail_beside_it(path: Path) -> None:
    """ComfyUI's template browser shows a custom node's template with `<name>.jpg` from the same folder
    (frontend: mediaType image, mediaSubtype jpg, /api/workflow_templates/<pack>/<name>.jpg)."""
    thumbnail = path.with_suffix(".jpg")
    assert thumbnail.is_file(), f"{path.name} has no {thumbnail.name} beside it"
    from PIL import Image

    with Image.open(thumbnail) as image:
        assert image.format == "JPEG" and min(image.size) >= 128, (image.format, image.size)
