"""The prompt enhancer's fewer-kernel decode step and its packed (FP8) weights.

The fused step (one rms_norm kernel per norm, a decode step's grouped-query attention as one plain SDPA) computes
the unfused step's logits within float32 rounding, past the Llama-4 query-scaling step; FP8 weights pack every
decoder-layer Linear, keep the embeddings and tied head, and move the logits by what e4m3's 3 mantissa bits allow.
"""
from __future__ import annotations

import pytest
import torch

from ernie_image.runtime.core.errors import InvalidInputError
from ernie_image.runtime.demo.tiny_pe import lively_prompt_enhancer
from ernie_image.runtime.quant.linear import QuantLinear
from ernie_image.runtime.text.pe_quant import quantize_pe_layers_
from ernie_image.runtime.text.static_decoder import StaticCacheDecoder

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT_IDS = [1] + [(7 * i) % 200 + 20 for i in range(39)]
STEPS = 240  # crosses the tiny PE's 256-position YaRN span


def forced_logits(model, fused: bool, tokens: list[int]) -> torch.Tensor:
    decoder = StaticCacheDecoder(model, len(PROMPT_IDS) + len(tokens) + 1, use_graph=False, fused=fused)
    out = [decoder.prefill(PROMPT_IDS)]
    for token in tokens:
        out.append(decoder.next_logits(token))
    decoder.close()
    return torch.cat(out)


@torch.inference_mode()
def test_fused_decode_step_equals_the_unfused_one_within_float32_rounding():
    model = lively_prompt_enhancer(seed=4).float().eval().requires_grad_(False)
    tokens = [(13 * i) % 250 + 3 for i in range(STEPS)]
    fused, unfused = forced_logits(model, True, tokens), forced_logits(model, False, tokens)
    assert (fused - unfused).abs().max().item() < 1e-5
    assert (fused.argmax(-1) == unfused.argmax(-1)).all()


@torch.inference_mode()
def test_fp8_pe_packs_the_layer_linears_and_stays_close():
    model = lively_prompt_enhancer(seed=4).to(torch.bfloat16).eval().requires_grad_(False)
    tokens = [(13 * i) % 250 + 3 for i in range(24)]
    want = forced_logits(model, True, tokens).float()
    embedding = model.get_input_embeddings().weight
    packed = quantize_pe_layers_(model, "fp8")
    assert packed == 7 * len(model.model.layers)
    assert all(type(m) is not torch.nn.Linear for m in model.model.layers.modules())
    assert sum(isinstance(m, QuantLinear) and m.format == "fp8" for m in model.modules()) == packed
    assert model.get_input_embeddings().weight is embedding and model.lm_head.weight is embedding
    got = forced_logits(model, True, tokens).float()
    assert torch.isfinite(got).all()
    relative = ((got - want).norm() / want.norm()).item()
    assert 0 < relative < 0.5  # e4m3 weights: changed, not broken (the full-size figure is the bench's)


def test_unknown_pe_quantisation_is_refused_with_the_choices():
    with pytest.raises(InvalidInputError, match="use one of fp8 or none"):
        quantize_pe_layers_(lively_prompt_enhancer(seed=4), "q4_k")


def test_a_pipe_with_an_fp8_pe_revises_through_packed_layers(tiny_turbo_with_pe):
    from ernie_image.runtime.core.host import NullHost
    from ernie_image.runtime.formats.sources import ModelSources
    from ernie_image.runtime.local.options import LoadOptions
    from ernie_image.runtime.local.pipe import LocalPipe

    with pytest.raises(InvalidInputError, match="pe_quant 'int4' is not supported"):
        LoadOptions(pe_quant="int4").validate()
    pipe = LocalPipe.load(ModelSources(model_dir=tiny_turbo_with_pe),
                          LoadOptions(device="cpu", dtype="fp32", previews=False, pe_quant="fp8"))
    revised = pipe.enhance("a lighthouse at dusk", 256, 256, seed=21, max_new_tokens=12, host=NullHost())
    assert revised.revisions[0].source in ("local", "original") and revised.revisions[0].tokens > 0
    model = pipe.parts.enhancer.model
    assert any(isinstance(m, QuantLinear) for m in model.modules())
    assert not any(type(m) is torch.nn.Linear for m in model.model.layers.modules())


def test_stacking_projection_weights_keeps_what_each_linear_computes_and_its_memory():
    from ernie_image.runtime.text.static_decoder import _stacked_weight, stack_weights_

    model = lively_prompt_enhancer(seed=4).float().eval().requires_grad_(False)
    attention = model.model.layers[0].self_attn
    linears = [attention.q_proj, attention.k_proj, attention.v_proj]
    x = torch.randn(3, model.config.hidden_size)
    want = [linear(x) for linear in linears]
    assert _stacked_weight(linears) is None
    assert stack_weights_(linears)
    stacked = _stacked_weight(linears)
    assert stacked is not None and stacked.shape[0] == sum(linear.out_features for linear in linears)
    assert all(torch.equal(linear(x), expected) for linear, expected in zip(linears, want))
    assert torch.equal(x @ stacked.t(), torch.cat(want, dim=-1))
    assert sum(linear.weight.untyped_storage().nbytes() for linear in linears[:1]) == stacked.numel() * 4
    assert stack_weights_(linears) and _stacked_weight(linears).data_ptr() == stacked.data_ptr()  # once
    quantised = lively_prompt_enhancer(seed=4).to(torch.bfloat16)
    quantize_pe_layers_(quantised, "fp8")
    layer = quantised.model.layers[0].self_attn
    assert not stack_weights_([layer.q_proj, layer.k_proj, layer.v_proj])


@torch.inference_mode()
def test_the_decode_step_with_stacked_weights_computes_the_same_logits():
    model = lively_prompt_enhancer(seed=4).float().eval().requires_grad_(False)
    tokens = [(13 * i) % 250 + 3 for i in range(16)]
    want = forced_logits(model, True, tokens)
    from ernie_image.runtime.text.static_decoder import stack_weights_

    for layer in model.model.layers:
        assert stack_weights_([layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj])
        assert stack_weights_([layer.mlp.gate_proj, layer.mlp.up_proj])
    assert (forced_logits(model, True, tokens) - want).abs().max().item() < 1e-5
