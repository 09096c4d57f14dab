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


def check_generate_call(request: Any, host: Any) -> None:
    """Refuse arguments of `generate` that are not a GenerationRequest and a Host, in one line, before any work
    (else an AttributeError from deep inside: "'NoneType' object has no attribute 'check_cancel'")."""
    from .errors import InvalidInputError

    if not isinstance(request, GenerationRequest):
        hint = " (a dict: GenerationRequest(**it))" if isinstance(request, dict) else ""
        raise InvalidInputError(f"request {short_repr(request)} is not a GenerationRequest: give "
                                f"ernie_image.GenerationRequest(prompt=...){hint}")
    if not isinstance(host, Host):
        raise InvalidInputError(f"host {short_repr(host)} is not a Host: give ernie_image.NullHost() (or an "
                                "object with progress, check_cancel, make_room and log)")


def short_repr(value: Any, limit: int = 60) -> str:
    """`repr(value)` on one line, cut to `limit`: how a refusal quotes a wrong argument."""
    text = " ".join(repr(value).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."
