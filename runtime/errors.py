"""Errors the runtime raises. Every message is one line naming the cause and the fix."""
from __future__ import annotations

from typing import TypeVar

_E = TypeVar("_E", bound="ErnieImageError")


class ErnieImageError(Exception):
    """Base class: anything the user can act on.

    A message names a setting by its Python name (a request field, a node widget: `mask_grow`); `naming` records
    which words of the message are such names, so a front end that calls them otherwise (the CLI: `--mask-grow`,
    cli_names.py) can say its own names without the checks knowing about it.
    """

    settings: tuple[str, ...] = ()

    def naming(self: _E, *settings: str) -> _E:
        """This error, recording that its message names `settings` (returned, to raise in one expression)."""
        self.settings = tuple(settings)
        return self


class InvalidInputError(ErnieImageError, ValueError):
    """A setting the user chose is out of range (size, steps, prompt...)."""


class ModelFileError(ErnieImageError):
    """A weight file is missing, corrupt, or not the ERNIE-Image component that was expected."""


class MemoryBudgetError(ErnieImageError):
    """The job cannot fit the VRAM budget; raised before anything is allocated."""


class RemoteError(ErnieImageError):
    """A remote server (SGLang or a chat endpoint) failed or answered something unusable."""


class Cancelled(ErnieImageError):
    """The host asked to stop (ComfyUI's Cancel, Ctrl-C in the CLI)."""


def one_line(error: BaseException, limit: int = 200) -> str:
    """`Type: message` of an unexpected error, whitespace collapsed and cut: the detail a one-line message quotes."""
    return " ".join(f"{type(error).__name__}: {error}".split())[:limit]
