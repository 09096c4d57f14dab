"""The pack's CUDA-graph and pinned-memory paths under both of PyTorch's CUDA allocator backends.

Current ComfyUI starts torch with PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync on NVIDIA. Each case runs in a
fresh subprocess (the backend is fixed when CUDA initialises, and an abort must fail the test, not end the run).
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

REPO_ROOT = Path(__file__).resolve().parent.parent
BACKENDS = ("native", "cudaMallocAsync")

# Registers the checkout as the package `ernie_image`, as tests/conftest.py does.
_PRELUDE = f"""
import importlib.util, sys
spec = importlib.util.spec_from_file_location("ernie_image", {str(REPO_ROOT / "__init__.py")!r},
                                              submodule_search_locations=[{str(REPO_ROOT)!r}])
module = importlib.util.module_from_spec(spec); sys.modules["ernie_image"] = module; spec.loader.exec_module(module)
import torch
assert torch.cuda.get_allocator_backend() == sys.argv[1], torch.cuda.get_allocator_backend()
"""


def run_under(backend: str, body: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF=f"backend:{backend}", PYTHONUNBUFFERED="1")
    script = _PRELUDE + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", script, backend], env=env, capture_output=True, text=True,
                          timeout=300)


_UNLAUNCHED_GRAPH_OUTPUT = """
x = torch.ones(1024, device="cuda")
side = torch.cuda.Stream()
side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side):
    (x * 2).sum()
torch.cuda.current_stream().wait_stream(side)
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph, stream=side):
    out = x * 2
{launch}
del out, graph
torch.cuda.synchronize()
print("survived")
"""


def test_root_cause_freeing_a_graph_output_before_any_launch_aborts_under_cudamallocasync():
    """The abort behind the PE decoder's crash, in plain PyTorch: a tensor a graph allocated, freed before the graph
    ever ran. Launching the graph once first makes the same free safe (what StaticCacheDecoder now does)."""
    unlaunched = run_under("cudaMallocAsync", _UNLAUNCHED_GRAPH_OUTPUT.format(launch=""))
    launched = run_under("cudaMallocAsync", _UNLAUNCHED_GRAPH_OUTPUT.format(launch="graph.replay()"))
    assert launched.returncode == 0 and "survived" in launched.stdout, launched.stderr[-2000:]
    if unlaunched.returncode == 0:
        pytest.skip("this PyTorch frees an unlaunched graph's output safely under cudaMallocAsync")
    assert "survived" not in unlaunched.stdout


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_graph_decoder_survives_every_order_of_capture_replay_cancel_and_close(backend):
    result = run_under(backend, """
        from ernie_image.runtime.core.errors import Cancelled
        from ernie_image.runtime.text.static_decoder import StaticCacheDecoder
        from ernie_image.runtime.demo.tiny_pe import lively_prompt_enhancer
        from ernie_image.runtime.text.token_sampler import SamplingSettings, open_decoder, sample_tokens

        model = lively_prompt_enhancer(seed=4).to(torch.bfloat16).eval().requires_grad_(False).cuda()
        prompt = [1] + list(range(20, 60))
        with torch.inference_mode():
            for tokens in (None, 0, 3):  # closed right after capture, after prefill, after a few tokens
                decoder = open_decoder(model, 64)
                assert isinstance(decoder, StaticCacheDecoder) and decoder.graph is not None
                if tokens is not None:
                    decoder.prefill(prompt)
                    for token in range(tokens):
                        decoder.next_logits(30 + token)
                decoder.close()
            dropped = open_decoder(model, 64)
            del dropped  # never closed: garbage-collected instead
            calls = []
            def cancel_at_third():
                calls.append(1)
                if len(calls) >= 3:
                    raise Cancelled("cancelled")
            try:
                sample_tokens(model, prompt, SamplingSettings(max_new_tokens=32, min_new_tokens=32), seed=1,
                              eos_ids=[2], check_cancel=cancel_at_third)
            except Cancelled:
                pass
            again = sample_tokens(model, prompt, SamplingSettings(max_new_tokens=16, min_new_tokens=16), seed=1,
                                  eos_ids=[2])
            assert len(again.token_ids) == 16
        torch.cuda.synchronize()
        print("decoder ok")
    """)
    assert result.returncode == 0 and "decoder ok" in result.stdout, result.stderr[-3000:]


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_compiled_decode_step_is_captured_and_repeats_its_rewrite_under_each_backend(backend):
    """Under cudaMallocAsync the compiled step goes through Inductor's C++ wrapper (static_decoder's
    `_compiled_decode_layer`): its Python launchers would refuse the capture's not-yet-backed tensors."""
    result = run_under(backend, """
        from ernie_image.runtime.text.static_decoder import StaticCacheDecoder
        from ernie_image.runtime.demo.tiny_pe import lively_prompt_enhancer
        from ernie_image.runtime.text.token_sampler import SamplingSettings, open_decoder, sample_tokens

        model = lively_prompt_enhancer(seed=4).to(torch.bfloat16).eval().requires_grad_(False).cuda()
        prompt = [1] + list(range(20, 60))
        settings = SamplingSettings(max_new_tokens=24, min_new_tokens=24)
        with torch.inference_mode():
            decoder = open_decoder(model, 64, compiled=True)
            assert isinstance(decoder, StaticCacheDecoder) and decoder.graph is not None
            assert decoder.layer_tensors is not None, "the compiled step is the one captured"
            decoder.close()
            first = sample_tokens(model, prompt, settings, seed=5, eos_ids=[2], compiled=True)
            again = sample_tokens(model, prompt, settings, seed=5, eos_ids=[2], compiled=True)
            assert first.token_ids == again.token_ids and len(first.token_ids) == 24
        torch.cuda.synchronize()
        print("compiled decoder ok")
    """)
    assert result.returncode == 0 and "compiled decoder ok" in result.stdout, result.stderr[-3000:]


@pytest.mark.parametrize("backend", BACKENDS)
def test_pinned_slabs_and_streamed_copies_work_and_unpin_under_each_backend(backend):
    result = run_under(backend, """
        from ernie_image.runtime.offload.pinned import HostSlab

        slab = HostSlab(64 << 20, pin=True)
        assert slab.pinned_bytes == 64 << 20 and slab.data.is_pinned()
        slab.data.fill_(7)
        side = torch.cuda.Stream()
        device_copy = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
        with torch.cuda.stream(side):
            device_copy.copy_(slab.data, non_blocking=True)
        side.synchronize()
        assert int(device_copy[-1]) == 7
        slab.free()
        assert slab.pinned_bytes == 0
        del device_copy
        torch.cuda.synchronize()
        print("pinned ok")
    """)
    assert result.returncode == 0 and "pinned ok" in result.stdout, result.stderr[-3000:]
