"""`ernie-image generate`: one image or a batch from the local model (the tiny demo model when no weights are
given) or from SGLang servers, every argument checked before any weights are read."""
from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional, Sequence

from ..core.errors import InvalidInputError
from ..core.number_text import range_text
from ..core.phrases import counted
from .console import ConsoleHost
from .interrupts import Interrupts
from .names import cli_words
from .parser import DecimalNumber, OneLineParser, Option, OutputPath, PathOption, WholeNumber
from .step_cache_args import check as step_cache_check

if TYPE_CHECKING:
    from ..core.request import GenerationRequest

DEMO_NOTICE = (
    "no model given: using a tiny random ERNIE-Image model built in code at {path}. "
    "Its pixels are noise from a demo model, not a real image; pass --model-dir or --dit/--text-encoder/--vae."
)

ArgCheck = Callable[[argparse.Namespace], None]

# The argument checks of features that add their own `generate` flags, run after checks.py's own checks and
# before any weights are read: add `your_module.check` here (each takes the parsed arguments, raises
# InvalidInputError).
FEATURE_CHECKS: tuple[ArgCheck, ...] = (step_cache_check,)


EXAMPLE_PROMPT = "a red fox in fresh snow, morning light"
EXAMPLE_PROMPT_NOTICE = f"no --prompt given: the example prompt {EXAMPLE_PROMPT!r} is used"


def _add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    from ..core.request import (BATCH_RANGE, CFG_RANGE, SEED_RANGE, SHIFT_RANGE, SIDE_MULTIPLE, SIDE_RANGE,
                                STEPS_RANGE)
    from ..local.options import DTYPE_CHOICES, QUANT_CHOICES
    from .checks import DEMO_SIDE, REAL_SIDE

    # A second, different file for one part, prompt, seed or output is refused (parser.py says why); the settings
    # a later value may override (sizes, steps, CFG, budget, device...) keep argparse's last-one-wins.
    one_file = dict(action=PathOption, once=True)
    parser.add_argument("--model-dir", **one_file, help="diffusers ERNIE-Image folder (model_index.json, transformer/, ...)")
    parser.add_argument("--dit", **one_file, help="DiT file (safetensors, GGUF, FP8/NVFP4); overrides the folder's")
    parser.add_argument("--text-encoder", **one_file, help="text-encoder file; overrides the folder's")
    parser.add_argument("--vae", **one_file, help="VAE file (flux2-vae.safetensors or diffusers layout)")
    parser.add_argument("--tokenizer", **one_file, help="tokenizer folder or tokenizer.json (single files embed one); "
                                                         "needs a model given")
    parser.add_argument("--pe", **one_file, help="prompt-enhancer folder or file, used with --use-pe; needs a model "
                                                  "given (the demo model has none: see `ernie-image enhance`)")
    parser.add_argument("--variant", choices=["auto", "base", "turbo"], default="auto",
                        help="auto (default): what the DiT file records, its diffusers config, else its name; the run "
                             "line says which decided")
    parser.add_argument("--prompt", action=Option, once=True, default=None,
                        repeat_hint=" (--batch N makes N images of it)",
                        help="up to 2048 tokens reach the model (a longer prompt is cut, with a notice); an empty "
                             f"prompt is allowed, with a notice; left out: {EXAMPLE_PROMPT!r}, with a notice")
    parser.add_argument("--negative", action=Option, once=True, default="")
    side = f"multiple of {SIDE_MULTIPLE} in {range_text(SIDE_RANGE)}"
    parser.add_argument("--width", action=WholeNumber, example="1024", default=None, allowed=SIDE_RANGE,
                        help=f"{side} (default {REAL_SIDE}; demo {DEMO_SIDE})")
    parser.add_argument("--height", action=WholeNumber, example="1024", default=None, allowed=SIDE_RANGE,
                        help=f"{side} (default {REAL_SIDE}; demo {DEMO_SIDE})")
    parser.add_argument("--steps", action=WholeNumber, example="8", default=None, allowed=STEPS_RANGE,
                        help=f"{range_text(STEPS_RANGE)} (default: 50 base, 8 turbo)")
    parser.add_argument("--cfg", action=DecimalNumber, example="4.0", default=None, allowed=CFG_RANGE,
                        help=f"{range_text(CFG_RANGE)} (default: 4.0 base, 1.0 turbo)")
    parser.add_argument("--shift", action=DecimalNumber, example="4.0", default=4.0, allowed=SHIFT_RANGE,
                        help=f"flow-matching timestep shift, {range_text(SHIFT_RANGE)} (default %(default)s, Baidu's)")
    parser.add_argument("--seed", action=WholeNumber, once=True, example="7", default=0, allowed=SEED_RANGE,
                        repeat_hint=" (run the command once per seed)", help=range_text(SEED_RANGE))
    parser.add_argument("--batch", action=WholeNumber, example="4", default=1, allowed=BATCH_RANGE,
                        help=f"images to make, {range_text(BATCH_RANGE)}")
    parser.add_argument("--use-pe", action="store_true", help="rewrite the prompt with the prompt enhancer first")
    parser.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES, help="auto: bf16 on a GPU, fp32 on the CPU")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--budget", default="auto",
                        help="VRAM budget in GiB (1024 MiB, as nvidia-smi counts), or auto; on the CPU it saves no "
                             "memory (a notice says so)")
    parser.add_argument("--quant", default="none", metavar="{" + ",".join(QUANT_CHOICES) + "}",
                        help="quantise a bf16 DiT on load (a DiT file that is already quantised runs in its own format: "
                             "leave --quant out for it)")
    parser.add_argument("--out", action=OutputPath, once=True, metavar="PNG", default=Path("ernie.png"),
                        help="output PNG in an existing folder (default: ernie.png in the current folder; batch: "
                             "name_0.png, ...); an existing file is replaced once the new one is complete")


