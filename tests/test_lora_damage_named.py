"""A LoRA is named as the cause of what it breaks: a LoRA that drives the DiT to NaN/inf (finite values far too
large, e.g. x1e30) ends in one line naming the LoRA(s) applied and the fix (lower the strength or leave it out),
not the DiT's weights; the same DiT without the LoRA still makes its image."""
from __future__ import annotations

from pathlib import Path

import pytest

import lora_files as lf
from ernie_image.runtime.cli.commands import main as cli_main
from ernie_image.runtime.core.errors import ModelFileError
from ernie_image.runtime.core.host import NullHost
from ernie_image.runtime.core.request import GenerationRequest
from ernie_image.runtime.formats.sources import ModelSources
from ernie_image.runtime.local.options import LoadOptions
from ernie_image.runtime.local.pipe import LocalPipe

REQUEST = GenerationRequest(prompt="a fox", width=256, height=256, steps=1, cfg=1.0, seed=2)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def huge_lora(tiny_turbo_folder, tmp_path_factory) -> Path:
    shapes = lf.linear_shapes(lf.dit_weights(tiny_turbo_folder))
    lora = {name: (down * 1e30, up * 1e30) for name, (down, up) in lf.random_lora(shapes, 2, seed=5).items()}
    return lf.write_ai_toolkit(tmp_path_factory.mktemp("huge") / "huge.safetensors", lora)


@pytest.mark.parametrize("mode", ["merge", "branch"])
def test_a_lora_that_drives_the_dit_to_nan_is_named_with_the_fix(tiny_turbo_folder, huge_lora, mode):
    pipe = LocalPipe.load(ModelSources(model_dir=tiny_turbo_folder), LoadOptions(device="cpu", dtype="fp32"))
    with pytest.raises(ModelFileError) as caught:
        pipe.with_loras([(huge_lora, 0.5)], mode=mode).generate(REQUEST, NullHost())
    message = str(caught.value)
    assert "\n" not in message and "non-finite latent values (NaN/inf)" in message
    assert "with LoRA(s) huge.safetensors (strength 0.5) applied: the LoRA is the likely cause: lower its strength " \
           "or leave it out" in message
    assert "damaged or mis-quantised" not in message and str(tiny_turbo_folder) not in message
    assert pipe.generate(REQUEST, NullHost()).images.isfinite().all()  # the base model is unharmed


def test_the_cli_names_the_lora_not_the_model_folder(tiny_turbo_folder, huge_lora, tmp_path, capsys):
    out = tmp_path / "x.png"
    code = cli_main(["generate", "--model-dir", str(tiny_turbo_folder), "--device", "cpu", "--steps", "1",
                     "--width", "256", "--height", "256", "--lora", str(huge_lora), "--out", str(out)])
    errors = [line for line in capsys.readouterr().err.strip().splitlines() if line.startswith("error: ")]
    assert code == 2 and len(errors) == 1, errors
    assert "huge.safetensors (strength 1) applied: the LoRA is the likely cause" in errors[0]
    assert "re-download" not in errors[0] and not out.exists()
