"""mask_feather blurs the repaint mask in pieces of bounded work, with a cancel check before each: a cancel (the
host's, ComfyUI's interrupt; Ctrl-C in the CLI) stops a wide feather within a second, where the blur of a 2048x2048
mask by 1024 pixels takes seconds on a two-core runner. The pieces give the values of one conv2d per pass, bit for
bit."""
from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from ernie_image.runtime.cli.commands import main
from ernie_image.runtime.core.errors import Cancelled
from ernie_image.runtime.core.host import NullHost
from ernie_image.runtime.core.request import GenerationRequest
from ernie_image.runtime.formats.sources import ModelSources
from ernie_image.runtime.local.options import LoadOptions
from ernie_image.runtime.local.pipe import LocalPipe
from ernie_image.runtime.sampling import image_in
from ernie_image.runtime.sampling.image_in import gaussian_blur, grown
from waiting import do_when, press_cancel

CANCEL_WITHIN_S = 1.0
WIDE = 2048  # a WIDE x WIDE mask feathered by FEATHER: seconds of blur
FEATHER = 1024


def one_call_blur(mask: torch.Tensor, radius: int) -> torch.Tensor:
    """The feather as one conv2d per pass over the whole mask: the values the pieces must give."""
    offsets = torch.arange(-radius, radius + 1, dtype=torch.float32)
    kernel = torch.exp(-0.5 * (offsets / (radius / 2)) ** 2)
    kernel = kernel / kernel.sum()
    padded = F.pad(mask, (radius, radius, radius, radius), mode="replicate")
    return F.conv2d(F.conv2d(padded, kernel.view(1, 1, 1, -1)), kernel.view(1, 1, -1, 1))


def painted(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """A mask of soft values on about half the pixels, zero elsewhere."""
    generator = torch.Generator().manual_seed(seed)
    return torch.rand(shape, generator=generator) * (torch.rand(shape, generator=generator) > 0.5)


def blurred_counting_checks(mask: torch.Tensor, radius: int) -> tuple[torch.Tensor, int]:
    checks = []
    return gaussian_blur(mask, radius, lambda: checks.append(1)), len(checks)


@pytest.mark.parametrize("shape", [(1, 1, 17, 23), (3, 1, 40, 31), (1, 1, 5, 5), (2, 1, 9, 64)])
@pytest.mark.parametrize("radius", [1, 2, 7, 64, 100])  # 100: larger than every side
def test_a_small_feather_is_one_piece_a_pass_with_the_one_call_values(shape, radius):
    blurred, checks = blurred_counting_checks(painted(shape, radius), radius)
    assert checks == 2
    assert torch.equal(blurred, one_call_blur(painted(shape, radius), radius))


@pytest.mark.parametrize("shape, radius", [
    ((1, 1, 1024, 1024), 256),
    ((3, 1, 768, 1024), 200),  # a batch, not square
    ((1, 1, 512, 2048), 300),
    ((1, 1, 1536, 640), 64),
    ((1, 1, 4096, 4096), 7),
    ((2, 1, 1000, 17), 1024),  # radius larger than the mask
    ((1, 1, 16, 4000), 1024),
])
def test_a_wide_feather_in_many_pieces_gives_the_one_call_values_bit_for_bit(shape, radius):
    mask = painted(shape, radius)
    blurred, checks = blurred_counting_checks(mask, radius)
    assert checks > 2
    assert torch.equal(blurred, one_call_blur(mask, radius))


def wide_mask() -> torch.Tensor:
    mask = torch.zeros(1, 1, WIDE, WIDE)
    mask[..., WIDE // 4:WIDE // 2, WIDE // 3:WIDE // 2] = 1
    return mask


def test_a_cancel_while_a_wide_feather_is_blurred_stops_it_within_a_second():
    started, cancel = threading.Event(), threading.Event()

    def check_cancel() -> None:
        started.set()
        if cancel.is_set():
            raise Cancelled("cancelled by the test")

    def press() -> float:
        at = time.monotonic()
        cancel.set()
        return at

    pressed = do_when(started.is_set, press)
    with pytest.raises(Cancelled):
        gaussian_blur(wide_mask(), FEATHER, check_cancel)
    assert time.monotonic() - pressed.result() < CANCEL_WITHIN_S


def test_growing_checks_for_a_cancel_between_its_passes():
    def cancelled() -> None:
        raise Cancelled("cancelled by the test")

    with pytest.raises(Cancelled):
        grown(wide_mask(), FEATHER, cancelled)


@pytest.fixture
def feather_started(monkeypatch) -> threading.Event:
    """Set at the feather's first cancel check, once the blur is under way."""
    started = threading.Event()
    blur = image_in.gaussian_blur

    def watched(mask: torch.Tensor, radius: int, check_cancel) -> torch.Tensor:
        def check() -> None:
            started.set()
            check_cancel()

        return blur(mask, radius, check)

    monkeypatch.setattr(image_in, "gaussian_blur", watched)
    return started


def test_a_pipe_cancelled_during_the_feather_stops_within_a_second_before_any_step(tiny_turbo_folder, dit_steps,
                                                                                   feather_started):
    pipe = LocalPipe.load(ModelSources(model_dir=tiny_turbo_folder), LoadOptions(device="cpu", dtype="fp32"))
    request = GenerationRequest(prompt="a fox", width=WIDE, height=WIDE, steps=1, denoise=0.5,
                                init_image=torch.full((1, WIDE, WIDE, 3), 0.5), mask=wide_mask()[0],
                                mask_feather=FEATHER)
    host = NullHost()
    pressed = do_when(feather_started.is_set, lambda: press_cancel(host))
    with pytest.raises(Cancelled):
        pipe.generate(request, host)
    assert time.monotonic() - pressed.result() < CANCEL_WITHIN_S
    assert dit_steps == []


def test_ctrl_c_during_the_feather_ends_the_cli_run_within_a_second_with_nothing_written(
        capsys, tmp_path, tiny_turbo_folder, feather_started):
    Image.fromarray(np.full((WIDE, WIDE, 3), 128, np.uint8)).save(tmp_path / "in.png")
    Image.fromarray((wide_mask()[0, 0].numpy() * 255).astype(np.uint8)).save(tmp_path / "mask.png")
    out_dir = tmp_path / "out"
    out_dir.mkdir()

    def ctrl_c() -> float:
        at = time.monotonic()
        os.kill(os.getpid(), signal.SIGINT)
        return at

    pressed = do_when(feather_started.is_set, ctrl_c)
    code = main(["generate", "--model-dir", str(tiny_turbo_folder), "--init-image", str(tmp_path / "in.png"),
                 "--mask", str(tmp_path / "mask.png"), "--mask-feather", str(FEATHER), "--denoise", "0.5",
                 "--steps", "1", "--prompt", "a fox", "--out", str(out_dir / "out.png")])
    assert time.monotonic() - pressed.result() < CANCEL_WITHIN_S
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 130 and lines[-1] == "cancelled", lines
    assert list(out_dir.iterdir()) == []
