"""The 'auto' VRAM budget under both of PyTorch's CUDA allocator backends, with the device faked.

FakeCuda keeps the books a real device keeps (driver-free bytes, bytes in use, idle cached bytes in the default
pool and in private pools) and answers torch.cuda's statistics the way each backend defines them
(c10/cuda/CUDACachingAllocator.cpp, CUDAMallocAsyncAllocator.cpp):
- native: memory_reserved = every segment of every pool; empty_cache() hands back the default pools' idle
  segments, but not those of a private pool in use (ComfyUI's DynamicVRAM runs each node in a torch.cuda.MemPool).
- cudaMallocAsync: memory_reserved / memory_allocated = the default CUDA mempool's reserved / used memory;
  empty_cache() trims the pool.
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from ernie_image.runtime.offload import device_memory
from ernie_image.runtime.offload.planner import GiB, auto_budget, budget_bytes


@dataclass
class FakeCuda:
    backend: str
    total: int = 80 * GiB
    in_use: int = 0  # bytes of live tensors (ComfyUI's models, this pipe's weights)
    default_idle: int = 0  # freed blocks kept by the allocator, reusable by any allocation
    private_idle: int = 0  # freed blocks of a private MemPool (native only): reusable only inside that pool
    private_pool_active: bool = False
    other_processes: int = 0
    empty_cache_calls: int = 0

    def install(self, monkeypatch: pytest.MonkeyPatch) -> "FakeCuda":
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_allocator_backend", lambda: self.backend)
        monkeypatch.setattr(torch.cuda, "empty_cache", self.empty_cache)
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (self.driver_free(), self.total))
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: self.reserved())
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: self.in_use)
        return self

    def reserved(self) -> int:
        return self.in_use + self.default_idle + self.private_idle

    def driver_free(self) -> int:
        return self.total - self.other_processes - self.reserved()

    def empty_cache(self) -> None:
        self.empty_cache_calls += 1
        self.default_idle = 0
        if self.backend == "native" and not self.private_pool_active:
            self.private_idle = 0  # the pool is no longer in use: freeable


def reserve(total: int) -> int:
    """What 'auto' keeps back for the CUDA context and others (auto_budget of 0 free bytes is floored at 0)."""
    return total - auto_budget(total, total)


@pytest.mark.parametrize("backend", ["native", "cudaMallocAsync"])
def test_auto_budget_counts_idle_cached_memory_once_under_either_backend(monkeypatch, backend) -> None:
    cuda = FakeCuda(backend, in_use=10 * GiB, default_idle=6 * GiB).install(monkeypatch)
    budget = budget_bytes("auto", "cuda")
    # 80 GiB card, 10 GiB in use by others: the 6 GiB the allocator kept idle are usable, counted once.
    assert budget == 70 * GiB - reserve(cuda.total)
    assert cuda.empty_cache_calls == 1 and cuda.default_idle == 0


@pytest.mark.parametrize("backend", ["native", "cudaMallocAsync"])
def test_auto_budget_adds_the_pipes_own_weights_and_nothing_of_comfyuis(monkeypatch, backend) -> None:
    cuda = FakeCuda(backend, in_use=30 * GiB).install(monkeypatch)  # 12 GiB this pipe's, 18 GiB ComfyUI's
    assert budget_bytes("auto", "cuda", held_by_pipe=12 * GiB) == 50 * GiB + 12 * GiB - reserve(cuda.total)


def test_idle_blocks_of_a_private_pool_are_not_counted_as_usable(monkeypatch) -> None:
    """DynamicVRAM: a node's MemPool keeps 20 GiB of idle blocks that this thread's allocations (routed to the
    next node's pool) cannot reuse and empty_cache() does not hand back. reserved - allocated would count them."""
    cuda = FakeCuda("native", in_use=10 * GiB, private_idle=20 * GiB, private_pool_active=True).install(monkeypatch)
    old_reading = cuda.driver_free() + (cuda.reserved() - cuda.in_use)
    memory = device_memory.usable_device_memory("cuda")
    assert memory.free == 50 * GiB and memory.idle_left == 20 * GiB and memory.backend == "native"
    assert budget_bytes("auto", "cuda") == 50 * GiB - reserve(cuda.total)
    assert old_reading - reserve(cuda.total) == 70 * GiB - reserve(cuda.total)  # 20 GiB that no allocation gets


def test_the_pool_of_the_async_allocator_is_trimmed_before_it_is_read(monkeypatch) -> None:
    cuda = FakeCuda("cudaMallocAsync", in_use=4 * GiB, default_idle=40 * GiB, other_processes=6 * GiB).install(monkeypatch)
    memory = device_memory.usable_device_memory("cuda")
    assert (memory.free, memory.total, memory.idle_left, memory.backend) == (70 * GiB, 80 * GiB, 0, "cudaMallocAsync")


def test_a_given_budget_reads_nothing_of_the_device(monkeypatch) -> None:
    cuda = FakeCuda("cudaMallocAsync").install(monkeypatch)
    assert budget_bytes(12.0, "cuda") == 12 * GiB and cuda.empty_cache_calls == 0


def test_allocator_backend_without_cuda_is_none(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert device_memory.allocator_backend() == "none"
    assert budget_bytes("auto", "cpu") is None
