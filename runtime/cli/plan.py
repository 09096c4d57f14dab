"""`ernie-image plan`: print the VRAM plan for a budget and a job. Needs no GPU and no weights."""
from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Sequence

from ..core.errors import ErnieImageError
from ..core.number_text import range_text
from ..core.step_cache_config import StepCacheConfig
from ..offload.planner import PCIE_GBPS, budget_bytes, gib_up, least_budget, plan_memory
from ..offload.sizes import FORMAT_BYTES, ModelSizes
from ..offload.workspace import Job, dit_workspace
from .parser import DecimalNumber, OneLineParser, WholeNumber
from .step_cache_args import add_step_cache_argument, step_cache_of


PCIE_GBPS_RANGE = (0.1, 1000.0)  # --pcie-gbps, in GB/s


def build_parser() -> argparse.ArgumentParser:
    from ..core.request import BATCH_RANGE, CFG_RANGE, SIDE_MULTIPLE, SIDE_RANGE
    from ..text.encoder import TOKENS_RANGE

    parser = OneLineParser(prog="ernie-image plan",
                           description="Show how ERNIE-Image is placed in a VRAM budget (no GPU needed).")
    parser.add_argument("--budget", default="auto",
                        help="VRAM budget in GiB (1024 MiB, as nvidia-smi counts), or 'auto' (this machine's GPU)")
    side = f"multiple of {SIDE_MULTIPLE} in {range_text(SIDE_RANGE)} (default %(default)s)"
    parser.add_argument("--width", action=WholeNumber, example="1024", default=1024, allowed=SIDE_RANGE, help=side)
    parser.add_argument("--height", action=WholeNumber, example="1024", default=1024, allowed=SIDE_RANGE, help=side)
    parser.add_argument("--batch", action=WholeNumber, example="2", default=1, allowed=BATCH_RANGE,
                        help=f"images per run, {range_text(BATCH_RANGE)} (default %(default)s)")
    parser.add_argument("--cfg", action=DecimalNumber, example="4.0", default=None, allowed=CFG_RANGE,
                        help=f"{range_text(CFG_RANGE)} (default: 4.0 base, 1.0 turbo); CFG > 1 runs the DiT on a "
                             "doubled batch")
    parser.add_argument("--format", default="bf16", choices=sorted(FORMAT_BYTES), help="DiT weight format")
    parser.add_argument("--variant", default="turbo", choices=("base", "turbo"))
    parser.add_argument("--text-tokens", action=WholeNumber, example="256", default=256, allowed=TOKENS_RANGE,
                        help=f"padded prompt length the DiT sees, {range_text(TOKENS_RANGE)} (default %(default)s)")
    parser.add_argument("--pe", action="store_true", help="include the local prompt enhancer")
    parser.add_argument("--pcie-gbps", action=DecimalNumber, example="25", default=PCIE_GBPS,
                        allowed=PCIE_GBPS_RANGE,
                        help=f"host-to-GPU copy speed for the estimate, {range_text(PCIE_GBPS_RANGE)} GB/s "
                             "(default %(default)s)")
    add_step_cache_argument(parser, " (as generate's; the plan counts its residuals, and a forced schedule's "
                                    "length is checked by generate, which knows the steps)")
    return parser


def main_plan(argv: Sequence[str]) -> int:
    from ..core.request import BATCH_RANGE, CFG_RANGE, VARIANT_DEFAULTS, validate_size
    from ..text.encoder import TOKENS_RANGE
    from .checks import check_int_range, check_number_range, parse_budget

    try:
        args = build_parser().parse_args(list(argv))
        validate_size(args.width, args.height)
        check_int_range(args.batch, "--batch", *BATCH_RANGE)
        if args.cfg is None:
            args.cfg = VARIANT_DEFAULTS[args.variant]["cfg"]  # as generate runs each model by default
        check_number_range(args.cfg, "--cfg", *CFG_RANGE, " (4.0 for ERNIE-Image, 1.0 for Turbo; above 1 the DiT "
                                                         "runs a doubled batch)")
        check_int_range(args.text_tokens, "--text-tokens", *TOKENS_RANGE, " (the text encoder's limit)")
        check_number_range(args.pcie_gbps, "--pcie-gbps", *PCIE_GBPS_RANGE, " (GB/s; PCIe 4.0 x16 is about 25)")
        budget_gb = parse_budget(args.budget)  # generate's check and words
        cache = step_cache_of(args)
        device = None
        if budget_gb is None:
            import torch

            if not torch.cuda.is_available():
                raise ErnieImageError("--budget auto needs a CUDA GPU to measure: give the budget in GiB, e.g. "
                                      "--budget 12")
            device = torch.device("cuda")
        budget = budget_bytes(budget_gb, device)
        sizes = ModelSizes.released(args.variant, args.format, with_pe=args.pe)
        first_blocks = cache.blocks_in(sizes.dit.layers)[0] if cache is not None else 0
        job = Job(args.width, args.height, args.batch, args.cfg, args.text_tokens, use_pe=args.pe,
                  step_cache=cache is not None, decision_after_blocks=first_blocks)
        print(plan_memory(budget, job, sizes).table(args.pcie_gbps))
        if cache is not None:
            note = cache.fit_note(sizes.dit.layers)
            if note:
                print(note)
            print(step_cache_effect(cache, job, sizes))
    except ErnieImageError as error:
        from .names import cli_message

        print(f"error: {cli_message(error)}", file=sys.stderr)
        return 2
    return 0


def step_cache_effect(cache: StepCacheConfig, job: Job, sizes: ModelSizes, device_type: str = "cuda") -> str:
    """What the step cache adds to the plan: its residuals' share of the DiT's work memory and the least budget
    with and without it."""
    uncached = dataclasses.replace(job, step_cache=False, decision_after_blocks=0)
    extra = dit_workspace(sizes, job, device_type) - dit_workspace(sizes, uncached, device_type)
    needed, needed_without = (least_budget(one, sizes, device_type) for one in (job, uncached))
    if needed == needed_without:
        least = f"least budget {gib_up(needed)} GiB with it or without (another phase needs more than the DiT)"
    else:  # one decimal as the budget refusal says them, more where that would show two equal figures
        decimals = next((d for d in range(1, 10) if gib_up(needed, d) != gib_up(needed_without, d)), 9)
        least = f"least budget {gib_up(needed, decimals)} GiB with it, {gib_up(needed_without, decimals)} GiB without"
    first, last = cache.blocks_in(sizes.dit.layers)
    return (f"step cache ({cache.label(f'F{first}B{last}')}): its residual tensors add {extra / 2**30:.2f} GiB to the "
            f"DiT's work memory; {least}")
