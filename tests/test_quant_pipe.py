"""Quantised DiTs through the whole pipeline: quantise on load, and files written once by `ernie-image quantize`.

Image tolerances (max abs difference of the decoded 0..1 image against the bf16/fp32 weights, tiny model, 4 steps)
follow each format's weight error: Q8_0 ~0.4% relative per block -> 0.01; FP8 e4m3 (3 mantissa bits, ~3%) -> 0.02;
4-bit Q4_K / NVFP4 (~8%) -> 0.05. Measured here: Q8_0 0.001-0.005, FP8 0.004, Q4_K 0.005, NVFP4 0.013.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ernie_image.runtime.cli.commands import main as cli_main
from ernie_image.runtime.core.host import NullHost
from ernie_image.runtime.core.request import GenerationRequest
from ernie_image.runtime.formats.sources import ModelSources
from ernie_image.runtime.local.options import LoadOptions
from ernie_image.runtime.local.pipe import LocalPipe
from ernie_image.runtime.quant.linear import QuantLinear

TOLERANCE = {"q8_0": 0.01, "fp8": 0.02, "q4_k": 0.05, "nvfp4": 0.05}
REQUEST = GenerationRequest(prompt="a fox in the snow", steps=4, cfg=1.0, width=256, height=256, seed=5)


@pytest.fixture(scope="module")
def model(tiny_turbo_folder) -> Path:
    return tiny_turbo_folder


@pytest.fixture(scope="module")
def reference(model) -> torch.Tensor:
    return LocalPipe.load(ModelSources(model_dir=model), LoadOptions(device="cpu")).generate(REQUEST, NullHost()).images


@pytest.mark.parametrize("fmt", ["fp8", "q8_0", "nvfp4"])
def test_quantise_on_load_stays_within_the_format_tolerance(fmt, model, reference):
    pipe = LocalPipe.load(ModelSources(model_dir=model), LoadOptions(device="cpu", quant=fmt))
    images = pipe.generate(REQUEST, NullHost()).images
    dit = pipe.parts.load_dit()
    assert isinstance(dit.layers[0].mlp.gate_proj, QuantLinear)
    assert 0 < (images - reference).abs().max().item() <= TOLERANCE[fmt]
    own = {"fp8": "FP8", "q8_0": "GGUF Q8_0", "nvfp4": "NVFP4"}[fmt]
    assert f"; DiT {own}, eager" in pipe.describe().splitlines()[0]  # the format that ran is named


def test_the_description_names_an_unpacked_dits_dtype(model):
    pipe = LocalPipe.load(ModelSources(model_dir=model), LoadOptions(device="cpu"))
    pipe.generate(REQUEST, NullHost())
    assert "; DiT float32, eager" in pipe.describe().splitlines()[0]


@pytest.mark.parametrize("fmt, suffix", [("q8_0", "gguf"), ("fp8", "safetensors"), ("nvfp4", "safetensors")])
def test_quantize_command_writes_a_file_the_generate_command_reloads(fmt, suffix, model, reference, tmp_path, capsys):
    quantised = tmp_path / f"ernie-image-turbo-{fmt}.{suffix}"
    assert cli_main(["quantize", "--dit", str(model / "transformer"), "--format", fmt, "--out", str(quantised)]) == 0
    sources = ModelSources(model_dir=model, dit=quantised)
    images = LocalPipe.load(sources, LoadOptions(device="cpu")).generate(REQUEST, NullHost()).images
    assert (images - reference).abs().max().item() <= TOLERANCE[fmt]
    out = tmp_path / "from-cli.png"
    assert cli_main(["generate", "--model-dir", str(model), "--dit", str(quantised), "--width", "256",
                     "--height", "256", "--steps", "2", "--out", str(out)]) == 0
    assert out.exists()


@pytest.mark.parametrize("fmt, suffix", [("fp8", "safetensors"), ("q8_0", "gguf")])
@pytest.mark.parametrize("key, damage", [
    ("adaLN_modulation.1.weight", lambda tensor: tensor[:, :3]),  # kept in high precision
    ("layers.0.mlp.up_proj.weight", lambda tensor: tensor[:-1]),  # packed: its shape is the one it unpacks to
], ids=["kept", "packed"])
def test_a_quantised_file_whose_tensor_has_another_shape_is_refused_in_one_line(fmt, suffix, key, damage, model,
                                                                                tmp_path, capsys):
    """A quantised file with a tensor of another shape than the config makes (written by another tool, or from a
    damaged bf16 file, which `quantize` now refuses) was a load_state_dict or quantize_linears traceback mid-load;
    the bf16 path names such a tensor, and so does the quantised one, packed or not."""
    from safetensors.torch import load_file

    from ernie_image.runtime.quant.writer import write_quantized_file

    state = load_file(str(next((model / "transformer").glob("*.safetensors"))))
    state[key] = damage(state[key]).contiguous()
    quantised = write_quantized_file(state, fmt, tmp_path / f"damaged-{fmt}.{suffix}", variant="turbo")
    code = cli_main(["generate", "--model-dir", str(model), "--dit", str(quantised), "--width", "256", "--height",
                     "256", "--steps", "1", "--out", str(tmp_path / "x.png")])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(lines) == 1, lines
    assert f"tensor {key} has shape" in lines[0] and "does not match" in lines[0], lines[0]
    assert not (tmp_path / "x.png").exists()


def test_unknown_quant_choice_is_refused_when_the_pipe_is_made(model):
    from ernie_image.runtime.core.errors import InvalidInputError

    with pytest.raises(InvalidInputError, match="quant 'int3' is not supported: use one of none, auto, bf16, fp8"):
        LocalPipe.load(ModelSources(model_dir=model), LoadOptions(device="cpu", quant="int3"))


@pytest.fixture(scope="module")
def q4_k_model(tmp_path_factory) -> Path:
    """A tiny Turbo model wide enough for Q4_K's 256-wide blocks (the default tiny DiT is 64 wide: nothing packs)."""
    from ernie_image.runtime.demo.tiny import TinySizes, build_tiny_model

    sizes = TinySizes(dit_hidden=256, dit_heads=8, dit_ffn=512)
    return build_tiny_model(tmp_path_factory.mktemp("tiny-q4k"), variant="turbo", sizes=sizes).model_dir


