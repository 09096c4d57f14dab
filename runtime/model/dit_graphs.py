"""The uncompiled DiT forward replayed as CUDA graphs: the eager path without Python's per-kernel launch cost.

Where torch.compile is off or Triton is missing, a DiT step is ~1,700 kernels launched from Python. `DiTGraphs`
wraps the DiT with the forward's signature (latents, timestep, text, text_lens), one graph per input signature
(shapes, dtypes, text_lens, device), with graph_cache.py's lifecycle: the first call of a signature runs eagerly as
a warm-up (cuBLAS and attention plans, the RoPE and mask cache), the second captures one CUDA graph and replays it,
later calls copy their inputs into the graph's static buffers and replay. The replay runs the same kernels on the
same data as the eager forward: the output is bit-identical (a GPU test). All graphs share one memory pool (CFG's
two length groups, a batch of another size run one after another). At most `max_graphs` are kept. Cancel is
checked by the sampler between steps; a replayed step checks nothing inside.

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
Each call compares `structure_key` (that version and the block runner: two attribute reads, never the parameters
themselves) with the one its graphs were made for and drops them on a change. Editing weights in place
(`param.copy_`, `load_state_dict` without assign, LoRA branch values refilled in place) needs nothing: a replay
reads the weights where they are (the eager form's laid-out q/k norm weights are made afresh inside a capture, and
made again in eager steps once the weights' edit counters move). Moving one block by hand
(`dit.layers[3].to(...)`) is a structure change the caller must report.
"""
from __future__ import annotations

import logging
from typing import Callable

import torch
from torch import nn

from .graph_cache import GraphCache

log = logging.getLogger(__name__)

DEFAULT_MAX_GRAPHS = 4


class DiTGraphs(GraphCache):
    """Callable like the DiT; see the module docstring for when it replays and what invalidates a graph."""

    def __init__(self, dit: nn.Module, max_graphs: int = DEFAULT_MAX_GRAPHS) -> None:
        super().__init__(max_graphs, "the DiT forward", log)
        if not isinstance(getattr(dit, "structure_version", None), int):
            raise TypeError(f"DiTGraphs needs a module that counts its structure changes (structure_version, as "
                            f"ErnieDiT does); {type(dit).__name__} has none")
        self.dit = dit

    def __call__(self, latents: torch.Tensor, timestep: torch.Tensor, text: torch.Tensor,
                 text_lens: list[int]) -> torch.Tensor:
        if self.eager_reason(latents) is not None:
            return self.dit(latents, timestep, text, text_lens)
        self.follow_structure()
        lens = [int(n) for n in text_lens]
        key = (tuple(latents.shape), latents.dtype, tuple(timestep.shape), timestep.dtype, tuple(text.shape),
               text.dtype, tuple(lens), latents.device)
        return self.replay(key, lambda *inputs: self.dit(*inputs, lens), (latents, timestep, text),
                           prepare=lambda: self._build_tables(latents, text, lens),
                           keep=lambda: list(getattr(self.dit, "_rope_cache", {}).values()))

    def _build_tables(self, latents: torch.Tensor, text: torch.Tensor, text_lens: list[int]) -> None:
        """The DiT's RoPE tables and key mask for these inputs, built now if not cached (evicted since the warm-up,
        say): they are uploaded with blocking copies, which neither a capture nor the warm-up's sync check allows."""
        rope_tables = getattr(self.dit, "rope_tables", None)
        if rope_tables is not None:
            rope_tables(tuple(latents.shape[2:]), text_lens, text.shape[1], latents.device, latents.dtype)


def graphed_dit(dit: nn.Module, enabled: bool, device: torch.device) -> Callable[..., torch.Tensor]:
    """The callable the sampler should use for `dit`: a DiTGraphs on a CUDA device when enabled, else the DiT."""
    if not enabled or torch.device(device).type != "cuda":
        return dit
    return DiTGraphs(dit)
