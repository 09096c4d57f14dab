"""The DiT's blocks compiled on a thread beside uncompiled calls, then switched to (model/background_compile.py).

On the CPU the compile is torch.compile's own (dynamo tracing a twin block on the thread) with a backend that the
test controls: "eager", or one that waits for the test's word or fails. The GPU test runs Inductor in a pipe.
"""
from __future__ import annotations

import dataclasses
import gc
import threading
import weakref
from typing import Optional

import pytest
import torch

from ernie_image.runtime.core.errors import Cancelled
from ernie_image.runtime.core.host import NullHost
from ernie_image.runtime.model.background_compile import GRAPH_CALLS, BlockCompile, CompilingForward, twin_of
from ernie_image.runtime.model.compile import blocks_compiled
from reference_models import random_dit


def step_inputs(batch: int = 2, text_len: int = 7):
    generator = torch.Generator().manual_seed(batch * 10 + text_len)
    latents = torch.randn(batch, 128, 8, 6, generator=generator)
    text = torch.randn(batch, text_len, 96, generator=generator)
    return latents, torch.full((batch,), 640.0), text, [text_len] * batch


def tensors_of(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: t for name, t in (*module.named_parameters(), *module.named_buffers())}


class GatedBackend:
    """A torch.compile backend that holds the compile until the test says go (or fails it), and counts its graphs."""

    def __init__(self, fail: Optional[str] = None) -> None:
        self.go = threading.Event()
        self.entered = threading.Event()
        self.fail = fail
        self.graphs = 0

    def __call__(self, graph_module, example_inputs):
        self.entered.set()
        self.go.wait()
        if self.fail:
            raise RuntimeError(self.fail)
        self.graphs += 1
        return graph_module.forward


def eager_blocks(dit) -> None:
    for block in dit.layers:
        block.compile(backend="eager")


class Recorder:
    def __init__(self) -> None:
        self.said: list[str] = []
        self.compiled: list[Optional[float]] = []
        self.in_place: list[object] = []

    def forward(self, dit, backend, uncompiled=None) -> CompilingForward:
        def in_place(model) -> None:
            self.in_place.append(model)
            eager_blocks(model)

        return CompilingForward(dit, uncompiled or dit, self.said.append, self.compiled.append, backend, in_place)


def start(forward: CompilingForward, inputs) -> None:
    """A signature's calls up to the one that hands it to the compile (the ones before make its CUDA graph)."""
    for _ in range(GRAPH_CALLS + 1):
        forward(*inputs)
    assert forward.block_compile is not None


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_a_twin_shares_every_tensor_and_none_of_the_modules():
    dit = random_dit("cpu", torch.float32)
    block = dit.layers[0]
    twin = twin_of(block)
    ours, its = tensors_of(block), tensors_of(twin)
    assert ours.keys() == its.keys() and all(its[name] is ours[name] for name in ours)
    assert not {id(m) for m in block.modules()} & {id(m) for m in twin.modules()}
    block.mlp.linear_fc2 = torch.nn.Identity()  # a LoRA wrapper put in: the traced structure is the twin's own
    assert isinstance(twin.mlp.linear_fc2, torch.nn.Linear)


def test_a_twin_that_would_copy_a_weight_is_refused_and_the_compile_says_so():
    dit = random_dit("cpu", torch.float32)
    block = dit.layers[0]
    block.mlp.tables = [torch.ones(3)]  # a tensor inside a list: deepcopy would copy it
    with pytest.raises(RuntimeError, match=r"a twin of Block would copy a tensor of shape \(3,\)"):
        twin_of(block)
    compile = BlockCompile(block, "eager")
    compile.add(torch.ones(1), None)
    assert compile.idle.is_set() and "would copy a tensor" in compile.error and compile.join(0)


