"""A cancel lands inside a VAE pass, between two of its layers: a tiled decode or encode of a large image runs for
seconds on a GPU and for a minute or more on a CPU, and a Cancel must stop it within a second, leaving the pipe
ready for the next job."""
from __future__ import annotations

import threading
import time
from typing import Callable

import pytest
import torch

from ernie_image.runtime.core.errors import Cancelled
from ernie_image.runtime.core.host import NullHost
from ernie_image.runtime.core.request import GenerationRequest
from ernie_image.runtime.formats.sources import ModelSources
from ernie_image.runtime.local.options import LoadOptions
from ernie_image.runtime.local.pipe import LocalPipe
from ernie_image.runtime.model.cancel_points import cancellable
from waiting import do_when, press_cancel

CANCEL_WITHIN_S = 1.0
DECODED_SIDE = 2048  # the tiny VAE decodes it in ~20 s on a two-core CPU
ENCODED_SIDE = 4096  # and encodes this in ~35 s


@pytest.fixture(scope="module")
def pipe(tiny_turbo_folder) -> LocalPipe:
    return LocalPipe.load(ModelSources(model_dir=tiny_turbo_folder), LoadOptions(device="cpu", dtype="fp32"))


def host_cancelled_once_under_way() -> tuple[NullHost, threading.Event, Callable[[], None]]:
    """A host, an event set at the pass's first cancel check, and the check the pass is given."""
    host, started = NullHost(), threading.Event()

    def check_cancel() -> None:
        started.set()
        host.check_cancel()
    return host, started, check_cancel


def test_a_cancel_during_the_decode_stops_it_within_a_second(pipe):
    host, started, check_cancel = host_cancelled_once_under_way()
    latents = torch.randn(1, 128, DECODED_SIDE // 16, DECODED_SIDE // 16)
    pressed = do_when(started.is_set, lambda: press_cancel(host))
    with pytest.raises(Cancelled):
        pipe.decode(latents, check_cancel)
    assert time.monotonic() - pressed.result() < CANCEL_WITHIN_S
    assert not any(layer._forward_pre_hooks for layer in pipe.parts.load_vae().modules())  # no check left behind


def test_a_cancel_during_the_image_encode_stops_it_within_a_second(pipe):
    host, started, check_cancel = host_cancelled_once_under_way()
    request = GenerationRequest(prompt="a fox", width=ENCODED_SIDE, height=ENCODED_SIDE, steps=1, denoise=0.5,
                                init_image=torch.full((1, ENCODED_SIDE, ENCODED_SIDE, 3), 0.5))
    pressed = do_when(started.is_set, lambda: press_cancel(host))
    with pytest.raises(Cancelled):
        pipe.encode_image(request, check_cancel)
    assert time.monotonic() - pressed.result() < CANCEL_WITHIN_S


def test_a_pass_not_cancelled_gives_the_same_images_as_one_without_checks(pipe):
    latents = torch.randn(1, 128, 8, 8, generator=torch.Generator().manual_seed(3))
    checks = []
    with_checks = pipe.decode(latents, lambda: checks.append(1))
    assert len(checks) > 10  # a check before each layer, not once a pass
    assert torch.equal(with_checks, pipe.decode(latents, lambda: None))


def test_the_checks_are_removed_when_the_pass_fails():
    layers = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Linear(2, 2)))

    def cancelled() -> None:
        raise Cancelled("cancelled by the test")

    with pytest.raises(Cancelled), cancellable(layers, cancelled):
        layers(torch.ones(1, 2))
    assert not any(layer._forward_pre_hooks for layer in layers.modules())
    layers(torch.ones(1, 2))
