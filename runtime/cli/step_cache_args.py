"""`--step-cache METHOD[:key=value,...]` (generate and plan) and `--step-cache-compare PNG` (generate)."""
from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any, Optional

from ..core.errors import InvalidInputError
from ..core.step_cache_config import COMPUTE, METHODS, OFF, SKIP, StepCacheConfig, parse_step_cache
from .parser import Option, OutputPath

if TYPE_CHECKING:
    from ..files.png_output import PngOutput


STEP_CACHE_HELP = (f"skip the DiT's middle blocks on steps where its first blocks barely change: {' or '.join(METHODS)} "
                   "(cache-dit's Dual Block Cache, First-Block-Cache), optionally with threshold (0.08), start (0.15), "
                   "end (0.95), max_skips (3), first_blocks (8), last_blocks (0), and for measuring forced (one "
                   f"letter per step, {COMPUTE} computed or {SKIP} skipped, the first and the last {COMPUTE}; it "
                   f"decides in place of start, end, max_skips and threshold: forced={COMPUTE}{SKIP}{SKIP}{COMPUTE} "
                   f"for 4 steps), e.g. dbcache:threshold=0.12,max_skips=2; {OFF} (alone) for none")


class StepCacheOption(Option):
    """--step-cache's text, two of which are compared by the settings they run with (`threshold=0.1` and `=.1`,
    `dbcache` and `dbcache:first_blocks=8` alike); a spec that does not parse is compared as text and refused by
    `check` with its own reason."""

    def meaning(self, value: str) -> Any:
        try:
            config = parse_step_cache(value)
        except InvalidInputError:
            return value
        return config.metadata() if config is not None else None


def add_step_cache_argument(parser: argparse.ArgumentParser, help_tail: str = "") -> None:
    """--step-cache METHOD[:key=value,...], given once (a second one would not add its settings to the first)."""
    parser.add_argument("--step-cache", action=StepCacheOption, once=True, default=None,
                        metavar="METHOD[:key=value,...]",
                        repeat_hint=", with all its settings after the method (e.g. dbcache:threshold=0.12,max_skips=2)",
                        help=STEP_CACHE_HELP + help_tail)


def add_step_cache_arguments(parser: argparse.ArgumentParser) -> None:
    """`generate`'s --step-cache and --step-cache-compare."""
    add_step_cache_argument(parser, ". Random weights cannot judge quality: try --step-cache-compare on your model")
    parser.add_argument("--step-cache-compare", action=OutputPath, once=True, metavar="PNG", default=None,
                        help="also make the image without the step cache (same seed) and write uncached | cached | "
                             "difference side by side to this PNG, with the difference figures (PSNR, pixel levels)")


def step_cache_of(args: argparse.Namespace) -> Optional[StepCacheConfig]:
    return parse_step_cache(args.step_cache) if args.step_cache is not None else None


def check(args: argparse.Namespace) -> None:
    """Before any weights are read: the spec parses, a forced schedule fits the steps where the command line tells
    them (else LocalPipe.check_request checks it once the files name the variant, before any weight), the
    comparison has a cache to compare, no server is asked."""
    from .checks import known_steps

    config = step_cache_of(args)
    if getattr(args, "step_cache_compare", None) is not None and config is None:
        raise InvalidInputError("--step-cache-compare needs --step-cache METHOD: it compares the image with that "
                                "cache against the image without it")
    if config is not None and getattr(args, "servers", None):
        raise InvalidInputError("--step-cache runs on the local model only: an SGLang server decides how its DiT "
                                "runs; leave out --server or --step-cache")
    if config is not None and config.forced is not None:
        config.validate(known_steps(args))


def comparison_output(pipe: Any, request: Any, cached: Any, host: Any, out: Any) -> "PngOutput":
    """--step-cache-compare: `request` (which holds the cache) made again without it, side by side with `cached`
    (its result), the figures logged. Returns the PngOutput to write with the command's other files."""
    from ..files.png_output import PngOutput
    from ..step_cache.compare import compare_with

    comparison = compare_with(pipe, request, cached, host)
    host.log(comparison.summary())
    return PngOutput(comparison.side_by_side(), out, comparison.settings(), name="step_cache_compare")
