"""A part's file that holds a LoRA's tensors beside its own weights (an adapter saved into the model unmerged) is
refused in one line, naming the file and the fix, by generate and by quantize, in every layout: its LoRA would
never be applied, so the picture (or the quantised file, which would carry the adapter along) would come without
it, without a word."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ernie_image.runtime.cli.commands import main
from ernie_image.runtime.formats.detect import adapter_key

ADAPTERS = {
    "peft": ("layers.0.self_attention.to_q.lora_A.weight", "layers.0.self_attention.to_q.lora_B.weight"),
    "kohya": ("layers.0.self_attention.to_q.lora_down.weight", "layers.0.self_attention.to_q.lora_up.weight"),
    "lokr": ("layers.0.mlp.gate_proj.lokr_w1", "layers.0.mlp.gate_proj.lokr_w2"),
    "dora": ("layers.0.self_attention.to_q.lora_A.weight", "layers.0.self_attention.to_q.lora_magnitude_vector"),
}


def _with_adapter(file: Path, names: tuple[str, ...], prefix: str = "") -> None:
    tensors = load_file(str(file))
    tensors.update({prefix + name: torch.ones(2, 2, dtype=torch.bfloat16) for name in names})
    save_file(tensors, str(file))


def _refused(capsys, *argv: str) -> str:
    assert main(list(argv)) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


@pytest.mark.parametrize("kind", sorted(ADAPTERS))
@pytest.mark.parametrize("layout", ["diffusers folder", "single file"])
def test_a_dit_holding_a_loras_tensors_is_refused_by_generate(capsys, tmp_path, tiny_turbo_folder, kind, layout):
    model = Path(shutil.copytree(tiny_turbo_folder, tmp_path / "model"))
    weights = model / "transformer" / "diffusion_pytorch_model.safetensors"
    out = tmp_path / "x.png"
    argv = ["generate", "--model-dir", str(model), "--steps", "1", "--device", "cpu", "--prompt", "a fox",
            "--out", str(out)]
    if layout == "single file":
        single = tmp_path / "ernie-image-turbo.safetensors"
        shutil.copy(weights, single)
        _with_adapter(single, ADAPTERS[kind], prefix="")
        argv += ["--dit", str(single), "--variant", "turbo"]
        shown = single.name
    else:
        _with_adapter(weights, ADAPTERS[kind])
        shown = "transformer"
    line = _refused(capsys, *argv)
    assert line.startswith(f"error: {shown} holds 2 LoRA tensors ({', '.join(sorted(ADAPTERS[kind]))}) beside the "
                           "ERNIE-Image transformer's weights, where a LoRA is never applied: "), line
    assert line.endswith("load the LoRA from a file of its own, or merge it into the weights and save them without it")
    assert not out.exists()


def test_quantize_refuses_a_dit_holding_a_loras_tensors_and_writes_nothing(capsys, tmp_path, tiny_turbo_folder):
    single = tmp_path / "ernie-image-turbo.safetensors"
    shutil.copy(tiny_turbo_folder / "transformer" / "diffusion_pytorch_model.safetensors", single)
    _with_adapter(single, ADAPTERS["peft"])
    out = tmp_path / "ernie-image-turbo-fp8.safetensors"
    line = _refused(capsys, "quantize", "--dit", str(single), "--format", "fp8", "--variant", "turbo",
                    "--out", str(out))
    assert f"{single.name} holds 2 LoRA tensors" in line, line
    assert sorted(path.name for path in tmp_path.iterdir()) == [single.name]


@pytest.mark.parametrize("key", ["layers.3.mlp.gate_proj.lora_B.default.weight", "unet.down.lora.up.weight",
                                 "layers.0.attn.to_k.hada_w1_a", "layers.0.attn.to_k.dora_scale",
                                 "layers.0.attn.to_q.alpha", "layers.0.attn.to_q.lora_magnitude_vector",
                                 "layers.0.attn.to_q.oft_blocks", "layers.0.attn.to_q.diff", "layers.0.attn.to_q.diff_b",
                                 "layers.0.attn.to_q.a1.weight", "layers.0.attn.to_q.b2.weight"])
def test_an_adapters_tensor_names_are_told_by_their_parts(key):
    assert adapter_key(key)


@pytest.mark.parametrize("key", ["layers.0.self_attention.to_q.weight", "final_linear.weight", "floral_A.weight",
                                 "layers.0.mlp.loraxis.weight", "adaLN_modulation.1.weight",
                                 "decoder.up_blocks.0.resnets.0.conv1.weight", "time_embedding.linear_1.weight"])
def test_a_models_own_tensor_names_are_no_adapters(key):
    assert not adapter_key(key)