def test_quantize_q4_k_packs_the_layers_it_reports_and_generate_reloads_them(q4_k_model, tmp_path, capsys):
    from ernie_image.runtime.formats.quantized_file import load_quantized_state_dict

    quantised = tmp_path / "ernie-image-turbo-q4_k.gguf"
    assert cli_main(["quantize", "--dit", str(q4_k_model / "transformer"), "--format", "q4_k",
                     "--out", str(quantised)]) == 0
    report = capsys.readouterr().out
    state = load_quantized_state_dict(quantised)
    packed = [name for name, entry in state.items() if getattr(entry, "qtype", None) == "Q4_K"]
    assert packed and f": {len(packed)} weight matrices as q4_k" in report, report
    reference = LocalPipe.load(ModelSources(model_dir=q4_k_model), LoadOptions(device="cpu")).generate(
        REQUEST, NullHost()).images
    images = LocalPipe.load(ModelSources(model_dir=q4_k_model, dit=quantised), LoadOptions(device="cpu")).generate(
        REQUEST, NullHost()).images
    assert 0 < (images - reference).abs().max().item() <= TOLERANCE["q4_k"]


def test_quantise_on_load_to_a_format_nothing_packs_in_is_refused_as_quantize_refuses_it(model, tmp_path, capsys,
                                                                                        monkeypatch):
    """q4_k on the 64-wide tiny DiT: `generate` ran it in bf16 without a word while `quantize` refused it. Now the
    pipe refuses it at load, from the file's shapes, in quantize's own words (naming the option that picks it)."""
    from ernie_image.runtime.core.errors import InvalidInputError
    from ernie_image.runtime.model import builders

    monkeypatch.setattr(builders, "build_dit", lambda *a, **k: pytest.fail("a DiT was built"))
    with pytest.raises(InvalidInputError) as caught:
        LocalPipe.load(ModelSources(model_dir=model), LoadOptions(device="cpu", quant="q4_k"))
    refusal = ("none of this DiT's 20 weight matrices can be packed as q4_k (it needs in_features divisible by 256): "
               "pick another {}, e.g. q8_0 or fp8")
    assert str(caught.value) == refusal.format("quant")
    assert cli_main(["quantize", "--dit", str(model / "transformer"), "--format", "q4_k",
                     "--out", str(tmp_path / "q4.gguf")]) == 2
    assert capsys.readouterr().err.strip() == "error: " + refusal.format("--format")
    assert cli_main(["generate", "--model-dir", str(model), "--quant", "q4_k", "--width", "256", "--height", "256",
                     "--out", str(tmp_path / "x.png")]) == 2
    assert capsys.readouterr().err.strip() == "error: " + refusal.format("--quant")
    assert list(tmp_path.iterdir()) == []