@pytest.mark.usefixtures("one_thread")  # twice seen in full runs beside other CPU work: one compiled output differed
@torch.inference_mode()
def test_calls_run_uncompiled_until_the_compile_is_done_then_switch_between_two_calls():
    dit = random_dit("cpu", torch.float32)
    plain = dit.with_arithmetic("plain")  # the expressions compiled blocks trace
    inputs = step_inputs()
    uncompiled_out, compiled_out = dit(*inputs), plain(*inputs)
    backend, record = GatedBackend(), Recorder()
    forward = record.forward(dit, backend)

    for _ in range(3):  # the third call hands the signature to the compile; every one runs uncompiled
        assert torch.equal(forward(*inputs), uncompiled_out)
    assert backend.entered.wait(30)  # the thread is tracing the twin (dynamo has handed it the graph)
    assert torch.equal(forward(*inputs), uncompiled_out) and not blocks_compiled(dit)
    backend.go.set()
    assert forward.block_compile.idle.wait(30) and forward.block_compile.error is None
    assert record.in_place == [] and record.compiled == []  # the switch waits for the next call
    assert torch.equal(forward(*inputs), compiled_out)
    assert record.in_place == [dit] and blocks_compiled(dit) and len(record.compiled) == 1 and record.compiled[0] > 0
    assert backend.graphs >= 1 and record.said == []
    assert torch.equal(forward(*inputs), compiled_out) and record.in_place == [dit]  # switched once


@torch.inference_mode()
def test_the_compile_lets_go_of_each_calls_tokens_once_compiled_and_of_the_twin_when_closed():
    dit = random_dit("cpu", torch.float32)
    x, ctx, _ = dit.prepare(*step_inputs())
    compile = BlockCompile(dit.layers[0], "eager")
    twin, tokens = weakref.ref(compile._twin), weakref.ref(x)
    compile.add(x, ctx)
    del x
    assert compile.idle.wait(60) and compile.error is None
    gc.collect()
    assert tokens() is None and twin() is not None  # the thread waits for more calls
    compile.close()
    assert compile.join(60)
    gc.collect()
    assert twin() is None


@torch.inference_mode()
def test_each_input_signature_is_compiled_before_the_switch():
    """CFG's two branches with texts of two lengths are two calls a step: both are compiled beside the run (the
    second as the dynamic-shape graph dynamo makes for it) before the blocks switch."""
    dit = random_dit("cpu", torch.float32)
    backend, record = GatedBackend(), Recorder()
    forward = record.forward(dit, backend)
    short, long = step_inputs(batch=1, text_len=5), step_inputs(batch=1, text_len=9)
    start(forward, short)
    forward(*long)  # a new signature while the compile runs: handed to it at once
    backend.go.set()
    assert forward.block_compile.idle.wait(60) and forward.block_compile.error is None
    assert backend.graphs == 2
    forward(*short)
    assert forward.switched and record.in_place == [dit]


@torch.inference_mode()
def test_a_failed_compile_is_said_in_one_line_and_the_blocks_compile_in_the_foreground():
    dit = random_dit("cpu", torch.float32)
    backend, record = GatedBackend(fail="out of memory beside the run\nsecond line"), Recorder()
    forward = record.forward(dit, backend)
    inputs = step_inputs()
    start(forward, inputs)
    backend.go.set()
    assert forward.block_compile.idle.wait(30)
    forward(*inputs)
    assert record.compiled == [None] and record.in_place == [dit]
    assert len(record.said) == 1 and "\n" not in record.said[0]
    assert record.said[0].startswith("the DiT's blocks could not compile in the background (")
    assert "out of memory beside the run" in record.said[0] and record.said[0].endswith(
        "they compile on their next call instead")


@torch.inference_mode()
def test_a_run_that_cannot_switch_between_calls_waits_for_the_compile_and_cancel_stops_the_wait():
    dit = random_dit("cpu", torch.float32)
    backend, record = GatedBackend(), Recorder()
    forward = record.forward(dit, backend)
    start(forward, step_inputs())
    assert backend.entered.wait(30)
    host = NullHost()
    host.cancel_requested = True
    with pytest.raises(Cancelled):
        forward.wait_and_switch(host.check_cancel, poll_s=0.01)
    assert not forward.switched and record.in_place == []
    waits = []

    def check_cancel() -> None:  # the wait polls: the compile is let go on the first poll
        waits.append(1)
        backend.go.set()

    forward.wait_and_switch(check_cancel, poll_s=0.01)
    assert forward.switched and record.in_place == [dit] and waits


