"""Running out of memory, said in one line: the phase, the job, the allocation that failed, and the fix. Device
(GPU) memory and host memory (RAM: the CPU's allocator, or Python's MemoryError) each have their own words.

A failed phase's tensors are referenced from the exception's traceback frames; a host that keeps the exception
(ComfyUI shows it later) would keep them allocated, so the chain is stripped of its tracebacks before re-raising.
"""
from __future__ import annotations

import re
from typing import Iterator, Optional

import torch

from ..core.errors import MemoryBudgetError
from ..core.request import GenerationRequest


PHASE_NAMES = {"setup": "setup", "pe": "prompt enhancer", "text": "text encoder", "dit": "DiT", "vae": "VAE decode",
               "encode": "VAE encode"}
PHASE_FIXES = {
    "pe": "or revise prompts on a PE chat endpoint (pe_endpoint)",
    "text": "or use a quantised (GGUF) text encoder",
    "vae": "or a smaller size or batch (under a budget the VAE decodes in tiles)",
    "encode": "or a smaller image or batch (under a budget the VAE encodes in tiles)",
}
DIT_FIX = "a smaller size or batch, or a quantised DiT (quant fp8/q8_0/q4_k/nvfp4, or a GGUF file)"
# Out of memory outside the caching allocator: a kernel launch, or cuBLAS creating its handle or workspace.
DRIVER_OUT_OF_MEMORY = ("CUDA error: out of memory", "CUBLAS_STATUS_ALLOC_FAILED")
_ALLOCATION = re.compile(r"Tried to allocate ([\d.]+ [KMGT]?i?B)")


def _chain(error: BaseException) -> Iterator[BaseException]:
    """`error` and every exception chained to it (`raise ... from`, or raised while handling), each once."""
    seen: set[int] = set()
    pending = [error]
    while pending:
        link = pending.pop()
        if link is None or id(link) in seen:
            continue
        seen.add(id(link))
        yield link
        pending += [link.__context__, link.__cause__]


def _out_of_memory(error: BaseException) -> Optional[BaseException]:
    """`error` or the exception it wraps (torch.compile and others re-raise) when it is the device running out."""
    for link in _chain(error):
        if isinstance(link, torch.OutOfMemoryError):
            return link
        if isinstance(link, RuntimeError) and any(marker in str(link) for marker in DRIVER_OUT_OF_MEMORY):
            return link
    return None


def _what_failed(request: GenerationRequest, allocation: Optional[str]) -> str:
    """The job ('1024x1024 batch 1 CFG 4') and, when the error said it, the allocation that failed."""
    cfg = f" CFG {request.cfg:g}" if request.uses_cfg else ""
    tried = f", tried to allocate {allocation}" if allocation else ""
    return f"{request.width}x{request.height} batch {request.batch}{cfg}{tried}"


def out_of_memory_message(error: BaseException, phase: str, request: GenerationRequest, device: torch.device,
                          budget_gb: Optional[float]) -> Optional[str]:
    """One line for a device that ran out of memory (None when `error` is something else): phase, job, the
    allocation that failed, and what to change."""
    oom = _out_of_memory(error)
    if oom is None:
        return None
    allocation = _ALLOCATION.search(str(oom))
    failed = _what_failed(request, allocation.group(1) if allocation else None)
    if budget_gb is not None and budget_gb != "auto":
        budget = f"lower the VRAM budget (vram_budget_gb, {float(budget_gb):g} GiB now)"
    else:
        budget = "set a VRAM budget (vram_budget_gb)"
    fix = PHASE_FIXES.get(phase, DIT_FIX)
    return f"out of GPU memory on {device} in the {PHASE_NAMES.get(phase, phase)} phase ({failed}): {budget}, {fix}"


_HOST_ALLOCATION = re.compile(r"DefaultCPUAllocator: .*?you tried to allocate (\d+) bytes")


def _out_of_host_memory(error: BaseException) -> Optional[BaseException]:
    """`error` or the exception it wraps when it is host RAM running out: Python's MemoryError or torch's CPU
    allocator failing ("DefaultCPUAllocator: can't allocate memory: you tried to allocate N bytes")."""
    for link in _chain(error):
        if isinstance(link, MemoryError) or (isinstance(link, RuntimeError) and _HOST_ALLOCATION.search(str(link))):
            return link
    return None


def _size(count: int) -> str:
    for unit, scale in (("PiB", 1 << 50), ("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20)):
        if count >= scale:
            return f"{count / scale:.1f} {unit}"
    return f"{count} bytes"


def out_of_host_memory_message(error: BaseException, phase: str, request: GenerationRequest,
                               device: torch.device) -> Optional[str]:
    """One line for host RAM that ran out (None when `error` is something else): phase, job, the allocation that
    failed, and what to change. It names the setting `device` (the CLI shows --device)."""
    oom = _out_of_host_memory(error)
    if oom is None:
        return None
    allocation = _HOST_ALLOCATION.search(str(oom))
    failed = _what_failed(request, _size(int(allocation.group(1))) if allocation else None)
    fix = ("use a smaller size or batch, or run on a GPU (device cuda)" if device.type == "cpu" else
           "use a smaller size or batch, or free host RAM (close other programs, keep fewer models loaded)")
    return f"out of host memory (RAM) in the {PHASE_NAMES.get(phase, phase)} phase ({failed}): {fix}"


def without_tracebacks(error: BaseException) -> BaseException:
    """`error` and the exceptions chained to it, stripped of their tracebacks: those hold the failed phase's frames
    and with them its device tensors, which would stay allocated while a host (ComfyUI) keeps the exception."""
    for link in _chain(error):
        link.__traceback__ = None
    return error


def memory_refusal(error: BaseException, phase: str, request: GenerationRequest, device: torch.device,
                   budget_gb: Optional[float]) -> Optional[MemoryBudgetError]:
    """The MemoryBudgetError to raise for `error` when it is device memory or host RAM running out (None for any
    other error), caused by `error` stripped of its tracebacks."""
    message = out_of_memory_message(error, phase, request, device, budget_gb)
    names: tuple[str, ...] = ("vram_budget_gb", "pe_endpoint", "quant")  # the settings its fixes name
    if message is None:  # host RAM rather than the device's: its fix names the device setting
        message, names = out_of_host_memory_message(error, phase, request, device), ("device",)
    if message is None:
        return None
    refusal = MemoryBudgetError(message).naming(*names)
    refusal.__cause__ = without_tracebacks(error)
    return refusal
