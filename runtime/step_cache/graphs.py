"""Runs of consecutive DiT blocks replayed as CUDA graphs, for the step cache on the uncompiled resident DiT.

A cached step cannot be one graph (dit_graphs.DiTGraphs): whether the middle blocks run is decided on the host
between the first blocks and the rest. So the block runs a step is made of (the first blocks, the middle ones, the
last ones: session.py) are captured one by one, each keyed by its block indices and its inputs' signature, with
DiTGraphs' lifecycle: the first call of a key runs eagerly (a warm-up with host syncs raising), the second captures
and replays, later ones copy x and the modulation into the graph's static inputs and replay. The output is cloned
(another graph in the shared pool may reuse its memory), as DiTGraphs does. Prepare and finish (x_embedder,
modulation, final layer: ~20 kernels; the run's text is projected once, before its first step) and the cache's own
arithmetic run eagerly between replays.

The same kernels on the same data as the eager blocks: bit-identical (a GPU test). Where DiTGraphs would run the
DiT's own forward (not CUDA, gradients on, compiled or streamed blocks, a capture that failed), `run` runs the
blocks through `dit.block_runner` instead. A structure change (dit_graphs.structure_key) drops every graph.
"""
from __future__ import annotations

import logging
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch
from torch import nn

from ..model.compile import blocks_compiled
from ..model.cuda_capture import capture_stream, heal_generator_after_failed_capture, host_syncs_raise, is_host_sync_error
from ..model.dit import StepContext
from ..model.dit_graphs import structure_key

log = logging.getLogger(__name__)

DEFAULT_MAX_GRAPHS = 12  # first / middle / last runs of up to four call groups or sizes
ATTRIBUTE = "_step_cache_graphs"  # where a DiT keeps its BlockGraphs (lives and dies with the DiT)


