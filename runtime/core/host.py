"""The small interface through which the runtime talks to whoever hosts it (ComfyUI, the CLI, tests).

runtime/ never imports ComfyUI: nodes/ implements this protocol with ComfyUI's ProgressBar, interrupt flag
and model_management; the CLI and tests use `NullHost` or their own subclass.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any, Iterator, Optional, Protocol, runtime_checkable

from .errors import Cancelled

CANCEL_POLL_S = 0.1  # how often a wait for another job asks the host whether to cancel


@runtime_checkable
class Host(Protocol):
    def progress(self, value: int, total: int, preview: Optional[Any] = None) -> None:
        """Report progress; `preview`: a PIL.Image of a recent step's denoised estimate, or None. Only a host that
        wants previews (`wants_previews`) is given any."""

    def check_cancel(self) -> None:
        """Raise `Cancelled` if the user asked to stop. Called between steps and between chunks."""

    def make_room(self, num_bytes: int, device: Any) -> None:
        """Ask the host to free `num_bytes` of memory on `device` (ComfyUI unloads its own models)."""

    def log(self, message: str) -> None:
        """A one-line notice for the user (not an error)."""


def show_status(host: Host, text: str) -> None:
    """A one-line state shown where the run is shown (ComfyUI: the running node's text), replacing the last one.
    `status(text)` is optional for a host: one without it shows nothing (its log lines still tell the story)."""
    status = getattr(host, "status", None)
    if callable(status):
        status(text)


def show_progress_phase(host: Host, name: str, unit: str) -> None:
    """Tell a host what the progress reported next counts: `unit`s ("step", "token") of `name` ("sampling",
    "prompt enhancer"). `progress_phase(name, unit)` is optional for a host, as `status` is: one without it shows
    the bare counts (ComfyUI's progress bar)."""
    progress_phase = getattr(host, "progress_phase", None)
    if callable(progress_phase):
        progress_phase(name, unit)


def wants_previews(host: Host) -> bool:
    """Whether `host` shows latent previews with its progress. `wants_previews` (a bool attribute or property) is
    optional for a host, as `status` is: one without it, or with it false, gets none, and the sampler then does no
    preview work at all (no picture computed, no copy from the device, no wait for one)."""
    return bool(getattr(host, "wants_previews", False))


class NullHost:
    """Host for the CLI and tests: no progress display, no previews, cancellation through a flag."""

    wants_previews = False

    def __init__(self, verbose: bool = False) -> None:
        self.cancel_requested = False
        self.verbose = verbose
        self.messages: list[str] = []
        self.progress_calls: list[tuple[int, int]] = []
        self.progress_phases: list[tuple[str, str]] = []
        self.statuses: list[str] = []

    def progress(self, value: int, total: int, preview: Optional[Any] = None) -> None:
        self.progress_calls.append((value, total))

    def progress_phase(self, name: str, unit: str) -> None:
        self.progress_phases.append((name, unit))

    def check_cancel(self) -> None:
        if self.cancel_requested:
            raise Cancelled("generation cancelled by the user")

    def make_room(self, num_bytes: int, device: Any) -> None:
        return None

    def status(self, text: str) -> None:
        self.statuses.append(text)

    def log(self, message: str) -> None:
        self.messages.append(message)
        if self.verbose:
            import sys

            print(message, file=sys.stderr)


@contextmanager
def held_unless_cancelled(lock: "threading.Lock | threading.RLock", host: Host) -> Iterator[None]:
    """Hold `lock` while inside; while another job holds it, the host is asked every CANCEL_POLL_S whether to stop
    waiting (its `check_cancel` raises Cancelled), so a job queued behind a long one cancels within a second."""
    while not lock.acquire(timeout=CANCEL_POLL_S):
        host.check_cancel()
    try:
        yield
    finally:
        lock.release()
