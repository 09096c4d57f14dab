"""The device memory CUDA graphs hold under the cudaMallocAsync allocator: read and handed back through the CUDA
driver (PyTorch exposes neither)."""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys
from typing import Optional

import torch


def give_back_graph_memory(device: torch.device) -> None:
    """Hand the memory of CUDA graphs that are gone back to the driver. Under cudaMallocAsync (current ComfyUI's
    default allocator) what a capture allocates comes from the device's graph memory, which the driver keeps
    reserved after the graphs are destroyed, where neither PyTorch's pool nor ComfyUI's empty-cache reaches it:
    a freed pipe, or a plan's next phase, would find it still taken. The native allocator's graph pools go back
    with torch.cuda.empty_cache() instead. Waits for the device's queued work first: the trim keeps the blocks of
    replays still queued (a cancelled run's last ones), and nothing would trim them later."""
    device = torch.device(device)
    if device.type != "cuda" or sys.is_finalizing() or not torch.cuda.is_initialized():
        return
    if torch.cuda.get_allocator_backend() != "cudaMallocAsync":
        return
    torch.cuda.synchronize(device)
    driver, handle = _driver_device(device)
    if handle is not None:
        driver.cuDeviceGraphMemTrim(handle)


GRAPH_MEM_RESERVED_CURRENT = 2  # CUgraphMem_attribute: CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT


def graph_memory_reserved(device: torch.device) -> Optional[int]:
    """Bytes the driver keeps reserved for CUDA graphs' allocations on `device` (None off CUDA or unreadable)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_initialized():
        return None
    driver, handle = _driver_device(device)
    value = ctypes.c_uint64()
    if handle is None or driver.cuDeviceGetGraphMemAttribute(handle, GRAPH_MEM_RESERVED_CURRENT, ctypes.byref(value)):
        return None
    return int(value.value)


def _driver_device(device: torch.device) -> tuple[Optional[ctypes.CDLL], Optional[ctypes.c_int]]:
    driver = _cuda_driver()
    if driver is None:
        return None, None
    ordinal = device.index if device.index is not None else torch.cuda.current_device()
    handle = ctypes.c_int()
    if driver.cuDeviceGet(ctypes.byref(handle), ctypes.c_int(ordinal)) != 0:
        return driver, None
    return driver, handle


@functools.lru_cache(maxsize=1)
def _cuda_driver() -> Optional[ctypes.CDLL]:
    """The CUDA driver library (every CUDA process has it loaded); None where it cannot be opened."""
    for name in ("libcuda.so.1", "nvcuda.dll"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    found = ctypes.util.find_library("cuda")  # runs ldconfig: only where the usual names fail
    try:
        return ctypes.CDLL(found) if found else None
    except OSError:
        return None
