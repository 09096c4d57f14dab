"""NaN weights are named by the part they are in: each part's output is checked as it is made, so NaN in the text
encoder is not blamed on the DiT, and NaN in the VAE names the VAE. `quantize` refuses a DiT holding NaN, naming the
tensor, and keeps an fp32 DiT's unpacked matrices in fp32."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ernie_image.runtime.cli.commands import main

from test_cli import _cli


def _with_nan(folder: Path, component: str, key: str) -> Path:
    """`folder`'s component weights with `key` all NaN (the file rewritten in place)."""
    weights = next((folder / component).glob("*.safetensors"))
    state = load_file(str(weights))
    state[key] = torch.full_like(state[key], float("nan"))
    save_file(state, str(weights))
    return folder / component


@pytest.fixture
def model(tmp_path, tiny_turbo_folder) -> Path:
    return Path(shutil.copytree(tiny_turbo_folder, tmp_path / "model"))


def _photo(path: Path) -> Path:
    from PIL import Image

    Image.new("RGB", (256, 256), (200, 120, 40)).save(path)
    return path


@pytest.mark.parametrize("component, key, part, extra", [
    ("text_encoder", "language_model.model.layers.0.mlp.down_proj.weight", "text encoder", []),
    ("vae", "decoder.conv_in.weight", "VAE decoder", []),
    ("vae", "encoder.conv_in.weight", "VAE encoder", ["--init-image", "{photo}", "--denoise", "0.5"]),
], ids=["text encoder", "VAE decoder", "VAE encoder"])
def test_nan_weights_are_named_by_the_part_they_are_in(capsys, tmp_path, model, component, key, part, extra):
    damaged = _with_nan(model, component, key)
    photo = str(_photo(tmp_path / "photo.png"))
    out = tmp_path / "x.png"
    line = _cli(capsys, "generate", "--model-dir", str(model), "--steps", "1", "--device", "cpu", "--out", str(out),
                *[value.format(photo=photo) for value in extra])
    assert line.startswith(f"error: the {part} produced ") and "non-finite" in line and str(damaged) in line, line
    assert "DiT" not in line and not out.exists()


def test_nan_weights_in_the_prompt_enhancer_name_it_not_a_garbage_prompt(capsys, tmp_path, tiny_turbo_with_pe):
    model = Path(shutil.copytree(tiny_turbo_with_pe, tmp_path / "model"))
    weights = next((model / "pe").glob("*.safetensors"))
    key = next(name for name, tensor in load_file(str(weights)).items() if "layers.0" in name and tensor.dim() == 2)
    _with_nan(model, "pe", key)
    line = _cli(capsys, "generate", "--model-dir", str(model), "--use-pe", "--steps", "1", "--device", "cpu",
                "--out", str(tmp_path / "x.png"))
    assert line.startswith("error: the prompt enhancer produced ") and "non-finite logits" in line, line
    assert str(model / "pe") in line


def test_quantize_refuses_a_dit_holding_nan_naming_the_tensor(capsys, tmp_path, model):
    _with_nan(model, "transformer", "layers.0.self_attention.to_q.weight")
    out = tmp_path / "q.gguf"
    line = _cli(capsys, "quantize", "--dit", str(model / "transformer"), "--format", "q8_0", "--out", str(out))
    assert line.startswith(f"error: --dit {model / 'transformer'}: tensor layers.0.self_attention.to_q.weight holds ")
    assert "NaN/inf values" in line and "re-download them, then quantise again" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no file, no partial file


def test_quantize_keeps_an_fp32_dits_unpacked_matrices_in_fp32_and_says_so(capsys, tmp_path, tiny_turbo_folder):
    import gguf

    source = load_file(str(next((tiny_turbo_folder / "transformer").glob("*.safetensors"))))
    assert source["final_linear.weight"].dtype == torch.float32
    out = tmp_path / "q.gguf"
    assert main(["quantize", "--dit", str(tiny_turbo_folder / "transformer"), "--format", "q8_0",
                 "--out", str(out)]) == 0
    assert "2 kept in high precision (float32, as --dit holds them)" in capsys.readouterr().out
    tensors = {tensor.name: tensor for tensor in gguf.GGUFReader(str(out)).tensors}
    for name in ("final_linear.weight", "x_embedder.proj.weight"):
        if name in tensors:
            kept = tensors[name]
            assert kept.tensor_type.name == "F32", (name, kept.tensor_type.name)
            assert torch.equal(torch.from_numpy(kept.data.copy()).reshape(source[name].shape), source[name])
