"""The step cache on a CUDA GPU: CUDA-graph replay of the block runs, compiled blocks and streamed blocks give
what the eager resident cache gives, bit for bit; threshold 0 gives the uncached image in every mode; a cancel in a
streamed cached run leaves no device memory. Tiny models; the full-size timings are bench/step_cache.py's.
"""
from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch

from ernie_image.runtime.core.errors import Cancelled
from ernie_image.runtime.core.host import NullHost
from ernie_image.runtime.local.options import LoadOptions
from ernie_image.runtime.local.pipe import LocalPipe
from ernie_image.runtime.core.request import GenerationRequest
from ernie_image.runtime.step_cache import parse_step_cache
from ernie_image.runtime.step_cache.graphs import graphs_of
from ernie_image.runtime.demo.tiny import TinySizes, build_tiny_model
from streaming_budgets import middle_streaming_budget_gb

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

REQUEST = GenerationRequest(prompt="a red fox in snow", negative_prompt="blurry", width=256, height=256, steps=8,
                            cfg=3.0, seed=11, batch=2)
FORCED = "dbcache:forced=CSSCSCSC,first_blocks=2,last_blocks=1"
ZERO = "dbcache:threshold=0,start=0,end=1,first_blocks=2"


def cached(request: GenerationRequest, spec: str) -> GenerationRequest:
    return dataclasses.replace(request, step_cache=parse_step_cache(spec))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny-base-gpu"), variant="base", sizes=TinySizes(dit_layers=6))


@pytest.fixture(scope="module")
def eager(model):
    """The reference: uncompiled, no graphs, resident."""
    pipe = LocalPipe.load(model, LoadOptions(device="cuda", compile=False, cuda_graphs=False))
    return {spec: pipe.generate(cached(REQUEST, spec) if spec else REQUEST, NullHost()).latents
            for spec in ("", ZERO, FORCED)}


def test_eager_threshold_zero_is_the_uncached_image(eager):
    assert torch.equal(eager[ZERO], eager[""]) and not torch.equal(eager[FORCED], eager[""])


def test_graph_replay_of_the_block_runs_is_bit_identical_and_replays(model, eager):
    pipe = LocalPipe.load(model, LoadOptions(device="cuda", compile=False, cuda_graphs=True))
    for _ in range(2):  # the second run replays graphs captured in the first
        assert torch.equal(pipe.generate(REQUEST, NullHost()).latents, eager[""])
        assert torch.equal(pipe.generate(cached(REQUEST, ZERO), NullHost()).latents, eager[ZERO])
        assert torch.equal(pipe.generate(cached(REQUEST, FORCED), NullHost()).latents, eager[FORCED])
    graphs = graphs_of(pipe.parts.dit)
    assert graphs.disabled_reason is None and graphs.replays > 0
    pipe.release()


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="compiled blocks need Triton")
def test_compiled_blocks_threshold_zero_is_the_compiled_uncached_image(model):
    pipe = LocalPipe.load(model, LoadOptions(device="cuda", compile=True))
    uncached = pipe.generate(REQUEST, NullHost()).latents
    assert torch.equal(pipe.generate(cached(REQUEST, ZERO), NullHost()).latents, uncached)
    forced = pipe.generate(cached(REQUEST, FORCED), NullHost())
    assert forced.info["step_cache"]["schedule"] == "CSSCSCSC" and torch.isfinite(forced.latents).all()
    pipe.release()


def test_streamed_cached_run_is_the_resident_one_bit_for_bit_across_runs_and_a_cancel(model, eager, cancel_after):
    request = cached(REQUEST, FORCED)
    pipe = LocalPipe.load(model, LoadOptions(device="cuda", compile=False, vram_budget_gb=middle_streaming_budget_gb(
        model, request, "cuda"), keep_loaded=True))
    for _ in range(2):
        assert torch.equal(pipe.generate(request, NullHost()).latents, eager[FORCED])
    assert pipe.memory.dit.streamer is not None
    assert torch.equal(pipe.generate(REQUEST, NullHost()).latents, eager[""])  # uncached after it: the ring's order
    counting = cancel_after(10**6)
    pipe.generate(request, counting)
    with pytest.raises(Cancelled):
        pipe.generate(request, cancel_after(counting.calls_at_last_step // 2))
    assert pipe.memory.dit is None and pipe.parts.dit is None
    assert torch.equal(pipe.generate(request, NullHost()).latents, eager[FORCED])
    pipe.release()

