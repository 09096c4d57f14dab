"""Running out of host RAM is one line, not a traceback: the phase, the job, how much was asked for, and the fix
(a smaller size or batch, or the GPU). The allocation that fails is real: torch's CPU allocator refusing more
memory than any host has, or Python's MemoryError."""
from __future__ import annotations

import pytest
import torch

from ernie_image.runtime.cli.commands import main
from ernie_image.runtime.core.errors import MemoryBudgetError


def _more_than_any_host_has(*args, **kwargs):
    return torch.empty(1 << 50, dtype=torch.uint8)  # 1 PiB: beyond any address space, refused by the allocator


def _python_out_of_memory(*args, **kwargs):
    raise MemoryError()


def test_ram_running_out_in_the_dit_on_the_cpu_is_one_line_with_the_size_and_the_fix(capsys, tmp_path, monkeypatch,
                                                                                    tiny_turbo_folder):
    from ernie_image.runtime.model.dit import ErnieDiT

    monkeypatch.setattr(ErnieDiT, "forward", _more_than_any_host_has)
    out = tmp_path / "x.png"
    assert main(["generate", "--model-dir", str(tiny_turbo_folder), "--width", "256", "--height", "256", "--steps", "1",
                 "--device", "cpu", "--out", str(out)]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert lines == ["error: out of host memory (RAM) in the DiT phase (256x256 batch 1, tried to allocate 1.0 PiB): "
                     "use a smaller size or batch, or run on a GPU (--device cuda)"], lines
    assert not out.exists()


def test_a_memory_error_in_the_vae_names_the_vae_phase_from_python_too(monkeypatch, tiny_turbo_folder):
    from ernie_image import GenerationRequest, LoadOptions, LocalPipe, NullHost
    from ernie_image.runtime.local import pipe as local_pipe

    monkeypatch.setattr(local_pipe, "decode_images", _python_out_of_memory)
    pipe = LocalPipe.load(tiny_turbo_folder, LoadOptions(device="cpu"))
    with pytest.raises(MemoryBudgetError) as caught:
        pipe.generate(GenerationRequest(prompt="a fox", width=256, height=256, steps=1, batch=2), NullHost())
    assert str(caught.value) == ("out of host memory (RAM) in the VAE decode phase (256x256 batch 2): use a smaller "
                                 "size or batch, or run on a GPU (device cuda)")
    assert not pipe.is_loaded()  # released, as after any failure