@torch.inference_mode()
def test_an_abandoned_forward_never_switches_and_a_forward_never_started_compiles_in_the_foreground():
    dit = random_dit("cpu", torch.float32)
    backend, record = GatedBackend(), Recorder()
    forward = record.forward(dit, backend)
    inputs = step_inputs()
    expected = dit(*inputs)
    start(forward, inputs)
    forward.abandon()
    backend.go.set()
    assert forward.block_compile.join(30)  # abandoning ends the thread after its call
    assert torch.equal(forward(*inputs), expected) and record.in_place == [] and record.compiled == []

    unstarted = record.forward(random_dit("cpu", torch.float32), "eager")
    unstarted.wait_and_switch(NullHost().check_cancel)
    assert len(record.in_place) == 1 and record.compiled == [None]
    assert record.said[-1] == ("the DiT's blocks had not started compiling in the background: they compile on their "
                               "next call instead")


@torch.inference_mode()
def test_a_signature_is_handed_over_after_its_graph_is_made_and_no_graph_is_made_while_the_compile_runs():
    """An uncompiled call replayed as a CUDA graph leaves Python to the compile's thread; a graph's warm-up would make
    the compile's host syncs raise, so none is made meanwhile."""
    class Graphs:
        def __init__(self, dit) -> None:
            self.dit = dit
            self.makes_graphs = True
            self.made_while: list[bool] = []
            self.released = 0

        def __call__(self, *inputs):
            self.made_while.append(self.makes_graphs)
            return self.dit(*inputs)

        def release_graphs(self) -> None:
            self.released += 1

    dit = random_dit("cpu", torch.float32)
    graphs, backend = Graphs(dit), GatedBackend()
    forward = Recorder().forward(dit, backend, uncompiled=graphs)
    inputs = step_inputs()
    forward(*inputs)
    forward(*inputs)
    assert forward.block_compile is None and graphs.made_while == [True, True]  # warm-up, capture
    forward(*inputs)
    assert forward.block_compile is not None and graphs.made_while == [True, True, False] and graphs.released == 0
    other = step_inputs(text_len=3)
    forward(*other)  # a new signature while the compile runs: handed at once, run without a new graph
    assert graphs.made_while[-1] is False and len(forward._handed) == 2
    backend.go.set()
    assert forward.block_compile.idle.wait(60)
    forward(*inputs)
    assert forward.switched and graphs.makes_graphs and graphs.released == 1 and len(graphs.made_while) == 4


def test_a_pipe_compiles_beside_its_run_at_once_when_that_pays_and_runs_compiled_after_the_switch(
        tiny_turbo_folder, monkeypatch):
    """CPU: the compiler is made "available", the plan is taken to have room, and the thread compiles with dynamo's
    "eager" backend; the policy's pricing, the pipe's wiring and the switch are what run."""
    import functools

    from ernie_image.runtime.core.request import GenerationRequest
    from ernie_image.runtime.local import compile_policy, parts
    from ernie_image.runtime.local.options import LoadOptions
    from ernie_image.runtime.local.pipe import LocalPipe
    from ernie_image.runtime.core.step_cache_config import parse_step_cache

    foreground = []
    monkeypatch.setattr(parts, "compile_available", lambda device: True)
    monkeypatch.setattr(parts, "compile_blocks", lambda dit: foreground.append(dit) or True)
    monkeypatch.setattr(parts, "caches_hold", lambda weight_format, device: True)
    monkeypatch.setattr(parts.PipeParts, "compile_fits_beside_the_run", lambda self: True)
    monkeypatch.setattr(parts, "CompilingForward", functools.partial(CompilingForward, backend="eager",
                                                                     compile_in_place=eager_blocks))
    monkeypatch.setitem(compile_policy.COMPILE_SECONDS, "bf16", 1e9)  # in the foreground it would never pay
    monkeypatch.setitem(compile_policy.BACKGROUND_COMPILE_SECONDS, "bf16", 1e-9)  # beside the run it pays at once
    pipe = LocalPipe.load(tiny_turbo_folder, LoadOptions(device="cpu", previews=False))
    reference = LocalPipe.load(tiny_turbo_folder, LoadOptions(device="cpu", previews=False, compile=False))
    request = GenerationRequest(prompt="a fox", width=256, height=256, steps=GRAPH_CALLS + 2, seed=1)
    host = NullHost()

    first = pipe.generate(request, host)
    assert any(m.startswith("compiling the DiT's blocks in the background") for m in host.messages)
    compiling = pipe.parts.compiling  # None where the compile was done before the run's last call
    assert compiling is None or compiling.block_compile.idle.wait(120)
    second = pipe.generate(request, host)  # switched by now: before its first call at the latest
    assert pipe.parts.compiling is None and blocks_compiled(pipe.parts.dit) and foreground == []
    assert any(m.startswith("the DiT's blocks compiled in the background (") for m in host.messages)
    assert "compiled" in pipe.describe()
    expected = reference.generate(request, NullHost()).images[0]
    for result in (first, second):
        difference = (result.images[0].float() - expected.float()).abs().max()
        assert difference <= 2 / 255  # the compiled blocks compute the plain expressions: within a level or two

    cached = pipe.generate(dataclasses.replace(request, step_cache=parse_step_cache("dbcache")), host)
    assert cached.images[0].shape == expected.shape and foreground == []


