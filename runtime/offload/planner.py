"""VRAM budget + job -> placement of every phase. Pure arithmetic: no GPU, no weights.

Policy (fastest first):
1. Everything resident (DiT, text tower, VAE, enhancer) when it fits with the largest phase's workspace.
2. Otherwise the DiT keeps a persistent part on the GPU: its stem, R resident blocks and a ring of `slots`
   staging buffers through which the other blocks stream each step. R is as large as the budget allows once
   the headroom of the largest other phase is set aside: the text tower streams layer-wise (it runs once per
   image, so streaming it costs the same copy as loading it whole and never evicts DiT blocks), the VAE decodes
   whole or in tiles, the enhancer loads for its phase (streaming it per generated token would be far slower).
3. Nothing fits: MemoryBudgetError naming the smallest budget that works at this size (and, where a step cache's
   residuals alone put the job out of the budget, the smallest without the cache too).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Literal, Optional

from ..core.errors import MemoryBudgetError
from ..core.request import MIN_SIDE
from ..model.vae_decode import vae_tile
from .sizes import FORMAT_BYTES, ModelSizes
from .workspace import Job, dit_workspace, pe_workspace, text_workspace, vae_encode_workspace, vae_workspace

GiB = 1024**3
DEFAULT_SLOTS = 2
VAE_TILE = 512
AUTO_RESERVE_MIN = 512 * 1024**2
AUTO_RESERVE_FRACTION = 0.04
ALLOCATOR_SLACK_FRACTION = 0.08
PCIE_GBPS = 25.0  # a desktop PCIe 4.0 x16 link in practice; the H200 here measured 55

LayerMode = Literal["resident", "phase", "streamed"]


@dataclass(frozen=True)
class DiTPlan:
    layers: int
    resident: tuple[int, ...]
    streamed: tuple[int, ...]
    slots: int
    block_bytes: int
    stem_bytes: int
    workspace: int

    @property
    def gpu_weight_bytes(self) -> int:
        return self.stem_bytes + (len(self.resident) + self.slots) * self.block_bytes

    @property
    def copy_bytes_per_step(self) -> int:
        return len(self.streamed) * self.block_bytes

    @property
    def pinned_bytes(self) -> int:
        return self.copy_bytes_per_step  # every streamed block is copied from its pinned host copy once a step


@dataclass(frozen=True)
class LayeredPlan:
    """Text tower or prompt enhancer. resident: stays between runs; phase: loaded for its phase, then dropped;
    streamed: layer-wise through `slots` staging buffers, embedding lookups on the host."""

    mode: LayerMode
    slots: int
    gpu_bytes: int  # weights on the GPU during the phase
    workspace: int
    pinned_bytes: int
    layers: int

    @property
    def phase_bytes(self) -> int:
        return self.gpu_bytes + self.workspace


@dataclass(frozen=True)
class VaePlan:
    persistent: bool
    tile: Optional[int]  # pixels per tile side the decode runs with (vae_decode.vae_tile); None: whole-image decode
    weight_bytes: int
    workspace: int


@dataclass(frozen=True)
class EncodePlan:
    """The VAE encoder of a job with an image in: its own phase, before the text encoder's."""

    persistent: bool  # kept between runs (everything fits); else loaded for its phase and dropped
    tile: Optional[int]  # pixels per tile side the encode runs with (vae_decode.vae_tile); None: whole-image encode
    weight_bytes: int
    workspace: int

    @property
    def phase_bytes(self) -> int:
        return self.weight_bytes + self.workspace


@dataclass(frozen=True)
class MemoryPlan:
    budget: int
    job: Job
    sizes: ModelSizes
    device_type: str
    dit: DiTPlan
    text: LayeredPlan
    vae: VaePlan
    pe: Optional[LayeredPlan]
    phase_peaks: dict[str, int] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    encode: Optional[EncodePlan] = None  # only for jobs with an image in

    @property
    def all_resident(self) -> bool:
        encoder = self.encode is None or self.encode.persistent
        return not self.dit.streamed and self.text.mode == "resident" and self.vae.persistent and encoder

    @property
    def peak(self) -> int:
        return max(self.phase_peaks.values())

    @property
    def pinned_bytes(self) -> int:
        pe = self.pe.pinned_bytes if self.pe is not None else 0
        return self.dit.pinned_bytes + self.text.pinned_bytes + pe

    def table(self, pcie_gbps: float = PCIE_GBPS, title: str = "VRAM plan") -> str:
        return render_plan(self, pcie_gbps, title)