def run_blocks_eagerly(dit: nn.Module, indices: Sequence[int], x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
    """The blocks `indices`, in order, through the DiT's block runner (streamed weights, cancel checks)."""
    runner, layers = dit.block_runner, dit.layers
    for index in indices:
        x = runner(index, layers[index], x, ctx)
    return x


@dataclass
class _Captured:
    graph: "torch.cuda.CUDAGraph"
    x: torch.Tensor
    modulation: tuple[torch.Tensor, ...]
    raw_modulation: tuple[torch.Tensor, ...]
    output: Optional[torch.Tensor]
    keep: list[Any] = field(default_factory=list)  # the RoPE tables and mask the replay reads


class BlockGraphs:
    """`run(indices, x, ctx, grid, text_lens)`: the blocks' output, replayed where it can (module docstring)."""

    def __init__(self, dit: nn.Module, max_graphs: int = DEFAULT_MAX_GRAPHS) -> None:
        self._dit = weakref.ref(dit)  # the DiT keeps this object (graphs_of): no reference cycle back to it
        self.max_graphs = max_graphs
        self.disabled_reason: Optional[str] = None
        self.captures = 0
        self.replays = 0
        self._graphs: OrderedDict[tuple, _Captured] = OrderedDict()
        self._warmed: set[tuple] = set()
        self._pool: Optional[tuple] = None
        self._structure: Optional[tuple] = None

    @property
    def dit(self) -> nn.Module:
        dit = self._dit()
        if dit is None:
            raise RuntimeError("the DiT of these graphs is gone")
        return dit

    def eager_reason(self, x: torch.Tensor) -> Optional[str]:
        if self.disabled_reason is not None:
            return self.disabled_reason
        if x.device.type != "cuda":
            return "not on a CUDA device"
        if torch.is_grad_enabled():
            return "gradients are enabled"
        if blocks_compiled(self.dit):
            return "the blocks are compiled"
        owner = getattr(self.dit.block_runner, "__self__", None)
        if getattr(owner, "streamer", None) is not None:
            return "blocks are streamed"
        return None

    def run(self, indices: Sequence[int], x: torch.Tensor, ctx: StepContext, grid: tuple[int, int],
            text_lens: Sequence[int]) -> torch.Tensor:
        indices = tuple(indices)
        if not indices:
            return x
        if self.eager_reason(x) is not None:
            return run_blocks_eagerly(self.dit, indices, x, ctx)
        self._follow_structure()
        key = (indices, tuple(x.shape), x.dtype, x.device, tuple(grid), tuple(int(n) for n in text_lens),
               tuple((m.shape, m.dtype) for m in ctx.modulation + ctx.raw_modulation))
        captured = self._graphs.get(key)
        if captured is not None:
            self._graphs.move_to_end(key)
            return self._replay(captured, x, ctx)
        if key not in self._warmed:
            output = self._warm_up(indices, x, ctx)
            if len(self._warmed) > 4 * self.max_graphs:
                self._warmed.clear()
            self._warmed.add(key)
            return output
        captured = self._capture(key, indices, x, ctx)
        if captured is None:
            return run_blocks_eagerly(self.dit, indices, x, ctx)
        return captured.output.clone()

    # -- lifetime ------------------------------------------------------------------------------------------
    def _follow_structure(self) -> None:
        current = structure_key(self.dit)
        if current != self._structure:
            self.invalidate()
            self._structure = current

    def invalidate(self) -> None:
        self.release_graphs()
        self._warmed.clear()
        self._structure = None

    def release_graphs(self) -> None:
        """Give the graphs' memory back, remembering which keys were warmed up (they capture at their next call)."""
        while self._graphs:
            _, captured = self._graphs.popitem(last=False)
            _drop(captured)
        self._pool = None

    @property
    def graph_count(self) -> int:
        return len(self._graphs)

    # -- internals -----------------------------------------------------------------------------------------
    def _warm_up(self, indices: tuple[int, ...], x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        current = torch.cuda.current_stream(x.device)
        side = capture_stream(x.device)
        side.wait_stream(current)
        output: Optional[torch.Tensor] = None
        try:
            with torch.cuda.stream(side), host_syncs_raise():
                output = run_blocks_eagerly(self.dit, indices, x, ctx)
        except RuntimeError as error:
            if not is_host_sync_error(error):
                raise
            self.disabled_reason = "the blocks synchronize with the host, which a CUDA graph cannot hold"
            log.warning("DiT step cache: %s (%s); running the blocks eagerly from now on", self.disabled_reason,
                        str(error).strip().splitlines()[0][:160])
        finally:
            current.wait_stream(side)
        if output is None:
            self.invalidate()
            return run_blocks_eagerly(self.dit, indices, x, ctx)
        output.record_stream(current)
        return output

    def _capture(self, key: tuple, indices: tuple[int, ...], x: torch.Tensor, ctx: StepContext
                 ) -> Optional[_Captured]:
        device = x.device
        static_x = x.clone()
        modulation = tuple(m.clone() for m in ctx.modulation)
        raw_modulation = tuple(m.clone() for m in ctx.raw_modulation)
        static_ctx = StepContext(modulation=modulation, raw_modulation=raw_modulation, rope=ctx.rope,
                                 key_mask=ctx.key_mask, arithmetic=ctx.arithmetic)
        current = torch.cuda.current_stream(device)
        side = capture_stream(device)
        side.wait_stream(current)
        graph = torch.cuda.CUDAGraph()
        pool = self._pool if torch.cuda.get_allocator_backend() == "native" else None
        failure: Optional[str] = None
        pending: Optional[BaseException] = None
        output: Optional[torch.Tensor] = None
        try:
            with torch.cuda.graph(graph, pool=pool, stream=side, capture_error_mode="thread_local"):
                try:
                    output = run_blocks_eagerly(self.dit, indices, static_x, static_ctx)
                except BaseException as error:  # see dit_graphs.DiTGraphs._capture: no traceback kept
                    if isinstance(error, RuntimeError) and not isinstance(error, torch.cuda.OutOfMemoryError):
                        failure = str(error)
                    else:
                        pending = error.with_traceback(None)
        except RuntimeError as error:
            if failure is None and pending is None and isinstance(error, torch.cuda.OutOfMemoryError):
                raise
            failure = failure or str(error)
        if pending is not None:
            raise pending
        if failure is not None:
            heal_generator_after_failed_capture(device)
            self.disabled_reason = f"CUDA-graph capture failed ({failure.strip().splitlines()[0][:160]})"
            log.warning("DiT step cache: %s; running the blocks eagerly from now on", self.disabled_reason)
            self.invalidate()
            return None
        graph.replay()  # launch now: under cudaMallocAsync the output exists only once the graph has run
        if pool is None and torch.cuda.get_allocator_backend() == "native":
            self._pool = graph.pool()
        captured = _Captured(graph, static_x, modulation, raw_modulation, output,
                             keep=[ctx.rope, ctx.key_mask])
        self._graphs[key] = captured
        self.captures += 1
        while len(self._graphs) > self.max_graphs:
            _, oldest = self._graphs.popitem(last=False)
            _drop(oldest)
        return captured

    def _replay(self, captured: _Captured, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        captured.x.copy_(x)
        for static, value in zip(captured.modulation + captured.raw_modulation, ctx.modulation + ctx.raw_modulation):
            static.copy_(value)
        captured.graph.replay()
        self.replays += 1
        return captured.output.clone()


def graphs_of(dit: nn.Module) -> BlockGraphs:
    """The DiT's BlockGraphs, made on first use (kept on the DiT: dropped with it)."""
    graphs = getattr(dit, ATTRIBUTE, None)
    if graphs is None or graphs._dit() is not dit:
        graphs = BlockGraphs(dit)
        setattr(dit, ATTRIBUTE, graphs)
    return graphs


def _drop(captured: _Captured) -> None:
    captured.output = None
    captured.keep.clear()
