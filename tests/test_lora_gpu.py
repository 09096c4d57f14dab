"""LoRAs on the compiled DiT on a CUDA GPU: one compile for a new branch shape, none for a same-shape switch or a
strength change, the fused projections' branches right, the base back bit for bit. Skipped without CUDA."""
from __future__ import annotations

import pytest
import torch

import lora_files as lf
from ernie_image.runtime.lora.attach import apply_stack
from ernie_image.runtime.lora.keys import dit_linear_shapes
from ernie_image.runtime.lora.parsed import load_lora
from ernie_image.runtime.model.compile import compile_blocks, fuse_projections
from ernie_image.runtime.model.dit import DiTConfig
from small_dits import compiled_graphs, scaled_random_dit, step_inputs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# A small DiT of the released structure (head dim 128 as released, so SDPA takes its flash path).
CONFIG = DiTConfig(hidden_size=256, num_attention_heads=2, num_layers=4, ffn_hidden_size=768, text_in_dim=192,
                   rope_axes_dim=(32, 48, 48))


@pytest.fixture(scope="module")
def loras(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gpu-loras")
    shapes = dit_linear_shapes(CONFIG)
    wide = lf.write_ai_toolkit(folder / "wide.safetensors", lf.random_lora(shapes, 16, seed=3))
    return {**lf.two_dit_loras(folder, shapes, kohya_rank=8), "wide": wide}


@torch.inference_mode()
def run(dit, args):
    return dit(*args)


def test_compiled_dit_switches_loras_without_recompiling(loras):
    torch._dynamo.reset()
    dit = scaled_random_dit(CONFIG, "cuda", torch.bfloat16)
    fuse_projections(dit)
    assert compile_blocks(dit)
    args = step_inputs(CONFIG, "cuda", torch.bfloat16)
    base = run(dit, args)
    stack = lambda name, strength=1.0: [(load_lora(loras[name], CONFIG), strength)]  # noqa: E731

    apply_stack(dit, stack("a"))
    before = compiled_graphs()
    with_a = run(dit, args)
    first_lora_graphs = compiled_graphs() - before
    assert first_lora_graphs >= 1  # the new block structure compiles once, for all four blocks

    before = compiled_graphs()
    apply_stack(dit, stack("b"))
    with_b = run(dit, args)
    apply_stack(dit, stack("a", 0.4))
    with_a_weak = run(dit, args)
    assert compiled_graphs() == before, "a same-shape switch or a strength change recompiled"
    assert not torch.equal(with_a, with_b) and not torch.equal(with_a, with_a_weak)

    apply_stack(dit, stack("wide"))
    before = compiled_graphs()
    run(dit, args)
    assert compiled_graphs() - before <= first_lora_graphs  # a new rank: one more compile at most

    apply_stack(dit, [])
    assert torch.equal(run(dit, args), base)


@torch.inference_mode()
def test_compiled_fused_lora_matches_the_eager_unfused_one(loras):
    torch._dynamo.reset()
    eager, compiled = scaled_random_dit(CONFIG, "cuda", torch.bfloat16), scaled_random_dit(CONFIG, "cuda", torch.bfloat16)
    fuse_projections(compiled)
    assert compile_blocks(compiled)
    stack = [(load_lora(loras["a"], CONFIG), 0.8), (load_lora(loras["b"], CONFIG), -0.5)]
    apply_stack(eager, stack)
    apply_stack(compiled, stack)
    args = step_inputs(CONFIG, "cuda", torch.bfloat16)
    want, got = eager(*args).float(), compiled(*args).float()
    assert torch.isfinite(got).all()
    assert ((got - want).norm() / want.norm()).item() <= 2e-2
