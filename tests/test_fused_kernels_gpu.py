"""comfy-kitchen's fused kernels compute what the PyTorch forms they replace compute (runtime/model/fused_kernels.py):
q/k per-head RMSNorm + ERNIE's split-half RoPE, on the strided q/k views of the fused q/k/v projection as on
contiguous ones; adaLN RMSNorm with the norm weight folded into the scale; and the eager DiT with them stays within
the fast forms' bound of the exact forward. Needs a CUDA GPU and comfy-kitchen with its CUDA backend."""
from __future__ import annotations

import pytest
import torch

from ernie_image.runtime.model import adaln, dit as dit_module, fused_kernels
from ernie_image.runtime.model.compile import fuse_projections
from ernie_image.runtime.model.dit import RopeTables, _positions
from reference_models import DIT_CONFIG, random_dit, relative_error

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(torch.cuda.is_available() and fused_kernels.cuda_backend() is None,
                       reason="needs comfy-kitchen with its CUDA backend (pip install comfy-kitchen)"),
]
HEAD_DIM = 128
CONFIG = dit_module.DiTConfig(hidden_size=4 * HEAD_DIM, num_attention_heads=4, num_layers=1, ffn_hidden_size=512,
                              text_in_dim=96, rope_axes_dim=(32, 48, 48))


def exact_norm_rope(x: torch.Tensor, weight: torch.Tensor, tables: RopeTables, eps: float) -> torch.Tensor:
    """fp32: rms_norm(x) * weight, then x * cos + rotate_half(x) * sin with the tables' per-element angles."""
    x = x.float()
    normed = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * weight.float()
    first, second = normed.chunk(2, dim=-1)
    return normed * tables.cos.float() + torch.cat((-second, first), dim=-1) * tables.sin.float()


@torch.inference_mode()
def test_the_q_k_kernel_is_rms_norm_then_ernies_rope_on_strided_and_contiguous_views():
    generator = torch.Generator(device="cuda").manual_seed(3)
    text_lens, text_max, grid = [40, 33], 40, (12, 20)
    positions = _positions(grid, text_lens, text_max, "cuda")
    tables = RopeTables(positions, CONFIG, torch.bfloat16)
    assert tables.rotation is not None and tables.rotation.shape == (2, 280, 1, HEAD_DIM // 2, 2, 2)
    qkv = torch.randn((2, 280, 3, 4, HEAD_DIM), generator=generator, device="cuda").to(torch.bfloat16)
    q_weight = (1 + 0.2 * torch.randn(HEAD_DIM, generator=generator, device="cuda")).to(torch.bfloat16)
    k_weight = (1 + 0.2 * torch.randn(HEAD_DIM, generator=generator, device="cuda")).to(torch.bfloat16)
    q, k = qkv[:, :, 0], qkv[:, :, 1]  # the fused projection's strided views
    q_out, k_out = fused_kernels.rms_rope(q, k, tables.rotation, q_weight, k_weight, 1e-6)
    q_contiguous, k_contiguous = fused_kernels.rms_rope(q.contiguous(), k.contiguous(), tables.rotation, q_weight,
                                                        k_weight, 1e-6)
    assert torch.equal(q_out, q_contiguous) and torch.equal(k_out, k_contiguous)
    assert relative_error(q_out, exact_norm_rope(q, q_weight, tables, 1e-6)) <= 4e-3  # one bf16 rounding: 2^-9
    assert relative_error(k_out, exact_norm_rope(k, k_weight, tables, 1e-6)) <= 4e-3


@torch.inference_mode()
def test_the_adaln_kernel_with_the_weight_folded_into_the_scale_is_norm_then_modulate():
    generator = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn((2, 300, 512), generator=generator, device="cuda").to(torch.bfloat16)
    weight = (1 + 0.3 * torch.randn(512, generator=generator, device="cuda")).to(torch.bfloat16)
    scale = (0.5 * torch.randn((2, 1, 512), generator=generator, device="cuda")).to(torch.bfloat16)
    shift = (0.5 * torch.randn((2, 1, 512), generator=generator, device="cuda")).to(torch.bfloat16)
    norm = dit_module.RMSNorm(512, 1e-6).to("cuda", torch.bfloat16)
    norm.weight.copy_(weight)
    got = adaln.norm_modulate(norm, x, 1 + scale.float(), shift.float(), scale, shift)
    xf = x.float()
    want = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + 1e-6) * weight.float() * (1 + scale.float()) \
        + shift.float()
    assert relative_error(got, want) <= 4e-3


@torch.inference_mode()
def test_the_eager_dit_with_the_kernels_stays_within_the_fast_forms_bound_and_replays_in_a_graph():
    from ernie_image.runtime.model.dit_graphs import DiTGraphs
    from test_dit_graphs import step_inputs

    assert DIT_CONFIG.head_dim % 32 == 0  # the kernel's rows
    model = random_dit("cuda", torch.bfloat16)
    fuse_projections(model)
    args = step_inputs("cuda", torch.bfloat16)
    with_kernels = model(*args)
    assert all(tables.rotation is not None for tables in model._rope_cache.values())
    exact = model.with_arithmetic("exact")(*args)
    assert relative_error(with_kernels, exact) <= 2e-3
    graphs = DiTGraphs(model)
    outputs = [graphs(*args) for _ in range(3)]
    assert graphs.captures == 1 and all(torch.equal(out, with_kernels) for out in outputs)
