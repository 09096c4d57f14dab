"""The original tensors of one merged Linear, kept in host memory so that unmerging restores them bit for bit.

Made once, before the Linear's first merge, from the tensors as they are on the device (so nothing is read from
the model files again); page-locked on CUDA (one HostSlab per tensor of 1 MB or more: no power-of-two rounding,
unlocked and freed with the backup), so the copies both ways run at full PCIe speed and asynchronously.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..offload.pinned import HostSlab

PIN_AT_LEAST = 1 << 20  # smaller tensors (FP8 scales) are kept in plain host memory: locking pages costs more


class LayerBackup:
    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        """`tensors`: name -> the live tensor (a parameter's or buffer's data) the merge will overwrite."""
        self.copies: dict[str, torch.Tensor] = {}
        self._slabs: list[HostSlab] = []
        for name, tensor in tensors.items():
            self.copies[name] = self._host_copy(tensor)

    def _host_copy(self, tensor: torch.Tensor) -> torch.Tensor:
        nbytes = tensor.numel() * tensor.element_size()
        if tensor.device.type != "cuda":
            return tensor.detach().clone()
        slab: Optional[HostSlab] = None
        if nbytes >= PIN_AT_LEAST:
            slab = HostSlab(nbytes, pin=True)
            self._slabs.append(slab)
            host = slab.data.view(tensor.dtype).view(tensor.shape)
        else:
            host = torch.empty(tensor.shape, dtype=tensor.dtype)
        host.copy_(tensor.detach(), non_blocking=slab is not None)  # stream-ordered before any later edit
        return host

    def restore(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy the originals back into the live tensors (same objects, same addresses)."""
        for name, live in tensors.items():
            live.copy_(self.copies[name], non_blocking=True)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.copies.values())

    @property
    def pinned_bytes(self) -> int:
        return sum(slab.pinned_bytes for slab in self._slabs)

    def free(self) -> None:
        """Unlock and free the host memory now; the caller has waited for copies from it to finish."""
        self.copies.clear()
        for slab in self._slabs:
            slab.free()
        self._slabs.clear()
