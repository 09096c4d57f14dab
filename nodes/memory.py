"""How much device memory a local pipe asks ComfyUI to free before it runs."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

ACTIVATION_RESERVE_BYTES = 2 * 1024**3
COMPONENTS = ("transformer", "text_encoder", "vae")


def _size_on_disk(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and f.suffix in (".safetensors", ".gguf"))


def bytes_to_free(pipe: Any) -> Optional[int]:
    """The room a local pipe on a GPU needs: its budget when one is set, else its largest phase plus activations.

    Phases (text encoder, DiT, VAE) are resident one at a time, so the largest one bounds the weights.
    None when the pipe is not local or not on a GPU: nothing to ask of ComfyUI then.
    """
    device = getattr(pipe, "device", None)
    if getattr(pipe, "kind", None) != "local" or getattr(device, "type", None) != "cuda":
        return None
    budget_gb = getattr(getattr(pipe, "options", None), "vram_budget_gb", None)
    if budget_gb:
        return int(budget_gb * 1024**3)
    sources = pipe.sources
    largest = max(_size_on_disk(sources.component(name)) for name in COMPONENTS)
    return largest + ACTIVATION_RESERVE_BYTES
