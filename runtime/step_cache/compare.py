"""Judging a step cache on your own weights: the same job with and without it, a difference figure and a
side-by-side picture. Random weights cannot say whether a threshold keeps the picture; the user's model can.

    from ernie_image import GenerationRequest, LocalPipe, NullHost
    from ernie_image.runtime.step_cache.compare import compare_step_cache
    result = compare_step_cache(pipe, GenerationRequest(prompt="...", seed=7), "dbcache:threshold=0.08", NullHost())
    print(result.summary())          # computed steps, PSNR, mean and max pixel difference
    save_pngs(result.side_by_side(), "compare.png", result.settings())

The CLI's `ernie-image generate ... --step-cache SPEC --step-cache-compare compare.png` does the same.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch

from ..core.host import Host
from ..core.request import GenerationRequest, GenerationResult
from ..core.step_cache_config import as_config

DIFFERENCE_GAIN = 8  # the third panel shows |cached - uncached| times this (a difference of 32 levels is white)


def difference(reference: torch.Tensor, other: torch.Tensor) -> dict[str, float]:
    """How far `other` is from `reference` (images [B, H, W, 3] in 0..1), on the 8-bit pixels a PNG stores: PSNR
    in dB (inf when equal), mean and max absolute difference in levels (0..255), and the share of pixels whose
    largest channel difference is more than 8 levels."""
    a = (reference.clamp(0, 1) * 255).round()
    b = (other.clamp(0, 1) * 255).round()
    delta = (a - b).abs()
    mse = float(delta.square().mean())
    return {
        "psnr_db": math.inf if mse == 0 else round(10 * math.log10(255.0 ** 2 / mse), 2),
        "mean_abs_levels": round(float(delta.mean()), 3),
        "max_abs_levels": float(delta.max()),
        "pixels_over_8_levels_pct": round(float((delta.amax(dim=-1) > 8).float().mean()) * 100, 3),
    }


@dataclass
class StepCacheComparison:
    uncached: GenerationResult
    cached: GenerationResult

    @property
    def figures(self) -> dict[str, float]:
        return difference(self.uncached.images, self.cached.images)

    def summary(self) -> str:
        cache = self.cached.info.get("step_cache", {})
        computed, skipped = cache.get("steps_computed", 0), cache.get("steps_skipped", 0)
        figures = self.figures
        psnr = "identical" if math.isinf(figures["psnr_db"]) else f"PSNR {figures['psnr_db']:g} dB"
        return (f"step cache: {computed} of {computed + skipped} steps computed (schedule "
                f"{cache.get('schedule', '?')}); against the uncached image: {psnr}, mean "
                f"|difference| {figures['mean_abs_levels']:g} and max {figures['max_abs_levels']:g} of 255 levels, "
                f"{figures['pixels_over_8_levels_pct']:g}% of pixels off by more than 8")

    def side_by_side(self) -> torch.Tensor:
        """[B, H, 3W, 3]: uncached | cached | |difference| x DIFFERENCE_GAIN, per image of the batch."""
        a, b = self.uncached.images, self.cached.images
        gain = ((a - b).abs() * DIFFERENCE_GAIN).clamp(0, 1)
        return torch.cat([a, b, gain], dim=2)

    def settings(self) -> dict[str, Any]:
        """PNG metadata for the side-by-side picture: the job, the cache's run and the figures."""
        request = self.cached.request or self.uncached.request
        settings: dict[str, Any] = dict(request.metadata()) if request is not None else {}
        if "step_cache" in self.cached.info:
            settings["step_cache"] = self.cached.info["step_cache"]
        figures = {name: (None if math.isinf(value) else value) for name, value in self.figures.items()}
        settings["comparison"] = {**figures, "panels": f"uncached | cached | |difference| x{DIFFERENCE_GAIN}"}
        return settings

def compare_step_cache(pipe: Any, request: GenerationRequest, step_cache: Any, host: Host) -> StepCacheComparison:
    """Run `request` on `pipe` with `step_cache` (a StepCacheConfig or spec), then without it, same seed."""
    config = as_config(step_cache)
    cached = _uncached_pipe(pipe).generate(dataclasses.replace(request, step_cache=config), host)
    return compare_with(pipe, request, cached, host)


def compare_with(pipe: Any, request: GenerationRequest, cached: GenerationResult, host: Host) -> StepCacheComparison:
    """`cached` (a result of `request` with a step cache) against `request` run again without one."""
    uncached = _uncached_pipe(pipe).generate(dataclasses.replace(request, step_cache=None), host)
    return StepCacheComparison(uncached, cached)


def _uncached_pipe(pipe: Any) -> Any:
    from .view import StepCachePipe

    return pipe.inner if isinstance(pipe, StepCachePipe) else pipe  # it would put its own cache on every run
