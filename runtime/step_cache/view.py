"""`StepCachePipe`: a local pipe (LocalPipe or a LoRA view of it) that runs every job with a step cache.

The library's `pipe.with_step_cache(...)` and the "ERNIE-Image Step Cache" node make one. It shares the pipe's
loaded model and sets GenerationRequest.step_cache on each job it runs (which the run records in the result's
request, info and PNG settings); LoRA nodes after it keep it (`with_loras`), another Step Cache node replaces it.
A remote backend refuses step caching: its server decides how its DiT runs.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Optional

from ..core.errors import InvalidInputError
from ..core.host import Host
from ..core.pipe import check_generate_call
from ..core.request import LOCAL_PIPE, GenerationRequest, GenerationResult
from ..core.step_cache_config import StepCacheConfig, as_config

REMOTE_REFUSAL = ("step caching runs only on a local pipe: an SGLang server decides how its DiT runs (its own "
                  f"cache-dit options); give the step cache {LOCAL_PIPE}, or leave it out")


def with_step_cache(pipe: Any, config: Any) -> Any:
    """`pipe` running every job with `config` (StepCacheConfig, a spec such as 'dbcache:threshold=0.1', or None
    for none); a StepCachePipe given is re-wrapped, not stacked."""
    if getattr(pipe, "kind", None) != "local" or not hasattr(pipe, "generate"):
        raise InvalidInputError(REMOTE_REFUSAL).naming(LOCAL_PIPE)
    config = as_config(config)
    inner = pipe.inner if isinstance(pipe, StepCachePipe) else pipe
    return inner if config is None else StepCachePipe(inner, config)


def refuse_remote(request: GenerationRequest) -> None:
    """A request with a step cache sent to a remote backend is refused, not run without it."""
    if request.step_cache is not None:
        raise InvalidInputError(REMOTE_REFUSAL).naming(LOCAL_PIPE)


class StepCachePipe:
    def __init__(self, inner: Any, config: StepCacheConfig) -> None:
        self.inner = inner
        self.step_cache = config

    @property
    def kind(self) -> str:
        return self.inner.kind

    def with_step_cache(self, config: Any) -> Any:
        return with_step_cache(self.inner, config)

    def with_loras(self, entries: Iterable, mode: Optional[str] = None) -> "StepCachePipe":
        return StepCachePipe(self.inner.with_loras(entries, mode), self.step_cache)

    def generate(self, request: GenerationRequest, host: Host) -> GenerationResult:
        check_generate_call(request, host)
        return self.inner.generate(dataclasses.replace(request, step_cache=self.step_cache), host)

    def describe(self, *args: Any, **kwargs: Any) -> str:
        return self.inner.describe(*args, **kwargs) + f"\nstep cache: {self.step_cache.label()}"

    def release(self) -> None:
        self.inner.release()

    def is_loaded(self) -> bool:
        return self.inner.is_loaded()

    def has_enhancer(self) -> bool:
        return self.inner.has_enhancer()

    def enhance(self, *args: Any, **kwargs: Any) -> Any:
        return self.inner.enhance(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:  # the rest of the pipe (variant, defaults, loras, check, ...)
        if name in ("inner", "step_cache"):
            raise AttributeError(name)
        return getattr(self.inner, name)
