"""ErnieImageSampler and ErnieImageTurboSampler: prompt and settings in, IMAGE / LATENT / used prompt out."""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

from ..runtime.core.errors import InvalidInputError
from ..runtime.core.request import (
    BATCH_RANGE,
    CFG_RANGE,
    MAX_SIDE,
    MIN_SIDE,
    RESOLUTION_PRESETS,
    SEED_MASK,
    SHIFT_RANGE,
    SIDE_MULTIPLE,
    STEPS_RANGE,
    VARIANT_DEFAULTS,
    GenerationRequest,
    GenerationResult,
    validate_size,
)
from .comfy_names import speaks_comfy
from .common import CATEGORY, PIPE_TYPE, shown_on_node
from .host import NoteHost, cancel_as_comfy_interrupt, log
from .image_inputs import image_input_fields, image_input_types
from .live_pipes import generation_lock

CUSTOM_RESOLUTION = "custom"


def _aspect_label(width: int, height: int) -> str:
    known = {(1, 1): "1:1", (2, 3): "2:3", (3, 2): "3:2", (3, 4): "3:4", (4, 3): "4:3", (9, 16): "9:16", (16, 9): "16:9"}
    ratio = width / height
    best = min(known, key=lambda wh: abs(wh[0] / wh[1] - ratio))
    return known[best]


def preset_label(width: int, height: int) -> str:
    return f"{width}x{height} ({_aspect_label(width, height)})"


RESOLUTION_CHOICES: list[str] = [preset_label(w, h) for w, h in RESOLUTION_PRESETS] + [CUSTOM_RESOLUTION]
_PRESET_SIZES: dict[str, tuple[int, int]] = {preset_label(w, h): (w, h) for w, h in RESOLUTION_PRESETS}


def resolve_size(resolution: str, width: Any, height: Any) -> tuple[int, int]:
    """A preset wins over the width/height widgets; 'custom' uses them, checked against ERNIE-Image's size rule.

    Checked when the node runs (before anything is loaded or sampled), not in VALIDATE_INPUTS: ComfyUI repeats a
    VALIDATE_INPUTS message once for every input the method names, so a size error would be shown three times."""
    if resolution == CUSTOM_RESOLUTION:
        try:
            size = int(width), int(height)
        except (TypeError, ValueError):
            raise InvalidInputError(f"width {width!r} and height {height!r} must be whole numbers: use multiples of "
                                    f"{SIDE_MULTIPLE} such as 1024") from None
        validate_size(*size)
        return size
    if resolution not in _PRESET_SIZES:
        raise InvalidInputError(f"resolution '{resolution}' is not one of {RESOLUTION_CHOICES}; pick one of them")
    return _PRESET_SIZES[resolution]


def joined_prompts(prompts: list[str]) -> str:
    unique = list(dict.fromkeys(prompts))
    return unique[0] if len(unique) == 1 else "\n---\n".join(prompts)


def latent_output(result: GenerationResult) -> Any:
    if result.latents is not None:
        return {"samples": result.latents}
    try:
        from comfy_execution.graph_utils import ExecutionBlocker  # type: ignore[import-not-found]
    except ImportError:
        return None
    return ExecutionBlocker(
        "this ERNIE-Image backend returns images only (a remote server sends no latents): "
        "connect the IMAGE output instead, or use a local Loader"
    )


def run_generation(pipe: Any, request: GenerationRequest, node_id: Optional[str]) -> tuple[GenerationResult, list[str]]:
    """Generate with ComfyUI as host (the node's @speaks_comfy words its errors): the result, and the notices the
    run gave (in ComfyUI's words; each is also a console line). The pipe asks the host to make room on its device, frees its own memory after an error or a
    cancel, and reports running out of memory as a MemoryBudgetError."""
    if pipe is None or not hasattr(pipe, "generate"):
        raise InvalidInputError("the pipe input is not connected: wire an ERNIE-Image Loader or Remote Backend to it")
    host = NoteHost(node_id)
    request.validate()  # before anything runs, so a bad request unloads nothing of ComfyUI's
    with generation_lock, cancel_as_comfy_interrupt():
        result = pipe.generate(request, host)
    return result, host.notes


def size_inputs(resolution_tooltip: str) -> dict[str, Any]:
    """The resolution preset and custom width/height widgets (shared with the Prompt Enhancer node)."""
    def side(name: str) -> tuple[str, dict[str, Any]]:
        return ("INT", {"default": 1024, "min": MIN_SIDE, "max": MAX_SIDE, "step": SIDE_MULTIPLE,
                        "tooltip": f"Image {name} in pixels, used when resolution is 'custom': a multiple of "
                        f"{SIDE_MULTIPLE} from {MIN_SIDE} to {MAX_SIDE}. ERNIE-Image is trained around 1 megapixel."})

    return {
        "resolution": (RESOLUTION_CHOICES, {"default": RESOLUTION_CHOICES[0], "tooltip": resolution_tooltip}),
        "width": side("width"),
        "height": side("height"),
    }


def seed_input(tooltip: str) -> tuple[str, dict[str, Any]]:
    return ("INT", {"default": 0, "min": 0, "max": SEED_MASK, "control_after_generate": True, "tooltip": tooltip})