def auto_budget(free_bytes: int, total_bytes: int, held_by_us: int = 0) -> int:
    """'auto': free VRAM plus what the pipe can reuse (`held_by_us`, see budget_bytes), minus a reserve for the
    CUDA context and others."""
    reserve = max(AUTO_RESERVE_MIN, int(AUTO_RESERVE_FRACTION * total_bytes))
    return max(free_bytes + held_by_us - reserve, 0)


MAX_BUDGET_GB = 1e6  # GiB; a budget above this is a typo, not a device (and past ~1.6e299 GiB not a byte count)


def budget_bytes(spec: "float | str | None", device=None, held_by_pipe: int = 0) -> Optional[int]:
    """'auto'/None -> measured on a CUDA device (None on the CPU: unbounded); a number -> that many GiB.

    'auto' counts as usable: free device memory once the allocator's idle blocks are handed back to the driver
    (device_memory.py: the same reading under the native and the cudaMallocAsync allocator), and `held_by_pipe`
    (weights the pipe already holds and will reuse). The two do not overlap: the pipe's live weights are
    allocated, so not free; once released they are free. Not the process's whole reserved memory: inside ComfyUI
    that includes ComfyUI's own loaded models, and under DynamicVRAM idle blocks of other nodes' pools.
    """
    if spec is not None and spec != "auto":
        try:
            value = float(spec)
        except ValueError:
            raise MemoryBudgetError(f"VRAM budget {spec!r} is not a number of GiB: give e.g. 12 or 'auto'") from None
        if not math.isfinite(value) or value <= 0:
            raise MemoryBudgetError(f"VRAM budget {spec!r} is not a positive number of GiB: give e.g. 12 or 'auto'")
        if value > MAX_BUDGET_GB:
            raise MemoryBudgetError(f"VRAM budget {spec!r} GiB is more than any device holds (at most "
                                    f"{MAX_BUDGET_GB:g}): give e.g. 12 or 'auto'")
        return int(value * GiB)
    import torch

    if device is None or torch.device(device).type != "cuda":
        return None
    from .device_memory import usable_device_memory

    memory = usable_device_memory(device)
    return auto_budget(memory.free, memory.total, held_by_pipe)


# Resident blocks kept right after a host wait inside a step (a step cache's decision): their compute covers the
# copies that start only after it (the step cache guesses one streamed block ahead of the decision, no more).
RESIDENT_AFTER_DECISION = 2


def spread(count: int, total: int, keep: tuple[int, ...] = ()) -> tuple[int, ...]:
    """`count` indices spread evenly over range(total) less `keep` (as far as the others suffice), so copies
    overlap resident blocks' compute."""
    if count <= 0:
        return ()
    candidates = [i for i in range(total) if i not in keep]
    if count > len(candidates):
        candidates = list(range(total))
    n = len(candidates)
    return tuple(sorted({candidates[min(n - 1, int((j + 0.5) * n / count))] for j in range(count)}))


def plan_dit(sizes: ModelSizes, resident_count: int, slots: int, workspace: int,
             decision_after_blocks: int = 0) -> DiTPlan:
    """The DiT with `resident_count` blocks on the device and the rest, spread out, streamed through `slots`;
    `decision_after_blocks` (a step cache's Fn): the blocks right after that one stay resident where they can."""
    layers = sizes.dit.layers
    resident_count = max(0, min(layers, resident_count))
    keep = tuple(range(decision_after_blocks, min(layers, decision_after_blocks + RESIDENT_AFTER_DECISION))
                 ) if decision_after_blocks else ()
    streamed = spread(layers - resident_count, layers, keep)
    resident = tuple(i for i in range(layers) if i not in streamed)
    return DiTPlan(layers, resident, streamed, slots if streamed else 0, sizes.dit.layer_bytes,
                   sizes.dit.stem_bytes, workspace)


