"""ErnieImageQuantConfig: the weight format the Loader should run the DiT in, with the reason for this GPU."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..runtime.core.errors import InvalidInputError
from .comfy_names import speaks_comfy
from .common import CATEGORY, shown_on_node

QUANT_TYPE = "ERNIE_QUANT"
# The runtime's selector choices (runtime/quant/gpu_support.SELECTOR_CHOICES) plus keeping a .gguf file's blocks.
FORMATS = ("auto", "bf16", "fp8", "nvfp4", "q8_0", "q4_k", "gguf-file")
# What LoadOptions.quant is given for each explicit choice; "auto" is resolved by the GPU check.
LOAD_QUANT = {"bf16": "none", "fp8": "fp8", "nvfp4": "nvfp4", "q8_0": "q8_0", "q4_k": "q4_k", "gguf-file": "none"}


@dataclass(frozen=True)
class QuantChoice:
    """What flows on an ERNIE_QUANT link."""

    requested: str  # one of FORMATS
    load_quant: str  # the value for runtime LoadOptions.quant
    reason: str  # one line for the user


def resolve_choice(requested: str) -> QuantChoice:
    if requested not in FORMATS:
        raise InvalidInputError(f"format '{requested}' is not one of {list(FORMATS)}; pick one of them")
    from ..runtime.quant import gpu_support  # imports torch: only when the node runs

    device = gpu_support.detect_device()
    if requested == "auto":
        _, reason = gpu_support.choose_auto(device)
        return QuantChoice("auto", "auto", f"{reason} for a bf16 DiT (a quantised DiT file runs in its own format; the "
                           "Loader shows what runs, checked against its VRAM budget)")
    if requested == "gguf-file":
        return QuantChoice("gguf-file", "none", f"gguf-file on {device.name}: the block format stored in the "
                           ".gguf file picked in the Loader, dequantised per layer")
    return QuantChoice(requested, LOAD_QUANT[requested], gpu_support.format_reasons(device)[requested])


def refuse_gguf_file_without_gguf(choice: QuantChoice, dit: Path) -> None:
    """'gguf-file' keeps a .gguf DiT's blocks: beside a DiT that is not a GGUF file it would run something else, so
    it is refused before anything loads. What the file is comes from its first bytes, not its name."""
    from ..runtime.formats.safetensors_reader import is_gguf

    if choice.requested != "gguf-file" or (dit.is_file() and is_gguf(dit)):
        return
    raise InvalidInputError(f"the Quant Config's gguf-file keeps a .gguf DiT's own blocks, but the DiT picked "
                            f"({dit.name}) is not a GGUF file: pick a .gguf as the Loader's diffusion_model, or "
                            "another Quant Config format (auto, bf16, fp8, q8_0, ...)")


class ErnieImageQuantConfig:
    DESCRIPTION = (
        "Chooses the weight format the ERNIE-Image Loader runs the DiT in: auto (best for this GPU), bf16, "
        "fp8 (SM 8.9+ computes natively), nvfp4 (Blackwell computes natively), q8_0 (GGUF blocks, near-lossless), "
        "q4_k (GGUF blocks, for 8-12 GB cards), or whatever a .gguf file holds. "
        "Connect it to the Loader's quant_config input."
    )
    CATEGORY = CATEGORY
    FUNCTION = "choose"
    RETURN_TYPES = (QUANT_TYPE, "STRING")
    RETURN_NAMES = ("quant_config", "reason")
    OUTPUT_TOOLTIPS = ("The format choice, for the Loader's quant_config input.", "Why this format on this GPU.")

    @classmethod
    def INPUT_TYPES(cls) -> dict[str, Any]:
        return {
            "required": {
                "format": (
                    list(FORMATS),
                    {"default": "auto", "tooltip": "auto picks the fastest format this GPU computes natively; "
                     "gguf-file keeps the quantisation of the .gguf file picked in the Loader."},
                ),
            }
        }

    @speaks_comfy
    def choose(self, format: str) -> dict[str, Any]:  # noqa: A002 - the widget is called format
        choice = resolve_choice(format)
        return shown_on_node(choice.reason, choice, choice.reason)
