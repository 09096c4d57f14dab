"""Latent previews: a cheap RGB picture of the first image's denoised estimate per step, no VAE; only for a host
that shows them, and on a GPU without making a step wait for the device."""
from __future__ import annotations

import sys
import types
from enum import Enum

import numpy
import pytest
import torch

from ernie_image.runtime.core.host import NullHost, wants_previews
from ernie_image.runtime.core.request import GenerationRequest
from ernie_image.runtime.sampling import preview_stream
from ernie_image.runtime.sampling.euler import sample_euler
from ernie_image.runtime.sampling.image_in import StartState
from ernie_image.runtime.sampling.preview import preview_image, preview_pixels
from ernie_image.runtime.sampling.preview_stream import PreviewStream
from ernie_image.runtime.sampling.schedule import shifted_sigmas
from reference_models import pipe, tiny_folder  # noqa: F401  (fixtures used by name)


class PreviewHost(NullHost):
    """A host that shows previews and keeps each one it is given, with the step it came with."""

    wants_previews = True

    def __init__(self) -> None:
        super().__init__()
        self.pictures: list = []

    def progress(self, value, total, preview=None):
        super().progress(value, total, preview)
        self.pictures.append(preview)


def pixels_of(image) -> numpy.ndarray:
    return numpy.array(image)


def test_preview_is_the_unpatchified_size_and_capped():
    latents = torch.zeros(2, 128, 20, 16)
    assert preview_image(preview_pixels(latents)).size == (32, 40)  # PIL size is (width, height): 2x the latent grid
    assert max(preview_image(preview_pixels(torch.zeros(1, 128, 400, 300))).size) == 512


def test_preview_brightens_where_the_bright_latent_channel_is_high():
    # Unpatchified channel 3 has the largest positive RGB factors; DiT channel 3*4 + 0 holds its (dy=0, dx=0) pixels.
    latents = torch.zeros(1, 128, 8, 8)
    latents[0, 12, :, :4] = 3.0
    pixels = torch.from_numpy(pixels_of(preview_image(preview_pixels(latents)))).float()  # [16, 16, 3]
    assert pixels[0::2, 0:8:2].mean() > pixels[0::2, 8::2].mean() + 60


def test_the_image_is_its_own_copy_of_the_bytes():
    pixels = preview_pixels(torch.randn(1, 128, 4, 4, generator=torch.Generator().manual_seed(0)))
    image = preview_image(pixels)
    before = pixels_of(image).copy()
    pixels.zero_()  # the stream reuses its page-locked buffer for a later step
    assert numpy.array_equal(pixels_of(image), before)


def predicting(target: torch.Tensor):
    """A denoiser whose clean estimate is always `target`: flow matching's velocity (x - x0) / sigma."""
    return lambda latents, timestep: (latents - target) / (timestep.float()[:, None, None, None] / 1000.0)


START_CASES = {
    "text to image": lambda target, original: None,
    "img2img": lambda target, original: StartState(shifted_sigmas(4, 3.0)[1:].contiguous(), original),
    "inpainting, left half repainted": lambda target, original: StartState(
        shifted_sigmas(4, 3.0)[1:].contiguous(), original,
        torch.cat([torch.ones(1, 1, 6, 4), torch.zeros(1, 1, 6, 4)], dim=-1)),
}


@pytest.mark.parametrize("case", list(START_CASES), ids=list(START_CASES))
def test_each_step_previews_its_denoised_estimate_as_the_step_used_it(case):
    generator = torch.Generator().manual_seed(1)
    target, original, noise = (torch.randn(1, 128, 6, 8, generator=generator) for _ in range(3))
    start = START_CASES[case](target, original)
    steps = 3 if start is not None else 4
    host = PreviewHost()
    sample_euler(predicting(target), noise, steps, 3.0, 1.0, torch.float32, host, PreviewStream("cpu"), start)
    # The step's clean estimate: the model's where it repaints, the original where an inpainting mask keeps it.
    estimate = target if start is None or start.mask is None else target * start.mask + original * (1 - start.mask)
    expected = pixels_of(preview_image(preview_pixels(estimate)))
    assert len(host.pictures) == steps
    for picture in host.pictures:  # on the CPU each step's own picture, at once
        assert numpy.abs(pixels_of(picture).astype(int) - expected.astype(int)).max() <= 1


def test_the_preview_is_of_the_first_image_of_a_batch():
    generator = torch.Generator().manual_seed(2)
    target, noise = torch.randn(3, 128, 4, 4, generator=generator), torch.randn(3, 128, 4, 4, generator=generator)
    host = PreviewHost()
    sample_euler(predicting(target), noise, 2, 3.0, 1.0, torch.float32, host, PreviewStream("cpu"))
    expected = pixels_of(preview_image(preview_pixels(target[:1])))
    assert all(numpy.abs(pixels_of(p).astype(int) - expected.astype(int)).max() <= 1 for p in host.pictures)


class CountingCalls:
    def __init__(self, function) -> None:
        self.function, self.calls = function, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.function(*args, **kwargs)