def _layered(size, mode: LayerMode, slots: int, workspace: int, host_stem: bool) -> LayeredPlan:
    if mode == "streamed":
        stem_on_gpu = 0 if host_stem else size.stem_bytes
        return LayeredPlan(mode, slots, stem_on_gpu + slots * size.layer_bytes, workspace,
                           size.layers * size.layer_bytes, size.layers)
    return LayeredPlan(mode, 0, size.total_bytes, workspace, 0, size.layers)


def allocator_slack(budget: int, device_type: str = "cuda") -> int:
    """Room left for the caching allocator's fragmentation; none for the CPU stand-in device used in tests."""
    if device_type != "cuda":
        return 0
    return max(256 * 1024**2, int(ALLOCATOR_SLACK_FRACTION * budget))


def smallest_budget(layout_bytes: int, device_type: str = "cuda") -> int:
    """The least budget whose usable part (budget minus slack) holds `layout_bytes`."""
    if device_type != "cuda":
        return layout_bytes
    return max(layout_bytes + 256 * 1024**2, math.ceil(layout_bytes / (1 - ALLOCATOR_SLACK_FRACTION)))


def least_layout(job: Job, sizes: ModelSizes, device_type: str = "cuda", slots: int = DEFAULT_SLOTS) -> int:
    """Bytes of the smallest layout `job` runs in: the DiT's stem and `slots` staging buffers, and room for the
    largest phase with everything streamed or tiled that can be (the text tower and enhancer layer-wise, the VAE
    by tiles where that takes less)."""
    text = _layered(sizes.text, "streamed", slots, text_workspace(sizes, device_type), True)
    pe = (_layered(sizes.pe, "streamed", slots, pe_workspace(sizes, device_type), False).phase_bytes
          if job.use_pe and sizes.pe is not None else 0)
    vae = sizes.vae_bytes + min(vae_workspace(sizes, job, tile, device_type) for tile in (None, VAE_TILE))
    encode = (sizes.vae_encoder_bytes + min(vae_encode_workspace(sizes, job, tile, device_type)
                                            for tile in (None, VAE_TILE))) if job.encode else 0
    headroom = max(dit_workspace(sizes, job, device_type), text.phase_bytes, vae, pe, encode)
    return sizes.dit.stem_bytes + slots * sizes.dit.layer_bytes + headroom


def least_budget(job: Job, sizes: ModelSizes, device_type: str = "cuda", slots: int = DEFAULT_SLOTS) -> int:
    """The smallest budget in which `job` plans (its usable part holds `least_layout`)."""
    return smallest_budget(least_layout(job, sizes, device_type, slots), device_type)


def _too_small(budget: int, job: Job, sizes: ModelSizes, device_type: str, slots: int) -> MemoryBudgetError:
    """The refusal of a budget below `least_budget`: the job, the least budget and the fixes; when the budget would
    have sufficed without the job's step cache, that the cache's residuals raised the minimum, with both minimums."""
    needed = least_budget(job, sizes, device_type, slots)
    what = f"a {job.width}x{job.height} batch-{job.batch} job (CFG {job.cfg:g}, DiT {sizes.dit_format})"
    uncached = dataclasses.replace(job, step_cache=False)
    usable = budget - allocator_slack(budget, device_type)
    if job.step_cache and least_layout(uncached, sizes, device_type, slots) <= usable:
        without_cache = least_budget(uncached, sizes, device_type, slots)
        needed_gb, without_gb, budget_gb = gib_apart(needed, without_cache, budget)
        return MemoryBudgetError(
            f"{what} with a step cache needs at least {needed_gb} GiB of VRAM with everything streamed, "
            f"{without_gb} GiB without it: the step cache's residual tensors raise the minimum above the budget of "
            f"{budget_gb} GiB: raise the budget (vram_budget_gb) to {needed_gb} GiB, or leave out the step cache "
            f"(step_cache)").naming("vram_budget_gb", "step_cache")
    return MemoryBudgetError(
        f"{what} needs at least {gib_up(needed)} GiB of VRAM with everything streamed; the budget is "
        f"{gib_shown(budget)} GiB: {', or '.join(_fixes(job, sizes))}")