def test_a_step_cache_run_lets_a_compile_in_flight_end_and_switches_before_it_starts(tiny_turbo_folder, monkeypatch):
    import functools

    from ernie_image.runtime.core.request import GenerationRequest
    from ernie_image.runtime.local import compile_policy, parts
    from ernie_image.runtime.local.options import LoadOptions
    from ernie_image.runtime.local.pipe import LocalPipe
    from ernie_image.runtime.core.step_cache_config import parse_step_cache

    backend = GatedBackend()
    monkeypatch.setattr(parts, "compile_available", lambda device: True)
    monkeypatch.setattr(parts, "caches_hold", lambda weight_format, device: True)
    monkeypatch.setattr(parts.PipeParts, "compile_fits_beside_the_run", lambda self: True)
    monkeypatch.setattr(parts, "CompilingForward", functools.partial(CompilingForward, backend=backend,
                                                                     compile_in_place=eager_blocks))
    monkeypatch.setitem(compile_policy.BACKGROUND_COMPILE_SECONDS, "bf16", 1e-9)
    pipe = LocalPipe.load(tiny_turbo_folder, LoadOptions(device="cpu", previews=False))
    request = GenerationRequest(prompt="a fox", width=256, height=256, steps=GRAPH_CALLS + 2, seed=1)
    pipe.generate(request, NullHost())
    assert backend.entered.wait(60) and not backend.go.is_set()

    class LetGo(NullHost):
        def check_cancel(self) -> None:  # the wait polls cancel: let the compile finish from there
            backend.go.set()
            super().check_cancel()

    host = LetGo()
    pipe.generate(dataclasses.replace(request, step_cache=parse_step_cache("dbcache")), host)
    assert pipe.parts.compiling is None and blocks_compiled(pipe.parts.dit)
    assert "waiting for the DiT's blocks to finish compiling in the background: a step-cache run cannot switch to " \
           "them between its calls" in host.messages


@torch.inference_mode()
def test_a_closed_compile_lets_go_of_the_calls_queued_behind_the_one_it_is_in():
    dit = random_dit("cpu", torch.float32)
    backend = GatedBackend()
    compile = BlockCompile(dit.layers[0], backend)
    for text_len in (5, 9):
        x, ctx, _ = dit.prepare(*step_inputs(batch=1, text_len=text_len))
        compile.add(x, ctx)
    assert backend.entered.wait(30)
    compile.close()
    backend.go.set()
    assert compile.join(60) and compile.idle.is_set() and compile.error is None
    assert backend.graphs == 1  # the second signature was never traced


def test_a_compile_whose_thread_cannot_start_says_why_and_is_idle(monkeypatch):
    dit = random_dit("cpu", torch.float32)
    compile = BlockCompile(dit.layers[0], "eager")

    def refuse() -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(compile._thread, "start", refuse)
    compile.add(torch.ones(1), None)
    assert compile.idle.is_set() and compile.error == "RuntimeError: can't start new thread"


