"""The FP8 activation kernels compiled before the DiT's first call, on a thread beside the DiT's load.

Triton compiles a kernel when it is first launched in a form it has not compiled: in a process whose kernel cache
is empty (the first run after an install or an upgrade), the FP8 DiT's kernels (gelu(gate) * up, the adaLN input with
the residual and without, plain rows; under cudaMallocAsync also the address forms CUDA-graph captures launch) cost
seconds of the first image. Triton's `warmup` compiles them without a launch and without device memory; it holds
Python's GIL for little of that time, so the weights load beside it. Where the cache holds them, each takes
milliseconds. A compile that fails here is left to the launch, which falls back as it always does
(fp8_kernel_call.py).
"""
from __future__ import annotations

import logging
import threading
from typing import Callable, Optional

import torch

from . import fp8_gated, fp8_modulated, fp8_rows
from .fp8_kernel_call import kernels_usable, on_device

log = logging.getLogger(__name__)


def kernel_forms(hidden: int, ffn: int, addresses: bool) -> list[Callable]:
    """Each form a DiT of this width launches, as a call that compiles it from the kernels module: tensors given as
    themselves, and by their `addresses` too where captures will launch them so."""
    forms = []
    for by_address in (False, True) if addresses else (False,):
        forms += [lambda kernels, a=by_address: fp8_gated.compile_ahead(kernels, ffn, a),
                  lambda kernels, a=by_address: fp8_modulated.compile_ahead(kernels, hidden, False, a),
                  lambda kernels, a=by_address: fp8_modulated.compile_ahead(kernels, hidden, True, a),
                  lambda kernels, a=by_address: fp8_rows.compile_ahead(kernels, hidden, a)]
    return forms


def captures_launch_by_address() -> bool:
    """Under cudaMallocAsync a capture's own memory is given to the kernels by address (fp8_kernel_call.py)."""
    return torch.cuda.get_allocator_backend() == "cudaMallocAsync"


def start(device: torch.device, hidden: int, ffn: int) -> Optional[threading.Thread]:
    """A thread compiling the kernels an FP8 DiT of width `hidden` (MLP `ffn`) launches on `device`; None where the
    kernels cannot run there. Join it before the DiT's first call: nothing else waits for it."""
    kernels = kernels_usable(device)
    if kernels is None or device.type != "cuda":
        return None
    forms = kernel_forms(hidden, ffn, captures_launch_by_address())

    def compile_all() -> None:
        try:
            with on_device(device):
                for form in forms:
                    form(kernels)
        except Exception as err:  # the first launch compiles it, or falls back to the torch form
            log.debug("compiling the FP8 kernels ahead failed (%s: %s)", type(err).__name__, str(err)[:300])

    thread = threading.Thread(target=compile_all, name="ernie-image-fp8-kernels", daemon=True)
    thread.start()
    return thread
