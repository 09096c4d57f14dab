"""One page-locked host slab for many tensors, without PyTorch's power-of-two rounding.

`torch.empty(..., pin_memory=True)` goes through the CachingHostAllocator, which rounds every request up to the
next power of two (6.5 GB of weights would lock 8 GB). Here a plain host tensor is allocated once and locked
in place with cudaHostRegister, so pinned bytes = weight bytes + alignment. Should registration fail, the slab
falls back to the caching allocator and reports the rounded size it really locked; should that fail too (the
system's locked-memory limit), it stays pageable: every copy still works, synchronously.

Locking is paid page by page: cudaHostRegister on fresh memory faults every 4 KB page in one thread (1.8-2.8 GB/s
on an H200 host: 5.5-8.5 s for a 15.7 GB LoRA backup). The slab is therefore an anonymous mapping advised to use
transparent huge pages (2 MB pages where the system allows them), its pages are faulted in by PyTorch's threads
(`zero_`), and only then registered: 12-16 GB/s on the same host (bench/host_memory.py).
"""
from __future__ import annotations

import logging
import mmap
import weakref

import torch

from ..core.rounding import power_of_two_at_least

log = logging.getLogger(__name__)


class HostSlab:
    """`nbytes` of host memory as a flat uint8 tensor; page-locked when `pin` (needs CUDA)."""

    def __init__(self, nbytes: int, pin: bool) -> None:
        self.nbytes = int(nbytes)
        self.pinned_bytes = 0
        self._registered_ptr = 0
        if not pin:
            self.data = torch.empty(self.nbytes, dtype=torch.uint8)
            return
        # The whole tensor is registered from its storage's first byte: PyTorch's `is_pinned()` (which decides
        # whether a copy may be asynchronous) looks at the storage base, so a registered inner slice reads False.
        raw = faulted_in_host_memory(self.nbytes)
        status = torch.cuda.cudart().cudaHostRegister(raw.data_ptr(), self.nbytes, 0)
        if int(status) == 0:
            self.data = raw
            self._registered_ptr = raw.data_ptr()
            self.pinned_bytes = self.nbytes
            self._finalizer = weakref.finalize(self, _unregister, self._registered_ptr, raw)
            return
        log.warning("cudaHostRegister failed (%s); pinning through PyTorch, rounded up to a power of two", status)
        try:
            self.data = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=True)
        except RuntimeError as error:  # the system's page-locking limit: correct, only the copies get slower
            log.warning("page-locking %.1f GB of host memory failed (%s); using pageable memory, so copies to the "
                        "device are slower", self.nbytes / 1e9, str(error).splitlines()[0][:160])
            self.data = raw
            return
        del raw
        self.pinned_bytes = power_of_two_at_least(self.nbytes)

    def free(self) -> None:
        finalizer = getattr(self, "_finalizer", None)
        if finalizer is not None:
            finalizer()
        self.data = torch.empty(0, dtype=torch.uint8)
        self.pinned_bytes = 0


def faulted_in_host_memory(nbytes: int) -> torch.Tensor:
    """`nbytes` of zeroed host memory, every page already present: on huge pages where the system grants them
    (madvise mode included), faulted in by all of PyTorch's CPU threads rather than page by page later."""
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    try:
        region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except (AttributeError, OSError, ValueError):  # no anonymous private mappings (Windows): ordinary memory
        return torch.empty(nbytes, dtype=torch.uint8).zero_()
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            region.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # huge pages switched off: 4 KB pages, still faulted in by many threads
            pass
    memory = torch.frombuffer(region, dtype=torch.uint8)  # the tensor keeps the mapping alive; unmapped with it
    return memory.zero_()


def _unregister(ptr: int, raw: torch.Tensor) -> None:
    # `raw` is held until the memory is unlocked: freeing locked pages first would leave them locked.
    torch.cuda.cudart().cudaHostUnregister(ptr)
    del raw