_SMALL_FORMATS = ("q4_k", "nvfp4")  # the smallest weight formats a user is offered


def _fixes(job: Job, sizes: ModelSizes) -> list[str]:
    """What can lower the least budget for this job: only what is not already as low as it goes."""
    lower = [what for what, possible in (("the size", max(job.width, job.height) > MIN_SIDE),
                                          ("the batch", job.batch > 1)) if possible]
    smaller = [fmt for fmt in _SMALL_FORMATS if FORMAT_BYTES[fmt] < FORMAT_BYTES.get(sizes.dit_format, 2.0)]
    return ["raise the budget", *([f"lower {' or '.join(lower)}"] if lower else []),
            *([f"use a smaller weight format ({', '.join(smaller)})"] if smaller else [])]


def plan_memory(budget: Optional[int], job: Job, sizes: ModelSizes, device_type: str = "cuda",
                slots: int = DEFAULT_SLOTS) -> MemoryPlan:
    """The placement for `job` within `budget` bytes (None: unbounded, everything resident).

    The layout is made for the budget minus an allocator slack: the caching allocator's reserved memory runs
    above the bytes in use (seen on the H200: 2.9 GiB above 9.9 GiB in use at a 12 GiB budget).
    """
    usable = None if budget is None else budget - allocator_slack(budget, device_type)
    dit_ws = dit_workspace(sizes, job, device_type)
    text_ws = text_workspace(sizes, device_type)
    use_pe = job.use_pe and sizes.pe is not None
    pe_ws = pe_workspace(sizes, device_type) if use_pe else 0
    # "Whole image" is the pass without a tile of the plan's: above a size it tiles by itself, as the plan records.
    own_tile = vae_tile(None, job.width * job.height, sizes.vae_sample_size)
    vae_full = VaePlan(True, own_tile, sizes.vae_bytes, vae_workspace(sizes, job, own_tile, device_type))
    pe_resident = _layered(sizes.pe, "resident", 0, pe_ws, False) if use_pe else None
    encode_full = (EncodePlan(True, own_tile, sizes.vae_encoder_bytes,
                              vae_encode_workspace(sizes, job, own_tile, device_type)) if job.encode else None)

    dit_all = plan_dit(sizes, sizes.dit.layers, 0, dit_ws)
    text_resident = _layered(sizes.text, "resident", 0, text_ws, True)
    everything = (dit_all.gpu_weight_bytes + text_resident.gpu_bytes + sizes.vae_bytes
                  + (pe_resident.gpu_bytes if pe_resident else 0)
                  + (encode_full.weight_bytes if encode_full else 0)
                  + max(dit_ws, text_ws, vae_full.workspace, pe_ws, encode_full.workspace if encode_full else 0))
    if usable is None or everything <= usable:
        return _finish(budget if budget is not None else everything, job, sizes, device_type, dit_all,
                       text_resident, vae_full, pe_resident, encode=encode_full)

    if least_layout(job, sizes, device_type, slots) > usable:
        raise _too_small(budget, job, sizes, device_type, slots)
    text_streamed = _layered(sizes.text, "streamed", slots, text_ws, True)
    vae_tiled_ws = vae_workspace(sizes, job, VAE_TILE, device_type)
    pe_streamed = _layered(sizes.pe, "streamed", slots, pe_ws, False) if use_pe else None
    encode_tiled = (EncodePlan(False, VAE_TILE, sizes.vae_encoder_bytes,
                               vae_encode_workspace(sizes, job, VAE_TILE, device_type)) if job.encode else None)
    spare = usable - sizes.dit.stem_bytes - slots * sizes.dit.layer_bytes
    vae = vae_full if sizes.vae_bytes + vae_full.workspace <= spare else VaePlan(False, VAE_TILE, sizes.vae_bytes,
                                                                                   vae_tiled_ws)
    encode = None
    if job.encode:
        # Whole-image encode only where the other phases already need that much: it must not cost DiT blocks.
        others = max(dit_ws, text_streamed.phase_bytes, sizes.vae_bytes + vae.workspace,
                     _layered(sizes.pe, "phase", 0, pe_ws, False).phase_bytes if use_pe else 0)
        whole = EncodePlan(False, encode_full.tile, encode_full.weight_bytes, encode_full.workspace)
        encode = whole if whole.phase_bytes <= others else encode_tiled
    encode_phase = encode.phase_bytes if encode else 0
    notes: list[str] = []
    pe_plan = None
    if use_pe:
        pe_phase = _layered(sizes.pe, "phase", 0, pe_ws, False)
        if pe_phase.phase_bytes <= spare:
            pe_plan = pe_phase
        else:
            pe_plan = pe_streamed
            notes.append("prompt enhancer streams layer-wise for every generated token: slow; "
                         "consider a remote enhancer endpoint")
    headroom = max(dit_ws, text_streamed.phase_bytes, sizes.vae_bytes + vae.workspace,
                   pe_plan.phase_bytes if pe_plan else 0, encode_phase)
    on_gpu = (usable - sizes.dit.stem_bytes - headroom) // sizes.dit.layer_bytes
    resident_count = sizes.dit.layers if on_gpu >= sizes.dit.layers else max(0, on_gpu - slots)
    dit = plan_dit(sizes, resident_count, slots, dit_ws, job.decision_after_blocks)

    text = text_streamed
    if dit.gpu_weight_bytes + text_resident.gpu_bytes + max(dit_ws, text_ws, sizes.vae_bytes + vae.workspace,
                                                            pe_plan.phase_bytes if pe_plan else 0,
                                                            encode_phase) <= usable:
        text = text_resident
    persistent_before_vae = dit.gpu_weight_bytes + (text.gpu_bytes if text.mode == "resident" else 0)
    if vae.persistent and persistent_before_vae + sizes.vae_bytes + max(dit_ws, text.phase_bytes,
                                                                        vae.workspace, encode_phase) > usable:
        vae = VaePlan(False, vae.tile, vae.weight_bytes, vae.workspace)
    return _finish(budget, job, sizes, device_type, dit, text, vae, pe_plan, tuple(notes), encode)


