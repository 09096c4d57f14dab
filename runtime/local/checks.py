"""What LocalPipe checks and names before and after the work: the files and options at load, empty prompts, the
DiT's output, and the weight formats it reports."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from ..core.errors import InvalidInputError, ModelFileError
from ..core.host import Host
from ..core.non_finite import refuse_non_finite
from ..core.pipe import short_repr
from ..core.variant import Variant
from ..formats import open_component
from ..formats.sources import ModelSources
from ..lora.stack import LoraStack
from ..model.builders import check_config_builds
from ..model.fill import QUANT_ON_LOAD_FORMATS
from .options import LoadOptions

def check_quant_packs(quant: str, dit_weights: dict[str, torch.Tensor]) -> None:
    """A quantise-on-load format that none of a bf16 DiT's weights can be packed in is refused as `ernie-image
    quantize` refuses it, not run in bf16 without a word. Only shapes and dtypes are looked at (views of a mapped
    file, or meta tensors): no weight is read."""
    if quant not in QUANT_ON_LOAD_FORMATS:
        return
    from ..quant.writer import quantized_layer_counts, refuse_unpackable

    refuse_unpackable(quantized_layer_counts(dit_weights, quant), quant, "quant")


def refuse_quant_for_quantized_dit(quant: str, dit) -> None:
    """A format asked for beside a DiT file that is already quantised (GGUF, FP8, NVFP4) cannot be had: the file runs
    in its own format, so asking for another is refused rather than ignored ('auto', 'none' and the file's own
    format take the file as it is)."""
    if quant not in ("bf16", *QUANT_ON_LOAD_FORMATS):
        return
    from ..quant.qweight import QuantizedWeight, block_format

    entries = [entry for entry in (dit.tensor(key) for key in dit.keys) if isinstance(entry, QuantizedWeight)]
    if {block_format(entry.format, entry.qtype) for entry in entries} == {quant}:
        return  # the format the file already has
    raise InvalidInputError(f"quant {quant} does not apply to {dit.path.name}, a DiT file already quantised "
                            f"({file_weight_format(dit) or 'packed'}): drop that option to run the file as it is, or "
                            "give the bf16 DiT to quantise it on load").naming("quant")


def file_weight_format(dit) -> str:
    """The packed weight formats of a quantised DiT file, most used first ("GGUF Q8_0", "FP8", ...), from its
    entries (no weight is read); "" when nothing in it is packed."""
    from collections import Counter

    from ..quant.qweight import QuantizedWeight, format_label

    packed = Counter(format_label(entry.format, entry.qtype) for entry in (dit.tensor(key) for key in dit.keys)
                     if isinstance(entry, QuantizedWeight))
    return "/".join(name for name, _ in packed.most_common())


def dit_weight_format(dit: torch.nn.Module) -> str:
    """The block Linears' weight formats, most used first ("FP8", "GGUF Q8_0/Q4_K", ...), or the weights' dtype
    when none is packed."""
    from collections import Counter

    from ..quant.linear import QuantLinear
    from ..quant.qweight import format_label

    packed: Counter[str] = Counter()  # weights by format, so that stacking layers does not reorder them
    for module in dit.modules():
        if isinstance(module, QuantLinear):
            packed[format_label(module.format, module.qtype)] += module.out_features * module.in_features
    if packed:
        return "/".join(name for name, _ in packed.most_common())
    weight = next((p for p in dit.parameters() if p.is_floating_point()), None)
    return str(weight.dtype).replace("torch.", "") if weight is not None else ""


def notice_empty_prompts(prompts: list[str], host: Host) -> None:
    """An empty prompt is allowed (the DiT then follows no text), but never silently."""
    empty = sum(1 for prompt in prompts if not prompt.strip())
    if empty:
        which = "the prompt is" if len(prompts) == 1 else f"{empty} of {len(prompts)} prompts are"
        host.log(f"{which} empty: the image follows no text (write a prompt to describe the picture)")


def check_finite_latents(latents: torch.Tensor, sources: ModelSources, loras: LoraStack = LoraStack()) -> None:
    """NaN or inf out of the DiT would decode to a black or noise image: stop with the likely cause instead. With
    LoRAs applied (`loras`: the job's stack) they are named as the likely cause, not the DiT's weights."""
    finite = torch.isfinite(latents)
    if bool(finite.all()):
        return
    bad = int((~finite).sum())
    if loras:
        applied = ", ".join(f"{entry.name} (strength {entry.strength:g})" for entry in loras.entries)
        raise ModelFileError(f"the DiT produced {bad} non-finite latent values (NaN/inf) of {latents.numel()} with "
                             f"LoRA(s) {applied} applied: the LoRA is the likely cause: lower its strength or leave "
                             "it out")
    dit = sources.dit or (sources.model_dir / "transformer" if sources.model_dir is not None else "the DiT")
    refuse_non_finite(latents, "DiT", dit, "latent values")


def checked_load_arguments(sources: Any, options: Any) -> tuple[ModelSources, LoadOptions]:
    """LocalPipe.load's `sources` (ModelSources, or the model folder's path) and `options` (None: the defaults),
    anything else refused in one line; the options validated."""
    if isinstance(sources, (str, os.PathLike)):
        sources = ModelSources(model_dir=Path(sources))
    if not isinstance(sources, ModelSources):
        raise InvalidInputError(f"sources {short_repr(sources)} is not a ModelSources: give "
                                "ernie_image.ModelSources(model_dir=...) or the model folder's path")
    options = LoadOptions() if options is None else options
    if not isinstance(options, LoadOptions):
        raise InvalidInputError(f"options {short_repr(options)} is not a LoadOptions: give "
                                "ernie_image.LoadOptions(...) or None for the defaults")
    return sources, options


# A part's kind -> its ModelSources component.
COMPONENTS = {"dit": "transformer", "text_encoder": "text_encoder", "vae": "vae"}


def open_part(sources: ModelSources, kind: str) -> Any:
    """The file of part `kind` ("dit", "text_encoder", "vae") opened, headers only."""
    return open_component(sources.component(COMPONENTS[kind]), kind)


def open_checked_parts(sources: ModelSources, options: LoadOptions) -> dict[str, Any]:
    """Every part's file opened (headers only) by kind ("dit", "text_encoder", "vae"): a missing, damaged or wrong
    file fails here, and so does a `quant` asked of a DiT file already quantised."""
    opened = {kind: open_part(sources, kind) for kind in COMPONENTS}
    if opened["dit"].quantized:
        refuse_quant_for_quantized_dit(options.quant, opened["dit"])
    return opened


def check_configs_build(opened: dict[str, Any], variant: Variant, quant: str = "none") -> None:
    """Each part built from its config on the meta device: a bad config.json, or weights in types the part's never
    are, fail at load, not mid-job; then a `quant` none of the DiT's weights can be packed in (told after the dtypes,
    since integer weights pack in no format)."""
    for kind, component in opened.items():
        check_config_builds(component, kind, variant)
    dit = opened["dit"]
    if not dit.quantized:
        check_quant_packs(quant, {key: dit.tensor(key) for key in dit.keys})  # mapped views


def check_pe_file(sources: ModelSources, variant: Variant) -> Any:
    """The prompt enhancer's file opened (headers only), or None without one: a text encoder given as the prompt
    enhancer, or a PE config that does not fit its weights, is refused at load, not when the PE first runs."""
    if not sources.has_pe():
        return None
    from ..text.pe_model import check_pe_config, locate_pe, open_pe_component

    component = open_pe_component(locate_pe(sources))
    check_pe_config(component, variant)
    return component