@torch.inference_mode()
def test_a_forward_whose_blocks_changed_structure_since_the_twin_was_made_is_outdated():
    """A LoRA put in or taken out while the compile runs: the graph being compiled is not the one the blocks run.
    A change that leaves the structure (a LoRA's strength set again in place, which counts as a structure version
    for CUDA graphs) keeps the compile."""
    from ernie_image.runtime.lora.attach import LoraLinear

    dit = random_dit("cpu", torch.float32)
    backend = GatedBackend()
    forward = Recorder().forward(dit, backend)
    assert not forward.outdated()  # nothing compiling yet
    start(forward, step_inputs())
    dit.structure_version += 1
    assert not forward.outdated()
    down = dit.layers[0].mlp.linear_fc2
    dit.layers[0].mlp.linear_fc2 = LoraLinear(down, 1, down.out_features, down.in_features)
    assert forward.outdated()
    forward.abandon()
    backend.go.set()
    assert forward.block_compile.join(30)


def _pipe_compiling_beside(tiny_turbo_folder, monkeypatch, backend):
    import functools

    from ernie_image.runtime.local import compile_policy, parts
    from ernie_image.runtime.local.options import LoadOptions
    from ernie_image.runtime.local.pipe import LocalPipe

    monkeypatch.setattr(parts, "compile_available", lambda device: True)
    monkeypatch.setattr(parts, "caches_hold", lambda weight_format, device: True)
    monkeypatch.setattr(parts.PipeParts, "compile_fits_beside_the_run",  # as on a GPU with room: while no LoRA
                        lambda self: not getattr(self.dit, "lora_signature", ()))
    monkeypatch.setattr(parts, "compile_blocks", lambda dit: eager_blocks(dit) or True)
    monkeypatch.setattr(parts, "CompilingForward", functools.partial(CompilingForward, backend=backend,
                                                                     compile_in_place=eager_blocks))
    monkeypatch.setitem(compile_policy.BACKGROUND_COMPILE_SECONDS, "bf16", 1e-9)
    return LocalPipe.load(tiny_turbo_folder, LoadOptions(device="cpu", previews=False, lora_mode="branch"))


def _lora(tiny_turbo_folder, tmp_path):
    import lora_files as lf

    shapes = lf.linear_shapes(lf.dit_weights(tiny_turbo_folder))
    return lf.write_down_up(tmp_path / "lora.safetensors", lf.random_lora(shapes, 4, seed=3), 4.0, lf.kohya_name)


def test_a_pipe_lets_a_compile_go_when_a_lora_changes_its_blocks_and_decides_again_once_its_thread_ends(
        tiny_turbo_folder, tmp_path, monkeypatch):
    """The next job's LoRAs are put in first; the compile made for the blocks without them is let go. While its
    thread still traces (it holds dynamo's lock), no compile is decided, and no speed is learnt from calls it
    slowed; the job after it decides again, and a DiT carrying a LoRA compiles before its calls, the LoRA put on
    every block in the one structure compiled blocks share."""
    from ernie_image.runtime.core.request import GenerationRequest
    from ernie_image.runtime.local import compile_policy
    from ernie_image.runtime.lora.attach import LoraLinear

    backend = GatedBackend()
    pipe = _pipe_compiling_beside(tiny_turbo_folder, monkeypatch, backend)
    request = GenerationRequest(prompt="a fox", width=256, height=256, steps=GRAPH_CALLS + 2, seed=1)
    pipe.generate(request, NullHost())
    compiling = pipe.parts.compiling
    assert compiling is not None and backend.entered.wait(60)
    learnt = pipe.parts.compile_policy.row_token_s
    host = NullHost()
    with_lora = pipe.with_loras([(_lora(tiny_turbo_folder, tmp_path), 0.8)])
    with_lora.generate(request, host)
    assert compiling.abandoned and not compiling.switched and not blocks_compiled(pipe.parts.dit)
    assert "the DiT's LoRAs changed while its blocks compiled in the background: that compile is let go" in \
        host.messages
    assert pipe.parts.compiling is None and pipe.parts.compile_let_go is compiling.block_compile
    assert pipe.parts.compile_policy.row_token_s == learnt
    backend.go.set()
    assert compiling.block_compile.join(60)
    monkeypatch.setitem(compile_policy.COMPILE_SECONDS, "bf16", 0.0)  # compiling first pays from here on
    host = NullHost()
    with_lora.generate(request, host)
    assert any(m.startswith("compiling the DiT's blocks: uncompiled runs have cost") for m in host.messages)
    assert pipe.parts.compiling is None and blocks_compiled(pipe.parts.dit)
    assert all(isinstance(block.mlp.linear_fc2, LoraLinear) for block in pipe.parts.dit.layers)


