"""LocalPipe with a VRAM budget, on the CPU playing the device: the streamed image equals the resident one,
a budget that cannot fit fails before anything loads, and a cancel in mid-step releases everything."""
from __future__ import annotations

import time

import pytest
import torch

from ernie_image.runtime.core.errors import Cancelled, MemoryBudgetError
from ernie_image.runtime.core.host import NullHost
from ernie_image.runtime.core.request import GenerationRequest
from ernie_image.runtime.demo.tiny import TinySizes, build_tiny_model
from ernie_image.runtime.local.memory import measured_dit_size
from ernie_image.runtime.local.options import LoadOptions
from ernie_image.runtime.local.pipe import LocalPipe
from ernie_image.runtime.offload.planner import MemoryPlan

from streaming_budgets import first_budget_gb
from waiting import PROMPTLY_S

SIZES = TinySizes(dit_layers=6)
REQUEST = GenerationRequest(prompt="a red fox", negative_prompt="blurry", width=256, height=256, steps=2, cfg=3.0,
                            seed=7, batch=1)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), variant="turbo", sizes=SIZES)


@pytest.fixture(scope="module")
def resident_result(model):
    pipe = LocalPipe.load(model, LoadOptions(device="cpu"))
    return pipe.generate(REQUEST, NullHost())


def streaming_budget_gb(model, device: str = "cpu") -> float:
    """A budget (GiB) at which the tiny DiT streams some of its blocks (and, on the CPU, the text tower streams)."""
    def streams(plan: MemoryPlan) -> bool:
        text_streams = plan.text.mode == "streamed" or device != "cpu"
        return 0 < len(plan.dit.streamed) < SIZES.dit_layers - 1 and text_streams

    return first_budget_gb(model, REQUEST, device, streams, "streams part of the tiny DiT")


def test_streamed_pipe_gives_the_resident_image(model, resident_result):
    budget = streaming_budget_gb(model)
    pipe = LocalPipe.load(model, LoadOptions(device="cpu", vram_budget_gb=budget, keep_loaded=True))
    for _ in range(2):  # the second run reuses the placed DiT and the parked text tower
        result = pipe.generate(REQUEST, NullHost())
        assert torch.equal(result.latents, resident_result.latents)
        assert torch.equal(result.images, resident_result.images)
    plan = pipe.memory.plan
    assert plan.dit.streamed and plan.dit.resident and plan.text.mode == "streamed"
    assert pipe.memory.dit.streamer is not None and pipe.memory.text.streamer.parked
    pipe.release()
    assert pipe.memory.dit is None and pipe.parts.dit is None


def test_streamed_runs_inside_inference_mode_as_comfyui_runs_nodes_then_outside_it(model, resident_result):
    """ComfyUI runs every node under torch.inference_mode(); the CLI does not. Rings, slabs and parked host copies
    made in one mode must serve the next run in either ("Inference tensors do not track version counter")."""
    pipe = LocalPipe.load(model, LoadOptions(device="cpu", vram_budget_gb=streaming_budget_gb(model), keep_loaded=True))
    for inference in (True, True, False):
        with torch.inference_mode(inference):
            result = pipe.generate(REQUEST, NullHost())
        assert torch.equal(result.images, resident_result.images)
    pipe.release()


def test_config_sizes_are_the_built_fp32_dits_so_placing_it_plans_once(model):
    pipe = LocalPipe.load(model, LoadOptions(device="cpu", vram_budget_gb=1.0))
    estimate = pipe.memory.sizes_for(model, pipe.variant).dit
    assert pipe.dtype == torch.float32
    pipe._plan(REQUEST, NullHost())
    planned = pipe.memory.plan
    built = pipe.parts.load_dit()
    assert measured_dit_size(built, estimate.largest_linear_params) == estimate
    assert pipe.memory.plan is planned and pipe.memory.dit.plan is planned.dit  # placed by it, not planned again


def test_budget_too_small_fails_before_loading_anything(model):
    pipe = LocalPipe.load(model, LoadOptions(device="cpu", vram_budget_gb=1e-6))
    with pytest.raises(MemoryBudgetError, match=r"needs at least .* GiB of VRAM"):
        pipe.generate(REQUEST, NullHost())
    assert pipe.parts.dit is None and pipe.parts.text_tower is None and pipe.memory.plan is None


def third_block_of_the_last_step(counting) -> int:
    """The checks after which a cancel lands at the third block of the last step of a run `counting` (conftest's
    CancelAfter) saw: that step's own check and its 6 blocks' came before its progress."""
    return counting.calls_at_last_step - 4


def test_cancel_in_mid_step_releases_everything(model, resident_result, cancel_after):
    budget = streaming_budget_gb(model)
    pipe = LocalPipe.load(model, LoadOptions(device="cpu", vram_budget_gb=budget, keep_loaded=True))
    counting = cancel_after(10**6)
    pipe.generate(REQUEST, counting)
    host = cancel_after(third_block_of_the_last_step(counting))
    with pytest.raises(Cancelled):
        pipe.generate(REQUEST, host)
    assert host.progress_calls == [(1, 2)]  # it stopped inside the second step
    assert pipe.memory.dit is None and pipe.memory.text is None
    assert pipe.parts.dit is None and pipe.parts.text_tower is None
    assert torch.equal(pipe.generate(REQUEST, NullHost()).latents, resident_result.latents)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_the_gpu_a_cancel_in_mid_step_returns_at_once_and_leaves_no_device_memory(model, cancel_after):
    budget = streaming_budget_gb(model, "cuda")
    pipe = LocalPipe.load(model, LoadOptions(device="cuda", vram_budget_gb=budget, keep_loaded=True, compile=False))
    counting = cancel_after(10**6)
    expected = pipe.generate(REQUEST, counting)  # also creates the CUDA handles and workspaces any program keeps
    assert pipe.memory.plan.dit.streamed and pipe.memory.plan.dit.resident
    pipe.release()
    torch.cuda.empty_cache()
    baseline = torch.cuda.memory_allocated()

    class TimedCancel(cancel_after):
        def check_cancel(self) -> None:
            if self.calls == self.checks:
                self.cancelled_at = time.perf_counter()
            super().check_cancel()

    host = TimedCancel(third_block_of_the_last_step(counting))  # streamed copies in flight
    with pytest.raises(Cancelled):
        pipe.generate(REQUEST, host)
    assert time.perf_counter() - host.cancelled_at < PROMPTLY_S, "back at the Cancel, no wait on copies in flight"
    assert host.progress_calls == [(1, 2)]
    assert not pipe.is_loaded()
    assert torch.cuda.memory_allocated() == baseline, "the cancelled run left device memory allocated"
    again = pipe.generate(REQUEST, NullHost())
    assert torch.equal(again.latents, expected.latents)
