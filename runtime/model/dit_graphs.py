"""The uncompiled DiT forward replayed as CUDA graphs: the eager path without Python's per-kernel launch cost.

Where torch.compile is off or Triton is missing, a DiT step is ~1,700 kernels launched from Python. `DiTGraphs`
wraps the DiT with the forward's signature (latents, timestep, text, text_lens): the first call for an input
signature (shapes, dtypes, text_lens, device) runs eagerly as a warm-up (cuBLAS and attention plans, the RoPE and
mask cache), the second captures one CUDA graph and replays it, later calls copy their inputs into the graph's
static buffers and replay. The replay runs the same kernels on the same data as the eager forward: the output is
bit-identical (a GPU test). All graphs share one memory pool, since they run one after another (CFG's two
length groups, a batch of another size), so each holds no more activation memory than the largest forward.
At most `max_graphs` are kept (the least recently used is dropped). Cancel is checked by the sampler between
steps; a replayed step checks nothing inside.

Where it does nothing (the DiT's own forward runs): a CPU device, gradients enabled, compiled blocks (inductor
has its own launch path), a block runner that streams weights (`dit.block_runner.__self__.streamer`, see
offload/placement.py: the copies are host-driven). Weights on another device than the inputs (or on several) fail
in the warm-up, which is the DiT's own forward, with its own error. A capture that fails (a layer that syncs with
the host, "Only one capture at a time" under the cudaMallocAsync allocator, ...) switches this wrapper to eager for
good, with one log line; out-of-memory propagates. The warm-up runs with PyTorch's sync debug mode raising, so a
forward that synchronizes with the host is found before any capture (where, under cudaMallocAsync, the failed
capture would abort the process) and runs eagerly from then on.

Contract for code that changes the DiT: a graph replays the tensors and modules that existed when it was captured.
Any change to *which* tensors or modules the forward reads must bump `dit.structure_version` (an int on ErnieDiT)
or call `invalidate()`. The code that does so: fusing projections (compile.py), LoRA attach/detach
(lora/attach.py), Linears replaced by packed ones (quant/linear.py), placement and its release (offload/
placement.py), and ErnieDiT itself for whole-model moves (`.to()`, `.to_empty()`) and `load_state_dict(assign=True)`.
Each call compares `structure_key` (that version and the block runner: two attribute reads) with the one its
graphs were made for and drops them on a change. Editing weights in place (`param.copy_`, `load_state_dict`
without assign, LoRA branch values refilled in place) needs nothing: a replay reads the weights where they are.
Moving one block by hand (`dit.layers[3].to(...)`) is a structure change the caller must report.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import nn

from .compile import blocks_compiled
from .cuda_capture import capture_stream, heal_generator_after_failed_capture, host_syncs_raise, is_host_sync_error

log = logging.getLogger(__name__)

DEFAULT_MAX_GRAPHS = 4


@dataclass
class _Captured:
    graph: "torch.cuda.CUDAGraph"
    inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # static latents, timestep, text
    output: Optional[torch.Tensor]
    keep: list[Any] = field(default_factory=list)  # RoPE tables and masks the replay reads


class DiTGraphs:
    """Callable like the DiT; see the module docstring for when it replays and what invalidates a graph."""

    def __init__(self, dit: nn.Module, max_graphs: int = DEFAULT_MAX_GRAPHS) -> None:
        if max_graphs < 1:
            raise ValueError("max_graphs must be at least 1")
        if not isinstance(getattr(dit, "structure_version", None), int):
            raise TypeError(f"DiTGraphs needs a module that counts its structure changes (structure_version, as "
                            f"ErnieDiT does); {type(dit).__name__} has none")
        self.dit = dit
        self.max_graphs = max_graphs
        self.disabled_reason: Optional[str] = None
        self.captures = 0
        self.replays = 0
        self._graphs: OrderedDict[tuple, _Captured] = OrderedDict()
        self._warmed: set[tuple] = set()
        self._pool: Optional[tuple] = None
        self._structure: Optional[tuple] = None  # the structure_key the graphs and warm-ups were made for

    # -- the forward -------------------------------------------------------------------------------------
    def __call__(self, latents: torch.Tensor, timestep: torch.Tensor, text: torch.Tensor,
                 text_lens: list[int]) -> torch.Tensor:
        if self.eager_reason(latents) is not None:
            return self.dit(latents, timestep, text, text_lens)
        self.follow_structure()
        key = (tuple(latents.shape), latents.dtype, tuple(timestep.shape), timestep.dtype, tuple(text.shape),
               text.dtype, tuple(int(n) for n in text_lens), latents.device)
        captured = self._graphs.get(key)
        if captured is not None:
            self._graphs.move_to_end(key)
            return self._replay(captured, latents, timestep, text)
        if key not in self._warmed:
            output = self._warm_up(latents, timestep, text, text_lens)  # a forward that fails is never captured
            if len(self._warmed) > 4 * self.max_graphs:
                self._warmed.clear()
            self._warmed.add(key)
            return output
        captured = self._capture(key, latents, timestep, text, text_lens)
        if captured is None:
            return self.dit(latents, timestep, text, text_lens)
        return captured.output.clone()  # the capture's own replay computed it

    def eager_reason(self, latents: Optional[torch.Tensor] = None) -> Optional[str]:
        """Why calls run the DiT's own forward now (None: they are replayed)."""
        if self.disabled_reason is not None:
            return self.disabled_reason
        if latents is not None and latents.device.type != "cuda":
            return "not on a CUDA device"
        if torch.is_grad_enabled():
            return "gradients are enabled"
        if blocks_compiled(self.dit):
            return "the blocks are compiled"
        owner = getattr(getattr(self.dit, "block_runner", None), "__self__", None)
        if getattr(owner, "streamer", None) is not None:
            return "blocks are streamed"
        return None

    # -- lifetime ----------------------------------------------------------------------------------------
    def follow_structure(self) -> bool:
        """Drop every graph and warm-up when the DiT's structure_key differs from the one they were made for;
        True when it did (the first call, which has nothing to compare with, included)."""
        current = structure_key(self.dit)
        if current == self._structure:
            return False
        self.invalidate()
        self._structure = current
        return True

    def invalidate(self) -> None:
        """Drop every graph and its memory (call after changing which tensors or modules the DiT uses)."""
        while self._graphs:
            _, captured = self._graphs.popitem(last=False)
            _drop(captured)
        self._warmed.clear()
        self._pool = None
        self._structure = None

    def release_graphs(self) -> None:
        """Give the graphs' memory back but remember which signatures were warmed up: the next call for one of them
        captures again at once (LocalPipe does this after each sampling run under a VRAM plan, whose later phases
        count on the DiT's activation memory being free)."""
        while self._graphs:
            _, captured = self._graphs.popitem(last=False)
            _drop(captured)
        self._pool = None

    @property
    def graph_count(self) -> int:
        return len(self._graphs)

    # -- internals ---------------------------------------------------------------------------------------
    def _warm_up(self, latents, timestep, text, text_lens) -> torch.Tensor:
        """The eager forward on the capture stream, so its cuBLAS workspace and plans exist before capture, with
        host syncs raising: a forward that waits for the host is never captured (see `host_syncs_raise`)."""
        self._build_tables(latents, text, text_lens)  # their one-time uploads are blocking copies
        current = torch.cuda.current_stream(latents.device)
        side = capture_stream(latents.device)
        side.wait_stream(current)
        output: Optional[torch.Tensor] = None
        try:
            with torch.cuda.stream(side), host_syncs_raise():
                output = self.dit(latents, timestep, text, text_lens)
        except RuntimeError as error:
            if not is_host_sync_error(error):
                raise
            self.disabled_reason = "the forward synchronizes with the host, which a CUDA graph cannot hold"
            log.warning("DiT: %s (%s); running the eager forward from now on", self.disabled_reason,
                        str(error).strip().splitlines()[0][:160])
        finally:  # a forward that raised (a cancel, weights on another device) leaves nothing unordered either
            current.wait_stream(side)
        if output is None:
            self.invalidate()
            return self.dit(latents, timestep, text, text_lens)
        output.record_stream(current)  # the caller frees it on the current stream
        return output

    def _build_tables(self, latents, text, text_lens) -> None:
        """The DiT's RoPE tables and key mask for these inputs, built now if not cached: they are uploaded with
        blocking copies, which neither a capture nor the warm-up's sync check allows."""
        rope_tables = getattr(self.dit, "rope_tables", None)
        if rope_tables is not None:
            rope_tables(tuple(latents.shape[2:]), [int(n) for n in text_lens], text.shape[1], latents.device,
                        latents.dtype)

    def _capture(self, key: tuple, latents, timestep, text, text_lens) -> Optional[_Captured]:
        device = latents.device
        inputs = (latents.clone(), timestep.clone(), text.clone())
        lens = [int(n) for n in text_lens]
        self._build_tables(latents, text, lens)  # evicted from the DiT's cache since the warm-up, say
        current = torch.cuda.current_stream(device)
        side = capture_stream(device)
        side.wait_stream(current)
        graph = torch.cuda.CUDAGraph()
        pool = self._pool if torch.cuda.get_allocator_backend() == "native" else None
        failure: Optional[str] = None  # why the capture failed: this wrapper goes eager
        pending: Optional[BaseException] = None  # raised again once the capture is closed (cancel, out of memory)
        try:
            # thread_local: only this thread is barred from unsafe CUDA calls while it captures, not the host's others
            with torch.cuda.graph(graph, pool=pool, stream=side, capture_error_mode="thread_local"):
                try:
                    output = self.dit(*inputs, lens)
                except BaseException as error:
                    # Keep no traceback: its tensors are graph allocations and must be freed while the capture is
                    # still open (freed after it, never launched, they abort the process under cudaMallocAsync).
                    if isinstance(error, RuntimeError) and not isinstance(error, torch.cuda.OutOfMemoryError):
                        failure = str(error)
                    else:
                        pending = error.with_traceback(None)
        except RuntimeError as error:  # ending a capture that an unsafe call invalidated
            if failure is None and pending is None and isinstance(error, torch.cuda.OutOfMemoryError):
                raise
            failure = failure or str(error)
        if pending is not None:
            raise pending
        if failure is not None:
            heal_generator_after_failed_capture(device)
            self.disabled_reason = f"CUDA-graph capture failed ({failure.strip().splitlines()[0][:160]})"
            log.warning("DiT: %s; running the eager forward from now on", self.disabled_reason)
            self.invalidate()
            return None
        # Under cudaMallocAsync the output is a graph allocation that exists only once the graph has launched, and
        # freeing it before that aborts the process: launch now (this call's result), before anything can fail.
        graph.replay()
        if pool is None and torch.cuda.get_allocator_backend() == "native":
            self._pool = graph.pool()
        captured = _Captured(graph, inputs, output, keep=list(getattr(self.dit, "_rope_cache", {}).values()))
        self._graphs[key] = captured
        self.captures += 1
        while len(self._graphs) > self.max_graphs:
            _, oldest = self._graphs.popitem(last=False)
            _drop(oldest)
        return captured

    def _replay(self, captured: _Captured, latents, timestep, text) -> torch.Tensor:
        static_latents, static_timestep, static_text = captured.inputs
        static_latents.copy_(latents)
        static_timestep.copy_(timestep)
        static_text.copy_(text)
        captured.graph.replay()
        self.replays += 1
        return captured.output.clone()  # the next replay overwrites the static output


def structure_key(dit: nn.Module) -> tuple:
    """What a graph depends on besides its inputs (those are in each graph's key): which tensors and modules the
    forward reads, as `dit.structure_version` counts their changes, and the block runner driving the blocks."""
    return (dit.structure_version, getattr(dit, "block_runner", None))


def graphed_dit(dit: nn.Module, enabled: bool, device: torch.device) -> Callable[..., torch.Tensor]:
    """The callable the sampler should use for `dit`: a DiTGraphs on a CUDA device when enabled, else the DiT."""
    if not enabled or torch.device(device).type != "cuda":
        return dit
    return DiTGraphs(dit)


def _drop(captured: _Captured) -> None:
    # The output goes first, while the graph that allocated it still exists.
    captured.output = None
    captured.keep.clear()


