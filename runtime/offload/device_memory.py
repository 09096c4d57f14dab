"""What a CUDA device can give a pipe now, read the same way under either of PyTorch's allocator backends.

PyTorch's statistics mean different things per backend (torch.cuda.get_allocator_backend()):
- "native" (the caching allocator): memory_reserved() counts the segments of every pool, including private
  pools (CUDA graphs; ComfyUI's DynamicVRAM routes each node's allocations to a fresh torch.cuda.MemPool) whose
  idle blocks the running thread cannot allocate from, and empty_cache() leaves those in place.
- "cudaMallocAsync" (ComfyUI's default allocator): memory_reserved() is the reserved memory of the device's
  default CUDA memory pool, shared by every cudaMallocAsync user in the process, and memory_allocated() is the
  pool's in-use memory as the driver sees it; empty_cache() trims the pool.
So "reserved - allocated" is not "cached and reusable by us" under both. What both agree on: after
empty_cache() the idle memory this thread could reuse is back with the driver, and mem_get_info() counts it as
free. The 'auto' budget is read that way.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

BACKENDS = ("native", "cudaMallocAsync")


def allocator_backend() -> str:
    """PyTorch's CUDA allocator backend ("native" or "cudaMallocAsync"), "none" without CUDA."""
    if not torch.cuda.is_available():
        return "none"
    try:
        return str(torch.cuda.get_allocator_backend())
    except (RuntimeError, AttributeError):
        return "native"


@dataclass(frozen=True)
class DeviceMemory:
    free: int  # bytes the driver would give out now (after the idle cache was handed back)
    total: int
    idle_left: int  # reserved but unused bytes the trim could not hand back (private pools), not counted as free
    backend: str


def usable_device_memory(device: "torch.device | str") -> DeviceMemory:
    """Free and total bytes of `device` once this process's idle cached blocks are handed back to the driver."""
    device = torch.device(device)
    torch.cuda.empty_cache()  # native: unused segments of the default pools; cudaMallocAsync: trims the pool
    free, total = torch.cuda.mem_get_info(device)
    idle_left = max(torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device), 0)
    return DeviceMemory(int(free), int(total), int(idle_left), allocator_backend())


class JobMemoryMeter:
    """A job's device-memory peak as PyTorch's allocator saw it (both backends keep a reserved high-water mark),
    with what was reserved and held by the pipe when the job started: the job's own peak is
    peak_reserved - (reserved_at_start - held_at_start). Nothing is measured off CUDA."""

    def __init__(self, device: "torch.device | str") -> None:
        self.device = torch.device(device)
        self.record: dict[str, object] = {}

    def start(self, held_bytes: int) -> None:
        if self.device.type != "cuda":
            return
        torch.cuda.reset_peak_memory_stats(self.device)
        self.record = {"allocator": allocator_backend(), "held_at_start": int(held_bytes),
                       "reserved_at_start": int(torch.cuda.memory_reserved(self.device))}

    def finish(self) -> dict[str, object]:
        if self.device.type != "cuda" or not self.record:
            return {}
        return {**self.record, "peak_reserved": int(torch.cuda.max_memory_reserved(self.device)),
                "peak_allocated": int(torch.cuda.max_memory_allocated(self.device))}