@pytest.fixture
def counted(monkeypatch):
    """Counts of preview renderings and of tensor copies to the host (`.cpu()`) during a run."""
    renders = CountingCalls(preview_stream.preview_pixels)
    copies = CountingCalls(torch.Tensor.cpu)
    monkeypatch.setattr(preview_stream, "preview_pixels", renders)
    monkeypatch.setattr(torch.Tensor, "cpu", lambda self, *a, **k: copies(self, *a, **k))
    return types.SimpleNamespace(renders=renders, copies=copies)


def run(pipe, host, steps: int) -> None:
    pipe.generate(GenerationRequest(prompt="a fox", steps=steps, cfg=1.0, width=256, height=256, seed=5), host)


class Silent:
    """A host implementing only what a Host must: no `wants_previews`."""

    def progress(self, value, total, preview=None):
        assert preview is None

    def check_cancel(self) -> None: ...

    def make_room(self, num_bytes, device) -> None: ...

    def log(self, message) -> None: ...


def test_a_host_without_previews_gets_no_preview_work_in_any_step(pipe, counted):
    for host in (NullHost(), Silent()):
        assert not wants_previews(host)
        counted.copies.calls = 0
        run(pipe, host, 2)
        after_two = counted.copies.calls
        counted.copies.calls = 0
        run(pipe, host, 5)
        assert counted.renders.calls == 0
        assert counted.copies.calls == after_two  # nothing copied to the host per step


def test_a_host_that_wants_previews_gets_one_each_step(pipe, counted):
    host = PreviewHost()
    run(pipe, host, 3)
    assert counted.renders.calls == 3
    assert [p.size for p in host.pictures] == [(32, 32)] * 3


def test_load_options_can_still_switch_previews_off_for_every_host(tiny_folder, counted):
    from ernie_image.runtime.formats.sources import ModelSources
    from ernie_image.runtime.local.options import LoadOptions
    from ernie_image.runtime.local.pipe import LocalPipe

    quiet = LocalPipe.load(ModelSources(model_dir=tiny_folder), LoadOptions(device="cpu", previews=False))
    host = PreviewHost()
    run(quiet, host, 2)
    assert counted.renders.calls == 0 and host.pictures == [None, None]


def test_a_host_says_whether_it_wants_previews_and_saying_nothing_means_no():
    assert not wants_previews(Silent()) and not wants_previews(NullHost()) and wants_previews(PreviewHost())


class LatentPreviewMethod(Enum):  # comfy.cli_args' enum, as ComfyUI v0.8.0 defines it
    NoPreviews = "none"
    Auto = "auto"
    Latent2RGB = "latent2rgb"
    TAESD = "taesd"


@pytest.mark.parametrize("method, wanted", [(LatentPreviewMethod.NoPreviews, False), (LatentPreviewMethod.Auto, True),
                                            (LatentPreviewMethod.Latent2RGB, True), (LatentPreviewMethod.TAESD, True)])
def test_comfyui_previews_follow_its_preview_method_for_the_run(monkeypatch, method, wanted):
    from ernie_image.nodes.host import ComfyHost

    args = types.SimpleNamespace(preview_method=LatentPreviewMethod.NoPreviews, preview_size=512)
    comfy, cli_args = types.ModuleType("comfy"), types.ModuleType("comfy.cli_args")
    cli_args.args = args
    comfy.cli_args = cli_args
    monkeypatch.setitem(sys.modules, "comfy", comfy)
    monkeypatch.setitem(sys.modules, "comfy.cli_args", cli_args)
    host = ComfyHost("3")
    args.preview_method = method  # a prompt's own choice is set as it starts (ComfyUI's set_preview_method)
    assert wants_previews(host) is wanted


def test_outside_comfyui_its_host_wants_no_previews(monkeypatch):
    from ernie_image.nodes.host import ComfyHost

    monkeypatch.setitem(sys.modules, "comfy", None)  # `import comfy...` raises ImportError
    assert not wants_previews(ComfyHost("3"))


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
def test_on_a_gpu_a_step_hands_over_the_previous_steps_picture_and_the_last_its_own():
    generator = torch.Generator().manual_seed(3)
    estimates = [torch.randn(1, 128, 8, 8, generator=generator) for _ in range(4)]
    stream = PreviewStream("cuda")
    zero = torch.zeros(1, 128, 8, 8, device="cuda")
    handed = [stream.after_step(estimate.cuda(), zero, 0.5, last=index == 3)
              for index, estimate in enumerate(estimates)]
    expected = [pixels_of(preview_image(preview_pixels(estimate))) for estimate in estimates]
    assert handed[0] is None
    for picture, want in zip(handed[1:3], expected[:2]):
        assert numpy.abs(pixels_of(picture).astype(int) - want.astype(int)).max() <= 1
    assert numpy.abs(pixels_of(handed[3]).astype(int) - expected[3].astype(int)).max() <= 1


@cuda
def test_on_a_gpu_the_step_does_not_wait_for_its_own_copy():
    stream = PreviewStream("cuda")
    zero = torch.zeros(1, 128, 8, 8, device="cuda")
    stream.after_step(zero, zero, 0.5)
    torch.cuda._sleep(2_000_000_000)  # the next step's work: ~1 s of GPU time queued
    blocker = torch.cuda.Event()
    blocker.record()
    stream.after_step(zero, zero, 0.5)  # hands over step 1's picture (done before the sleep), queues its own copy
    assert not blocker.query(), "the step waited for work queued after the previous step's copy"
    torch.cuda.synchronize()
