"""Apply a plan to built modules: resident parts to the device, streamed layers into a LayerStreamer.

The modules come in with every tensor materialised anywhere (a CPU build from memory-mapped files, or, in the
bench, blocks made directly on the GPU); each part ends in its planned home and nothing else is kept.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from torch.nn import functional as F

from ..model.dit import Block, ErnieDiT, StepContext, run_block_in_place
from .phase_weights import PhaseWeights
from .planner import DiTPlan, LayeredPlan
from .streamer import FakeMode, LayerStreamer, StreamHooks


class DiTPlacement:
    """The DiT's stem and resident blocks on `device`, the streamed blocks behind `dit.block_runner`."""

    def __init__(self, dit: ErnieDiT, plan: DiTPlan, device: torch.device, fake_mode: FakeMode = "lazy") -> None:
        self.dit = dit
        self.plan = plan
        self.device = torch.device(device)
        self.host = None
        # Streamed blocks first: their source tensors are freed as they are ingested, before resident ones grow.
        self.streamer: Optional[LayerStreamer] = None
        if plan.streamed:
            self.streamer = LayerStreamer(dit.layers, plan.streamed, plan.slots, self.device, fake_mode=fake_mode)
        for name, child in dit.named_children():
            if name != "layers":
                child.to(self.device)
        for index in plan.resident:
            dit.layers[index].to(self.device)
        dit._rope_cache.clear()
        dit.block_runner = self.run_block
        dit.structure_version += 1  # moved and streamed tensors: captured forwards (dit_graphs) are stale

    def run_block(self, index: int, block: Block, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        if self.host is not None:
            self.host.check_cancel()
        streamer = self.streamer
        if streamer is None:
            return block(x, ctx)
        streamer.before(index)
        out = block(x, ctx)
        streamer.after(index)
        return out

    @property
    def pinned_bytes(self) -> int:
        return self.streamer.pinned_bytes if self.streamer else 0

    def release(self) -> None:
        """Free the ring and the slab and point every weight at meta: the DiT holds no memory afterwards."""
        if self.streamer is not None:
            self.streamer.close()
            self.streamer = None
        self.dit.block_runner = run_block_in_place
        self.dit._rope_cache.clear()
        if _has_real_tensors(self.dit):
            self.dit.to_empty(device="meta")
        self.dit.structure_version += 1  # the streamed blocks' tensors were pointed at meta
        self.host = None


def _has_real_tensors(module: nn.Module) -> bool:
    return any(not t.is_meta for t in list(module.parameters()) + list(module.buffers()))


class HostEmbedding(nn.Module):
    """Token embedding looked up on the host; only the [T, D] rows travel. Saves the 0.8 GB table on the GPU."""

    def __init__(self, weight: torch.Tensor, device: torch.device) -> None:
        super().__init__()
        self.weight = weight.detach().to("cpu")
        self.device = torch.device(device)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids.cpu(), self.weight).to(self.device, non_blocking=False)


class TextPlacement:
    """A Mistral tower (text encoder or enhancer) resident on `device`, or streamed layer-wise through hooks."""

    def __init__(self, tower: nn.Module, plan: LayeredPlan, device: torch.device, fake_mode: FakeMode = "lazy",
                 host_embedding: bool = True) -> None:
        self.tower = tower
        self.mode = plan.mode
        self.device = torch.device(device)
        self.streamer: Optional[LayerStreamer] = None
        self.hooks: Optional[StreamHooks] = None
        if plan.mode != "streamed":
            tower.to(self.device)
            return
        layers = tower.layers
        self.streamer = LayerStreamer(layers, list(range(len(layers))), plan.slots, self.device, fake_mode=fake_mode)
        self.hooks = StreamHooks(layers, self.streamer)
        if host_embedding and isinstance(tower.embed_tokens, nn.Embedding):
            tower.embed_tokens = HostEmbedding(tower.embed_tokens.weight, self.device)
        for name, child in tower.named_children():
            if name != "layers" and not isinstance(child, HostEmbedding):
                child.to(self.device)  # a device-side embedding (the PE's, tied or not) joins the stem

    def set_host(self, host) -> None:
        if self.hooks is not None:
            self.hooks.host = host

    def release(self) -> None:
        if self.hooks is not None:
            self.hooks.remove()
            self.hooks = None
        if self.streamer is not None:
            self.streamer.close()
            self.streamer = None
        if isinstance(self.tower.embed_tokens, HostEmbedding):
            self.tower.embed_tokens.weight = torch.empty(0)
        if _has_real_tensors(self.tower):
            self.tower.to_empty(device="meta")


class PePlacement:
    """The prompt enhancer (a Ministral3ForCausalLM) placed for its phase by its plan's mode.

    resident: on the device for good; phase: on the device for the PE phase, between phases in a page-locked host
    copy made once (PhaseWeights: nothing is copied back after a phase); streamed: the decoder layers stream
    through a TextPlacement's ring for every forward (prefill and each token).
    The stem (embedding, final norm, rotary tables, LM head) stays on the device during a streamed phase: the
    planner counts it there (a budget that cannot hold it fails with MemoryBudgetError before anything loads), the
    head is tied to the embedding (one table serves both), and the head runs for every token, so a host head
    would put a vocab x hidden matmul on the CPU per token.
    """

    def __init__(self, model: nn.Module, plan: LayeredPlan, device: torch.device, fake_mode: FakeMode = "lazy"
                 ) -> None:
        self.model = model
        self.mode = plan.mode
        self.device = torch.device(device)
        self.phase_weights: Optional[PhaseWeights] = None
        if plan.mode == "phase":
            self.phase_weights = PhaseWeights(model, self.device)
            self.phase_weights.enter()
        self.text = TextPlacement(model.model, plan, self.device, fake_mode, host_embedding=False)
        model.lm_head.to(self.device)  # tied: moved with the embedding already; untied: its own table joins the stem

    @property
    def streamer(self) -> Optional[LayerStreamer]:
        return self.text.streamer

    def set_host(self, host) -> None:
        self.text.set_host(host)

    def _stem(self) -> list[nn.Module]:
        return [child for name, child in self.model.model.named_children() if name != "layers"] + [self.model.lm_head]

    def enter(self) -> None:
        """Start of a PE phase: bring what `leave` sent to host memory back (streamed layers come by streaming)."""
        if self.mode == "streamed":
            for part in self._stem():
                part.to(self.device)
        elif self.phase_weights is not None:
            self.phase_weights.enter()

    def leave(self) -> None:
        """End of a PE phase with its weights kept: everything but a resident PE goes back to host memory."""
        if self.mode == "streamed":
            self.text.streamer.park()
            for part in self._stem():
                part.to("cpu")
        elif self.phase_weights is not None:
            self.phase_weights.leave()

    def release(self) -> None:
        """Hooks off, ring and slab freed, every weight (the head included, tied or not) pointed at meta."""
        self.text.release()
        if _has_real_tensors(self.model):
            self.model.to_empty(device="meta")
        if self.phase_weights is not None:
            self.phase_weights.release()
            self.phase_weights = None
