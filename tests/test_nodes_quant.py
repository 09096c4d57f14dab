"""The Quant Config node: a format choice with the reason for this machine, consumed by the Loader."""
from __future__ import annotations

import pytest

from ernie_image.nodes.loader import build_options
from ernie_image.nodes.quant_config import FORMATS, LOAD_QUANT, ErnieImageQuantConfig, QuantChoice


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
    from ernie_image.runtime.model_files import QUANT_ON_LOAD_FORMATS
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