def _finish(budget: int, job: Job, sizes: ModelSizes, device_type: str, dit: DiTPlan, text: LayeredPlan,
            vae: VaePlan, pe: Optional[LayeredPlan], notes: tuple[str, ...] = (),
            encode: Optional[EncodePlan] = None) -> MemoryPlan:
    persistent = dit.gpu_weight_bytes + (text.gpu_bytes if text.mode == "resident" else 0) \
        + (vae.weight_bytes if vae.persistent else 0) + (pe.gpu_bytes if pe is not None and pe.mode == "resident" else 0) \
        + (encode.weight_bytes if encode is not None and encode.persistent else 0)
    peaks = {
        "text": persistent + (0 if text.mode == "resident" else text.gpu_bytes) + text.workspace,
        "dit": persistent + dit.workspace,
        "vae": persistent + (0 if vae.persistent else vae.weight_bytes) + vae.workspace,
    }
    if pe is not None:
        peaks["pe"] = persistent + (0 if pe.mode == "resident" else pe.gpu_bytes) + pe.workspace
    if encode is not None:
        peaks["encode"] = persistent + (0 if encode.persistent else encode.weight_bytes) + encode.workspace
    return MemoryPlan(budget, job, sizes, device_type, dit, text, vae, pe, peaks, notes, encode)


def gib_shown(num_bytes: int) -> str:
    """GiB with two decimals, or two significant digits below 0.1 (a 0.001 budget does not read as 0.00)."""
    value = num_bytes / GiB
    return f"{value:.2f}" if value >= 0.1 else f"{value:.2g}"


def gib_up(num_bytes: int, decimals: int = 1) -> str:
    """GiB rounded up to `decimals` decimals: a least budget shown is never below it."""
    scale = 10**decimals
    return f"{math.ceil(num_bytes / GiB * scale) / scale:.{decimals}f}"


