"""Which steps are computed: the documented rule, on plain numbers (no tensors), so tests can state it exactly.

For N steps (0-based step i) and a StepCacheConfig:

1. The window of steps that may be skipped is ceil(start * N) <= i < ceil(end * N), narrowed to 1 <= i <= N - 2:
   the first step and the last are always computed (the first has no cached residual; the last is the image).
2. A step outside the window is computed.
3. A step inside the window after `max_skips` skipped steps in a row is computed (no measurement).
4. Any other step in the window is measured: its first blocks' residual r is compared with r_last, the residual of
   the last *computed* step (a skipped step never replaces it, as in cache-dit's can_cache/set_Fn_buffer):
   change = sum |r - r_last| / sum |r_last| over every token, channel and row of every call group of the step
   (both CFG branches and all batch rows: one decision per step, as cache-dit decides for ERNIE-Image's batched
   CFG), summed in fp32. The step is skipped when change < threshold (so threshold 0 never skips); 0/0 is 0.
5. forced (a C/S letter per step) replaces 3. and 4.: the letter decides; steps in the window or forced to S are
   still measured, so a forced run costs what a measured one does.

A computed step stores its first blocks' residual (r_last) and its middle blocks' residual; a skipped step adds the
stored middle residual to its own first blocks' output and runs only the last blocks.
"""
from __future__ import annotations

import math
from typing import Optional

from ..core.step_cache_config import COMPUTE, SKIP, StepCacheConfig


def _ceil(value: float) -> int:
    return math.ceil(round(value, 9))  # 0.15 * 20 = 3.0000000000000004 is 3


def skippable_window(config: StepCacheConfig, steps: int) -> range:
    """The steps that may be skipped (rule 1)."""
    low = max(1, _ceil(config.start * steps))
    high = min(steps - 1, _ceil(config.end * steps))
    return range(low, max(low, high))


def relative_change(numerator: float, denominator: float) -> float:
    """sum |r - r_last| / sum |r_last|, 0/0 as 0 (nothing changed) and x/0 as infinity."""
    if denominator > 0:
        return numerator / denominator
    return 0.0 if numerator == 0 else math.inf


class SkipRule:
    """The rule for one run of `steps` steps; `measures(i)` then `decide(i, change)` once per step, in order."""

    def __init__(self, config: StepCacheConfig, steps: int) -> None:
        config.validate(steps)
        self.config = config
        self.steps = steps
        self.window = skippable_window(config, steps)
        self.in_a_row = 0
        self.schedule: list[str] = []  # C / S per step decided so far
        self.changes: dict[int, float] = {}  # the measured change per measured step

    def measures(self, step: int) -> bool:
        """Whether step `step` is measured (its change computed, which waits for the device: one host sync)."""
        forced = self.config.forced
        if forced is not None:
            return step in self.window or forced[step] == SKIP
        return step in self.window and self.in_a_row < self.config.max_skips

    def decide(self, step: int, change: Optional[float]) -> bool:
        """Whether step `step` is skipped; `change`: its measurement (None when `measures` said no)."""
        if step != len(self.schedule):
            raise RuntimeError(f"step {step} decided out of order (expected {len(self.schedule)})")
        if change is not None:
            self.changes[step] = change
        forced = self.config.forced
        if forced is not None:
            skip = forced[step] == SKIP
        else:
            skip = change is not None and step in self.window and self.in_a_row < self.config.max_skips \
                and change < self.config.threshold
        self.in_a_row = self.in_a_row + 1 if skip else 0
        self.schedule.append(SKIP if skip else COMPUTE)
        return skip

    @property
    def computed(self) -> int:
        return self.schedule.count(COMPUTE)

    @property
    def skipped(self) -> int:
        return self.schedule.count(SKIP)

