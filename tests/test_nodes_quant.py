"""The Quant Config node: a format choice with the reason for this machine, consumed by the Loader."""
from __future__ import annotations

import pytest

from ernie_image.nodes.loader import build_options
from ernie_image.nodes.quant_config import FORMATS, ErnieImageQuantConfig, QuantChoice


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


def test_the_loader_passes_the_choice_to_the_runtime() -> None:
    fp8 = ErnieImageQuantConfig().choose(format="fp8")["result"][0]
    assert build_options(12.0, False, fp8).quant == "fp8"
    options = build_options(0.0, True, None)
    assert options.quant == "none" and options.vram_budget_gb is None and options.keep_loaded is True
    assert build_options(12.0, False, None).vram_budget_gb == 12.0
