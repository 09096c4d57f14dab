"""Keyed CUDA graphs of a DiT's runs, with the one lifecycle the DiT forward's graphs (dit_graphs.DiTGraphs) and the
step cache's block runs (step_cache/graphs.py) share.

A run is a function of static tensor inputs (`compute(*inputs)`) under a key naming its signature. The first call
of a key runs eagerly on the capture stream as a warm-up (cuBLAS and attention plans exist before any capture) with
host syncs raising, the second captures one CUDA graph and replays it, later ones copy their inputs into the graph's
static inputs and replay. Every output is cloned (the next replay, or another graph of the shared pool, overwrites
it). All graphs share one memory pool, since they run one after another, so each holds no more activation memory
than the largest run. At most `max_graphs` are kept (the least recently used is dropped).

A run that synchronizes with the host (found in the warm-up) or a capture that fails switches the cache to eager for
good, with one log line; out-of-memory and a cancel propagate. A change of the DiT's structure (`structure_key`)
drops every graph and warm-up: see dit_graphs.py for the contract.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

from .compile import blocks_compiled
from .cuda_capture import capture_stream, heal_generator_after_failed_capture, host_syncs_raise, is_host_sync_error
from .graph_memory import give_back_graph_memory

Compute = Callable[..., torch.Tensor]  # (*static inputs) -> output


@dataclass
class Captured:
    graph: "torch.cuda.CUDAGraph"
    inputs: tuple[torch.Tensor, ...]  # the static inputs a replay copies the call's inputs into, in order
    output: Optional[torch.Tensor]
    keep: list[Any] = field(default_factory=list)  # what else the replay reads (RoPE tables, masks)


def structure_key(dit: nn.Module) -> tuple:
    """What a graph depends on besides its inputs (those are in each graph's key): which tensors and modules the
    forward reads, as `dit.structure_version` counts their changes, and the block runner driving the blocks."""
    return (dit.structure_version, getattr(dit, "block_runner", None))


def replay_refusal(dit: nn.Module, x: Optional[torch.Tensor]) -> Optional[str]:
    """Why `dit`'s runs on `x` (an input; None: not known yet) are left to its own eager code, or None."""
    if x is not None and x.device.type != "cuda":
        return "not on a CUDA device"
    if torch.is_grad_enabled():
        return "gradients are enabled"
    if blocks_compiled(dit):
        return "the blocks are compiled"
    owner = getattr(getattr(dit, "block_runner", None), "__self__", None)
    if getattr(owner, "streamer", None) is not None:
        return "blocks are streamed"
    return None


class GraphCache:
    """The lifecycle (module docstring). A subclass has `dit` and calls `replay` for each run; `what` names one run
    in the log ("the DiT forward"), `log` is the subclass module's logger."""

    dit: nn.Module

    def __init__(self, max_graphs: int, what: str, log: logging.Logger) -> None:
        if max_graphs < 1:
            raise ValueError("max_graphs must be at least 1")
        self.max_graphs = max_graphs
        self.what = what
        self.log = log
        self.disabled_reason: Optional[str] = None
        self.captures = 0
        self.replays = 0
        self._graphs: OrderedDict[tuple, Captured] = OrderedDict()
        self._warmed: set[tuple] = set()
        self._pool: Optional[tuple] = None
        self._structure: Optional[tuple] = None  # the structure_key the graphs and warm-ups were made for
        self.makes_graphs = True  # False: graphs made are replayed, a signature without one runs eagerly

    def eager_reason(self, x: Optional[torch.Tensor] = None) -> Optional[str]:
        """Why calls run eagerly now (None: they are replayed); `x`: the call's input, if known."""
        return self.disabled_reason or replay_refusal(self.dit, x)

    def replay(self, key: tuple, compute: Compute, inputs: Sequence[torch.Tensor],
               prepare: Callable[[], None] = lambda: None, keep: Callable[[], list] = list) -> torch.Tensor:
        """`compute(*inputs)`, warmed up, captured or replayed as the key's history says. `prepare`: what must
        exist before a warm-up or capture (built with blocking copies, which neither allows); `keep`: what the
        graph reads besides its inputs, kept with it."""
        captured = self._graphs.get(key)
        if captured is not None:
            self._graphs.move_to_end(key)
            for static, value in zip(captured.inputs, inputs):
                static.copy_(value)
            captured.graph.replay()
            self.replays += 1
            return captured.output.clone()  # the next replay overwrites the static output
        if not self.makes_graphs:
            return compute(*inputs)
        prepare()
        if key not in self._warmed:
            output = self._warm_up(compute, inputs)  # a run that fails is never captured
            if len(self._warmed) > 4 * self.max_graphs:
                self._warmed.clear()
            self._warmed.add(key)
            return output
        captured = self._capture(key, compute, inputs, keep)
        if captured is None:
            return compute(*inputs)
        return captured.output.clone()  # the capture's own replay computed it

    # -- lifetime ----------------------------------------------------------------------------------------
    def follow_structure(self) -> bool:
        """Drop every graph and warm-up when the DiT's structure_key differs from the one they were made for;
        True when it did (the first call, which has nothing to compare with, included)."""
        current = structure_key(self.dit)
        if current == self._structure:
            return False
        self.invalidate()
        self._structure = current
        return True

    def invalidate(self) -> None:
        """Drop every graph and its memory (call after changing which tensors or modules the DiT uses)."""
        self.release_graphs()
        self._warmed.clear()
        self._structure = None

    def release_graphs(self) -> None:
        """Give the graphs' memory back but remember which signatures were warmed up: the next call for one of them
        captures again at once (LocalPipe does this after each sampling run under a VRAM plan, whose later phases
        count on the DiT's activation memory being free)."""
        devices = {captured.output.device for captured in self._graphs.values() if captured.output is not None}
        while self._graphs:
            _, captured = self._graphs.popitem(last=False)
            _drop(captured)
        self._pool = None
        for device in devices:
            give_back_graph_memory(device)

    @property
    def graph_count(self) -> int:
        return len(self._graphs)

    # -- internals ---------------------------------------------------------------------------------------
    def _warm_up(self, compute: Compute, inputs: Sequence[torch.Tensor]) -> torch.Tensor:
        """The eager run on the capture stream, so its cuBLAS workspace and plans exist before capture, with host
        syncs raising: a run that waits for the host is never captured (see `host_syncs_raise`)."""
        current = torch.cuda.current_stream(inputs[0].device)
        side = capture_stream(inputs[0].device)
        side.wait_stream(current)
        output: Optional[torch.Tensor] = None
        try:
            with torch.cuda.stream(side), host_syncs_raise():
                output = compute(*inputs)
        except RuntimeError as error:
            if not is_host_sync_error(error):
                raise
            self.disabled_reason = f"{self.what} synchronizes with the host, which a CUDA graph cannot hold"
            self.log.warning("%s (%s); running eagerly from now on", self.disabled_reason,
                             str(error).strip().splitlines()[0][:160])
        finally:  # a run that raised (a cancel, weights on another device) leaves nothing unordered either
            current.wait_stream(side)
        if output is None:
            self.invalidate()
            return compute(*inputs)
        output.record_stream(current)  # the caller frees it on the current stream
        return output

    def _capture(self, key: tuple, compute: Compute, inputs: Sequence[torch.Tensor], keep: Callable[[], list]
                 ) -> Optional[Captured]:
        device = inputs[0].device
        static = tuple(value.clone() for value in inputs)
        current = torch.cuda.current_stream(device)
        side = capture_stream(device)
        side.wait_stream(current)
        graph = torch.cuda.CUDAGraph()
        pool = self._pool if torch.cuda.get_allocator_backend() == "native" else None
        failure: Optional[str] = None  # why the capture failed: this cache goes eager
        pending: Optional[BaseException] = None  # raised again once the capture is closed (cancel, out of memory)
        output: Optional[torch.Tensor] = None
        try:
            # thread_local: only this thread is barred from unsafe CUDA calls while it captures, not the host's others
            with torch.cuda.graph(graph, pool=pool, stream=side, capture_error_mode="thread_local"):
                try:
                    output = compute(*static)
                except BaseException as error:
                    # Keep no traceback: its tensors are graph allocations and must be freed while the capture is
                    # still open (freed after it, never launched, they abort the process under cudaMallocAsync).
                    if isinstance(error, RuntimeError) and not isinstance(error, torch.cuda.OutOfMemoryError):
                        failure = str(error)
                    else:
                        pending = error.with_traceback(None)
        except RuntimeError as error:  # ending a capture that an unsafe call invalidated
            if failure is None and pending is None and isinstance(error, torch.cuda.OutOfMemoryError):
                raise
            failure = failure or str(error)
        if pending is not None:
            raise pending
        if failure is not None:
            heal_generator_after_failed_capture(device)
            self.disabled_reason = f"CUDA-graph capture failed ({failure.strip().splitlines()[0][:160]})"
            self.log.warning("%s for %s; running eagerly from now on", self.disabled_reason, self.what)
            self.invalidate()
            return None
        # Under cudaMallocAsync the output is a graph allocation that exists only once the graph has launched, and
        # freeing it before that aborts the process: launch now (this call's result), before anything can fail.
        graph.replay()
        if pool is None and torch.cuda.get_allocator_backend() == "native":
            self._pool = graph.pool()
        captured = Captured(graph, static, output, keep=keep())
        self._graphs[key] = captured
        self.captures += 1
        while len(self._graphs) > self.max_graphs:
            _, oldest = self._graphs.popitem(last=False)
            _drop(oldest)
        return captured


def _drop(captured: Captured) -> None:
    # The output goes first, while the graph that allocated it still exists.
    captured.output = None
    captured.keep.clear()
