"""The one object the graph passes around: a backend that turns a GenerationRequest into images.

Local (in-process) and remote (SGLang) backends both implement `ErniePipe`; the samplers only call
`generate`, so switching a workflow from local to remote is rewiring one link.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

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
