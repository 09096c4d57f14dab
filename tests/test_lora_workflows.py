"""The two-LoRA example workflow (UI format in example_workflows/, API twin in workflows/api/) agrees with the node
definitions, and its API graph runs in process on tiny models placed under the file names it expects."""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import lora_files as lf
import test_workflows as tw
from comfy_folders import fake_folder_paths
from ernie_image.nodes import NODE_CLASS_MAPPINGS
from ernie_image.runtime.core.host import NullHost
from ernie_image.runtime.core.request import GenerationRequest
from ernie_image.runtime.demo.tiny import build_tiny_model
from ernie_image.runtime.local.pipe import LocalPipe

REPO_ROOT = Path(__file__).resolve().parent.parent
NAME = "ernie_image_turbo_two_loras"
UI_PATH = REPO_ROOT / "example_workflows" / f"{NAME}.json"
API_PATH = REPO_ROOT / "workflows" / "api" / f"{NAME}.json"

pytestmark = pytest.mark.usefixtures("one_thread", "no_comfy_modules_left_behind")  # tiny models: one thread



def test_the_workflow_checks_cover_the_two_lora_scenario() -> None:
    """test_workflows.py checks it against the node definitions, its API twin and its Note; lora_name is a file."""
    assert NAME in tw.SCENARIOS and "lora_name" in tw.FILE_WIDGETS


def test_the_loras_are_chained_between_loader_and_sampler_and_named_in_the_note() -> None:
    ui = tw.load(UI_PATH)
    notes = " ".join(node["widgets_values"][0] for node in ui["nodes"] if node["type"] == "Note")
    loras = [node for node in ui["nodes"] if node["type"] == "ErnieImageLoRA"]
    assert len(loras) == 2 and all(node["widgets_values"][0] in notes for node in loras)
    api = tw.load(API_PATH)
    sampler = next(n for n in api.values() if n["class_type"] == "ErnieImageTurboSampler")
    second = api[sampler["inputs"]["pipe"][0]]
    first = api[second["inputs"]["pipe"][0]]
    assert (second["class_type"], first["class_type"]) == ("ErnieImageLoRA", "ErnieImageLoRA")
    assert api[first["inputs"]["pipe"][0]]["class_type"] == "ErnieImageLoader"


def run_api_graph(graph: dict[str, Any]) -> dict[str, tuple]:
    """Each node's outputs, nodes run in dependency order as ComfyUI does (SaveImage keeps its images)."""
    outputs: dict[str, tuple] = {}
    pending = dict(graph)
    while pending:
        for node_id, node in list(pending.items()):
            links = [v for v in node["inputs"].values() if isinstance(v, list)]
            if any(source not in outputs for source, _ in links):
                continue
            inputs = {k: (outputs[v[0]][v[1]] if isinstance(v, list) else v) for k, v in node["inputs"].items()}
            if node["class_type"] == "SaveImage":
                outputs[node_id] = (inputs["images"],)
            else:
                cls = NODE_CLASS_MAPPINGS[node["class_type"]]
                result = getattr(cls(), cls.FUNCTION)(**inputs)
                outputs[node_id] = tuple(result["result"]) if isinstance(result, dict) else tuple(result)
            del pending[node_id]
    return outputs


def test_api_graph_runs_in_process_and_applies_both_loras(tmp_path, monkeypatch):
    models = tmp_path / "models"
    tiny = build_tiny_model(tmp_path / "tiny", layout="comfy", variant="turbo")
    for folder, name, source in (("diffusion_models", "ernie-image-turbo.safetensors", tiny.dit),
                                 ("text_encoders", "ministral-3-3b.safetensors", tiny.text_encoder),
                                 ("vae", "flux2-vae.safetensors", tiny.vae)):
        (models / folder).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, models / folder / name)
    loras = lf.write_example_loras(models / "loras", tiny.dit)
    monkeypatch.setitem(sys.modules, "folder_paths", fake_folder_paths(models))
    graph = json.loads(API_PATH.read_text())
    sampler = next(n for n in graph.values() if n["class_type"] == "ErnieImageTurboSampler")
    sampler["inputs"].update(resolution="custom", width=256, height=256, steps=2)
    outputs = run_api_graph(graph)
    saved = next(outputs[i][0] for i, n in graph.items() if n["class_type"] == "SaveImage")

    strengths = {n["inputs"]["lora_name"]: n["inputs"]["strength"] for n in graph.values()
                 if n["class_type"] == "ErnieImageLoRA"}
    request = GenerationRequest(prompt=sampler["inputs"]["prompt"], width=256, height=256, steps=2, cfg=1.0,
                                seed=sampler["inputs"]["seed"], use_pe=False)
    pipe = next(outputs[i][0] for i, n in graph.items() if n["class_type"] == "ErnieImageLoader")
    assert isinstance(pipe, LocalPipe)
    expected = pipe.with_loras([(loras[name], strength) for name, strength in strengths.items()]).generate(
        request, NullHost()).images
    assert torch.equal(saved, expected)
    assert not torch.equal(saved, pipe.generate(request, NullHost()).images)
