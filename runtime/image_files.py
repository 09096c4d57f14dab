"""Image and mask files for the CLI: PNG/JPEG/WebP read with PIL into ComfyUI's IMAGE and MASK tensors.

Policy (the same as the nodes' and the API's): 8-bit images only (16-bit and float files are refused: save them
as 8-bit RGB); an alpha channel that is fully opaque carries nothing and is dropped, one with transparent pixels
is refused (flatten it, or paint the area to repaint as a mask); sizes are never resized or cropped: a side that
is not a multiple of 16 is refused by the request with the nearest valid size.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .errors import InvalidInputError, one_line
from .file_kind import not_a_regular_file
from .request import MAX_SIDE

HIGH_DEPTH_MODES = ("I;16", "I;16B", "I;16L", "I;16N", "I", "F")


def _open(path: Path, option: str):
    from PIL import Image, UnidentifiedImageError

    what = not_a_regular_file(path)
    if what is not None:
        raise InvalidInputError(f"{option} {path} {what}: give the path of a PNG or JPEG file")
    try:
        image = Image.open(path)
        # the size from the header first: an image far beyond any size ERNIE-Image takes is refused undecoded
        if image.width * image.height > 4 * MAX_SIDE * MAX_SIDE:
            raise InvalidInputError(f"{option} {path} is {image.width}x{image.height}: ERNIE-Image takes sides up to "
                                    f"{MAX_SIDE}: resize it first")
        image.load()
    except Image.DecompressionBombError:
        raise InvalidInputError(f"{option} {path} claims more pixels than any image ERNIE-Image takes (sides up to "
                                f"{MAX_SIDE}): resize it first, or re-save it if it is damaged") from None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as error:
        raise InvalidInputError(f"{option} {path} is not a readable image ({one_line(error, 120)}): give a PNG or "
                                "JPEG file (re-save it if it is damaged)") from None
    if image.mode in HIGH_DEPTH_MODES:
        raise InvalidInputError(f"{option} {path} is a {image.mode} ({'16-bit' if '16' in image.mode else '32-bit'}) "
                                "image: ERNIE-Image reads 8-bit images: save it as 8-bit RGB")
    return image


def _has_alpha(image) -> bool:
    return image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info)


def _opaque(image, refusal: str):
    """`image` without its alpha channel when every pixel is opaque; `refusal` (the one-line error) otherwise."""
    if not _has_alpha(image):
        return image
    rgba = image.convert("RGBA")
    if rgba.getextrema()[3][0] < 255:
        raise InvalidInputError(refusal)
    return rgba


def read_image(path: Path, option: str = "--init-image") -> torch.Tensor:
    """An image file -> float32 [1, H, W, 3] in 0..1 (ComfyUI's IMAGE)."""
    image = _opaque(_open(Path(path), option),
                    f"{option} {path} has transparent pixels (alpha): flatten it onto a background and save it as "
                    "RGB, or paint the area to repaint into a --mask")
    pixels = np.asarray(image.convert("RGB"), dtype=np.float32) / 255.0
    return torch.from_numpy(pixels.copy()).unsqueeze(0)


def read_mask(path: Path, option: str = "--mask") -> torch.Tensor:
    """A mask file -> float32 [1, H, W] in 0..1: its grey level, white = repaint, black = keep."""
    image = _opaque(_open(Path(path), option),
                    f"{option} {path} has transparent pixels: a mask is read from its grey level (white = repaint): "
                    "save it as grayscale without alpha")
    grey = np.asarray(image.convert("L"), dtype=np.float32) / 255.0
    return torch.from_numpy(grey.copy()).unsqueeze(0)


def add_image_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--init-image", type=Path, help="start from this image (img2img); its size is the output size")
    parser.add_argument("--denoise", type=float, default=1.0,
                        help="how much of the image to redraw, in (0, 1]: 1.0 redraws everything (default)")
    parser.add_argument("--mask", type=Path, help="inpainting mask, same size as --init-image: white = repaint")
    parser.add_argument("--mask-grow", type=int, default=0, help="grow the mask by this many pixels")
    parser.add_argument("--mask-feather", type=int, default=0, help="soften the mask's edge over this many pixels")
    parser.add_argument("--no-composite", action="store_true",
                        help="keep the sampler's pixels outside the mask (default: the original's, exactly)")


def image_fields(args: argparse.Namespace) -> dict[str, Any]:
    """GenerationRequest fields from the image options, files read and checked (before any weights are read).

    With --init-image the image decides the size: args.width and args.height become its own unless given (then
    the request refuses a size that differs).
    """
    if args.init_image is None and args.mask is not None:
        raise InvalidInputError("--mask needs --init-image: give the image to repaint")
    if args.init_image is None and args.denoise != 1.0:
        raise InvalidInputError(f"--denoise {args.denoise:g} needs --init-image: give the image to start from, or "
                                "leave --denoise out")
    if args.mask is None and (args.mask_grow or args.mask_feather):
        raise InvalidInputError("--mask-grow and --mask-feather shape a mask: give --mask too, or leave them out")
    if args.mask is None and args.no_composite:
        raise InvalidInputError("--no-composite keeps the sampler's pixels outside a mask: give --init-image and "
                                "--mask too, or leave it out")
    fields: dict[str, Any] = {"denoise": args.denoise, "mask_grow": args.mask_grow,
                              "mask_feather": args.mask_feather, "composite": not args.no_composite}
    if args.init_image is not None:
        image = read_image(args.init_image)
        fields["init_image"] = image
        args.width = int(image.shape[2]) if args.width is None else args.width
        args.height = int(image.shape[1]) if args.height is None else args.height
    if args.mask is not None:
        fields["mask"] = read_mask(args.mask)
    return fields


def check_image_fields(fields: dict[str, Any], args: argparse.Namespace) -> None:
    """The request's own checks of the image inputs, run now: before the model files are opened."""
    from .request import GenerationRequest

    if "init_image" in fields or fields["denoise"] != 1.0:
        size = {"width": args.width, "height": args.height} if "init_image" in fields else {}
        GenerationRequest(prompt="", batch=args.batch, **size, **fields).validate()
