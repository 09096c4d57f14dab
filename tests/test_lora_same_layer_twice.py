"""A LoRA file that gives one DiT layer the same part twice, under two names, holds two LoRAs merged into one file:
refused in one line naming the layer and both keys, before any model is opened, rather than one of them silently
dropped. Two names are two of the trainers' prefixes (transformer., diffusion_model., model.diffusion_model.,
base_model.model., none), kohya's underscored names beside a dotted one or another kohya prefix, or two spellings
of a part (lora.down/lora_down, a raw PEFT state dict's lora_A.default). One layer with parts of two adapter
layouts (lora_A/lora_B beside LoKr or LoHa factors) is refused the same way. Different layers under different
prefixes are one LoRA, and are applied."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import lora_files as lf
from ernie_image.runtime.cli.commands import main as cli_main
from ernie_image.runtime.core.host import NullHost
from ernie_image.runtime.core.request import GenerationRequest
from ernie_image.runtime.demo import cached_model as demo_module
from ernie_image.runtime.formats.sources import ModelSources
from ernie_image.runtime.local.options import LoadOptions
from ernie_image.runtime.local.pipe import LocalPipe
from ernie_image.runtime.lora.keys import linear_names, map_keys

pytestmark = pytest.mark.usefixtures("one_thread")

LAYER = "layers.0.self_attention.to_q"
KOHYA = LAYER.replace(".", "_")


@pytest.fixture(scope="module")
def shapes(tiny_turbo_folder) -> dict[str, tuple[int, int]]:
    return lf.linear_shapes(lf.dit_weights(tiny_turbo_folder))


def _refused(capsys, monkeypatch, tmp_path: Path, lora: Path) -> str:
    """The CLI's one line for a LoRA refused before the (demo) model is built: exit code 2, nothing else."""
    monkeypatch.setattr(demo_module, "load_demo_pipe", lambda *a, **k: pytest.fail("the demo model was built"))
    code = cli_main(["generate", "--prompt", "a fox", "--device", "cpu", "--lora", str(lora),
                     "--out", str(tmp_path / "x.png")])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), lines
    assert not (tmp_path / "x.png").exists()
    return lines[0].removeprefix("error: ")


# Two keys naming the same part of LAYER: (first key's module and part, second key's), as sorted in the file.
SAME_PART = {
    "two prefixes": (f"diffusion_model.{LAYER}.lora_A.weight", f"transformer.{LAYER}.lora_A.weight"),
    "ComfyUI's two prefixes": (f"diffusion_model.{LAYER}.lora_A.weight",
                               f"model.diffusion_model.{LAYER}.lora_A.weight"),
    "PEFT and diffusers": (f"base_model.model.{LAYER}.lora_A.weight", f"transformer.{LAYER}.lora_A.weight"),
    "no prefix and a prefix": (f"{LAYER}.lora_A.weight", f"transformer.{LAYER}.lora_A.weight"),
    "kohya and dotted": (f"diffusion_model.{LAYER}.lora_down.weight", f"lora_unet_{KOHYA}.lora_down.weight"),
    "two kohya prefixes": (f"lora_unet_{KOHYA}.lora_down.weight", f"lycoris_{KOHYA}.lora_down.weight"),
    "two spellings of a part": (f"transformer.{LAYER}.lora.down.weight", f"transformer.{LAYER}.lora_down.weight"),
    "a raw PEFT state dict's part": (f"transformer.{LAYER}.lora_A.default.weight",
                                     f"transformer.{LAYER}.lora_A.weight"),
}
PARTNER = {"lora_A.weight": "lora_B.weight", "lora_A.default.weight": "lora_B.default.weight",
           "lora_down.weight": "lora_up.weight", "lora.down.weight": "lora.up.weight"}


def _down_part(key: str) -> tuple[str, str]:
    """(module, part) of a down key."""
    part = next(part for part in PARTNER if key.endswith("." + part))
    return key[: -len(part) - 1], part


@pytest.mark.parametrize("first, second", SAME_PART.values(), ids=SAME_PART.keys())
def test_one_layer_given_twice_under_two_names_is_refused_naming_both_keys(shapes, tmp_path, capsys, monkeypatch,
                                                                           first, second):
    state = {}
    for seed, key in enumerate((first, second)):
        (down, up), = lf.random_lora({LAYER: shapes[LAYER]}, 2, seed).values()
        module, part = _down_part(key)
        state[key], state[f"{module}.{PARTNER[part]}"] = down, up
    path = tmp_path / "twice.safetensors"
    save_file(state, str(path))
    canonical = "lora_A.weight" if "lora_A" in first else "lora_down.weight"
    assert _refused(capsys, monkeypatch, tmp_path, path) == (
        f"LoRA twice.safetensors holds two LoRAs for {LAYER} (keys {first} and {second}, its {canonical} under two "
        f"names): it was merged from two files; use each LoRA's own file")


@pytest.mark.parametrize("other, layout", [
    ({"lokr_w1": torch.ones(2, 2), "lokr_w2": torch.ones(1, 1)}, "LoKr (lokr_*)"),
    ({"hada_w1_a": torch.ones(1, 1), "hada_w1_b": torch.ones(1, 1), "hada_w2_a": torch.ones(1, 1),
      "hada_w2_b": torch.ones(1, 1)}, "LoHa (hada_*)"),
], ids=["LoRA and LoKr", "LoRA and LoHa"])
def test_one_layer_with_parts_of_two_adapter_kinds_is_refused(shapes, tmp_path, capsys, monkeypatch, other, layout):
    (down, up), = lf.random_lora({LAYER: shapes[LAYER]}, 2, 0).values()
    state = {f"transformer.{LAYER}.lora_A.weight": down, f"transformer.{LAYER}.lora_B.weight": up}
    state.update({f"diffusion_model.{LAYER}.{part}": tensor for part, tensor in other.items()})
    path = tmp_path / "mixed.safetensors"
    save_file(state, str(path))
    assert _refused(capsys, monkeypatch, tmp_path, path) == (
        f"LoRA mixed.safetensors holds two LoRAs for {LAYER} (lora_A/lora_B and {layout} keys, two kinds of "
        f"adapter): it was merged from two files; use each LoRA's own file")


def test_different_layers_under_different_prefixes_are_one_lora_and_applied(shapes, tiny_turbo_folder, tmp_path):
    other = "layers.1.self_attention.to_q"
    lora = lf.random_lora({name: shapes[name] for name in (LAYER, other)}, 2, 3)
    state = {**lf.peft_keys({LAYER: lora[LAYER]}, "transformer."),
             **lf.peft_keys({other: lora[other]}, "diffusion_model.")}
    path = tmp_path / "mixed-prefixes.safetensors"
    save_file(state, str(path))
    assert set(map_keys(path.name, state, linear_names(list(state))).layers) == {LAYER, other}
    request = GenerationRequest(prompt="a fox", width=256, height=256, steps=1, cfg=1.0, seed=2)
    images = [LocalPipe.load(ModelSources(model_dir=tiny_turbo_folder), LoadOptions(device="cpu", dtype="fp32"),
                             loras=loras).generate(request, NullHost()).images for loras in ([], [path])]
    assert images[1].isfinite().all() and not torch.equal(images[0], images[1])