def gib_apart(needed: int, suffices: int, budget: int) -> tuple[str, str, str]:
    """Two least budgets rounded up and a budget between them, in GiB to one decimal or as many more as keep them
    in the order they are in (a tiny model's figures differ by kilobytes)."""
    for decimals in range(1, 10):
        shown = gib_up(needed, decimals), gib_up(suffices, decimals), f"{budget / GiB:.{decimals}f}"
        if float(shown[0]) > float(shown[2]) >= float(shown[1]):
            return shown
    return shown


def _ranges(indices: tuple[int, ...]) -> str:
    parts, start = [], None
    for position, index in enumerate(indices):
        if start is None:
            start = index
        if position + 1 == len(indices) or indices[position + 1] != index + 1:
            parts.append(str(start) if start == index else f"{start}-{index}")
            start = None
    return ",".join(parts) or "none"


def render_plan(plan: MemoryPlan, pcie_gbps: float = PCIE_GBPS, title: str = "VRAM plan") -> str:
    job, dit = plan.job, plan.dit

    def g(num_bytes: int) -> str:
        return f"{num_bytes / GiB:6.2f}"

    lines = [
        f"{title}: budget {plan.budget / GiB:.2f} GiB on {plan.device_type}; {job.width}x{job.height}, batch "
        f"{job.batch}, CFG {job.cfg:g} (DiT batch {job.dit_batch}, {job.sequence} tokens), DiT {plan.sizes.dit_format}",
        f"{'phase':<13}{'placement':<52}{'GPU GiB':>8}{'work GiB':>9}{'pinned GiB':>11}",
    ]

    def row(name: str, what: str, gpu: int, work: int, pinned: int) -> None:
        lines.append(f"{name:<13}{what:<52}{g(gpu):>8}{g(work):>9}{g(pinned):>11}")

    if plan.encode is not None:
        encode_what = ("resident" if plan.encode.persistent else "loaded for its phase, then dropped") \
            + _tiles_text(plan.encode.tile)
        row("VAE encode", encode_what, plan.encode.weight_bytes, plan.encode.workspace, 0)
    if plan.pe is not None:
        row("enhancer", _layer_text(plan.pe), plan.pe.gpu_bytes, plan.pe.workspace, plan.pe.pinned_bytes)
    row("text encoder", _layer_text(plan.text), plan.text.gpu_bytes, plan.text.workspace, plan.text.pinned_bytes)
    if dit.streamed:
        what = f"{len(dit.resident)}/{dit.layers} blocks resident, {len(dit.streamed)} streamed, {dit.slots} buffers"
    else:
        what = f"all {dit.layers} blocks resident"
    row("DiT", what, dit.gpu_weight_bytes, dit.workspace, dit.pinned_bytes)
    vae_what = ("resident" if plan.vae.persistent else "loaded per decode") + _tiles_text(plan.vae.tile)
    row("VAE decode", vae_what, plan.vae.weight_bytes, plan.vae.workspace, 0)
    if dit.streamed:
        lines.append(f"streamed DiT blocks: {_ranges(dit.streamed)}")
        copy = dit.copy_bytes_per_step
        lines.append(f"copy per DiT step: {copy / GiB:.2f} GiB, {1000 * copy / (pcie_gbps * 1e9):.0f} ms at "
                     f"{pcie_gbps:g} GB/s (overlaps the resident blocks' compute)")
    peaks = ", ".join(f"{name} {value / GiB:.2f}" for name, value in plan.phase_peaks.items())
    lines.append(f"peak by phase (GiB): {peaks}; pinned host {plan.pinned_bytes / GiB:.2f} GiB")
    lines.extend(f"note: {note}" for note in plan.notes)
    return "\n".join(lines)


def _tiles_text(tile: Optional[int]) -> str:
    """How a VAE pass covers the image: the tile side it runs with (the plan's own record), or the whole image."""
    return f", {tile}-pixel tiles" if tile else ", whole image"


def _layer_text(plan: LayeredPlan) -> str:
    if plan.mode == "streamed":
        return f"streamed layer-wise ({plan.layers} layers, {plan.slots} buffers)"
    return "resident" if plan.mode == "resident" else "loaded for its phase, then dropped"
