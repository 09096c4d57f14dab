"""A Loader's pipe in ComfyUI's node cache: sized by its host memory, and freed with its slabs when evicted.

Current ComfyUI keeps node outputs in a RAMPressureCache (comfy_execution/caching.py). Under RAM pressure
`ram_release` walks every cached output: lists, tuples and mappings are walked into, a CPU torch.Tensor counts
its untyped storage's bytes once per storage, an object with `_comfy_cache_tensors()` is sized by walking what
that returns, and anything else counts as nothing. Eviction is `del cache[key]`, with no garbage collection
after it. `ram_usage` below follows that code; the entry is the Loader's outputs as ComfyUI stores them
(one list per output socket).
"""
from __future__ import annotations

import types
import weakref
from collections.abc import Mapping
from typing import Any

import pytest
import torch

from ernie_image.runtime.core.host import NullHost
from ernie_image.runtime.core.request import GenerationRequest
from ernie_image.runtime.demo.tiny import build_tiny_model
from ernie_image.runtime.local.options import LoadOptions
from ernie_image.runtime.local.pipe import LocalPipe
from ernie_image.runtime.offload import pinned
from test_offload_pipe import SIZES, streaming_budget_gb

REQUEST = GenerationRequest(prompt="a red fox", width=256, height=256, steps=2, cfg=1.0, seed=5)


def ram_usage(outputs: Any) -> int:
    """Bytes RAMPressureCache.ram_release counts for a cache entry's outputs (its scan_list_for_ram_usage)."""
    seen: set[tuple[int, int]] = set()
    total = 0

    def scan(value: Any) -> None:
        nonlocal total
        if value is None:
            return
        values = value.values() if isinstance(value, Mapping) else value if isinstance(value, (list, tuple)) else (value,)
        for item in values:
            if isinstance(item, (list, tuple, Mapping)):
                scan(item)
            elif isinstance(item, torch.Tensor) and item.device.type == "cpu":
                storage = item.untyped_storage()
                key = (storage.data_ptr(), storage.nbytes())
                if key not in seen:
                    seen.add(key)
                    total += storage.nbytes()
            elif hasattr(item, "_comfy_cache_tensors"):
                scan(item._comfy_cache_tensors())

    scan(outputs)
    return total


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "turbo", variant="turbo", sizes=SIZES)


def loaded_streaming_pipe(model) -> LocalPipe:
    pipe = LocalPipe.load(model, LoadOptions(device="cpu", vram_budget_gb=streaming_budget_gb(model), keep_loaded=True))
    pipe.generate(REQUEST, NullHost())
    return pipe


def test_a_pipe_before_its_first_run_counts_as_nothing(model) -> None:
    pipe = LocalPipe.load(model, LoadOptions(device="cpu"))
    assert pipe._comfy_cache_tensors() == [] and ram_usage([[pipe], ["plan"]]) == 0


