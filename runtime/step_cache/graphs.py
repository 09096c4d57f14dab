"""Runs of consecutive DiT blocks replayed as CUDA graphs, for the step cache on the uncompiled resident DiT.

A cached step cannot be one graph (dit_graphs.DiTGraphs): whether the middle blocks run is decided on the host
between the first blocks and the rest. So the block runs a step is made of (the first blocks, the middle ones, the
last ones: session.py) are captured one by one, each keyed by its block indices and its inputs' signature, with
DiTGraphs' lifecycle (model/graph_cache.py): the first call of a key runs eagerly (a warm-up with host syncs
raising), the second captures and replays, later ones copy x and the modulation into the graph's static inputs and
replay. The output is cloned (another graph in the shared pool may reuse its memory). Prepare and finish
(x_embedder, modulation, final layer: ~20 kernels; the run's text is projected once, before its first step) and the
cache's own arithmetic run eagerly between replays.

The same kernels on the same data as the eager blocks: bit-identical (a GPU test). Where DiTGraphs would run the
DiT's own forward (not CUDA, gradients on, compiled or streamed blocks, a capture that failed), `run` runs the
blocks through `dit.block_runner` instead. A structure change (graph_cache.structure_key) drops every graph.
"""
from __future__ import annotations

import logging
import weakref
from dataclasses import replace
from typing import Sequence

import torch
from torch import nn

from ..model.dit import StepContext
from ..model.graph_cache import GraphCache

log = logging.getLogger(__name__)

DEFAULT_MAX_GRAPHS = 12  # first / middle / last runs of up to four call groups or sizes
ATTRIBUTE = "_step_cache_graphs"  # where a DiT keeps its BlockGraphs (lives and dies with the DiT)


def run_blocks_eagerly(dit: nn.Module, indices: Sequence[int], x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
    """The blocks `indices`, in order, through the DiT's block runner (streamed weights, cancel checks)."""
    runner, layers = dit.block_runner, dit.layers
    for index in indices:
        x = runner(index, layers[index], x, ctx)
    return x


class BlockGraphs(GraphCache):
    """`run(indices, x, ctx, grid, text_lens)`: the blocks' output, replayed where it can (module docstring)."""

    def __init__(self, dit: nn.Module, max_graphs: int = DEFAULT_MAX_GRAPHS) -> None:
        super().__init__(max_graphs, "a step-cache block run", log)
        self._dit = weakref.ref(dit)  # the DiT keeps this object (graphs_of): no reference cycle back to it

    @property
    def dit(self) -> nn.Module:
        dit = self._dit()
        if dit is None:
            raise RuntimeError("the DiT of these graphs is gone")
        return dit

    def run(self, indices: Sequence[int], x: torch.Tensor, ctx: StepContext, grid: tuple[int, int],
            text_lens: Sequence[int]) -> torch.Tensor:
        indices = tuple(indices)
        if not indices:
            return x
        if self.eager_reason(x) is not None:
            return run_blocks_eagerly(self.dit, indices, x, ctx)
        self.follow_structure()
        key = (indices, tuple(x.shape), x.dtype, x.device, tuple(grid), tuple(int(n) for n in text_lens),
               tuple((m.shape, m.dtype) for m in ctx.modulation + ctx.raw_modulation))
        modulations = len(ctx.modulation)

        def blocks(x: torch.Tensor, *modulation: torch.Tensor) -> torch.Tensor:  # a replay's static inputs in
            step = replace(ctx, modulation=modulation[:modulations], raw_modulation=modulation[modulations:])
            return run_blocks_eagerly(self.dit, indices, x, step)

        return self.replay(key, blocks, (x, *ctx.modulation, *ctx.raw_modulation),
                           keep=lambda: [ctx.rope, ctx.key_mask])


def graphs_of(dit: nn.Module) -> BlockGraphs:
    """The DiT's BlockGraphs, made on first use (kept on the DiT: dropped with it)."""
    graphs = getattr(dit, ATTRIBUTE, None)
    if graphs is None or graphs._dit() is not dit:
        graphs = BlockGraphs(dit)
        setattr(dit, ATTRIBUTE, graphs)
    return graphs
