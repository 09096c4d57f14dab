"""The Quant Config node: a format choice with the reason for this machine, consumed by the Loader."""
from __future__ import annotations

import pytest

from ernie_image.nodes.loader import build_options
from ernie_image.nodes.quant_config import FORMATS, LOAD_QUANT, ErnieImageQuantConfig, QuantChoice
from ernie_image.runtime.core.errors import InvalidInputError


@pytest.mark.parametrize("choice", FORMATS)
def test_every_format_comes_with_a_reason(choice: str) -> None:
    out = ErnieImageQuantConfig().choose(format=choice)
    quant, reason = out["result"]
    assert isinstance(quant, QuantChoice) and quant.requested == choice
    assert reason and out["ui"]["text"] == [reason]


def test_on_a_machine_without_cuda_auto_explains_bf16() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this checks the CPU-only answer")
    quant, reason = ErnieImageQuantConfig().choose(format="auto")["result"]
    assert quant.load_quant == "auto" and "bf16" in reason and "no CUDA GPU" in reason


def test_the_choices_are_the_runtimes_formats() -> None:
    from ernie_image.runtime.model.fill import QUANT_ON_LOAD_FORMATS
    from ernie_image.runtime.quant.gpu_support import SELECTOR_CHOICES

    assert set(FORMATS) == set(SELECTOR_CHOICES) | {"gguf-file"}
    assert set(LOAD_QUANT) == set(FORMATS) - {"auto"}
    assert set(LOAD_QUANT.values()) <= set(QUANT_ON_LOAD_FORMATS) | {"none"}


def test_the_loader_passes_the_choice_to_the_runtime() -> None:
    for choice in ("fp8", "q4_k"):
        quant = ErnieImageQuantConfig().choose(format=choice)["result"][0]
        assert build_options(12.0, False, quant).quant == choice
    options = build_options(0.0, True, None)
    assert options.quant == "none" and options.vram_budget_gb is None and options.keep_loaded is True
    assert build_options(12.0, False, None).vram_budget_gb == 12.0


# -- what the Loader says runs, and what it refuses ----------------------------------------------------------------
@pytest.fixture
def comfy_models(tmp_path, tiny_turbo_folder, monkeypatch):
    """ComfyUI's model folders: the tiny Turbo model's bf16 DiT, a GGUF Q8_0 of it, its text encoder and VAE."""
    import shutil
    import sys

    from comfy_folders import fake_folder_paths
    from ernie_image.runtime.cli.quantize import read_bf16_dit
    from ernie_image.runtime.demo.tiny import build_tiny_model
    from ernie_image.runtime.quant.writer import write_quantized_file

    tiny = build_tiny_model(tmp_path / "tiny", layout="comfy", variant="turbo")
    models = tmp_path / "models"
    for folder, source in (("diffusion_models", tiny.dit), ("text_encoders", tiny.text_encoder), ("vae", tiny.vae)):
        (models / folder).mkdir(parents=True)
        shutil.copyfile(source, models / folder / source.name)
    write_quantized_file(read_bf16_dit(tiny.dit), "q8_0", models / "diffusion_models" / "ernie-image-turbo-q8.gguf")
    monkeypatch.setitem(sys.modules, "folder_paths", fake_folder_paths(models))
    return {"bf16": tiny.dit.name, "gguf": "ernie-image-turbo-q8.gguf", "text_encoder": tiny.text_encoder.name,
            "vae": tiny.vae.name}


def load(models: dict, dit: str, fmt: str) -> dict:
    from ernie_image.nodes.loader import ErnieImageLoader

    quant = ErnieImageQuantConfig().choose(format=fmt)["result"][0]
    return ErnieImageLoader().load(diffusers_folder="(none)", diffusion_model=models[dit],
                                   text_encoder=models["text_encoder"], vae=models["vae"], prompt_enhancer="(none)",
                                   variant="auto", vram_budget_gb=0.0, keep_loaded=False, quant_config=quant)


def test_auto_on_a_gguf_dit_says_the_files_own_format_runs(comfy_models) -> None:
    text = load(comfy_models, "gguf", "auto")["ui"]["text"][0]
    assert "DiT GGUF Q8_0, eager" in text.splitlines()[0]
    assert ("auto -> GGUF Q8_0, the DiT file's own format (ernie-image-turbo-q8.gguf is already quantised; auto picks "
            "a format for a bf16 DiT only)") in text.splitlines()
    assert "auto -> bf16" not in text


def test_auto_on_a_bf16_dit_says_once_what_auto_picks(comfy_models) -> None:
    text = load(comfy_models, "bf16", "auto")["ui"]["text"][0]
    assert text.count("auto -> ") == 1


def test_gguf_file_with_a_safetensors_dit_is_refused_before_anything_loads(comfy_models, monkeypatch) -> None:
    from ernie_image.runtime.local import pipe as local_pipe

    monkeypatch.setattr(local_pipe.LocalPipe, "load", lambda *a, **k: pytest.fail("the model was loaded"))
    with pytest.raises(InvalidInputError) as refused:
        load(comfy_models, "bf16", "gguf-file")
    assert str(refused.value) == (
        f"the Quant Config's gguf-file keeps a .gguf DiT's own blocks, but the DiT picked ({comfy_models['bf16']}) is "
        "not a GGUF file: pick a .gguf as the Loader's diffusion_model, or another Quant Config format (auto, bf16, "
        "fp8, q8_0, ...)")


def test_gguf_file_with_a_gguf_dit_runs_its_blocks(comfy_models) -> None:
    pipe, plan = load(comfy_models, "gguf", "gguf-file")["result"]
    assert pipe.dit_weights == "GGUF Q8_0" and "gguf-file" in plan
