"""ErnieImageQuantConfig: the weight format the Loader should run the DiT in, with the reason for this GPU."""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Optional

CATEGORY = "ERNIE-Image"
QUANT_TYPE = "ERNIE_QUANT"
FORMATS = ("auto", "bf16", "fp8", "nvfp4", "gguf-file")
# What LoadOptions.quant is given for each explicit choice; "auto" is resolved by the GPU check.
LOAD_QUANT = {"bf16": "none", "fp8": "fp8", "nvfp4": "nvfp4", "gguf-file": "none"}


@dataclass(frozen=True)
class QuantChoice:
    """What flows on an ERNIE_QUANT link."""

    requested: str  # one of FORMATS
    load_quant: str  # the value for runtime LoadOptions.quant
    reason: str  # one line for the user


def _gpu_support_module() -> Optional[Any]:
    """runtime/quant/gpu_support.py (the quant issue) when it exists; this node falls back without it."""
    try:
        return importlib.import_module("..runtime.quant.gpu_support", __package__)
    except ImportError:
        return None


def _describe_device() -> str:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a hard dependency
        return "no torch"
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    major, minor = torch.cuda.get_device_capability()
    return f"{torch.cuda.get_device_name()} (SM {major}.{minor})"


def resolve_choice(requested: str) -> QuantChoice:
    if requested not in FORMATS:
        from ..runtime.errors import InvalidInputError

        raise InvalidInputError(f"format '{requested}' is not one of {list(FORMATS)}; pick one of them")
    support = _gpu_support_module()
    resolver: Optional[Callable[..., Any]] = getattr(support, "choose_format", None) if support else None
    if resolver is not None:
        decision = resolver(requested)
        load_quant = getattr(decision, "quant", None) or getattr(decision, "format", None) or LOAD_QUANT.get(requested, "none")
        return QuantChoice(requested, _normalise(load_quant), str(getattr(decision, "reason", decision)))
    device = _describe_device()
    if requested == "auto":
        return QuantChoice("auto", "none", f"auto on {device}: bf16 (the quantised formats' GPU check is not installed)")
    if requested in ("bf16", "gguf-file"):
        what = "bf16 weights" if requested == "bf16" else "the format stored in the chosen .gguf file"
        return QuantChoice(requested, "none", f"{requested} on {device}: {what}")
    return QuantChoice(
        requested,
        LOAD_QUANT[requested],
        f"{requested} on {device}: requested explicitly; the runtime checks the GPU when it loads",
    )


def _normalise(value: Any) -> str:
    text = str(value).lower()
    return "none" if text in ("bf16", "auto", "") else text


class ErnieImageQuantConfig:
    DESCRIPTION = (
        "Chooses the weight format the ERNIE-Image Loader runs the DiT in: auto (best for this GPU), bf16, "
        "fp8 (SM 8.9+ computes natively), nvfp4 (Blackwell computes natively), or whatever a .gguf file holds. "
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

    def choose(self, format: str) -> tuple[QuantChoice, str]:  # noqa: A002 - the widget is called format
        choice = resolve_choice(format)
        return (choice, choice.reason)
