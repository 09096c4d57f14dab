"""Stream layers' weights from one host slab through a ring of fixed device buffers.

Setup (once): every tensor (parameters and buffers, whatever their dtype: bf16 weights or QuantLinear's packed
uint8/fp8 data alike) of each streamed layer is copied into a host slab (page-locked on CUDA) at a 256-byte
aligned offset. A layer's bytes are contiguous in both places, so one copy moves it.

Slots are handed out by a cursor that keeps rotating across steps: the j-th copy ever issued goes to slot
j % slots, and the layer's tensors are re-pointed at that slot (precomputed views, no allocation) when its copy
is issued. So the previous user of every slot is always the layer `slots` positions earlier in the stream, and
every copy is issued as soon as that layer is done: `slots - 1` layers ahead, across step boundaries too.
(A fixed slot per layer, k % slots, breaks this whenever r = n % slots != 0: the previous user of a next-step
layer k < r is then only r positions back, and copies go in stream order, so the first `slots - 1` copies of
every step overlap fewer than `slots - 1` layers; with r == 1 layer 0 even shares the slot of layer n-1.)
When n is a multiple of `slots` the cursor gives every layer the same slot each step and nothing is re-pointed.

Per layer, at run time, nothing is allocated:
  before(i): the compute stream waits for the "ready" event of the slot layer i's copy went to;
  after(i):  the compute stream records that slot's "free" event; copies of the next positions are issued on
             the side stream, each waiting for its slot's "free" event, then recording its "ready" event.
A layer is never re-pointed while it runs: the copies in flight are of the `slots` positions from the running
one on, which are distinct layers because `slots` <= n. Re-pointing only changes which address the layer's next
kernels get; kernels already queued keep reading the old slot, which no copy refills before its "free" event,
recorded after them.
A (re)start (first use, after unpark, after a run stopped inside a layer) makes the side stream wait for all the
compute queued so far before its first copies: a fresh ring may be memory whose previous tensors' kernels are
still queued (the allocator orders reuse on the compute stream only), and a stopped layer recorded no "free".

A route (`follow_route`, for a caller that runs only some layers, or some twice, in an order it knows ahead:
step_cache/): copies then follow the layer indices given to `extend_route`, in that order, and stop where the known
route ends until more is given, so a layer the caller will not run is not copied. A layer that comes again
while its previous visit still holds a slot waits (copies stay in route order) until that visit is done: it is
never re-pointed while it runs. `end_route` returns to every layer in turn. A caller that will know only later
whether some layers run (a step cache's decision) may `guess` them: they are copied as if routed, and the next
`extend_route` (even one naming no streamed layer) confirms the ones it begins with and drops the others, whose
copies are simply never used (their slots go to the next copies, in copy-stream order); a guessed layer run before
that is confirmed by running.

On the CPU the same bookkeeping runs with `FakeSync`: the "device" ring is a second CPU tensor and copies are
either run at once ("eager", catches a copy that overwrites a slot still in use) or deferred until the compute
side waits for them ("lazy", catches a missing wait). Tests use both to check the ordering, not just the maths.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Literal, Optional, Sequence

import torch
from torch import nn

from .pinned import HostSlab

ALIGN = 256
FakeMode = Literal["eager", "lazy"]


@dataclass
class _Entry:
    module: nn.Module
    name: str
    is_param: bool
    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype


def _aligned(value: int) -> int:
    return (value + ALIGN - 1) // ALIGN * ALIGN


def layer_tensors(layer: nn.Module) -> list[tuple[nn.Module, str, bool, torch.Tensor]]:
    """(owner, name, is_parameter, tensor) for every parameter and buffer of `layer`, shared ones once."""
    seen: set[int] = set()
    found = []
    for module in layer.modules():
        for is_param, table in ((True, module._parameters), (False, module._buffers)):
            for name, tensor in table.items():
                if tensor is None or id(tensor) in seen:
                    continue
                seen.add(id(tensor))
                found.append((module, name, is_param, tensor))
    return found


def _layout(layer: nn.Module) -> tuple[list[_Entry], int]:
    """Where each tensor of `layer` sits in its contiguous block, and the block's aligned size."""
    entries, offset = [], 0
    for module, name, is_param, tensor in layer_tensors(layer):
        entries.append(_Entry(module, name, is_param, offset, tuple(tensor.shape), tensor.dtype))
        offset = _aligned(offset + tensor.numel() * tensor.element_size())
    return entries, offset


def module_bytes(module: nn.Module) -> int:
    """Bytes of every parameter and buffer of `module` (shared ones once), whatever their dtype."""
    return sum(t.numel() * t.element_size() for _, _, _, t in layer_tensors(module))