class ErnieImageSampler:
    VARIANT = "base"  # whose defaults (runtime VARIANT_DEFAULTS) the widgets start at
    HAS_NEGATIVE = True

    DESCRIPTION = (
        "Generates images with ERNIE-Image from a pipe (a local Loader or a Remote Backend). "
        "Defaults are Baidu's for the base model: 50 steps, CFG 4.0, shift 4.0, prompt enhancer on."
    )
    CATEGORY = CATEGORY
    FUNCTION = "generate"
    RETURN_TYPES = ("IMAGE", "LATENT", "STRING")
    RETURN_NAMES = ("images", "latent", "prompt_used")
    OUTPUT_TOOLTIPS = (
        "The generated images, float RGB [batch, height, width, 3].",
        "ERNIE-Image latents [batch, 128, height/16, width/16] (Flux2 layout); local backends only.",
        "The prompt the model actually saw (after the prompt enhancer, when it ran).",
    )

    @classmethod
    def INPUT_TYPES(cls) -> dict[str, Any]:
        defaults = VARIANT_DEFAULTS[cls.VARIANT]
        required: dict[str, Any] = {
            "pipe": (PIPE_TYPE, {"tooltip": "The model to run: an ERNIE-Image Loader or Remote Backend output."}),
            "prompt": ("STRING", {"multiline": True, "default": "", "tooltip": "What to draw. Chinese and English both work."}),
        }
        if cls.HAS_NEGATIVE:
            required["negative_prompt"] = (
                "STRING",
                {"multiline": True, "default": "", "tooltip": "What to avoid. Used only when cfg is above 1."},
            )
        required.update(
            {
                **size_inputs("Baidu's seven ~1 MP sizes; 'custom' uses width and height below."),
                "steps": ("INT", {"default": int(defaults["steps"]), "min": STEPS_RANGE[0], "max": STEPS_RANGE[1], "tooltip": "Denoising steps: 50 for ERNIE-Image, 8 for Turbo."}),
                "cfg": (
                    "FLOAT",
                    {"default": defaults["cfg"], "min": CFG_RANGE[0], "max": CFG_RANGE[1], "step": 0.1, "round": 0.01,
                     "tooltip": "Classifier-free guidance: 4.0 for ERNIE-Image, 1.0 (off, twice as fast) for Turbo."},
                ),
                "seed": seed_input("Noise seed; the same seed gives the same image on any device."),
                "batch_size": ("INT", {"default": 1, "min": BATCH_RANGE[0], "max": BATCH_RANGE[1], "tooltip": "Images per run."}),
                "shift": ("FLOAT", {"default": 4.0, "min": SHIFT_RANGE[0], "max": SHIFT_RANGE[1], "step": 0.1, "tooltip": "Flow-matching timestep shift (Baidu's value is 4.0)."}),
                "use_pe": (
                    "BOOLEAN",
                    {"default": True, "label_on": "enhance prompt", "label_off": "prompt as written",
                     "tooltip": "Rewrite the prompt with the prompt enhancer first (as Baidu does). Ignored when the backend has no enhancer."},
                ),
            }
        )
        return {"required": required, "optional": image_input_types(), "hidden": {"unique_id": "UNIQUE_ID"}}

    @speaks_comfy
    def generate(self, pipe: Any, prompt: str, resolution: str, width: int, height: int, steps: int, cfg: float,
                 seed: int, batch_size: int, shift: float, use_pe: bool, negative_prompt: str = "",
                 unique_id: Optional[str] = None, image: Any = None, latent: Any = None, mask: Any = None,
                 denoise: float = 1.0, mask_grow: int = 0, mask_feather: int = 0,
                 composite: bool = True) -> dict[str, Any]:
        width, height = resolve_size(resolution, width, height)
        image_in = image_input_fields(image, latent, mask, denoise, mask_grow, mask_feather, composite)
        if "width" in image_in:
            log.info("ERNIE-Image sampler: size %sx%s from the %s input (the size widgets are not used)",
                     image_in["width"], image_in["height"], "image" if image is not None else "latent")
        request = GenerationRequest(
            prompt=prompt,
            negative_prompt=negative_prompt,
            width=width,
            height=height,
            steps=int(steps),
            cfg=float(cfg),
            shift=float(shift),
            seed=int(seed) & SEED_MASK,
            batch=int(batch_size),
            use_pe=bool(use_pe),
            settings_for=self.VARIANT,  # a pipe of the other variant runs them with a notice
        )
        if image_in:
            request = dataclasses.replace(request, **image_in)
        result, notes = run_generation(pipe, request, unique_id)
        outputs = (result.images, latent_output(result), joined_prompts(result.prompts_used))
        return shown_on_node("\n".join(notes), *outputs)


class ErnieImageTurboSampler(ErnieImageSampler):
    VARIANT = "turbo"
    HAS_NEGATIVE = False  # Turbo runs at CFG 1, where a negative prompt does nothing

    DESCRIPTION = (
        "Generates images with ERNIE-Image-Turbo: 8 steps at CFG 1.0 (no negative prompt, one model pass per "
        "step). Takes the same pipe as the Sampler."
    )