def build_parser() -> argparse.ArgumentParser:
    """`generate`'s options: its own, then each feature's."""
    from .image_args import add_image_arguments
    from .lora_args import add_lora_argument
    from .remote_args import add_remote_arguments
    from .step_cache_args import add_step_cache_arguments

    parser = OneLineParser(prog="ernie-image generate", description="Generate an image with ERNIE-Image.")
    _add_generate_arguments(parser)
    add_lora_argument(parser)
    add_step_cache_arguments(parser)  # --step-cache, --step-cache-compare
    add_image_arguments(parser)
    add_remote_arguments(parser)  # --server URL (a fleet when repeated), its timeouts and key, --pe-url
    return parser


def main_generate(argv: Sequence[str], interrupts: Optional["Interrupts"] = None) -> int:
    from .image_args import check_image_fields, image_fields
    from .lora_args import lora_stack
    from .remote_args import pe_endpoint_from_args, remote_pipe_from_args
    from .step_cache_args import comparison_output, step_cache_of

    args = build_parser().parse_args(argv)
    example_prompt = args.prompt is None
    if example_prompt:
        args.prompt = EXAMPLE_PROMPT
    args.variant = None if args.variant == "auto" else args.variant
    from .checks import (DEMO_VARIANT, check_generate_args, cpu_budget_notice, default_side, parse_budget, unused_pe_notice,
                         uses_demo_model)

    image_in = image_fields(args)  # image files read and checked before any model file is opened
    check_image_fields(image_in, args)
    check_generate_args(args, *FEATURE_CHECKS)  # before the demo model is built or any model file read
    if args.servers:
        _refuse_local_only_inputs(args, image_in)  # before the LoRA files are read
    loras = lora_stack(args.lora)
    remote = remote_pipe_from_args(args)  # None without --server; its options are checked before any work
    if remote is not None:
        from .remote_generate import generate_on_servers

        interrupts = interrupts or Interrupts()
        host = ConsoleHost(interrupts)
        if example_prompt:
            host.log(EXAMPLE_PROMPT_NOTICE)
        return generate_on_servers(args, remote, host)
    from ..core.request import GenerationRequest
    from ..demo.cached_model import load_demo_pipe
    from ..files.outputs_seen import OutputsSeen
    from ..files.png_output import PngOutput, png_paths, save_png_outputs
    from ..formats.sources import ModelSources
    from ..local.options import LoadOptions
    from ..local.pipe import LocalPipe

    interrupts = interrupts or Interrupts()
    host = ConsoleHost(interrupts)
    options = LoadOptions(device=args.device, dtype=args.dtype, vram_budget_gb=parse_budget(args.budget),
                          quant=args.quant, keep_loaded=args.step_cache_compare is not None,
                          pe_endpoint=pe_endpoint_from_args(args), lora_mode=args.lora_mode or "merge")
    request = GenerationRequest(
        prompt=args.prompt, negative_prompt=args.negative,
        width=default_side(args) if args.width is None else args.width,
        height=default_side(args) if args.height is None else args.height,
        steps=args.steps, cfg=args.cfg,  # None: the variant's defaults, resolved by the pipe
        shift=args.shift, seed=args.seed, batch=args.batch, use_pe=args.use_pe, **image_in,
        step_cache=step_cache_of(args),
    )
    demo = uses_demo_model(args)
    if demo:
        # A budget too small or a schedule of another length: refused on its configs, before it is built or read
        pipe = load_demo_pipe(options, args.variant or DEMO_VARIANT, job=request)
        host.log(DEMO_NOTICE.format(path=pipe.sources.model_dir))
        if loras:
            pipe = pipe.with_loras(loras)
    else:
        sources = ModelSources(model_dir=args.model_dir, dit=args.dit, text_encoder=args.text_encoder, vae=args.vae,
                               tokenizer=args.tokenizer, pe=args.pe, variant=args.variant)
        pipe = LocalPipe.load(sources, options, loras=loras)  # reads the LoRA files and headers, not the weights
        pipe.check_request(request)  # a schedule or budget the variant the files name refuses: before any weight
    for notice in (EXAMPLE_PROMPT_NOTICE if example_prompt else None, unused_pe_notice(args), cpu_budget_notice(args)):
        if notice:
            host.log(notice)
    seen = OutputsSeen(png_paths(args.out, request.batch) + (
        png_paths(args.step_cache_compare, request.batch) if args.step_cache_compare is not None else []))
    started = time.perf_counter()
    result = pipe.generate(request, host)
    elapsed = time.perf_counter() - started
    used = result.request or request
    settings = {**used.metadata(), "variant": pipe.variant, "prompts_used": result.prompts_used, "demo_model": demo,
                "dit_weights": pipe.dit_weights, "dtype": str(pipe.dtype).removeprefix("torch."),
                **({"loras": loras.metadata()} if loras else {}),
                **({"step_cache": result.info["step_cache"]} if "step_cache" in result.info else {})}
    host.check_cancel()  # a Ctrl-C that landed while the last step ran: nothing is written
    outputs = [PngOutput(result.images, args.out, settings)]
    if args.step_cache_compare is not None:  # the uncached twin, side by side
        outputs.append(comparison_output(pipe, request, result, host, args.step_cache_compare))
    written = save_png_outputs(outputs, lambda: seen.say_changed(host.log))  # every file of the command, or none
    paths = written[0]
    for path in (path for group in written for path in group):
        print(path)
    described = cli_words(pipe.describe(used), pipe.variant_choice.settings)  # the plan of this job, not a default one
    host.log(f"{run_line(len(paths), used, elapsed)}; {described}")
    return 0


def run_line(images: int, used: GenerationRequest, seconds: float) -> str:
    """What a local run made, with the settings it used: "1 image 256x256, 1 step, CFG 1, seed 0 in 2.00 s"."""
    return (f"{counted(images, 'image')} {used.width}x{used.height}, {counted(used.steps, 'step')}, CFG "
            f"{used.cfg:g}, seed {used.seed} in {seconds:.2f} s")


def _refuse_local_only_inputs(args: argparse.Namespace, image_in: dict) -> None:
    """--lora and --init-image with --server: the SGLang backend takes neither, so the run could not honour them."""
    local_only = [flag for flag, given in (("--lora", bool(args.lora)), ("--init-image", "init_image" in image_in))
                  if given]
    if len(local_only) == 1:
        taken = "no LoRA" if local_only[0] == "--lora" else "no init image"
        raise InvalidInputError(f"{local_only[0]} runs on the local model only: the SGLang backend takes {taken}; "
                                f"leave out --server or {local_only[0]}")
    if local_only:
        raise InvalidInputError(f"{' and '.join(local_only)} run on the local model only: the SGLang backend takes "
                                f"neither; leave out --server, or leave out both")