def typed_view(flat: torch.Tensor, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """The bytes of flat uint8 `flat` from `offset` seen as a `dtype` tensor of `shape` (no copy)."""
    nbytes = math.prod(shape) * dtype.itemsize
    return flat[offset: offset + nbytes].view(dtype).view(shape)


def _bound(entry: _Entry) -> torch.Tensor:
    table = entry.module._parameters if entry.is_param else entry.module._buffers
    return table[entry.name]


def _point_views(entries: list[_Entry], views: Sequence[torch.Tensor]) -> None:
    """Rebind each entry's parameter or buffer to its view (same shape and dtype)."""
    for entry, view in zip(entries, views):
        if entry.is_param:
            entry.module._parameters[entry.name].data = view
        else:
            entry.module._buffers[entry.name] = view


def _point(entries: list[_Entry], flat: torch.Tensor) -> None:
    """Rebind each entry's parameter or buffer to its typed window of the layer block `flat`."""
    _point_views(entries, [typed_view(flat, e.offset, e.dtype, e.shape) for e in entries])


class CudaSync:
    """A side copy stream and, per ring slot, a "ready" (copy done) and a "free" (compute done) event."""

    def __init__(self, device: torch.device, slots: int) -> None:
        self.device = device
        self.copy_stream = torch.cuda.Stream(device)
        self.ready = [torch.cuda.Event() for _ in range(slots)]
        self.free = [torch.cuda.Event() for _ in range(slots)]

    def copy(self, slot: int, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.copy_stream.wait_event(self.free[slot])
        with torch.cuda.stream(self.copy_stream):
            dst.copy_(src, non_blocking=True)
        self.ready[slot].record(self.copy_stream)

    def wait_ready(self, slot: int) -> None:
        torch.cuda.current_stream(self.device).wait_event(self.ready[slot])

    def mark_free(self, slot: int) -> None:
        self.free[slot].record(torch.cuda.current_stream(self.device))

    def join(self) -> None:
        """Copies issued from now on wait for everything already queued on the compute stream."""
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))

    def synchronize(self) -> None:
        self.copy_stream.synchronize()
        torch.cuda.current_stream(self.device).synchronize()


class FakeSync:
    """CPU stand-in for CudaSync (see the module docstring); `copies` counts copies actually performed.

    Set `trace` to a list to have every call appended in issue order, for tests of the ordering:
    ("copy", slot, source data_ptr), ("wait", slot), ("free", slot), ("join",)."""

    def __init__(self, mode: FakeMode = "lazy") -> None:
        self.mode = mode
        self.pending: deque[tuple[int, torch.Tensor, torch.Tensor]] = deque()
        self.copies = 0
        self.trace: Optional[list[tuple]] = None

    def copy(self, slot: int, dst: torch.Tensor, src: torch.Tensor) -> None:
        if self.trace is not None:
            self.trace.append(("copy", slot, src.data_ptr()))
        self.pending.append((slot, dst, src))
        if self.mode == "eager":
            self._run_until(len(self.pending))

    def wait_ready(self, slot: int) -> None:
        if self.trace is not None:
            self.trace.append(("wait", slot))
        last = max((n + 1 for n, (s, _, _) in enumerate(self.pending) if s == slot), default=0)
        self._run_until(last)

    def _run_until(self, count: int) -> None:
        for _ in range(count):
            _, dst, src = self.pending.popleft()
            dst.copy_(src)
            self.copies += 1

    def mark_free(self, slot: int) -> None:
        if self.trace is not None:
            self.trace.append(("free", slot))

    def join(self) -> None:
        if self.trace is not None:
            self.trace.append(("join",))

    def synchronize(self) -> None:
        self._run_until(len(self.pending))


