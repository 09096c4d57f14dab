"""The prompt enhancer's fast decoder (static KV cache, one CUDA graph per token) computes transformers' Ministral3
logits: checked token by token on the CPU in fp32 (graph off), past the position where the Llama-4 query scaling
steps up, and on the GPU with the graph on, where it must also hand back every byte it took."""
from __future__ import annotations

import pytest
import torch

from ernie_image.runtime.core.errors import Cancelled
from ernie_image.runtime.demo.tiny_pe import lively_prompt_enhancer
from ernie_image.runtime.text.static_decoder import (CACHE_ROUNDING, StaticCacheDecoder, computes_like_transformers,
                                                     static_decoding_device)
from ernie_image.runtime.text.token_sampler import (SamplingSettings, TransformersDecoder, open_decoder,
                                                    sample_tokens)

pytestmark = pytest.mark.usefixtures("one_thread")

# The tiny PE's YaRN span is 256 positions: a 40-token prompt plus 240 forced tokens crosses it.
PROMPT_IDS = [1] + [(7 * i) % 200 + 20 for i in range(39)]
STEPS = 240


@pytest.fixture(scope="module")
def model():
    return lively_prompt_enhancer(seed=4).float().eval().requires_grad_(False)


def teacher_forced_difference(decoder, model, steps: int) -> tuple[float, list[int]]:
    """Largest logit difference from transformers after the prompt and after each of `steps` tokens, the tokens
    chosen greedily by transformers; and those tokens."""
    reference = TransformersDecoder(model)
    expected = reference.prefill(PROMPT_IDS)
    worst = (expected - decoder.prefill(PROMPT_IDS)).abs().max().item()
    tokens = []
    for _ in range(steps):
        token = int(expected.argmax())
        tokens.append(token)
        expected = reference.next_logits(token)
        worst = max(worst, (expected - decoder.next_logits(token)).abs().max().item())
    reference.close()
    return worst, tokens


def assert_replay_equals_eager(graph_decoder, eager, tokens: list[int]) -> None:
    """Replaying the captured kernels gives exactly the same decoder's eager step's logits; both are closed."""
    eager.prefill(PROMPT_IDS)
    graph_decoder.prefill(PROMPT_IDS)
    for token in tokens:
        assert torch.equal(graph_decoder.next_logits(token), eager.next_logits(token))
    graph_decoder.close()
    eager.close()


@torch.inference_mode()
def test_static_cache_logits_equal_transformers_token_by_token(model):
    decoder = StaticCacheDecoder(model, len(PROMPT_IDS) + STEPS, use_graph=False)
    worst, tokens = teacher_forced_difference(decoder, model, STEPS)
    assert worst < 1e-4
    assert len(set(tokens)) > 20, "the tiny PE must not just repeat one token"


def test_cache_capacity_is_rounded_and_enforced(model):
    decoder = StaticCacheDecoder(model, 10, use_graph=False)
    assert decoder.capacity == CACHE_ROUNDING
    with pytest.raises(ValueError, match="does not fit a cache of 256"):
        decoder.prefill(list(range(1, CACHE_ROUNDING + 1)))
    with torch.inference_mode():
        decoder.prefill(list(range(1, CACHE_ROUNDING)))
        decoder.next_logits(5)
        with pytest.raises(ValueError, match="cache of 256 positions is full"):
            decoder.next_logits(5)


def test_cpu_models_keep_transformers_path(model):
    assert static_decoding_device(model) is None
    assert isinstance(open_decoder(model, 64), TransformersDecoder)


def test_hooked_layers_and_sliding_windows_keep_transformers_path():
    """A streamed PE's weights are all on the device (ring slots), but only its layer hooks fill them; a sliding
    window is maths this decoder does not do. (On the GPU the test below checks open_decoder's choice itself.)"""
    model = lively_prompt_enhancer(seed=4).eval()
    assert computes_like_transformers(model)
    handle = model.model.layers[3].register_forward_pre_hook(lambda module, args: None)
    assert not computes_like_transformers(model)
    handle.remove()
    assert computes_like_transformers(model)
    model.config.sliding_window = 64
    assert not computes_like_transformers(model)


