"""The uncompiled DiT: cast-folded eager kernels and CUDA-graph replay, both bit-identical to the plain forward.

CPU: the cast-folding `out=` forms give exactly the plain expressions' numbers (bf16 and fp32, CFG length groups),
and DiTGraphs leaves every case it must not touch to the DiT's own forward. GPU: a replay equals the eager forward
bit for bit (batch 1 and 2, two length groups sharing one pool), the graph count is bounded, any change of structure
recaptures, a capture that fails falls back to eager with one warning, released graphs leave no memory reserved for
graphs, and all of it holds under both CUDA allocator backends (fresh subprocesses, as ComfyUI's cudaMallocAsync
default is fixed when CUDA starts).
"""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from ernie_image.runtime.model.arithmetic import Arithmetic
from ernie_image.runtime.model.compile import fuse_projections
from ernie_image.runtime.model.dit import ErnieDiT
from ernie_image.runtime.model.dit_graphs import DiTGraphs, graphed_dit
from ernie_image.runtime.model.graph_cache import Captured, structure_key
from ernie_image.runtime.sampling.euler import length_grouped_denoiser
from reference_models import random_dit, relative_error


def tiny_dit(device: str, dtype: torch.dtype, fused: bool = True) -> ErnieDiT:
    model = random_dit(device, dtype)
    if fused:
        fuse_projections(model)
    return model


def step_inputs(device: str, dtype: torch.dtype, batch: int = 2, text_len: int = 9):
    generator = torch.Generator().manual_seed(batch * 100 + text_len)
    latents = torch.randn(batch, 128, 12, 10, generator=generator).to(device, dtype)
    timestep = torch.full((batch,), 730.0).to(device, dtype)
    text = torch.randn(batch, text_len, 96, generator=generator).to(device, dtype)
    return latents, timestep, text, [text_len] * batch


def plain_forward(model: ErnieDiT, *args) -> torch.Tensor:
    """The forward with the plain `.float()` ... `.to(dtype)` expressions (those compiled blocks use)."""
    return model.with_arithmetic("plain")(*args)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@torch.inference_mode()
def test_cast_folded_eager_kernels_are_bit_identical_to_the_plain_expressions(dtype):
    model = tiny_dit("cpu", dtype)
    latents, timestep, text, lens = step_inputs("cpu", dtype)
    padded_lens = [5, 9]  # one masked batch: the cached key mask is used
    assert torch.equal(model(latents, timestep, text, lens), plain_forward(model, latents, timestep, text, lens))
    assert torch.equal(model(latents, timestep, text, padded_lens),
                       plain_forward(model, latents, timestep, text, padded_lens))
    rows = [text[0, :4], text[1]]  # CFG: two length groups
    grouped = length_grouped_denoiser(model, rows, "cpu", dtype)(latents, timestep)
    plain = length_grouped_denoiser(model.with_arithmetic("plain"), rows, "cpu", dtype)(latents, timestep)
    assert torch.equal(grouped, plain)


