"""`ernie-image plan`: print the VRAM plan for a budget and a job. Needs no GPU and no weights."""
from __future__ import annotations

import argparse
import sys
from typing import Sequence

from ..core.errors import ErnieImageError
from ..offload.planner import PCIE_GBPS, budget_bytes, plan_memory
from ..offload.sizes import FORMAT_BYTES, ModelSizes
from ..offload.workspace import Job
from .parser import OneLineParser


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="ernie-image plan",
                                     description="Show how ERNIE-Image is placed in a VRAM budget (no GPU needed).")
    parser.add_argument("--budget", default="auto", help="VRAM budget in GB (GiB), or 'auto' (this machine's GPU)")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--height", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--cfg", type=float, default=1.0, help="CFG > 1 runs the DiT on a doubled batch")
    parser.add_argument("--format", default="bf16", choices=sorted(FORMAT_BYTES), help="DiT weight format")
    parser.add_argument("--variant", default="turbo", choices=("base", "turbo"))
    parser.add_argument("--text-tokens", type=int, default=256, help="padded prompt length the DiT sees")
    parser.add_argument("--pe", action="store_true", help="include the local prompt enhancer")
    parser.add_argument("--pcie-gbps", type=float, default=PCIE_GBPS, help="host-to-GPU copy speed for the estimate")
    return parser


def main_plan(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(list(argv))
    from ..core.request import validate_size
    from ..text.encoder import MAX_TOKENS
    from .checks import check_int_range, check_number_range

    try:
        validate_size(args.width, args.height)
        check_int_range(args.batch, "--batch", 1, 64)
        check_int_range(args.text_tokens, "--text-tokens", 1, MAX_TOKENS, " (the text encoder's limit)")
        check_number_range(args.pcie_gbps, "--pcie-gbps", 0.1, 1000, " (GB/s; PCIe 4.0 x16 is about 25)")
        if not 0 <= args.cfg <= 100:  # also refuses nan
            raise ErnieImageError(f"--cfg {args.cfg} is not allowed: use 0..100 (above 1 the DiT runs a doubled batch)")
        device = None
        if args.budget == "auto":
            import torch

            if not torch.cuda.is_available():
                raise ErnieImageError("--budget auto needs a CUDA GPU to measure: give the budget in GB, e.g. --budget 12")
            device = torch.device("cuda")
        budget = budget_bytes(args.budget, device)
        sizes = ModelSizes.released(args.variant, args.format, with_pe=args.pe)
        job = Job(args.width, args.height, args.batch, args.cfg, args.text_tokens, use_pe=args.pe)
        print(plan_memory(budget, job, sizes).table(args.pcie_gbps))
    except ErnieImageError as error:
        from .names import cli_message

        print(f"error: {cli_message(error)}", file=sys.stderr)
        return 2
    return 0
