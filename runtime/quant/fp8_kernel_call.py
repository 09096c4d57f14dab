"""How the FP8 activation kernels (triton_fp8_kernels.py) are called: as custom ops, each with its torch form
beside it, which runs where the kernel cannot (no Triton, a CPU tensor without the interpreter, an input the
kernel does not take) and computes what the kernel computes.

A custom op is opaque to torch.compile, so a compiled block calls the kernel as it is. Triton asks the driver about
each tensor's address before a launch, which fails inside a CUDA-graph capture under cudaMallocAsync (the memory the
capture allocates is mapped only when the graph runs): there the launch is made again with the tensors' integer
addresses (`as_arguments`), which Triton takes as they are. A kernel failure (a compile failure on an untested GPU
or Triton) turns the kernels off on that device type for good, with one warning; inside a capture it only makes
that graph hold the torch form.
"""
from __future__ import annotations

import contextlib
import logging
from types import ModuleType
from typing import Callable, TypeVar

import torch

from .triton_loader import kernels_for

Result = TypeVar("Result")
_failed: set[str] = set()  # device types where a kernel failed once: the torch forms run there from then on
log = logging.getLogger(__name__)


def kernel_or_torch_form(what: str, device: torch.device, kernel_takes: bool,
                         launch: Callable[[ModuleType, bool], Result], torch_form: Callable[[], Result]) -> Result:
    """`launch(kernels, addresses)` where the kernel `what` can run on `device` and takes the input
    (`kernel_takes`), else `torch_form()`. Inside a CUDA-graph capture a launch Triton refuses is made again with
    the tensors' addresses (`as_arguments`), and only then left to the torch form."""
    kernels = kernels_usable(device) if kernel_takes else None
    if kernels is None:
        return torch_form()
    try:
        return launch(kernels, False)
    except torch.cuda.OutOfMemoryError:
        raise
    except Exception as err:  # the torch form computes the same
        if _in_a_capture(device):
            return _in_the_capture(what, kernels, launch, torch_form, err)
        _failed.add(device.type)
        log.warning("the FP8 %s kernel failed (%s: %s); using the torch forms from now on", what,
                    type(err).__name__, str(err)[:300])
        return torch_form()


def kernels_usable(device: torch.device) -> ModuleType | None:
    """The kernels module for tensors on `device`, or None where Triton cannot run them or a kernel failed there."""
    return None if device.type in _failed else kernels_for("triton_fp8_kernels", device)


def _in_the_capture(what: str, kernels: ModuleType, launch: Callable[[ModuleType, bool], Result],
                    torch_form: Callable[[], Result], refused: Exception) -> Result:
    """Under cudaMallocAsync Triton cannot check the memory a capture allocates (it is mapped only when the graph
    runs): the kernel is given the addresses; where that fails too (a tensor not 16-byte aligned), this graph holds
    the torch form and other calls keep the kernel."""
    try:
        return launch(kernels, True)
    except torch.cuda.OutOfMemoryError:
        raise
    except Exception as err:
        log.debug("the FP8 %s kernel cannot run inside this graph capture (%s: %s; given addresses, %s: %s); the "
                  "graph holds the torch form", what, type(refused).__name__, str(refused)[:200],
                  type(err).__name__, str(err)[:200])
        return torch_form()


def _in_a_capture(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def as_arguments(tensors: tuple[torch.Tensor, ...], addresses: bool) -> tuple:
    """The tensors as a kernel's arguments: themselves, or (`addresses`) their integer addresses, which the kernels'
    ADDRESSES form takes as 16-byte aligned pointers (ValueError where one is not)."""
    if not addresses:
        return tensors
    for tensor in tensors:
        if tensor.data_ptr() % 16:
            raise ValueError("a tensor given by its address is not 16-byte aligned")
    return tuple(tensor.data_ptr() for tensor in tensors)


_AN_ALIGNED_ADDRESS = 1 << 40  # 16-byte aligned and past 32 bits, as a device address is: the same specialisation


def placeholders(dtypes: tuple[torch.dtype, ...], addresses: bool) -> tuple:
    """What `as_arguments` gives for 16-byte aligned tensors of `dtypes`, as Triton's `warmup` (a compile without a
    launch) takes them: the dtypes themselves, or addresses of the kind the ADDRESSES form is given."""
    return tuple(_AN_ALIGNED_ADDRESS for _ in dtypes) if addresses else dtypes


def on_device(device: torch.device):
    """The context a launch runs in: Triton launches on the current CUDA device, which must be the tensors'."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def registered_op(name: str, schema: str, impl: Callable, fake: Callable) -> object:
    """The custom op `name` ("namespace::op"), registered with `impl` and its fake (shapes only); where another
    copy of the pack in the process (an installed one beside ComfyUI's) registered it already, that copy's op,
    which computes the same where both copies are one version."""
    namespace, op_name = name.split("::")
    try:
        return getattr(getattr(torch.ops, namespace), op_name)
    except (AttributeError, RuntimeError):
        pass
    op = torch.library.custom_op(name, mutates_args=(), schema=schema)(impl)
    op.register_fake(fake)
    return op


def quantised_like(rows: int, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty e4m3 [rows, n] values and fp32 [rows, 1] scales: what every kernel writes."""
    return (torch.empty((rows, n), dtype=torch.float8_e4m3fn, device=device),
            torch.empty((rows, 1), dtype=torch.float32, device=device))
