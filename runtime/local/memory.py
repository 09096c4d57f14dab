"""What LocalPipe needs from the offloader, in one object: plan per job, place each phase, release.

Active on CUDA (budget given or "auto") and on the CPU when a budget is given (the CPU then plays the device,
which is how CI exercises streaming end to end). Inactive: every method is a no-op and the pipe behaves as if
no offloader existed.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch
from torch import nn

from ..core.errors import MemoryBudgetError, NamedLine, naming_line
from ..core.phrases import RUN_CHECKS_ITS_SIZE
from ..offload.placement import DiTPlacement, PePlacement, TextPlacement
from ..offload.planner import MemoryPlan, budget_bytes, gib_shown, gib_up, least_budget, plan_memory
from ..offload.reserve import file_dit_size
from ..offload.sizes import LayeredSize, ModelSizes
from ..offload.streamer import module_bytes
from ..offload.workspace import Job
from ..sampling.image_in import needs_encoding

TEXT_TOKENS_FOR_PLAN = 512  # the DiT's text length is known only after encoding; plan for a long prompt
# Why a plan previewed for an assumed size refuses nothing, in the library's words (ComfyUI's: nodes/comfy_names.py).


def _dtype_format(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.float16: "fp16"}.get(dtype, "bf16")


def measured_dit_size(dit: nn.Module, largest_linear_params: int) -> LayeredSize:
    """The built DiT's real block and stem bytes (its dtype, its packed Linears): what placing it takes."""
    blocks = [module_bytes(block) for block in dit.layers]
    return LayeredSize(len(blocks), max(blocks), module_bytes(dit) - sum(blocks), largest_linear_params)


