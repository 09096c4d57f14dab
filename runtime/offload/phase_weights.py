"""A module's weights in one page-locked host slab, on the device only for its phase.

A phase-placed model (the prompt enhancer at budgets where it fits whole but not beside the DiT) used to move with
`module.to(device)` and back with `module.to("cpu")`: 6.9 GB copied into fresh pageable host memory after every
rewrite (4.5 s on an H200 host) and back from pageable memory before the next (1.3 s). Here the host copy is made
once, page-locked, and never written again: `enter()` copies the slab into one device buffer and points every
parameter and buffer at its view there; `leave()` points them back at the slab and lets the device buffer go. A
phase does not change weights, so nothing is copied back.

Tensors keep their registration order and sit back to back where their sizes allow (256-byte starts), so weights
a decoder wants stacked (q/k/v, gate/up: `static_decoder.stack_weights_`) are already consecutive views of one
buffer and stacking them copies nothing.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from .pinned import HostSlab
from .streamer import ALIGN, typed_view


@dataclass(frozen=True)
class _Slot:
    owner: nn.Module
    name: str
    is_parameter: bool
    key: int  # index into the unique tensors: tied weights share one


@dataclass(frozen=True)
class _Span:
    start: int
    dtype: torch.dtype
    shape: torch.Size


class PhaseWeights:
    """Every parameter and buffer of `module` (materialised anywhere) copied once into a host slab, page-locked when
    `device` is a CUDA device; afterwards the module's tensors are the slab's views until `enter`.

    Each side (slab, device buffer) gets Parameters of its own, made outside inference mode: a Parameter a decoder
    made under inference mode cannot be given other data, and tied weights stay tied (one Parameter per unique
    tensor, set wherever the original was)."""

    def __init__(self, module: nn.Module, device: torch.device) -> None:
        self.device = torch.device(device)
        self._slots: list[_Slot] = []
        sources: list[Optional[torch.Tensor]] = []
        self._is_parameter: list[bool] = []
        seen: dict[int, int] = {}
        for owner in module.modules():
            for is_parameter, table in ((True, owner._parameters), (False, owner._buffers)):
                for name, tensor in table.items():
                    if tensor is None:
                        continue
                    key = seen.setdefault(id(tensor), len(sources))
                    if key == len(sources):
                        sources.append(tensor)
                        self._is_parameter.append(isinstance(tensor, nn.Parameter))
                    self._slots.append(_Slot(owner, name, is_parameter, key))
        self._spans: list[_Span] = []
        offset = 0
        for tensor in sources:
            offset = -(-offset // ALIGN) * ALIGN
            nbytes = tensor.numel() * tensor.element_size()
            self._spans.append(_Span(offset, tensor.dtype, tensor.shape))
            offset += nbytes
        self.nbytes = offset
        self.slab = HostSlab(self.nbytes, pin=self.device.type == "cuda")
        with torch.inference_mode(False), torch.no_grad():
            host_tensors = self._tensors(self.slab.data)
        slots_of: dict[int, list[_Slot]] = {}
        for slot in self._slots:
            slots_of.setdefault(slot.key, []).append(slot)
        with torch.no_grad():
            for key, view in enumerate(host_tensors):  # each source is dropped once copied: no second host copy
                view.copy_(sources[key].detach())
                sources[key] = None
                self._point_at(host_tensors, slots_of[key])
        self._host_tensors = host_tensors
        self._device_buffer: Optional[torch.Tensor] = None

    @property
    def on_device(self) -> bool:
        return self._device_buffer is not None

    @property
    def pinned_bytes(self) -> int:
        return self.slab.pinned_bytes

    def enter(self) -> None:
        """The weights on the device: one buffer, one copy from the slab (asynchronous from page-locked memory)."""
        if self._device_buffer is not None:
            return
        with torch.inference_mode(False), torch.no_grad():
            buffer = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
            buffer.copy_(self.slab.data, non_blocking=self.slab.pinned_bytes > 0)
            tensors = self._tensors(buffer)
        self._device_buffer = buffer
        self._point_at(tensors)

    def leave(self) -> None:
        """The weights back on the slab's tensors; the device buffer is freed once nothing else holds a view of it
        (a decoder's stacked views, say, go with the decoder)."""
        if self._device_buffer is None:
            return
        self._point_at(self._host_tensors)
        self._device_buffer = None

    def release(self) -> None:
        """Drop the device buffer and the slab (call once the module's tensors point elsewhere, e.g. at meta)."""
        self._device_buffer = None
        self._host_tensors = []
        self.slab.free()

    def _tensors(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Per unique tensor, its view of `flat` (a Parameter where the original was one)."""
        views = [typed_view(flat, span.start, span.dtype, tuple(span.shape)) for span in self._spans]
        return [nn.Parameter(view, requires_grad=False) if is_parameter else view
                for view, is_parameter in zip(views, self._is_parameter)]

    def _point_at(self, tensors: list[torch.Tensor], slots: Optional[list[_Slot]] = None) -> None:
        """Every slot (or those given) gets its tensor of `tensors`, over whatever it holds now (a decoder's stacked
        view included)."""
        for slot in self._slots if slots is None else slots:
            table = slot.owner._parameters if slot.is_parameter else slot.owner._buffers
            table[slot.name] = tensors[slot.key]