class LayerStreamer:
    """Streams `layers[i]` for i in `streamed` through `slots` device buffers; see the module docstring."""

    def __init__(self, layers: Sequence[nn.Module], streamed: Sequence[int], slots: int, device: torch.device,
                 pin: Optional[bool] = None, fake_mode: FakeMode = "lazy") -> None:
        if not streamed:
            raise ValueError("LayerStreamer needs at least one streamed layer")
        self.device = torch.device(device)
        self.streamed = list(streamed)
        self.position = {index: k for k, index in enumerate(self.streamed)}
        self.slots = max(1, min(slots, len(self.streamed)))
        on_cuda = self.device.type == "cuda"
        layouts = [_layout(layers[index]) for index in self.streamed]
        self._entries: list[list[_Entry]] = [entries for entries, _ in layouts]
        self.layer_bytes = [size for _, size in layouts]
        self.weight_bytes = sum(math.prod(e.shape) * e.dtype.itemsize for entries in self._entries for e in entries)
        self.slot_bytes = max(self.layer_bytes)
        self.slab = HostSlab(sum(self.layer_bytes), pin=on_cuda if pin is None else pin)
        self.sync = CudaSync(self.device, self.slots) if on_cuda else FakeSync(fake_mode)
        self._host: list[torch.Tensor] = []
        start = 0
        with torch.no_grad():
            for entries, size in layouts:
                host = self.slab.data[start: start + size]
                for entry in entries:
                    typed_view(host, entry.offset, entry.dtype, entry.shape).copy_(_bound(entry))
                _point(entries, host)  # the layer's source tensors are dropped here, one layer at a time
                self._host.append(host)
                start += size
        # Per layer k and slot j: the layer's window of slot j (copy target) and its tensors' views in it.
        self._dev: list[list[torch.Tensor]] = []
        self._views: list[list[list[torch.Tensor]]] = []
        self._at: list[int] = []  # the slot each layer's tensors point at now
        self._issued: deque[tuple[int, int]] = deque()  # (position, slot) of copies not yet released, in order
        self._next = 0  # the stream position the next copy is of
        self._cursor = 0  # the slot the next copy goes to
        self._route: Optional[deque[int]] = None  # stream positions still to copy when following a route
        self._guessed: deque[int] = deque()  # the last positions routed, in order, that `guess` put there
        self._started = False  # copies were issued since the ring was (re)bound: the next ones need no join
        self._bind_ring()
        self.closed = False

    @property
    def pinned_bytes(self) -> int:
        return self.slab.pinned_bytes

    @property
    def host_bytes(self) -> int:
        return self.slab.nbytes

    @property
    def ring_bytes(self) -> int:
        return self.ring.numel()

    def _pump(self) -> None:
        # The cursor's slot is free: the copies not yet released hold the len(_issued) < slots slots before it.
        while len(self._issued) < self.slots:
            route = self._route
            if route is not None:
                if not route or any(k == route[0] for k, _ in self._issued):
                    return  # the route is not known further, or its next layer still holds a slot
                k = route.popleft()
            else:
                k = self._next
            slot = self._cursor
            if self._at[k] != slot:
                _point_views(self._entries[k], self._views[k][slot])
                self._at[k] = slot
            self.sync.copy(slot, self._dev[k][slot], self._host[k])
            self._issued.append((k, slot))
            self._next = (k + 1) % len(self.streamed)
            self._cursor = (slot + 1) % self.slots

    def _restart(self, k: int) -> None:
        """First use, after unpark, or after a run stopped part-way (cancel, error): stream again from position k."""
        self.sync.join()  # see the module docstring
        self._forget_copied_guesses()
        self._issued.clear()
        self._next = k
        if self._route is not None and (not self._route or self._route[0] != k):
            self._route.appendleft(k)  # a route that did not foresee this layer: it comes first, the rest follows
        self._started = True
        self._pump()

    # -- a route: the layers the caller will run, in order, when not every layer in turn (module docstring) --
    def follow_route(self) -> None:
        """From now on copy only the layers given to `extend_route`, in that order."""
        self._route = deque()
        self._guessed.clear()  # a route left without end_route: its guesses are routed no more

    def extend_route(self, indices: Sequence[int]) -> None:
        """Layers (model indices; resident ones are ignored) the caller will run next, after those given before.
        Their copies are issued at once as far as free slots allow. Guessed layers (`guess`) these begin with are
        confirmed; the other guesses are dropped."""
        if self._route is None:
            raise RuntimeError("extend_route needs follow_route first")
        positions = deque(self.position[index] for index in indices if index in self.position)
        while self._guessed and positions and positions[0] == self._guessed[0]:
            positions.popleft()
            self._guessed.popleft()
        if self._guessed:
            self._drop_guesses()
        self._route.extend(positions)
        if self._started and not self.parked:
            self._pump()

    def guess(self, indices: Sequence[int], limit: int) -> None:
        """Copy the first `limit` streamed layers of `indices` next, before it is known whether they run (module
        docstring): the next `extend_route` confirms or drops them."""
        if self._route is None:
            raise RuntimeError("guess needs follow_route first")
        positions = [self.position[index] for index in indices if index in self.position][:max(0, limit)]
        self._route.extend(positions)
        self._guessed.extend(positions)
        if self._started and not self.parked:
            self._pump()

    def _drop_guesses(self) -> None:
        """Unroute the guesses: those not copied yet leave the route, the copied ones give their slots back (they
        are the last copies issued; nothing ran in them, so the next copy may overwrite them)."""
        route = self._route if self._route is not None else deque()
        for _ in range(min(len(route), len(self._guessed))):  # the guesses are the last of what is routed
            route.pop()
            self._guessed.pop()
        while self._guessed:
            k, _ = self._issued.pop()
            if k != self._guessed.pop():
                raise RuntimeError("the stream's guessed copies are not its last ones")
            self._cursor = (self._cursor - 1) % self.slots
            self._next = k

    def _copied_guesses(self) -> int:
        """How many guesses are copies issued (the last of `_issued`); the others are the last of the route."""
        routed = len(self._route) if self._route is not None else 0
        return len(self._guessed) - min(routed, len(self._guessed))

    def _forget_copied_guesses(self) -> None:
        """The copies issued are being forgotten (a restart, a park): guesses among them are copies no more, the
        ones still routed stay guesses."""
        for _ in range(self._copied_guesses()):
            self._guessed.popleft()

    def end_route(self) -> None:
        """Back to every streamed layer in turn (the next layer run restarts the stream if it was not foreseen)."""
        self._route = None
        self._guessed.clear()

    @property
    def following_route(self) -> bool:
        return self._route is not None

    def before(self, index: int) -> None:
        k = self.position.get(index)
        if k is None:
            return
        if self.parked:
            self.unpark()
        if not self._issued or self._issued[0][0] != k:
            self._restart(k)
        if self._guessed and len(self._issued) <= self._copied_guesses():
            self._guessed.popleft()  # a guessed copy run before any extend_route settled it: run, so confirmed
        self.sync.wait_ready(self._issued[0][1])

    def after(self, index: int) -> None:
        k = self.position.get(index)
        if k is None:
            return
        if self._issued and self._issued[0][0] == k:
            self.sync.mark_free(self._issued.popleft()[1])
        self._pump()

    def park(self) -> None:
        """Between phases: wait for copies, point the layers at their host copies and free the device ring."""
        if self.closed or self.ring.numel() == 0:
            return
        self.sync.synchronize()
        with torch.inference_mode(False):
            for host, entries in zip(self._host, self._entries):
                _point(entries, host)
        self._forget_copied_guesses()
        self._issued.clear()
        self._dev, self._views, self._at = [], [], []
        self.ring = torch.empty(0, dtype=torch.uint8, device=self.device)

    def unpark(self) -> None:
        """Allocate the ring again and point the layers back at their slots (contents arrive by streaming)."""
        if self.closed or self.ring.numel() > 0:
            return
        with torch.inference_mode(False):  # may run inside the model's inference_mode; the ring must stay writable
            self._bind_ring()

    def _bind_ring(self) -> None:
        """Allocate the device ring, make each layer's views into every slot, point layer k at slot k % slots."""
        self.ring = torch.empty(self.slots * self.slot_bytes, dtype=torch.uint8, device=self.device)
        self._dev, self._views, self._at = [], [], []
        for k, entries in enumerate(self._entries):
            windows = [self.ring[j * self.slot_bytes: j * self.slot_bytes + self.layer_bytes[k]]
                       for j in range(self.slots)]
            self._dev.append(windows)
            self._views.append([[typed_view(window, e.offset, e.dtype, e.shape) for e in entries]
                                for window in windows])
            _point_views(entries, self._views[k][k % self.slots])
            self._at.append(k % self.slots)
        self._issued.clear()
        self._cursor = 0
        self._started = False

    @property
    def parked(self) -> bool:
        return self.ring.numel() == 0

    def close(self) -> None:
        """Wait for in-flight copies, point the layers at meta tensors and free the ring and the slab."""
        if self.closed:
            return
        self.sync.synchronize()
        for entries in self._entries:
            for entry in entries:
                meta = torch.empty(entry.shape, dtype=entry.dtype, device="meta")
                if entry.is_param:  # set_data cannot change the device type to meta: replace the Parameter
                    entry.module._parameters[entry.name] = nn.Parameter(meta, requires_grad=False)
                else:
                    entry.module._buffers[entry.name] = meta
        self._issued.clear()
        self._host, self._dev, self._views, self._at, self._entries = [], [], [], [], []
        self.ring = torch.empty(0, dtype=torch.uint8, device=self.device)
        self.slab.free()
        self.closed = True


class StreamHooks:
    """Drive a LayerStreamer from forward hooks, for models whose layer loop we do not own (Mistral)."""

    def __init__(self, layers: Sequence[nn.Module], streamer: LayerStreamer, host=None) -> None:
        self.streamer = streamer
        self.host = host
        self._handles = []
        for index, layer in enumerate(layers):
            self._handles.append(layer.register_forward_pre_hook(self._pre(index)))
            self._handles.append(layer.register_forward_hook(self._post(index)))

    def _pre(self, index: int):
        def hook(module, args):
            if self.host is not None:
                self.host.check_cancel()
            self.streamer.before(index)

        return hook

    def _post(self, index: int):
        def hook(module, args, output):
            self.streamer.after(index)

        return hook

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