class PipeMemory:
    def __init__(self, device: torch.device, dtype: torch.dtype, budget_gb: Optional[float],
                 quant: str = "none") -> None:
        self.device = torch.device(device)
        self.dtype = dtype
        self.budget_gb = budget_gb
        self.quant = quant
        self.active = self.device.type == "cuda" or budget_gb is not None
        self.plan: Optional[MemoryPlan] = None
        self.dit: Optional[DiTPlacement] = None
        self.text: Optional[TextPlacement] = None
        self.pe: Optional[PePlacement] = None
        self.host = None
        self.held_bytes: Callable[[], int] = lambda: 0  # device bytes the pipe's loaded weights hold ('auto' reuses them)
        self._sizes: dict[tuple, ModelSizes] = {}  # sizes_for, by files, variant and PE
        # Device bytes of the LoRA branches the next job's DiT carries: resident beside the stem, planned as part
        # of it. `_placed_lora_bytes`: what the placed DiT's plan counted when it was placed.
        self.lora_bytes = 0
        self._placed_lora_bytes = 0

    # -- planning ---------------------------------------------------------------------------------------

    def sizes_for(self, sources, variant, with_pe: bool = False) -> ModelSizes:
        """The weights' sizes before anything is built, from the files' configs (a quantised DiT file as packed,
        a DiT quantised on load in its format). Read once per set of files: every job asks, some twice."""
        key = (dataclasses.astuple(sources), variant, with_pe)
        if key not in self._sizes:
            self._sizes[key] = self._read_sizes(sources, variant, with_pe)
        return self._sizes[key]

    def _read_sizes(self, sources, variant, with_pe: bool) -> ModelSizes:
        from ..formats import open_component
        from ..formats.config_json import load_config
        from ..model.builders import dit_config_for, text_config_for

        dit_component = open_component(sources.component("transformer"), "dit")
        dit_config = dataclasses.asdict(dit_config_for(dit_component))
        text_config = text_config_for(open_component(sources.component("text_encoder"), "text_encoder"), variant)
        vae_component = open_component(sources.component("vae"), "vae")
        vae_config = vae_component.config or load_config("base", "vae")
        pe_config = _pe_config(sources, variant) if with_pe else None
        sizes = self.sizes_from_configs(dit_config, text_config, vae_config, pe_config)
        if not dit_component.quantized:
            return sizes
        dit, packed = file_dit_size(dit_component, self.dtype.itemsize, sizes.dit.largest_linear_params)
        return dataclasses.replace(sizes, dit=dit, dit_format=packed or sizes.dit_format)

    def sizes_from_configs(self, dit_config: dict, text_config: dict, vae_config: dict,
                           pe_config: Optional[dict] = None) -> ModelSizes:
        """The sizes of unquantised models with these configs, the DiT in the format this pipe builds it in."""
        from ..model.fill import QUANT_ON_LOAD_FORMATS

        fmt = self.quant if self.quant in QUANT_ON_LOAD_FORMATS else _dtype_format(self.dtype)
        return ModelSizes.from_configs(dit_config, text_config, vae_config, pe_config, fmt, self.dtype.itemsize)

    def check_job(self, request, sizes: ModelSizes) -> None:
        """plan_job's refusal (MemoryBudgetError: the budget is below what `request` needs) for models of `sizes`,
        without reading a file, placing or releasing anything."""
        if self.active:
            plan_memory(budget_bytes(self.budget_gb, self.device, self.held_bytes()), self.job_for(request, False),
                        sizes, self.device.type)

    def planning_sizes(self, sources, variant, with_pe: bool = False) -> ModelSizes:
        """`sizes_for`, with the placed DiT's measured block and stem bytes in place of the config's estimate, and
        the LoRA branches (`lora_bytes`) in the stem."""
        sizes = self.sizes_for(sources, variant, with_pe)
        if self.dit is None:
            if not self.lora_bytes:
                return sizes
            return dataclasses.replace(sizes, dit=dataclasses.replace(
                sizes.dit, stem_bytes=sizes.dit.stem_bytes + self.lora_bytes))
        placed = self.dit.plan
        return dataclasses.replace(sizes, dit=dataclasses.replace(
            sizes.dit, layer_bytes=placed.block_bytes,
            stem_bytes=placed.stem_bytes - self._placed_lora_bytes + self.lora_bytes))

    def check_request(self, request, sources, variant, local_pe: bool = True) -> None:
        """plan_job's refusal (MemoryBudgetError) for `request` on these files, placing and releasing nothing."""
        if self.active:
            plan_memory(*self._plan_inputs(request, sources, variant, local_pe), self.device.type)

    @staticmethod
    def job_for(request, use_pe: bool) -> Job:
        cache = getattr(request, "step_cache", None)
        return Job(width=request.width, height=request.height, batch=request.batch, cfg=request.cfg,
                   text_tokens=TEXT_TOKENS_FOR_PLAN, use_pe=use_pe, encode=needs_encoding(request),
                   step_cache=cache is not None, decision_after_blocks=cache.probe_blocks if cache is not None else 0)

    def _plan_inputs(self, request, sources, variant, local_pe: bool) -> tuple[Optional[int], Job, ModelSizes]:
        """Budget (None: 'auto' off CUDA, unbounded), job and sizes (`planning_sizes`) for `request`."""
        use_pe = plans_pe(request, sources, local_pe)
        return (budget_bytes(self.budget_gb, self.device, self.held_bytes()), self.job_for(request, use_pe),
                self.planning_sizes(sources, variant, use_pe))

    def plan_job(self, request, sources, variant, local_pe: bool = True) -> Optional[MemoryPlan]:
        """The plan for `request`; raises MemoryBudgetError before anything is allocated. A placed DiT, text
        tower or prompt enhancer that the new plan cannot keep is released here (`self.dit` / `self.text` /
        `self.pe` become None). `local_pe`: False when a remote PE endpoint revises the prompts instead."""
        if not self.active:
            return None
        budget, job, sizes = self._plan_inputs(request, sources, variant, local_pe)
        plan = plan_memory(budget, job, sizes, self.device.type)
        if self.text is not None and self.text.mode != plan.text.mode:
            self.release_text()
        if self.pe is not None and plan.pe is not None and self.pe.mode != plan.pe.mode:
            self.release_pe()
        elif self.pe is not None and plan.pe is None and self.pe.mode == "resident":
            self.release_pe()  # a job without the PE: its plan has no room for a resident one (others are parked)
        if self.dit is not None and self.dit.plan.resident != plan.dit.resident:
            others = plan.peak - plan.dit.gpu_weight_bytes
            placed = dataclasses.replace(self.dit.plan, stem_bytes=plan.dit.stem_bytes)  # with today's LoRA bytes
            if placed.gpu_weight_bytes + others <= plan.budget:
                plan = dataclasses.replace(plan, dit=placed)  # the placed DiT still fits: keep it
            else:
                self.release_dit()
        self.plan = plan
        return plan

    def preview(self, request, sources, variant, local_pe: bool = True) -> NamedLine:
        """The plan `request` would get, as text, without placing or releasing anything."""
        if not self.active:
            return naming_line(self._inactive())
        try:
            return naming_line(plan_memory(*self._plan_inputs(request, sources, variant, local_pe),
                                           self.device.type).table())
        except MemoryBudgetError as error:
            return naming_line(f"VRAM plan: {error}", *error.settings)

    def preview_before_a_size(self, request, sources, variant, local_pe: bool = True) -> NamedLine:
        """`preview` for a size assumed before a run gives its own (a loaded pipe's default 1024x1024): the plan
        labelled with the size it is for; where that size does not fit, the budget it needs instead of a refusal
        (each run checks its own size before it starts)."""
        if not self.active:
            return naming_line(self._inactive())
        budget, job, sizes = self._plan_inputs(request, sources, variant, local_pe)
        size = f"a {job.width}x{job.height} image"
        try:
            plan = plan_memory(budget, job, sizes, self.device.type)
        except MemoryBudgetError:
            needed = gib_up(least_budget(job, sizes, self.device.type))
            shown = f"{gib_shown(budget)} GiB" + (", auto" if self.budget_gb is None else "")
            return naming_line(f"VRAM plan for {size}: this budget ({shown}) is below the {needed} GiB {size} "
                               f"needs at least (batch {job.batch}, CFG {job.cfg:g}); {RUN_CHECKS_ITS_SIZE}, and a "
                               "smaller image needs less", RUN_CHECKS_ITS_SIZE)
        return naming_line(plan.table(title=f"VRAM plan for {size} ({RUN_CHECKS_ITS_SIZE})"), RUN_CHECKS_ITS_SIZE)

    def _inactive(self) -> str:
        return f"VRAM plan: none on {self.device.type} (weights stay in host memory)"

    def build_device(self) -> torch.device:
        """Where model files are materialised: the host when the offloader places them, else the device."""
        return torch.device("cpu") if self.active else self.device

    def places_pe(self) -> bool:
        """Whether the current plan has a PE phase: then the PE is built on the host and given to `place_pe`."""
        return self.plan is not None and self.plan.pe is not None

    # -- phases -----------------------------------------------------------------------------------------

    def place_text(self, tower: nn.Module) -> nn.Module:
        if self.plan is None:
            return tower
        self.text = TextPlacement(tower, self.plan.text, self.device)
        self.text.set_host(self.host)
        return tower

    def after_text(self) -> None:
        """Leave the text phase: a streamed tower gives its device buffers back (its host copy stays)."""
        if self.text is not None and self.text.streamer is not None:
            self.text.streamer.park()
        self._empty_cache()  # hand the text phase's freed blocks back before the DiT's workspace is carved

    def place_pe(self, model: nn.Module) -> nn.Module:
        """Start the PE phase by the plan's mode (see PePlacement): `model` comes built on the host, or is the
        one placed before (its parked parts come back). Without a PE plan the model is left as it is."""
        if self.plan is None or self.plan.pe is None:
            return model
        if self.pe is not None and self.pe.model is not model:
            self.release_pe()
        if self.pe is None:
            self.pe = PePlacement(model, self.plan.pe, self.device)
        else:
            self.pe.enter()
        self.pe.set_host(self.host)
        return model

    def after_pe(self, keep: bool) -> None:
        """Leave the PE phase before the text encoder's: its device buffers are parked in host memory (`keep`) or
        the PE is released; either way its freed blocks go back to the driver."""
        if self.pe is not None:
            if keep:
                self.pe.leave()
            else:
                self.release_pe()
        self._empty_cache()

    def _empty_cache(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def place_dit(self, dit: nn.Module) -> nn.Module:
        if self.plan is None:
            return dit
        plan = self.plan
        measured = measured_dit_size(dit, plan.sizes.dit.largest_linear_params)
        measured = dataclasses.replace(measured, stem_bytes=measured.stem_bytes + self.lora_bytes)
        self._placed_lora_bytes = self.lora_bytes
        if (measured.layer_bytes, measured.stem_bytes) != (plan.dit.block_bytes, plan.dit.stem_bytes):
            # The built DiT's real sizes (a quantised file, packed on load) decide: plan again before placing.
            plan = plan_memory(plan.budget, plan.job, dataclasses.replace(plan.sizes, dit=measured), self.device.type)
            self.plan = plan
        self.dit = DiTPlacement(dit, plan.dit, self.device)
        self.dit.host = self.host
        return dit

    def set_host(self, host) -> None:
        self.host = host
        if self.dit is not None:
            self.dit.host = host
        if self.text is not None:
            self.text.set_host(host)
        if self.pe is not None:
            self.pe.set_host(host)

    def vae_is_persistent(self) -> bool:
        return self.plan is None or self.plan.vae.persistent

    def encoder_is_persistent(self) -> bool:
        """Whether the VAE encoder stays after its phase: no plan (nothing to make room for), or all resident."""
        return self.plan is None or (self.plan.encode is not None and self.plan.encode.persistent)

    def after_encode(self) -> None:
        """Leave the encode phase: its freed blocks go back before the next phase's weights arrive."""
        self._empty_cache()

    def describe(self) -> str:
        return self.plan.table() if self.plan is not None else "no VRAM plan (offloading inactive)"

    def host_slabs(self) -> list[torch.Tensor]:
        """The host slabs (page-locked on CUDA) of every live layer streamer: the streamed layers' host copies."""
        placements = (self.dit, self.text, self.pe)
        streamers = [p.streamer for p in placements if p is not None and p.streamer is not None]
        return [s.slab.data for s in streamers if not s.closed and s.slab.data.numel()]

    def pinned_bytes(self) -> int:
        """Page-locked host bytes of the live layer streamers' slabs."""
        placements = (self.dit, self.text, self.pe)
        return sum(p.streamer.pinned_bytes for p in placements if p is not None and p.streamer is not None)

    # -- release ----------------------------------------------------------------------------------------

    def release_dit(self) -> None:
        if self.dit is not None:
            self.dit.release()
            self.dit = None

    def release_pe(self) -> None:
        if self.pe is not None:
            self.pe.release()
            self.pe = None

    def release_text(self) -> None:
        if self.text is not None:
            self.text.release()
            self.text = None

    def release(self) -> None:
        self.release_dit()
        self.release_pe()
        self.release_text()
        self.plan = None
        self.host = None


def plans_pe(request, sources, local_pe: bool) -> bool:
    """The PE is a phase of this plan only when it runs here: asked for, in the model files, not on a server."""
    return bool(getattr(request, "use_pe", False)) and local_pe and sources.has_pe()


def _pe_config(sources, variant) -> dict:
    from ..text.pe_model import locate_pe, open_pe_component, pe_config_for

    return pe_config_for(open_pe_component(locate_pe(sources)), variant)


__all__ = ["PipeMemory", "MemoryBudgetError"]