def test_a_background_compile_wanted_is_forgotten_when_the_parts_are_dropped_or_the_policy_decides_again(
        tiny_turbo_folder):
    from ernie_image.runtime.local.compile_policy import DitWork
    from ernie_image.runtime.local.options import LoadOptions
    from ernie_image.runtime.local.pipe import LocalPipe

    pipe = LocalPipe.load(tiny_turbo_folder, LoadOptions(device="cpu", previews=False))
    pipe.parts.compile_wanted_in_background = True
    pipe.parts.drop()
    assert not pipe.parts.compile_wanted_in_background
    pipe.parts.compile_wanted_in_background = True
    pipe.parts.compile_if_it_pays(DitWork(calls=1, rows=1, tokens=1), NullHost())  # no compiler on the CPU
    assert not pipe.parts.compile_wanted_in_background


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("quant", ["none", "fp8"])
def test_on_the_gpu_inductor_compiles_beside_the_run_and_the_switch_compiles_nothing_more(tiny_turbo_folder, quant,
                                                                                          monkeypatch):
    """Inductor on a thread beside real uncompiled CUDA calls, under the allocator the suite runs with: the switch
    finds every block's graph in the caches the twin filled (no new graph), and the images agree with uncompiled
    ones within the compiled form's tolerance."""
    from ernie_image.runtime.core.request import GenerationRequest
    from ernie_image.runtime.local import compile_policy
    from ernie_image.runtime.local.options import LoadOptions
    from ernie_image.runtime.local.pipe import LocalPipe
    from ernie_image.runtime.quant.gpu_support import cuda_capability
    from ernie_image.runtime.quant import fp8_kernel_call
    from small_dits import compiled_graphs

    if quant == "fp8" and cuda_capability(torch.device("cuda")) < (8, 9):
        pytest.skip("FP8 GEMMs need SM 8.9 or newer")
    for seconds in (compile_policy.BACKGROUND_COMPILE_SECONDS, compile_policy.COLD_BACKGROUND_COMPILE_SECONDS):
        monkeypatch.setitem(seconds, "bf16", 1e-9)  # a tiny job's calls outlast it, whatever the caches hold
        monkeypatch.setitem(seconds, "fp8", 1e-9)
    request = GenerationRequest(prompt="a fox", width=512, height=512, steps=6, cfg=4.0, seed=2)
    reference = LocalPipe.load(tiny_turbo_folder, LoadOptions(device="cuda", quant=quant, compile=False))
    try:
        expected = reference.generate(request, NullHost()).images[0]
    finally:
        reference.release()
    pipe = LocalPipe.load(tiny_turbo_folder, LoadOptions(device="cuda", quant=quant, previews=False))
    host = NullHost()
    try:
        first = pipe.generate(request, host)
        policy, plan = pipe.parts.compile_policy, pipe.memory.plan
        why = (host.messages, pipe.parts.compile_fits_beside_the_run(), policy.spent_s, policy.background_s,
               plan and (plan.budget, plan.phase_peaks, plan.dit.workspace, plan.dit.streamed))
        assert any(m.startswith("compiling the DiT's blocks in the background") for m in host.messages), why
        assert pipe.parts.compiling is not None  # a tiny model's calls end long before Inductor does
        assert pipe.parts.compiling.block_compile.idle.wait(300)
        graphs = compiled_graphs()
        second = pipe.generate(request, host)
        assert blocks_compiled(pipe.parts.dit) and pipe.parts.compiling is None
        assert not [m for m in host.messages if "could not compile" in m], host.messages
        assert any(m.startswith("the DiT's blocks compiled in the background (") for m in host.messages)
        assert compiled_graphs() == graphs, host.messages  # the real blocks' first compiled calls were cache lookups
        assert "cuda" not in fp8_kernel_call._failed  # the FP8 activation kernels ran in the compile's thread too
        for result in (first, second):
            assert (result.images[0].float() - expected.float()).abs().mean().item() < 0.02
    finally:
        pipe.release()
