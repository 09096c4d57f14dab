"""The one object the graph passes around: a backend that turns a GenerationRequest into images.

Local (in-process) and remote (SGLang) backends both implement `ErniePipe`; the samplers only call
`generate`, so switching a workflow from local to remote is rewiring one link.
"""
from __future__ import annotations

from typing import Any, Optional, Protocol, runtime_checkable

from .host import Host
from .request import GenerationRequest, GenerationResult


@runtime_checkable
class ErniePipe(Protocol):
    kind: str  # "local" or "remote"

    def describe(self) -> str:
        """One or a few lines for the user: model variant, formats, memory plan or servers."""

    def generate(self, request: GenerationRequest, host: Host) -> GenerationResult:
        """Run the whole job. Raises ErnieImageError subclasses with one-line messages; Cancelled on cancel."""

    def release(self) -> None:
        """Free device memory held by this backend (weights, buffers). Safe to call twice."""

    def is_loaded(self) -> bool:
        """Whether the backend holds anything `release` would free (weights locally, connections remotely)."""

    def has_enhancer(self) -> bool:
        """Whether `enhance` can run (a local prompt enhancer, or a PE chat endpoint)."""

    def enhance(self, prompt: str, width: int, height: int, seed: int, temperature: float = 0.6,
                top_p: float = 0.95, max_new_tokens: int = 512, host: Optional[Host] = None) -> Any:
        """The prompt enhancer's revision of one prompt (text.enhancer.RevisedPrompts), nothing else."""
