"""One sampling run with the step cache: the sampler's denoiser (sampling.Denoiser), built instead of
sampling.length_grouped_denoiser, with the cache's state for the run.

Each step runs the step's DiT call groups (sampling.text_groups: CFG's negative and positive when their texts
differ in length, batch rows of other prompt lengths) in two passes:

1. for every group: ErnieDiT.prepare, the first Fn blocks, their residual r = x_Fn - x_0;
2. the decision (rule.py): one per step over every group (at most one host sync: `.item()` of two fp32 sums);
3. for every group: computed, the middle blocks (their residual m = x_out - x_Fn is stored for the group) then
   the last Bn blocks; skipped, x_Fn + m of the group's last computed step, then the last Bn blocks; then
   ErnieDiT.finish.

State is per group: r_last and m of that group's own rows, from the last computed step (no tensor is shared between
groups, and each row of a group's tensors is that row's own). Blocks run through `dit.block_runner` (streamed
weights, cancel checks), or as CUDA-graph replays (graphs.py) where the uncompiled resident DiT would be replayed.
A streamed DiT's LayerStreamer follows the run's route (offload/streamer.py): the blocks a step will run, known
ahead where the step cannot skip, else up to the decision, plus a guess of the first streamed middle block, copied
while the first blocks run, so the copies need not wait for the decision; a skipped step wastes that one copy (about
9 ms of an H200's bus against the ~220 ms the skip saves), no other skipped block is copied.

Computed with threshold 0, every group runs prepare, all blocks in order and finish on the same tensors as the
uncached forward: the same image bit for bit (tests/test_step_cache.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn

from ..core.host import Host
from ..sampling.euler import text_groups
from ..core.step_cache_config import StepCacheConfig, fitted_blocks
from .graphs import BlockGraphs, graphs_of, run_blocks_eagerly
from .rule import SkipRule, relative_change


GUESSED_BLOCKS = 1  # streamed middle blocks copied before a decision (wasted when the step is skipped)


@dataclass(frozen=True)
class BlockSplit:
    """The DiT's blocks in the cache's three runs: first (always computed, compared), middle (skippable), last."""
    first: tuple[int, ...]
    middle: tuple[int, ...]
    last: tuple[int, ...]

    @classmethod
    def of(cls, layers: int, first: int, last: int) -> "BlockSplit":
        if layers < 2:
            raise ValueError("a step cache needs a DiT of at least 2 blocks")
        first, last = fitted_blocks(layers, first, last)
        return cls(tuple(range(first)), tuple(range(first, layers - last)), tuple(range(layers - last, layers)))


@dataclass
class _Group:
    rows: Optional[torch.Tensor]  # the batch rows of this call (None: the whole batch, one group)
    text: torch.Tensor
    text_lens: list[int]
    first_residual: Optional[torch.Tensor] = None  # r_last: the first blocks' residual of the last computed step
    middle_residual: Optional[torch.Tensor] = None  # m: the middle blocks' residual of the last computed step

    def cache_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.first_residual, self.middle_residual)
                   if t is not None)


@dataclass
class _Head:
    x: torch.Tensor  # after the first blocks
    ctx: Any
    conditioning: torch.Tensor
    residual: torch.Tensor  # r of this step
    grid: tuple[int, int]


@dataclass
class StepCacheReport:
    config: StepCacheConfig
    steps: int
    schedule: str  # C computed / S skipped, per step
    changes: dict[int, float] = field(default_factory=dict)
    blocks: str = ""  # the FnBn that ran: "F8B0"
    layers: int = 0
    cache_bytes: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def computed(self) -> int:
        return self.schedule.count("C")

    @property
    def skipped(self) -> int:
        return self.schedule.count("S")

    def line(self) -> str:
        """What the Sampler's text and the CLI say after a run."""
        return (f"step cache ({self.config.label(self.blocks)}): {self.computed} of {self.steps} steps computed, "
                f"{self.skipped} skipped")

    def info(self) -> dict[str, Any]:
        """For GenerationResult.info (and the CLI's PNG settings)."""
        record = self.config.metadata()
        if self.layers:  # the blocks that ran, where the DiT had fewer than asked for (its notice said so)
            first, last = self.config.blocks_in(self.layers)
            if (first, last) != (record["first_blocks"], record["last_blocks"]):
                asked = f"F{record['first_blocks']}B{record['last_blocks']}"
                record.update(first_blocks=first, last_blocks=last, blocks_asked=asked)
        return {"step_cache": {**record, "steps_computed": self.computed,
                               "steps_skipped": self.skipped, "schedule": self.schedule,
                               "blocks_run": f"{self.blocks} of {self.layers}",
                               "changes": {str(step): round(change, 5) for step, change in self.changes.items()},
                               "cache_mb": round(self.cache_bytes / 2**20, 1)}}


