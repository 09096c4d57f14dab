"""How much device memory a pipe would ask ComfyUI to free for a request.

The local pipe plans this itself (LocalPipe.device_bytes_needed, runtime/offload/reserve.py) and asks its host
at the start of `generate` / `enhance`; this adapter is for callers that want the number without running.
"""
from __future__ import annotations

from typing import Any, Optional


def bytes_to_free(pipe: Any, request: Any) -> Optional[int]:
    """The pipe's own answer; None for a pipe that holds no device memory here (remote) or is off the GPU."""
    needed = getattr(pipe, "device_bytes_needed", None)
    return needed(request) if callable(needed) else None