@pytest.mark.parametrize("dtype, bound", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused-qkv", "separate-qkv"])
@torch.inference_mode()
def test_fewer_pass_forms_compute_the_plain_forward(dtype, bound, fused):
    """The forms the uncompiled CUDA forward takes (norm weights folded into the modulation and RoPE tables, one
    addcmul per modulation and residual), run here on the CPU: the same function, rounded once where the plain
    expressions round twice."""
    model = tiny_dit("cpu", dtype, fused=fused)
    fast_here = model.with_arithmetic(Arithmetic(fast_devices=("cuda", "cpu")))
    latents, timestep, text, _ = step_inputs("cpu", dtype)
    for lens in ([9, 9], [5, 9]):
        want = plain_forward(model, latents, timestep, text, lens)
        got = fast_here(latents, timestep, text, lens)
        assert relative_error(got, want) <= bound


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@torch.inference_mode()
def test_on_the_gpu_the_shipped_eager_forward_matches_diffusers_and_the_exact_one_is_bit_identical():
    from test_dit_fast_paths import bf16_error_against_diffusers_on_the_gpu

    ours, error = bf16_error_against_diffusers_on_the_gpu(compiled=False)
    assert error <= 1e-2  # the bound compiled blocks meet
    args = step_inputs("cuda", torch.bfloat16)
    exact = ours.with_arithmetic("exact")(*args)
    assert torch.equal(exact, plain_forward(ours, *args))
    assert relative_error(ours(*args), exact) <= 2e-3  # the fewer-pass forms: bf16 roundings skipped


@torch.inference_mode()
def test_off_the_gpu_the_wrapper_is_the_dits_own_forward():
    model = tiny_dit("cpu", torch.float32)
    graphs = DiTGraphs(model)
    args = step_inputs("cpu", torch.float32)
    for _ in range(3):
        assert torch.equal(graphs(*args), model(*args))
    assert graphs.eager_reason(args[0]) == "not on a CUDA device"
    assert graphs.captures == 0 and graphs.replays == 0 and graphs.graph_count == 0
    assert graphed_dit(model, enabled=True, device=torch.device("cpu")) is model
    assert graphed_dit(model, enabled=False, device=torch.device("cuda")) is model
    assert isinstance(graphed_dit(model, enabled=True, device=torch.device("cuda")), DiTGraphs)


def test_gradients_and_compiled_blocks_are_left_to_the_dit():
    model = tiny_dit("cpu", torch.float32)
    graphs = DiTGraphs(model)
    with torch.enable_grad():
        assert graphs.eager_reason() == "gradients are enabled"
    with torch.inference_mode():
        assert graphs.eager_reason() is None
        model.layers[0].compile()  # sets the compiled call; nothing is compiled until it is called
        assert graphs.eager_reason() == "the blocks are compiled"


def test_max_graphs_must_be_positive():
    with pytest.raises(ValueError, match="at least 1"):
        DiTGraphs(tiny_dit("cpu", torch.float32), max_graphs=0)


def test_a_module_that_does_not_count_its_structure_changes_is_refused():
    with pytest.raises(TypeError, match="structure_version"):
        DiTGraphs(torch.nn.Linear(4, 4))


def _holding_a_graph(graphs: DiTGraphs) -> DiTGraphs:
    """`graphs` as after a warm-up and a capture (a placeholder graph: the bookkeeping is what is under test)."""
    graphs.follow_structure()
    graphs._warmed.add(("signature",))
    graphs._graphs[("signature",)] = Captured(graph=None, inputs=(), output=torch.zeros(1))
    return graphs


@torch.inference_mode()
def test_a_structure_version_bump_or_a_new_block_runner_drops_the_graphs_and_their_warm_ups():
    model = tiny_dit("cpu", torch.float32, fused=False)
    graphs = _holding_a_graph(DiTGraphs(model))
    assert graphs.follow_structure() is False and graphs.graph_count == 1
    fuse_projections(model)
    assert graphs.follow_structure() is True
    assert graphs.graph_count == 0 and not graphs._warmed  # the next call warms up again, then captures
    assert graphs.follow_structure() is False
    _holding_a_graph(graphs)
    model.block_runner = lambda index, block, x, ctx: block(x, ctx)
    assert graphs.follow_structure() is True and graphs.graph_count == 0


@torch.inference_mode()
def test_in_place_weight_edits_keep_the_graphs():
    model = tiny_dit("cpu", torch.float32, fused=False)
    graphs = _holding_a_graph(DiTGraphs(model))
    before = structure_key(model)
    model.layers[0].mlp.linear_fc2.weight.mul_(0.5)
    model.final_linear.weight.copy_(torch.randn_like(model.final_linear.weight))
    model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()})  # copied into the same tensors
    assert structure_key(model) == before
    assert graphs.follow_structure() is False and graphs.graph_count == 1 and graphs._warmed


# -- GPU ---------------------------------------------------------------------------------------------------------
def replaying(batch: int = 1, fused: bool = True) -> tuple[ErnieDiT, DiTGraphs, tuple]:
    """A tiny DiT on the GPU, its DiTGraphs and one input signature, past warm-up, capture and a first replay."""
    model = tiny_dit("cuda", torch.bfloat16, fused)
    graphs = DiTGraphs(model)
    args = step_inputs("cuda", torch.bfloat16, batch)
    for _ in range(3):
        graphs(*args)
    assert graphs.captures == 1 and graphs.replays == 1
    return model, graphs, args