def test_a_model_the_graph_cannot_capture_falls_back_to_transformers(model, monkeypatch, caplog):
    import ernie_image.runtime.text.static_decoder as static_decoder

    def refuse(*args, **kwargs):
        raise RuntimeError("operation not permitted when stream is capturing\nmore detail")

    monkeypatch.setattr(static_decoder, "static_decoding_device", lambda model: torch.device("cuda", 0))
    monkeypatch.setattr(static_decoder, "StaticCacheDecoder", refuse)
    assert isinstance(open_decoder(model, 64), TransformersDecoder)
    assert "CUDA-graph decoding unavailable (operation not permitted when stream is capturing)" in caplog.text


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@torch.inference_mode()
def test_on_the_gpu_the_graph_decoder_matches_transformers_and_frees_its_memory(cancel_after):
    cuda_model = lively_prompt_enhancer(seed=4).float().eval().requires_grad_(False).cuda()
    assert isinstance(open_decoder(cuda_model, 64, fast=False), TransformersDecoder)
    handle = cuda_model.model.layers[0].register_forward_hook(lambda module, args, output: None)
    assert isinstance(open_decoder(cuda_model, 64), TransformersDecoder), "a hooked (streamed) PE"
    handle.remove()
    # Kept for good, so taken before measuring: the process's one capture stream and the cuBLAS workspaces of it
    # and of this thread's current stream (cuBLAS allocates one per stream on its first matmul there).
    open_decoder(cuda_model, 64).close()
    teacher_forced_difference(StaticCacheDecoder(cuda_model, 64, use_graph=False), cuda_model, 2)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()

    graph_decoder = open_decoder(cuda_model, len(PROMPT_IDS) + STEPS)
    assert isinstance(graph_decoder, StaticCacheDecoder) and graph_decoder.graph is not None
    worst, tokens = teacher_forced_difference(graph_decoder, cuda_model, STEPS)
    assert worst < 1e-3

    assert_replay_equals_eager(graph_decoder, StaticCacheDecoder(cuda_model, len(PROMPT_IDS) + STEPS, use_graph=False),
                               tokens[:32])
    del graph_decoder
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before

    settings = SamplingSettings(max_new_tokens=48, min_new_tokens=48)
    fast = sample_tokens(cuda_model, PROMPT_IDS, settings, seed=9, eos_ids=[2])
    reference = sample_tokens(cuda_model, PROMPT_IDS, settings, seed=9, eos_ids=[2], fast=False)
    assert fast.token_ids == reference.token_ids  # fp32: the logits agree far inside the sampler's margins

    with pytest.raises(Cancelled):
        sample_tokens(cuda_model, PROMPT_IDS, settings, seed=9, eos_ids=[2], check_cancel=cancel_after(5).check_cancel)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before, "a cancel leaves no cache or graph memory behind"


def test_a_compiled_step_that_fails_falls_back_to_the_uncompiled_graph_decoder(model, monkeypatch, caplog):
    import ernie_image.runtime.text.static_decoder as static_decoder

    built = []

    class Decoder:
        def __init__(self, model, capacity, use_graph, compiled=False):
            built.append(compiled)
            if compiled:
                raise RuntimeError("backend compiler failed: no Triton for this GPU\ndetail")

    monkeypatch.setattr(static_decoder, "static_decoding_device", lambda model: torch.device("cuda", 0))
    monkeypatch.setattr(static_decoder, "StaticCacheDecoder", Decoder)
    assert isinstance(open_decoder(model, 64, compiled=True), Decoder)
    assert built == [True, False]
    assert "compiled decode step unavailable (backend compiler failed: no Triton for this GPU)" in caplog.text


ASYNC_ALLOCATOR = torch.cuda.is_available() and torch.cuda.get_allocator_backend() != "native"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@torch.inference_mode()
def test_on_the_gpu_the_compiled_decode_step_matches_transformers_and_replays_exactly():
    from ernie_image.runtime.model.compile import compile_available

    if not compile_available(torch.device("cuda")):
        pytest.skip("needs Triton for torch.compile")
    cuda_model = lively_prompt_enhancer(seed=4).float().eval().requires_grad_(False).cuda()
    open_decoder(cuda_model, 64).close()  # stacks the weights and makes the process's capture stream
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    compiled = open_decoder(cuda_model, len(PROMPT_IDS) + STEPS, compiled=True)
    assert isinstance(compiled, StaticCacheDecoder) and compiled.layer_tensors is not None
    worst, tokens = teacher_forced_difference(compiled, cuda_model, STEPS)
    assert worst < 1e-3
    assert_replay_equals_eager(compiled, StaticCacheDecoder(cuda_model, len(PROMPT_IDS) + STEPS, use_graph=False,
                                                             compiled=True), tokens[:16])
    del compiled
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before
    settings = SamplingSettings(max_new_tokens=48, min_new_tokens=48)
    fast = sample_tokens(cuda_model, PROMPT_IDS, settings, seed=9, eos_ids=[2], compiled=True)
    assert fast.token_ids == sample_tokens(cuda_model, PROMPT_IDS, settings, seed=9, eos_ids=[2]).token_ids


@pytest.mark.gpu
@pytest.mark.skipif(not ASYNC_ALLOCATOR, reason="checks the cudaMallocAsync allocator (scripts/gpu_suite.sh runs both)")
@torch.inference_mode()
def test_under_cuda_malloc_async_the_compiled_step_is_the_one_in_the_graph():
    """Inductor's C++ wrapper there (static_decoder._compiled_decode_layer): its Python launchers refuse tensors
    allocated inside the capture."""
    from ernie_image.runtime.model.compile import compile_available

    if not compile_available(torch.device("cuda")):
        pytest.skip("needs Triton for torch.compile")
    cuda_model = lively_prompt_enhancer(seed=4).float().eval().requires_grad_(False).cuda()
    decoder = open_decoder(cuda_model, len(PROMPT_IDS) + STEPS, compiled=True)
    try:
        assert isinstance(decoder, StaticCacheDecoder) and decoder.graph is not None
        assert decoder.layer_tensors is not None  # the compiled step
        worst, _ = teacher_forced_difference(decoder, cuda_model, STEPS)
        assert worst < 1e-3
    finally:
        decoder.close()
