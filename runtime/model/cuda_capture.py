"""What every CUDA-graph capture in the runtime shares: one side stream per device, and repairing the device's
random number generator after a capture that failed."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

_CAPTURE_STREAMS: dict[torch.device, "torch.cuda.Stream"] = {}


def capture_stream(device: torch.device) -> "torch.cuda.Stream":
    """One side stream per device for warm-ups and captures: each new stream would get (and keep) its own cuBLAS
    workspace, so a fresh stream per capture would grow the process's memory by ~32 MB a call."""
    device = torch.device(device)
    if device not in _CAPTURE_STREAMS:
        _CAPTURE_STREAMS[device] = torch.cuda.Stream(device)
    return _CAPTURE_STREAMS[device]


def heal_generator_after_failed_capture(device: torch.device) -> None:
    """A capture registers the device's default generator and marks its state as capturing; a capture that fails
    (a host sync inside it, say) never reaches the end that clears the mark, and from then on every random op on
    the device, in this process and in the host application's other code, raises "Offset increment outside graph
    capture encountered unexpectedly". Give the generator a fresh state with the same seed and offset."""
    device = torch.device(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    generator = torch.cuda.default_generators[index]
    fresh = torch.Generator(device=device)
    try:
        fresh.set_state(generator.get_state())
    except RuntimeError:
        fresh.manual_seed(generator.initial_seed())
    generator.graphsafe_set_state(fresh.graphsafe_get_state())


@contextmanager
def host_syncs_raise() -> Iterator[None]:
    """Make a CUDA operation that waits for the host (`.item()`, a blocking copy, a synchronize) raise instead of
    running, for the duration (PyTorch's sync debug mode, process-wide). A forward that passes under it can be
    captured; one that fails must not be: an invalidated capture aborts the process under cudaMallocAsync when
    PyTorch frees the temporaries it made inside it."""
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def is_host_sync_error(error: BaseException) -> bool:
    return isinstance(error, RuntimeError) and "called a synchronizing CUDA operation" in str(error)