def test_the_cache_sees_the_slabs_and_host_weights_of_a_loaded_pipe(model) -> None:
    pipe = loaded_streaming_pipe(model)
    slabs = pipe.memory.host_slabs()
    assert slabs and all(s.device.type == "cpu" for s in slabs)  # the DiT's and the text tower's streamed layers
    slab_bytes = sum(s.untyped_storage().nbytes() for s in slabs)
    weights = [t for m in (pipe.parts.dit, pipe.parts.text_tower, pipe.parts.vae)
               for t in (*m.parameters(), *m.buffers()) if t.device.type == "cpu"]
    weight_storages = {(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in weights}
    slab_storages = {(s.untyped_storage().data_ptr(), s.untyped_storage().nbytes()) for s in slabs}
    expected = sum(n for _, n in weight_storages | slab_storages)
    sized = ram_usage([[pipe], [pipe.describe()]])
    assert sized == expected and sized >= slab_bytes > 0
    # A streamed layer's host weights are views of its slab: counted once, not twice.
    assert sized < slab_bytes + sum(t.untyped_storage().nbytes() for t in weights)


def test_evicting_the_cache_entry_frees_the_pipe_and_its_slabs_at_once(model) -> None:
    pipe = loaded_streaming_pipe(model)
    streamers = [p.streamer for p in (pipe.memory.dit, pipe.memory.text) if p is not None and p.streamer is not None]
    assert streamers and not any(s.closed for s in streamers)
    cache = {"loader": [[pipe], [pipe.describe()]]}
    gone = weakref.ref(pipe)
    del pipe
    del cache["loader"]  # what ram_release does; no gc.collect() follows it there
    assert gone() is None, "the pipe outlived its last reference (a reference cycle keeps it for a later GC)"
    assert all(s.closed and s.slab.data.numel() == 0 and s.slab.pinned_bytes == 0 for s in streamers)



def test_the_memory_route_counts_a_dropped_pipes_weights_until_they_are_gone(model) -> None:
    """/ernie_image/memory's weight_owners_alive: a tracked pipe's parts and memory, counted while anything holds
    them, so a "Free model and node cache" that leaves weights behind shows as a count above 0."""
    from ernie_image.nodes import live_pipes

    before = live_pipes.summary()
    pipe = live_pipes.track(loaded_streaming_pipe(model))
    assert live_pipes.summary()["weight_owners_alive"] == before["weight_owners_alive"] + 2
    keeper = {"kept_by_the_test": pipe.parts}  # something outside the pipe still holding its weights (and memory)
    del pipe
    after = live_pipes.summary(holders=True)
    assert after["live_pipes"] == before["live_pipes"]
    assert after["weight_owners_alive"] == before["weight_owners_alive"] + 2
    holders = after["orphaned_weights_held_by"]
    assert any(chain.startswith("PipeParts <- dict['kept_by_the_test']") for chain in holders), holders
    keeper["https://user:hunter2@example.invalid/v1"] = keeper.pop("kept_by_the_test")  # keys that are not names
    holders = live_pipes.summary(holders=True)["orphaned_weights_held_by"]
    assert any("dict of 1 keys" in chain for chain in holders) and not any("hunter2" in c for c in holders), holders
    del keeper
    assert live_pipes.summary()["weight_owners_alive"] == before["weight_owners_alive"]
    assert live_pipes.summary(holders=True)["orphaned_weights_held_by"] == []


def test_the_memory_route_names_a_thread_that_keeps_a_dropped_pipes_model(model) -> None:
    """A model a pipe built that outlives the pipe (here kept in a waiting thread's local variable, as a worker
    thread would) counts as an orphaned model; no referrer holds it, so the holders name the threads running and
    where, the one that keeps it among them."""
    import threading

    from ernie_image.nodes import live_pipes
    from ernie_image.nodes.heap_holders import UNSEEN_HOLDER

    before = live_pipes.summary()
    pipe = live_pipes.track(loaded_streaming_pipe(model))
    assert live_pipes.summary()["orphaned_models"] == before["orphaned_models"]  # its models are its own
    holding, done = threading.Event(), threading.Event()
    handed = [pipe.parts.dit]

    def keep() -> None:
        dit = handed.pop()  # noqa: F841 - held by this frame alone
        holding.set()
        done.wait(60)

    worker = threading.Thread(target=keep, name="kept-worker")
    worker.start()
    holding.wait(60)
    del pipe
    try:
        after = live_pipes.summary(holders=True)
        assert after["weight_owners_alive"] == before["weight_owners_alive"]  # parts and memory went with the pipe
        assert after["orphaned_models"] == before["orphaned_models"] + 1
        assert any(chain.startswith(f"ErnieDiT <- {UNSEEN_HOLDER}") and "kept-worker in frame " in chain
                   for chain in after["orphaned_weights_held_by"]), after["orphaned_weights_held_by"]
    finally:
        done.set()
        worker.join(60)
    assert live_pipes.summary()["orphaned_models"] == before["orphaned_models"]


class FakeCudart:
    """cudaHostRegister / cudaHostUnregister as CUDA answers them, recorded."""

    def __init__(self) -> None:
        self.registered: dict[int, int] = {}

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        self.registered[ptr] = size
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:
        assert ptr in self.registered, "unregistering memory that was never registered"
        del self.registered[ptr]
        return 0


def test_a_pinned_slab_dropped_without_free_is_unregistered(monkeypatch) -> None:
    cudart = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    slab = pinned.HostSlab(1 << 20, pin=True)
    assert slab.pinned_bytes == 1 << 20 and list(cudart.registered.values()) == [1 << 20]
    del slab
    assert cudart.registered == {}


def test_holder_walks_are_rationed_to_a_tenth_of_the_time(monkeypatch) -> None:
    """The heap walk holds the interpreter while it runs: asked in a loop, it walks again only once nine times its
    own duration has passed, answering the last walk (with its age) in between; a walk that fails starts its quiet
    time as well. (A clock the fake walks move: the rule, without wall-clock windows.)"""
    from ernie_image.nodes import heap_holders
    from ernie_image.nodes.heap_holders import HolderWalks

    clock = [100.0]
    monkeypatch.setattr(heap_holders, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    walked: list[float] = []

    def walk(seconds: float = 0.05, fails: bool = False):
        def run() -> list[str]:
            clock[0] += seconds
            walked.append(clock[0])
            if fails:
                raise RuntimeError("the walk failed")
            return [f"walk {len(walked)}"]
        return run

    walks = HolderWalks()
    assert walks.answer(walk())["orphaned_weights_held_by"] == ["walk 1"]  # ends at 100.05: quiet until 100.5
    clock[0] = 100.49
    later = walks.answer(walk())
    assert later == {"orphaned_weights_held_by": ["walk 1"], "holders_walked_s_ago": 0.44} and len(walked) == 1
    clock[0] = 100.5
    assert walks.answer(walk())["orphaned_weights_held_by"] == ["walk 2"]
    clock[0] = 200.0
    with pytest.raises(RuntimeError):
        walks.answer(walk(seconds=1.0, fails=True))  # ends at 201: quiet until 210
    clock[0] = 209.9
    assert walks.answer(walk())["orphaned_weights_held_by"] == ["walk 2"] and len(walked) == 3


def test_a_caller_during_a_walk_gets_the_last_answer_at_once() -> None:
    import threading

    from ernie_image.nodes.heap_holders import HolderWalks

    walks, inside, release = HolderWalks(), threading.Event(), threading.Event()
    walks.QUIET_FACTOR = 1e9  # after the slow walk, none for the rest of the test

    def slow() -> list[str]:
        inside.set()
        release.wait(30)
        return ["slow"]

    walker = threading.Thread(target=walks.answer, args=(slow,))
    walker.start()
    assert inside.wait(30)
    assert walks.answer(lambda: ["not walked"])["orphaned_weights_held_by"] == []  # the last answer, no wait
    release.set()
    walker.join(30)
    assert walks.answer(lambda: ["not walked"])["orphaned_weights_held_by"] == ["slow"]  # quiet after the walk