def assert_calls_match_eager(graphs: DiTGraphs, model: ErnieDiT, args: tuple, calls: int = 3) -> None:
    outputs = [graphs(*args) for _ in range(calls)]
    want = model(*args)
    assert all(torch.equal(out, want) for out in outputs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("batch", [1, 2])
def test_replay_is_bit_identical_to_the_eager_forward(batch):
    model = tiny_dit("cuda", torch.bfloat16)
    graphs = DiTGraphs(model)
    with torch.inference_mode():
        args = step_inputs("cuda", torch.bfloat16, batch)
        want = model(*args)
        outputs = [graphs(*args) for _ in range(4)]  # warm-up, capture (+ its launch), two replays
        assert graphs.captures == 1 and graphs.replays == 2 and graphs.disabled_reason is None
        for got in outputs:
            assert torch.equal(got, want)
        other = step_inputs("cuda", torch.bfloat16, batch)[0] * 0.5  # new latents through the same graph
        assert torch.equal(graphs(other, *args[1:]), model(other, *args[1:]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@torch.inference_mode()
def test_cfg_length_groups_share_one_pool_and_match_eager_over_a_whole_sampling_run():
    from ernie_image.runtime.core.host import NullHost
    from ernie_image.runtime.sampling.euler import sample_euler

    model = tiny_dit("cuda", torch.bfloat16)
    graphs = DiTGraphs(model)
    generator = torch.Generator().manual_seed(3)
    rows = [torch.randn(4, 96, generator=generator).cuda().bfloat16(),
            torch.randn(9, 96, generator=generator).cuda().bfloat16()]
    noise = torch.randn(1, 128, 12, 10, generator=generator).cuda()
    run = lambda forward: sample_euler(length_grouped_denoiser(forward, rows, "cuda", torch.bfloat16), noise,  # noqa: E731
                                       6, 3.0, 4.0, torch.bfloat16, NullHost())
    assert torch.equal(run(graphs), run(model))
    assert graphs.captures == 2 and graphs.graph_count == 2 and graphs.replays == 2 * 4
    pools = {captured.graph.pool() for captured in graphs._graphs.values()}
    if torch.cuda.get_allocator_backend() == "native":
        assert len(pools) == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@torch.inference_mode()
def test_graph_count_is_bounded_and_the_oldest_is_dropped():
    model = tiny_dit("cuda", torch.bfloat16)
    graphs = DiTGraphs(model, max_graphs=1)
    short, long = step_inputs("cuda", torch.bfloat16, 1, 4), step_inputs("cuda", torch.bfloat16, 1, 9)
    for args in (short, short, long, long, short, short, short):
        assert torch.equal(graphs(*args), model(*args))
    assert graphs.graph_count == 1 and graphs.captures == 3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@torch.inference_mode()
def test_structure_changes_recapture_and_in_place_weight_edits_replay():
    model, graphs, args = replaying(fused=False)
    model.layers[0].mlp.linear_fc2.weight.mul_(0.5)  # in place: the graph reads the edited weight
    assert torch.equal(graphs(*args), model(*args)) and graphs.captures == 1
    fuse_projections(model)  # new tensors and modules: fuse_projections bumps structure_version
    for _ in range(2):
        graphs(*args)
    assert torch.equal(graphs(*args), model(*args)) and graphs.captures == 2
    model.structure_version += 1  # what LoRA attach/detach does
    graphs(*args)
    assert graphs.graph_count == 0  # invalidated; this call was the new warm-up
    graphs(*args)
    assert graphs.captures == 3
    graphs.invalidate()
    assert graphs.graph_count == 0
    assert torch.equal(graphs(*args), model(*args))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@torch.inference_mode()
def test_a_dit_moved_away_and_back_recaptures_at_its_new_addresses():
    model, graphs, args = replaying()
    model.cpu()
    with pytest.raises(RuntimeError):  # the warm-up is the DiT's own forward: its own device error
        graphs(*args)
    assert graphs.graph_count == 0 and graphs.disabled_reason is None
    model.cuda()
    assert_calls_match_eager(graphs, model, args)  # warm-up, capture, replay
    assert graphs.captures == 2 and graphs.replays == 2 and graphs.disabled_reason is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@torch.inference_mode()
def test_weights_copied_in_replay_and_weights_assigned_recapture():
    model, graphs, args = replaying()
    state = {key: value * 0.9 if value.is_floating_point() else value for key, value in model.state_dict().items()}
    model.load_state_dict(state)  # copied into the captured tensors
    assert torch.equal(graphs(*args), model(*args)) and graphs.captures == 1
    model.load_state_dict({key: value.clone() * 0.9 for key, value in state.items()}, assign=True)  # new tensors
    assert_calls_match_eager(graphs, model, args)
    assert graphs.captures == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@torch.inference_mode()
def test_released_graphs_give_their_memory_back_and_recapture_without_a_warm_up():
    model, graphs, args = replaying(batch=2)
    want = model(*args)
    graphs.release_graphs()
    assert graphs.graph_count == 0
    model._rope_cache.clear()  # evicted tables are rebuilt before the capture, not inside it
    assert torch.equal(graphs(*args), want)
    assert graphs.captures == 2 and graphs.graph_count == 1 and graphs.disabled_reason is None


def assert_runs_eagerly_with_one_warning(model: ErnieDiT, runner, reason: str, caplog) -> DiTGraphs:
    """Four calls through DiTGraphs with `runner` as the block runner: each equals the eager forward, the wrapper
    went eager for `reason` and said so in one warning."""
    model.block_runner = runner
    graphs = DiTGraphs(model)
    args = step_inputs("cuda", torch.bfloat16, 1)
    with caplog.at_level(logging.WARNING, logger="ernie_image.runtime.model.dit_graphs"):
        outputs = [graphs(*args) for _ in range(4)]
    assert graphs.disabled_reason and reason in graphs.disabled_reason
    assert len([r for r in caplog.records if reason in r.getMessage()]) == 1
    want = model(*args)
    assert all(torch.equal(out, want) for out in outputs)
    return graphs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@torch.inference_mode()
def test_a_forward_that_syncs_with_the_host_is_never_captured_and_runs_eagerly_with_one_warning(caplog):
    """Found in the warm-up, before any capture: under cudaMallocAsync (ComfyUI's allocator) a capture that a host
    sync invalidates aborts the process."""
    model = tiny_dit("cuda", torch.bfloat16)

    def syncing_runner(index, block, x, ctx):
        if float(x.float().abs().max()) < 0:  # a host sync: not allowed while a graph is being captured
            raise AssertionError("unreachable")
        return block(x, ctx)

    graphs = assert_runs_eagerly_with_one_warning(model, syncing_runner, "synchronizes with the host", caplog)
    assert graphs.captures == 0
    assert torch.cuda.get_sync_debug_mode() == 0  # the check's mode is not left on for the host application


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_allocator_backend() != "native",
                    reason="a capture invalidated inside the forward aborts the process under cudaMallocAsync: "
                           "the warm-up's sync check keeps the pack's forward from reaching one")
@torch.inference_mode()
def test_a_capture_that_fails_falls_back_to_eager_with_one_warning_and_leaves_random_numbers_usable(caplog):
    model = tiny_dit("cuda", torch.bfloat16)

    def capture_breaking_runner(index, block, x, ctx):
        if torch.cuda.is_current_stream_capturing():
            torch.cuda.current_stream().query()  # not a sync, but illegal while capturing: invalidates it
        return block(x, ctx)

    graphs = assert_runs_eagerly_with_one_warning(model, capture_breaking_runner, "capture failed", caplog)
    assert graphs.disabled_reason.startswith("CUDA-graph capture failed")
    # the failed capture left the device's random numbers usable (for this process and the host application)
    assert torch.randn(4, device="cuda").isfinite().all()
    assert torch.compile(lambda t: t * 2)(torch.ones(2, device="cuda")).sum().item() == 4.0


@torch.inference_mode()
def test_a_streaming_block_runner_is_left_to_the_dit():
    from ernie_image.runtime.offload.placement import DiTPlacement
    from ernie_image.runtime.offload.planner import DiTPlan

    model = tiny_dit("cpu", torch.float32, fused=False)
    graphs = DiTGraphs(model)
    placement = DiTPlacement(model, DiTPlan(3, (0,), (1, 2), 2, 0, 0, 0), torch.device("cpu"), fake_mode="lazy")
    try:
        assert graphs.eager_reason() == "blocks are streamed"
    finally:
        placement.release()
    resident = tiny_dit("cpu", torch.float32, fused=False)
    placement = DiTPlacement(resident, DiTPlan(3, (0, 1, 2), (), 0, 0, 0, 0), torch.device("cpu"))
    try:
        assert DiTGraphs(resident).eager_reason() is None  # resident placement: graphs would serve it on a GPU
    finally:
        placement.release()


# -- both allocator backends, fresh processes ----------------------------------------------------------------
REPO_ROOT = Path(__file__).resolve().parent.parent
_SCRIPT = f"""
import importlib.util, sys
spec = importlib.util.spec_from_file_location("ernie_image", {str(REPO_ROOT / "__init__.py")!r},
                                              submodule_search_locations=[{str(REPO_ROOT)!r}])
module = importlib.util.module_from_spec(spec); sys.modules["ernie_image"] = module; spec.loader.exec_module(module)
sys.path.insert(0, {str(REPO_ROOT / "tests")!r})
import torch
assert torch.cuda.get_allocator_backend() == sys.argv[1], torch.cuda.get_allocator_backend()
from test_dit_graphs import tiny_dit, step_inputs
from ernie_image.runtime.model.dit_graphs import DiTGraphs
from ernie_image.runtime.model.graph_memory import graph_memory_reserved
from ernie_image.runtime.core.errors import Cancelled
with torch.inference_mode():
    model = tiny_dit("cuda", torch.bfloat16)
    graphs = DiTGraphs(model, max_graphs=1)
    short, long = step_inputs("cuda", torch.bfloat16, 2, 4), step_inputs("cuda", torch.bfloat16, 2, 9)
    for args in (short, short, short, long, long, short):  # capture, replay, evict, capture again
        assert torch.equal(graphs(*args), model(*args))
    # A cancel raised inside a capture: no graph allocation may outlive the capture unlaunched.
    calls = []
    def cancelling_runner(index, block, x, ctx):
        calls.append(index)
        if len(calls) == 5:  # the warm-up runs blocks 1-3; this is the capture's second block
            raise Cancelled("cancelled")
        return block(x, ctx)
    model.block_runner = cancelling_runner
    graphs(*short)  # a new block runner: a new structure key, this call warms up again
    try:
        graphs(*short)
    except Cancelled:
        pass
    else:
        raise AssertionError("the cancel was swallowed")
    assert graphs.disabled_reason is None and graphs.graph_count == 0
    for _ in range(3):
        assert torch.equal(graphs(*short), model(*short))
    assert graphs.graph_count == 1
    # Released graphs leave no memory reserved for graphs (cudaMallocAsync keeps it until trimmed), and capture again.
    if sys.argv[1] == "cudaMallocAsync":  # captures allocate from the driver's graph memory there
        assert graph_memory_reserved(torch.device("cuda")) > 0
    graphs.release_graphs()
    assert graph_memory_reserved(torch.device("cuda")) == 0, graph_memory_reserved(torch.device("cuda"))
    for _ in range(3):
        assert torch.equal(graphs(*short), model(*short))
    del graphs
    torch.cuda.synchronize()
print("survived")
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", ["native", "cudaMallocAsync"])
def test_capture_replay_eviction_and_cancel_under_each_allocator_backend(backend):
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF=f"backend:{backend}", PYTHONUNBUFFERED="1")
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(_SCRIPT), backend], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0 and "survived" in done.stdout, done.stdout[-2000:] + done.stderr[-4000:]
