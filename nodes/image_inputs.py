"""The Samplers' image inputs: optional IMAGE, LATENT and MASK sockets and their widgets, turned into
GenerationRequest fields. ComfyUI's types pass through as they are; the runtime checks them (one line each).

With an image or a latent connected, the output size is its size: the resolution, width and height widgets are
not used. A LATENT carrying a noise_mask (core SetLatentNoiseMask) inpaints with it unless a MASK is connected.
"""
from __future__ import annotations

from typing import Any, Optional

from ..runtime.core.errors import InvalidInputError
from ..runtime.core.request import DENOISE_RANGE, MAX_MASK_PIXELS

LOAD_IMAGE_EMPTY_MASK = (64, 64)  # what core Load Image gives as MASK for an image without alpha


def image_input_types() -> dict[str, Any]:
    """Optional inputs, after every existing widget: old workflows' widgets_values stay valid."""
    pixels = ("INT", {"default": 0, "min": 0, "max": MAX_MASK_PIXELS, "step": 1})
    return {
        "image": ("IMAGE", {"tooltip": "Start from this image (img2img, a hires second pass). Its size is the "
                                       "output size; sides must be multiples of 16 (Upscale Image first)."}),
        "latent": ("LATENT", {"tooltip": "Start from this ERNIE-Image / FLUX.2 LATENT [batch, 128, h/16, w/16] "
                                         "(VAE Encode with flux2-vae, Latent Upscale By, or this node's output). A "
                                         "noise_mask on it (Set Latent Noise Mask) inpaints."}),
        "mask": ("MASK", {"tooltip": "Inpainting: 1 (white) = repaint, 0 = keep; the image's size (Load Image's "
                                     "MASK output, painted in its mask editor)."}),
        "denoise": ("FLOAT", {"default": 1.0, "min": DENOISE_RANGE[0], "max": DENOISE_RANGE[1], "step": 0.01, "tooltip":
                              "How much of the image to redraw (ComfyUI KSampler's denoise): the last `steps` of a "
                              "schedule of steps/denoise steps run. 1.0 redraws everything; 0.3-0.5 refines."}),
        "mask_grow": (pixels[0], {**pixels[1], "tooltip": "Grow the mask by this many pixels before use."}),
        "mask_feather": (pixels[0], {**pixels[1], "tooltip": "Soften the mask's edge over this many pixels."}),
        "composite": ("BOOLEAN", {"default": True, "label_on": "paste onto original", "label_off": "sampler's pixels",
                                  "tooltip": "Inpainting with an image: outside the mask, keep the original pixels "
                                             "exactly (blended over the feathered edge)."}),
    }


def _latent_samples(latent: Any) -> tuple[Any, Optional[Any]]:
    if not isinstance(latent, dict) or "samples" not in latent:
        raise InvalidInputError("the latent input is not a LATENT: connect a LATENT output (e.g. VAE Encode)")
    return latent["samples"], latent.get("noise_mask")


def _empty_load_image_mask(mask: Any) -> bool:
    return (tuple(mask.shape[-2:]) == LOAD_IMAGE_EMPTY_MASK and float(mask.abs().max()) == 0.0)


def image_input_fields(image: Any, latent: Any, mask: Any, denoise: float, mask_grow: int, mask_feather: int,
                       composite: bool) -> dict[str, Any]:
    """GenerationRequest fields for the connected image inputs; {} when none is connected and denoise is 1."""
    fields: dict[str, Any] = {}
    if latent is not None:
        samples, noise_mask = _latent_samples(latent)
        fields["init_latents"] = samples
        if mask is None and noise_mask is not None:
            mask = noise_mask
        if getattr(samples, "ndim", 0) == 4:
            fields["width"], fields["height"] = int(samples.shape[-1]) * 16, int(samples.shape[-2]) * 16
    if image is not None:
        fields["init_image"] = image
        if getattr(image, "ndim", 0) == 4:
            fields["width"], fields["height"] = int(image.shape[2]), int(image.shape[1])
    if mask is not None:
        if _empty_load_image_mask(mask):
            raise InvalidInputError("the mask is Load Image's empty 64x64 mask (the image has no alpha): paint the "
                                    "area to repaint in Load Image's mask editor, or disconnect the mask")
        fields["mask"] = mask
    if fields or float(denoise) != 1.0:
        fields.update(denoise=float(denoise), mask_grow=int(mask_grow), mask_feather=int(mask_feather),
                      composite=bool(composite))
    return fields
