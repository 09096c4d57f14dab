"""`generate`'s image options (--init-image, --denoise, --mask, --mask-grow, --mask-feather, --no-composite): the
files read and checked into GenerationRequest fields before any weights are read."""
from __future__ import annotations

import argparse
from typing import Any

from ..core.errors import InvalidInputError
from ..core.number_text import range_text
from ..core.request import DENOISE_RANGE, MASK_PIXELS_RANGE, GenerationRequest
from ..files.image_files import read_image, read_mask
from .checks import check_int_range, check_number_range
from .parser import DecimalNumber, PathOption, WholeNumber


def add_image_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--init-image", action=PathOption, once=True,
                        help="start from this image (img2img); its size is the output size")
    parser.add_argument("--denoise", action=DecimalNumber, example="0.6", default=1.0, allowed=DENOISE_RANGE,
                        help=f"how much of the image to redraw, {range_text(DENOISE_RANGE)}: 1.0 redraws everything "
                             "(default)")
    parser.add_argument("--mask", action=PathOption, once=True,
                        help="inpainting mask, same size as --init-image: white = repaint")
    parser.add_argument("--mask-grow", action=WholeNumber, example="8", default=0, allowed=MASK_PIXELS_RANGE,
                        help=f"grow the mask by this many pixels, {range_text(MASK_PIXELS_RANGE)}")
    parser.add_argument("--mask-feather", action=WholeNumber, example="8", default=0, allowed=MASK_PIXELS_RANGE,
                        help=f"soften the mask's edge over this many pixels, {range_text(MASK_PIXELS_RANGE)}")
    parser.add_argument("--no-composite", action="store_true",
                        help="keep the sampler's pixels outside the mask (default: the original's, exactly)")


def image_fields(args: argparse.Namespace) -> dict[str, Any]:
    """GenerationRequest fields from the image options, files read and checked (before any weights are read).

    With --init-image the image decides the size: args.width and args.height become its own unless given (then
    the request refuses a size that differs).
    """
    _check_ranges(args)  # a value no run takes is named as that, before what it needs beside it
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
        image = read_image(args.init_image, "init_image")
        fields["init_image"] = image
        args.width = int(image.shape[2]) if args.width is None else args.width
        args.height = int(image.shape[1]) if args.height is None else args.height
    if args.mask is not None:
        fields["mask"] = read_mask(args.mask, "mask")
    return fields


def _check_ranges(args: argparse.Namespace) -> None:
    check_number_range(args.denoise, "--denoise", *DENOISE_RANGE, " (1.0 redraws everything)")
    check_int_range(args.mask_grow, "--mask-grow", *MASK_PIXELS_RANGE, " pixels")
    check_int_range(args.mask_feather, "--mask-feather", *MASK_PIXELS_RANGE, " pixels")


def check_image_fields(fields: dict[str, Any], args: argparse.Namespace) -> None:
    """The request's own checks of the image inputs, run now: before the model files are opened."""
    if "init_image" in fields or fields["denoise"] != 1.0:
        size = {"width": args.width, "height": args.height} if "init_image" in fields else {}
        GenerationRequest(prompt="", batch=args.batch, **size, **fields).validate()