def streamer_of(dit: nn.Module):
    """The LayerStreamer behind a streaming placement's block runner (offload/placement.py), or None."""
    return getattr(getattr(dit.block_runner, "__self__", None), "streamer", None)


class StepCacheRun:
    """The denoiser for one sampling run (`self(latents, timestep)` once per step, in order), and its report."""

    def __init__(self, config: StepCacheConfig, dit: nn.Module, rows: list[torch.Tensor], device: torch.device,
                 dtype: torch.dtype, steps: int, host: Host, graphs: bool = False) -> None:
        self.config = config
        self.dit = dit
        self.host = host
        self.steps = steps
        self.rule = SkipRule(config, steps)
        layers = len(dit.layers)
        self.split = BlockSplit.of(layers, config.probe_blocks, config.tail_blocks)
        note = config.fit_note(layers)
        self.notes: list[str] = [note] if note else []
        groups = text_groups(rows, device, dtype, dit.project_text)  # the text projected once for the run
        single = len(groups) == 1
        self.groups = [_Group(None if single else indices, text, lens) for indices, text, lens in groups]
        self.graphs: Optional[BlockGraphs] = graphs_of(dit) if graphs and torch.device(device).type == "cuda" else None
        self.step = 0
        self.peak_cache_bytes = 0
        self.streamer = streamer_of(dit)
        if self.streamer is not None:
            self.streamer.follow_route()
            self._route(self.split.first)  # step 0's first pass
            self._guess_rest(0)

    # -- the denoiser ----------------------------------------------------------------------------------------
    def __call__(self, latents: torch.Tensor, timestep: torch.Tensor) -> torch.Tensor:
        step = self.step
        if step >= self.steps:
            raise RuntimeError(f"the step cache was built for {self.steps} steps; step {step + 1} was asked for")
        self.step += 1
        measures = self.rule.measures(step)
        if not measures:  # computed whatever the blocks say: decided now, so the route (and the guess) run ahead
            skip = self.rule.decide(step, None)
            self._plan_rest(step, skip)
        heads = [self._head(group, latents, timestep) for group in self.groups]
        if measures:
            skip = self.rule.decide(step, self._measure(heads))
            self._plan_rest(step, skip)
        self.host.check_cancel()
        outputs = [self._rest(group, head, skip) for group, head in zip(self.groups, heads)]
        self.peak_cache_bytes = max(self.peak_cache_bytes, sum(group.cache_bytes() for group in self.groups))
        if len(outputs) == 1:
            return outputs[0]
        velocity = torch.empty_like(latents)
        for group, output in zip(self.groups, outputs):
            velocity[group.rows] = output
        return velocity

    def _head(self, group: _Group, latents: torch.Tensor, timestep: torch.Tensor) -> _Head:
        if group.rows is not None:
            latents, timestep = latents[group.rows], timestep[group.rows]
        x0, ctx, conditioning = self.dit.prepare(latents, timestep, group.text, group.text_lens)
        grid = (int(latents.shape[-2]), int(latents.shape[-1]))
        x = self._blocks(self.split.first, x0, ctx, grid, group.text_lens)
        return _Head(x, ctx, conditioning, x - x0, grid)

    def _measure(self, heads: list[_Head]) -> float:
        """The step's change over every group: one host sync for the two fp32 sums."""
        sums = torch.zeros(2, dtype=torch.float32, device=heads[0].x.device)
        for group, head in zip(self.groups, heads):
            last = group.first_residual
            sums[0] += (head.residual - last).abs().sum(dtype=torch.float32)
            sums[1] += last.abs().sum(dtype=torch.float32)
        numerator, denominator = sums.tolist()
        return relative_change(numerator, denominator)

    def _rest(self, group: _Group, head: _Head, skip: bool) -> torch.Tensor:
        if skip:
            x = head.x + group.middle_residual
        else:
            x = self._blocks(self.split.middle, head.x, head.ctx, head.grid, group.text_lens)
            group.middle_residual = x - head.x
            group.first_residual = head.residual
        x = self._blocks(self.split.last, x, head.ctx, head.grid, group.text_lens)
        return self.dit.finish(x, head.conditioning, head.grid)

    def _blocks(self, indices: tuple[int, ...], x: torch.Tensor, ctx: Any, grid: tuple[int, int],
                text_lens: list[int]) -> torch.Tensor:
        if self.graphs is not None:
            return self.graphs.run(indices, x, ctx, grid, text_lens)
        return run_blocks_eagerly(self.dit, indices, x, ctx)

    # -- the streamer's route: every group's blocks of a pass, in the order they run ----------------------------
    def _route(self, indices: tuple[int, ...]) -> None:
        """Every group's `indices`, in run order; called even with none, since that too settles a guess."""
        if self.streamer is not None:
            self.streamer.extend_route(indices * len(self.groups))

    def _plan_rest(self, step: int, skip: bool) -> None:
        """After step `step`'s first pass: its second pass, then the next step's first pass (if any)."""
        if self.streamer is None:
            return
        self._route(self.split.last if skip else self.split.middle + self.split.last)
        if step + 1 < self.steps:
            self._route(self.split.first)
            self._guess_rest(step + 1)

    def _guess_rest(self, step: int) -> None:
        """A step that may be skipped: its first streamed middle block is copied before the decision (a guess the
        decision confirms or drops), so the copies after the decision do not start from an empty ring."""
        if self.streamer is not None and self.rule.measures(step):
            self.streamer.guess(self.split.middle, limit=GUESSED_BLOCKS)

    # -- the end ------------------------------------------------------------------------------------------------
    def close(self, release_graphs: bool = False) -> StepCacheReport:
        """End the run (also after an error or a cancel): the streamer back to its own order, the cached tensors
        dropped, the block graphs' memory given back when `release_graphs` (LocalPipe under a VRAM plan, whose
        next phases count on the DiT's activation memory). Returns what ran."""
        if self.streamer is not None and not getattr(self.streamer, "closed", False):
            self.streamer.end_route()
        if release_graphs and self.graphs is not None:
            self.graphs.release_graphs()
        for group in self.groups:
            group.first_residual = group.middle_residual = None
        split = self.split
        return StepCacheReport(self.config, self.steps, "".join(self.rule.schedule), dict(self.rule.changes),
                               f"F{len(split.first)}B{len(split.last)}", len(self.dit.layers),
                               self.peak_cache_bytes, list(self.notes))


def open_run(config: StepCacheConfig, dit: nn.Module, forward: Any, rows: list[torch.Tensor], device: torch.device,
             dtype: torch.dtype, steps: int, host: Host) -> StepCacheRun:
    """LocalPipe's hook: the cached denoiser for one run. `forward` is what the uncached run would call (the DiT, or
    dit_graphs.DiTGraphs where the uncompiled resident DiT is replayed): a DiTGraphs means replay the block runs
    too, and its own graphs' memory is given back first (one graph pool at a time)."""
    graphs = forward is not dit
    if graphs:
        release = getattr(forward, "release_graphs", None)
        if release is not None:
            release()
    run = StepCacheRun(config, dit, rows, device, dtype, steps, host, graphs=graphs)
    for note in run.notes:
        host.log(note)
    return run