def test_quantise_on_load_to_a_format_the_demo_model_cannot_take_is_refused_before_it_is_built(tmp_path, capsys,
                                                                                              monkeypatch):
    monkeypatch.setenv("ERNIE_IMAGE_CACHE", str(tmp_path / "cache"))
    assert cli_main(["generate", "--quant", "q4_k", "--out", str(tmp_path / "x.png")]) == 2
    assert capsys.readouterr().err.strip().startswith("error: none of this DiT's 20 weight matrices can be packed "
                                                      "as q4_k")
    assert list(tmp_path.iterdir()) == []  # no demo model in the cache, no image


def test_quantise_on_load_to_a_format_that_packs_still_runs(q4_k_model):
    pipe = LocalPipe.load(ModelSources(model_dir=q4_k_model), LoadOptions(device="cpu", quant="q4_k"))
    pipe.generate(REQUEST, NullHost())
    assert isinstance(pipe.parts.load_dit().layers[0].mlp.gate_proj, QuantLinear)


@pytest.fixture(scope="module")
def quantised_files(model, tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("quantised")
    files = {"q8_0": folder / "ernie-q8_0.gguf", "fp8": folder / "ernie-fp8.safetensors",
             "nvfp4": folder / "ernie-nvfp4.safetensors"}
    for fmt, path in files.items():
        assert cli_main(["quantize", "--dit", str(model / "transformer"), "--format", fmt, "--out", str(path)]) == 0
    return files


@pytest.mark.parametrize("file_format, asked, own", [("q8_0", "fp8", "GGUF Q8_0"), ("q8_0", "bf16", "GGUF Q8_0"),
                                                     ("fp8", "nvfp4", "FP8"), ("nvfp4", "q8_0", "NVFP4")])
def test_a_format_asked_for_beside_an_already_quantised_dit_file_is_refused_naming_the_files_own(
        model, quantised_files, file_format, asked, own, capsys, tmp_path):
    """--quant beside a GGUF/FP8/NVFP4 DiT file was ignored without a word: the file runs in its own format."""
    from ernie_image.runtime.core.errors import InvalidInputError

    dit = quantised_files[file_format]
    with pytest.raises(InvalidInputError) as caught:
        LocalPipe.load(ModelSources(model_dir=model, dit=dit), LoadOptions(device="cpu", quant=asked))
    assert str(caught.value) == (f"quant {asked} does not apply to {dit.name}, a DiT file already quantised ({own}): "
                                 "drop that option to run the file as it is, or give the bf16 DiT to quantise it on "
                                 "load")
    assert cli_main(["generate", "--model-dir", str(model), "--dit", str(dit), "--quant", asked,
                     "--out", str(tmp_path / "x.png")]) == 2
    assert capsys.readouterr().err.strip().startswith(f"error: --quant {asked} does not apply to {dit.name}")
    assert list(tmp_path.iterdir()) == []


OWN_FORMAT = {"q8_0": "GGUF Q8_0", "fp8": "FP8", "nvfp4": "NVFP4"}  # as the pipe's description names them


@pytest.mark.parametrize("quant", ["none", "auto", "same"])
def test_a_quantised_dit_file_runs_as_it_is_with_no_quant_auto_or_its_own_format(model, quantised_files, reference,
                                                                                 quant):
    """Runs: an image within the file format's tolerance. As it is: every packed weight of the file is what the DiT
    holds, bit for bit (not quantised again, not unpacked), and the description names the file's own format."""
    from ernie_image.runtime.formats.quantized_file import load_quantized_state_dict

    for file_format, dit in quantised_files.items():
        pipe = LocalPipe.load(ModelSources(model_dir=model, dit=dit),
                              LoadOptions(device="cpu", quant=file_format if quant == "same" else quant))
        images = pipe.generate(REQUEST, NullHost()).images
        assert 0 < (images - reference).abs().max().item() <= TOLERANCE[file_format], file_format
        assert f"; DiT {OWN_FORMAT[file_format]}, eager" in pipe.describe().splitlines()[0]
        packed = {name.removesuffix(".weight"): entry for name, entry in load_quantized_state_dict(dit).items()
                  if getattr(entry, "qtype", None)}
        assert packed, f"{dit.name} holds no packed weight"
        for name, entry in packed.items():
            layer = pipe.parts.load_dit().get_submodule(name)
            assert isinstance(layer, QuantLinear) and (layer.format, layer.qtype) == (entry.format, entry.qtype), name
            for buffer, stored in entry.tensors().items():
                assert torch.equal(getattr(layer, buffer), stored), f"{dit.name}: {name}.{buffer} is not the file's"
