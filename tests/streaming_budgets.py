"""Budgets at which a tiny model plans at all, or with part of its DiT streamed, found as a user's budget is planned
(plan_memory over the model's own sizes): the least budget that plans at all, by halving to 4 KiB, then walked up
4 KiB at a time to one that streams.

The tiny DiT's blocks are ~80 KB, so the window where part of it streams is a few hundred KB wide, above whatever
the device's plan reserves (~457 MiB on CUDA).
"""
from __future__ import annotations

from typing import Callable, Optional

from ernie_image.runtime.core.errors import MemoryBudgetError
from ernie_image.runtime.core.request import GenerationRequest
from ernie_image.runtime.local.options import LoadOptions
from ernie_image.runtime.local.pipe import LocalPipe
from ernie_image.runtime.offload.planner import GiB, MemoryPlan, plan_memory

SEARCH_STEP = 4096
SEARCH_SPAN = 64 * 1024**2


def _planner(model, request: GenerationRequest, device: str) -> Callable[[int], Optional[MemoryPlan]]:
    """The plan a budget (bytes) gives `request` on `device`, None where it is refused."""
    pipe = LocalPipe.load(model, LoadOptions(device=device, vram_budget_gb=1.0))
    sizes = pipe.memory.sizes_for(pipe.sources, pipe.variant)
    job = pipe.memory.job_for(request.with_defaults(pipe.variant), False)
    assert job.step_cache == (request.step_cache is not None)  # the plan counts a step cache's residuals

    def plan_or_none(budget: int) -> Optional[MemoryPlan]:
        try:
            return plan_memory(budget, job, sizes, device)
        except MemoryBudgetError:
            return None

    return plan_or_none


def _least_planning_bytes(plan_or_none: Callable[[int], Optional[MemoryPlan]]) -> int:
    low, high = 0, 64 * GiB
    while high - low > SEARCH_STEP:
        middle = (low + high) // 2
        low, high = (low, middle) if plan_or_none(middle) is not None else (middle, high)
    return high


def least_budget_gb(model, request: GenerationRequest, device: str) -> float:
    """The least budget (GiB, within 4 KiB above it) at which `request` plans on `device`."""
    return _least_planning_bytes(_planner(model, request, device)) / GiB


def first_budget_gb(model, request: GenerationRequest, device: str, streams: Callable[[MemoryPlan], bool],
                    what: str) -> float:
    """The smallest budget (GiB) whose plan for `request` on `device` `streams`; an AssertionError saying 'no
    budget `what`' when none does within 64 MiB of the least budget that plans."""
    plan_or_none = _planner(model, request, device)
    high = _least_planning_bytes(plan_or_none)
    for budget in range(high, high + SEARCH_SPAN, SEARCH_STEP):
        plan = plan_or_none(budget)
        if plan is not None and streams(plan):
            return budget / GiB
    raise AssertionError(f"no budget {what}")


def middle_streaming_budget_gb(model, request: GenerationRequest, device: str) -> float:
    """The smallest budget (GiB) at which `request` plans with the tiny DiT partly streamed, block 2, 3 or 4 (the
    middle a step cache skips) among the streamed ones."""
    def streams_the_middle(plan: MemoryPlan) -> bool:
        streamed = plan.dit.streamed
        return 0 < len(streamed) < plan.dit.layers - 1 and bool(set(streamed) & {2, 3, 4})

    return first_budget_gb(model, request, device, streams_the_middle,
                           f"streams part of the tiny DiT's middle on {device}")
