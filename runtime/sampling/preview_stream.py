"""Per-step latent previews that never make a step wait for the device.

A preview shows the step's denoised estimate x0 = latents - sigma * velocity of the first image (what ComfyUI's
latent previewer is given), projected to RGB where the latents are (preview.py). On a CUDA device its few bytes go
to page-locked host memory by a non-blocking copy behind the step, with an event: the picture of step n is handed
to the host at step n + 1, once step n + 1's work is queued, so the device always has a step to run while the host
reads it (and the host runs at most one step ahead of the device, so progress and Cancel stay timely). The last
step's picture is waited for: the run ends there anyway. On the CPU the picture is the step's own, copied at once.

A run builds one only for a host that wants previews (core.host.wants_previews): without one the sampler does no
preview work at all.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from .preview import preview_image, preview_pixels


@dataclass
class _Copy:
    host: torch.Tensor  # page-locked RGB bytes the copy lands in
    done: "torch.cuda.Event"


class PreviewStream:
    """`after_step(latents, velocity, sigma, last)` once per step: the picture to hand to the host now, or None."""

    def __init__(self, device: torch.device, max_side: int = 512) -> None:
        self.device = torch.device(device)
        self.max_side = max_side
        self._pending: Optional[_Copy] = None  # the last step's copy, handed over at the next step
        self._spare: Optional[torch.Tensor] = None  # the page-locked buffer free for the next copy

    def after_step(self, latents: torch.Tensor, velocity: torch.Tensor, sigma: float, last: bool = False
                   ) -> Optional[Any]:
        """`latents` and `velocity` as the step used them (after an image input's own rules), `sigma` its sigma;
        `last`: the run's final step, whose own picture is returned."""
        pixels = preview_pixels(latents[:1] - sigma * velocity[:1])
        if self.device.type != "cuda":
            return preview_image(pixels, self.max_side)
        previous, self._pending = self._pending, self._start_copy(pixels)
        if last:
            own, self._pending = self._pending, None
            return self._take(own)
        return self._take(previous) if previous is not None else None

    def _start_copy(self, pixels: torch.Tensor) -> _Copy:
        host = self._spare
        if host is None or host.shape != pixels.shape:
            host = torch.empty(pixels.shape, dtype=torch.uint8, pin_memory=True)
        self._spare = None
        host.copy_(pixels, non_blocking=True)
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.device))
        return _Copy(host, done)

    def _take(self, copy: _Copy) -> Any:
        """The copy's picture; its buffer becomes the spare. Waits only for work queued before the step now queued."""
        copy.done.synchronize()
        picture = preview_image(copy.host, self.max_side)
        self._spare = copy.host
        return picture
