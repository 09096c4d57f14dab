"""LoRA input refused before any model work: a file given twice in one stack (it would apply at the sum of its
strengths) is refused in one line; a file that is not a LoRA, another model's LoRA or one with NaN inside is refused
by the CLI before the demo model's notice or any model file, and by the Python API before any model file is opened
(LocalPipe.load) or when the LoRA is added (with_loras); the LoRA node refuses a bad strength when the prompt is
queued (VALIDATE_INPUTS, ComfyUI's 400), not only when it runs."""
from __future__ import annotations

import math
import sys
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import lora_files as lf
from ernie_image.nodes.lora import ErnieImageLoRA
from ernie_image.runtime.cli.commands import main as cli_main
from ernie_image.runtime.core.errors import InvalidInputError, ModelFileError
from ernie_image.runtime.demo import cached_model as demo_module
from ernie_image.runtime.formats.sources import ModelSources
from ernie_image.runtime.local import parts as local_parts, pipe as local_pipe_module
from ernie_image.runtime.local.options import LoadOptions
from ernie_image.runtime.local.pipe import LocalPipe
from ernie_image.runtime.lora import LoraStack

pytestmark = pytest.mark.usefixtures("one_thread", "no_comfy_modules_left_behind")


@pytest.fixture(scope="module")
def files(tiny_turbo_folder, tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("checked") / "loras"
    folder.mkdir()
    shapes = lf.linear_shapes(lf.dit_weights(tiny_turbo_folder))
    good = lf.write_ai_toolkit(folder / "good.safetensors", lf.random_lora(shapes, 2, seed=1))
    state = {k: v.clone() for k, v in lf.load_file(str(good)).items()}
    next(iter(state.values()))[0, 0] = math.nan
    save_file(state, str(folder / "nan.safetensors"))
    save_file({"diffusion_model.double_blocks.0.img_attn.qkv.lora_A.weight": torch.zeros(2, 8),
               "diffusion_model.double_blocks.0.img_attn.qkv.lora_B.weight": torch.zeros(8, 2)},
              str(folder / "flux.safetensors"))
    save_file({"layers.0.mlp.linear_fc2.weight": torch.zeros(8, 8)}, str(folder / "checkpoint.safetensors"))
    return {"good": good, "nan": folder / "nan.safetensors", "flux": folder / "flux.safetensors",
            "checkpoint": folder / "checkpoint.safetensors"}


CONTENT_ERRORS = [("nan", "has NaN or infinite values"), ("flux", "is for FLUX"), ("checkpoint", "is not a LoRA file")]


# -- the same file twice ---------------------------------------------------------------------------------------

def test_the_same_file_twice_in_a_stack_is_refused_in_one_line(files, tiny_turbo_folder):
    good = files["good"]
    with pytest.raises(InvalidInputError) as caught:
        LoraStack.of([(good, 1.0), (good.parent / ".." / good.parent.name / good.name, 0.5)])
    assert str(caught.value) == ("LoRA good.safetensors is given twice (strengths 1 and 0.5), which would apply it "
                                 "at 1.5: give it once, with the strength you want")
    pipe = LocalPipe.load(ModelSources(model_dir=tiny_turbo_folder), LoadOptions(device="cpu"), loras=[good])
    with pytest.raises(InvalidInputError, match="is given twice"):
        pipe.with_loras([(good, 0.3)])  # the pipe's own LoRA and a view's
    with pytest.raises(InvalidInputError, match="is given twice"):
        LocalPipe.load(ModelSources(model_dir=tiny_turbo_folder), LoadOptions(device="cpu"), loras=[good, good])


def test_the_cli_refuses_a_file_given_twice(tiny_turbo_folder, files, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(local_parts, "build_dit", lambda *a, **k: pytest.fail("weights were read"))
    code = cli_main(["generate", "--model-dir", str(tiny_turbo_folder), "--device", "cpu", "--lora", str(files["good"]),
                     "--lora", f"{files['good']}:0.5", "--out", str(tmp_path / "x.png")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "is given twice" in err[0]


def test_chained_lora_nodes_with_the_same_file_are_refused(tiny_turbo_folder, files, monkeypatch):
    folder = files["good"].parent
    fake = types.ModuleType("folder_paths")
    fake.folder_names_and_paths = {"loras": ([str(folder)], {".safetensors"})}
    fake.get_folder_paths = lambda key: [str(folder)]
    fake.get_filename_list = lambda key: sorted(p.name for p in folder.iterdir())
    fake.get_full_path = lambda key, name: str(folder / name) if (folder / name).is_file() else None
    monkeypatch.setitem(sys.modules, "folder_paths", fake)
    pipe = LocalPipe.load(ModelSources(model_dir=tiny_turbo_folder), LoadOptions(device="cpu"))
    first = ErnieImageLoRA().apply(pipe=pipe, lora_name="good.safetensors", strength=1.0)["result"][0]
    with pytest.raises(InvalidInputError, match="LoRA good.safetensors is given twice"):
        ErnieImageLoRA().apply(pipe=first, lora_name="good.safetensors", strength=1.0)


# -- contents before any model work --------------------------------------------------------------------------

@pytest.mark.parametrize("name, message", CONTENT_ERRORS)
def test_the_cli_checks_lora_contents_before_the_demo_model_and_its_notice(files, tmp_path, capsys, monkeypatch,
                                                                          name, message):
    monkeypatch.setattr(demo_module, "load_demo_pipe", lambda *a, **k: pytest.fail("the demo model was built"))
    code = cli_main(["generate", "--prompt", "a fox", "--device", "cpu", "--lora", str(files[name]),
                     "--out", str(tmp_path / "x.png")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and message in err[0], err
    assert not (tmp_path / "x.png").exists()


@pytest.mark.parametrize("name, message", CONTENT_ERRORS)
def test_the_python_api_checks_lora_contents_before_opening_any_model_file(files, tmp_path, name, message):
    missing_model = ModelSources(model_dir=tmp_path / "no-model-here")
    with pytest.raises(ModelFileError, match=message):  # the LoRA's error, not the missing model's
        LocalPipe.load(missing_model, LoadOptions(device="cpu"), loras=[files[name]])


@pytest.mark.parametrize("name, message", CONTENT_ERRORS)
def test_with_loras_refuses_bad_contents_at_once(files, tiny_turbo_folder, monkeypatch, name, message):
    pipe = LocalPipe.load(ModelSources(model_dir=tiny_turbo_folder), LoadOptions(device="cpu"))
    monkeypatch.setattr(local_pipe_module, "open_component", lambda *a, **k: pytest.fail("a model file was opened"))
    with pytest.raises(ModelFileError, match=message):
        pipe.with_loras([(files[name], 1.0)])  # no generate: refused when added


def test_a_checked_file_is_not_read_again_when_the_pipe_parses_it(files, tiny_turbo_folder, monkeypatch):
    from ernie_image.runtime.lora import parsed as parsed_module

    parsed_module._cache.clear()
    parsed_module._checked.clear()
    pipe = LocalPipe.load(ModelSources(model_dir=tiny_turbo_folder), LoadOptions(device="cpu"), loras=[files["good"]])
    reads = []
    real = parsed_module.read_lora_tensors
    monkeypatch.setattr(parsed_module, "read_lora_tensors", lambda path: reads.append(path) or real(path))
    pipe._lora.resolve(pipe.loras, pipe.sources)
    assert reads == []


# -- the node's strength at queue time -------------------------------------------------------------------------

@pytest.mark.parametrize("strength, message", [
    (math.nan, "LoRA strength nan is not allowed: use a finite value from -10 to 10 (1.0 = as trained)"),
    (math.inf, "LoRA strength inf is not allowed"), (10.5, "LoRA strength 10.5 is not allowed"),
    ("loud", "LoRA strength 'loud' is not a number"),
])
def test_the_lora_node_refuses_a_bad_strength_when_the_prompt_is_queued(strength, message):
    result = ErnieImageLoRA.VALIDATE_INPUTS(strength=strength)
    assert isinstance(result, str) and result.startswith(message) and "\n" not in result


@pytest.mark.parametrize("strength", [1.0, -10.0, 0.0, None])
def test_the_lora_node_passes_a_good_or_linked_strength(strength):
    assert ErnieImageLoRA.VALIDATE_INPUTS(strength=strength) is True  # None: fed by a link, checked when it runs


def test_an_old_workflow_without_the_mode_widget_runs_with_merge(tiny_turbo_folder, files, monkeypatch):
    """The mode widget is optional and last: an API graph saved before it has no `mode` input (ComfyUI then calls
    `apply` without it), and the editor fills a UI graph's missing last widget with its default."""
    inputs = ErnieImageLoRA.INPUT_TYPES()
    assert "mode" in inputs["optional"] and "mode" not in inputs["required"]
    assert inputs["optional"]["mode"][1]["default"] == "merge" and list(inputs["required"])[-1] == "strength"
    folder = files["good"].parent
    fake = types.ModuleType("folder_paths")
    fake.folder_names_and_paths = {"loras": ([str(folder)], {".safetensors"})}
    fake.get_folder_paths = lambda key: [str(folder)]
    fake.get_filename_list = lambda key: sorted(p.name for p in folder.iterdir())
    fake.get_full_path = lambda key, name: str(folder / name) if (folder / name).is_file() else None
    monkeypatch.setitem(sys.modules, "folder_paths", fake)
    pipe = LocalPipe.load(ModelSources(model_dir=tiny_turbo_folder), LoadOptions(device="cpu", lora_mode="branch"))
    view = ErnieImageLoRA().apply(pipe=pipe, lora_name="good.safetensors", strength=1.0)["result"][0]
    assert [entry.mode for entry in view.loras.entries] == ["merge"]
