"""Triton kernel modules, loaded on first use so the pack imports without Triton.

A kernel module (a file beside this one that imports triton at its top) is loaded once per mode: compiled for
CUDA tensors, or interpreted for CPU tensors when TRITON_INTERPRET=1 is set (Triton's interpreter, for tests;
never in production, it is slow). Each mode gets its own copy of the module because `triton.jit` decides
compiled vs interpreted when a kernel is defined.
"""
from __future__ import annotations

import importlib.util
import logging
import os
import sys
import threading
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

_modules: dict[tuple[str, bool], ModuleType | None] = {}
_lock = threading.Lock()


def kernels_for(stem: str, device: torch.device) -> ModuleType | None:
    """The kernel module `stem` (a file name without .py) for tensors on `device`, or None where Triton cannot
    run them (then the caller's torch path runs)."""
    interpret = device.type != "cuda"
    if interpret and os.environ.get("TRITON_INTERPRET") != "1":
        return None
    key = (stem, interpret)
    if key in _modules:  # every forward asks: no lock once loaded
        return _modules[key]
    with _lock:
        if key not in _modules:
            _modules[key] = _load(stem, interpret)
        return _modules[key]


def _load(stem: str, interpret: bool) -> ModuleType | None:
    name = f"{__package__}._{stem}_{'interpreted' if interpret else 'compiled'}"
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
    try:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{stem}.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # triton looks kernels' modules up by name
        spec.loader.exec_module(module)
        return module
    except ImportError:  # no triton: the torch path is the only one
        sys.modules.pop(name, None)
        return None
    except Exception as err:  # a broken triton install must not break the torch path
        sys.modules.pop(name, None)
        log.warning("Triton kernels unavailable (%s: %s); using torch", type(err).__name__, err)
        return None
    finally:
        if previous is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = previous


def cdiv(count: int, per_program: int) -> int:
    """Programs for `count` items at `per_program` each (a launch grid's size), as triton.cdiv."""
    return -(-count // per_program)
