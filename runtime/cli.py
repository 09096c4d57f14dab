"""`ernie-image`: the runtime from the command line (no ComfyUI needed).

Subcommands: generate, plan, quantize, enhance, check-remote. Errors print one line and exit 2; Ctrl-C prints
"cancelled" and exits 130 (SIGTERM: 143), leaving no file behind. Help goes to stdout with exit 0.
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from .cli_names import cli_message, cli_words
from .cli_parser import OneLineParser, OutputPath
from .errors import Cancelled, ErnieImageError, InvalidInputError
from .host import NullHost
from .variant import VARIANT_SETTING
from .uninterrupted import interrupt_now

ArgCheck = Callable[[argparse.Namespace], None]
CANCELLED_EXIT_CODES = (130, 143)  # 128 + SIGINT, 128 + SIGTERM

def _step_cache_check(args: argparse.Namespace) -> None:
    from .step_cache.cli_args import check

    check(args)


# The argument checks of features that add their own `generate` flags, run after cli_checks' own checks and
# before any weights are read: add `your_module.check` here (each takes the parsed arguments, raises
# InvalidInputError).
FEATURE_CHECKS: tuple[ArgCheck, ...] = (_step_cache_check,)


def _add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    from .local_pipe import DTYPE_CHOICES, QUANT_CHOICES
    from .request import SEED_MASK

    parser.add_argument("--model-dir", type=Path, help="diffusers ERNIE-Image folder (model_index.json, transformer/, ...)")
    parser.add_argument("--dit", type=Path, help="DiT file (safetensors, GGUF, FP8/NVFP4); overrides the folder's")
    parser.add_argument("--text-encoder", type=Path, help="text-encoder file; overrides the folder's")
    parser.add_argument("--vae", type=Path, help="VAE file (flux2-vae.safetensors or diffusers layout)")
    parser.add_argument("--tokenizer", type=Path, help="tokenizer folder or tokenizer.json (single files embed one)")
    parser.add_argument("--pe", type=Path, help="prompt-enhancer folder or file")
    parser.add_argument("--variant", choices=["auto", "base", "turbo"], default="auto",
                        help="auto (default): what the DiT file records, its diffusers config, else its name; the run "
                             "line says which decided")
    parser.add_argument("--prompt", default="a red fox in fresh snow, morning light",
                        help="up to 2048 tokens reach the model (a longer prompt is cut, with a notice); an empty "
                             "prompt is allowed, with a notice")
    parser.add_argument("--negative", default="")
    parser.add_argument("--width", type=int, default=None, help="multiple of 16 in 256..4096 (default 1024; demo 256)")
    parser.add_argument("--height", type=int, default=None, help="as --width")
    parser.add_argument("--steps", type=int, default=None, help="1..1000 (default: 50 base, 8 turbo)")
    parser.add_argument("--cfg", type=float, default=None, help="0..100 (default: 4.0 base, 1.0 turbo)")
    parser.add_argument("--shift", type=float, default=4.0)
    parser.add_argument("--seed", type=int, default=0, help=f"0..{SEED_MASK}")
    parser.add_argument("--batch", type=int, default=1, help="1..64")
    parser.add_argument("--use-pe", action="store_true", help="rewrite the prompt with the prompt enhancer first")
    parser.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES, help="auto: bf16 on a GPU, fp32 on the CPU")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--budget", default="auto", help="VRAM budget in GB (GiB), or auto")
    parser.add_argument("--quant", default="none", metavar="{" + ",".join(QUANT_CHOICES) + "}",
                        help="quantise a bf16 DiT on load (a DiT file that is already quantised runs in its own format: "
                             "leave --quant out for it)")
    parser.add_argument("--out", action=OutputPath, metavar="PNG", default=Path("ernie.png"),
                        help="output PNG in an existing folder (batch: name_0.png, ...); an existing file is "
                             "replaced once the new one is complete")


class _Stderr:
    """stderr as the console shows it: a progress line (`step 3/8`, rewritten in place) stays open until a full
    line follows, which first ends it; so no notice lands inside a step count, and no blank line opens one."""

    def __init__(self) -> None:
        self.progress_open = False
        self.progress_text = ""

    def progress(self, text: str, done: bool) -> None:
        if self.progress_open and text == self.progress_text and not done:
            return  # the same count again (a remote estimate polled every 0.1 s): nothing new to show
        self._write(f"\r{text}" + ("\n" if done else ""))
        self.progress_open, self.progress_text = not done, text

    def line(self, text: str) -> None:
        self._write(("\n" if self.progress_open else "") + text + "\n")
        self.progress_open = False

    @staticmethod
    def _write(text: str) -> None:
        # One write per line (print writes the text and its end separately: a Ctrl-C between them lost the newline)
        sys.stderr.write(text)
        sys.stderr.flush()


STDERR = _Stderr()


class _ConsoleHost(NullHost):
    """Progress and notices on stderr; Ctrl-C is the cancel (see _Interrupts)."""

    def __init__(self, interrupts: "_Interrupts") -> None:
        super().__init__()
        self.interrupts = interrupts

    def progress(self, value: int, total: int, preview=None) -> None:
        STDERR.progress(f"step {value}/{total}", done=value >= total)

    def log(self, message: str) -> None:
        STDERR.line(cli_words(message, (VARIANT_SETTING,)))  # a notice naming the variant setting names --variant

    def check_cancel(self) -> None:
        self.interrupts.raise_if_interrupted()


def main_generate(argv: Sequence[str], interrupts: Optional["_Interrupts"] = None) -> int:
    from .image_files import add_image_arguments, check_image_fields, image_fields
    from .lora.cli_args import add_lora_argument, lora_stack

    from .remote.cli_args import add_remote_arguments, pe_endpoint_from_args, remote_pipe_from_args

    parser = OneLineParser(prog="ernie-image generate", description="Generate an image with ERNIE-Image.")
    _add_generate_arguments(parser)
    add_lora_argument(parser)
    from .step_cache.cli_args import add_step_cache_arguments, step_cache_of, write_comparison

    add_step_cache_arguments(parser)  # --step-cache, --step-cache-compare
    add_image_arguments(parser)
    add_remote_arguments(parser)  # --server URL (a fleet when repeated), its timeouts and key, --pe-url
    args = parser.parse_args(argv)
    args.variant = None if args.variant == "auto" else args.variant
    from .cli_checks import check_generate_args, default_side, parse_budget, uses_demo_model

    image_in = image_fields(args)  # image files read and checked before any model file is opened
    check_image_fields(image_in, args)
    check_generate_args(args, *FEATURE_CHECKS)  # before the demo model is built or any model file read
    if args.servers:
        _refuse_local_only_inputs(args, image_in)  # before the LoRA files are read
    loras = lora_stack(args.lora)
    remote = remote_pipe_from_args(args)  # None without --server; its options are checked before any work
    if remote is not None:
        from .remote.cli_generate import generate_on_servers

        interrupts = interrupts or _Interrupts()
        return generate_on_servers(args, remote, _ConsoleHost(interrupts))
    from .demo import DEMO_NOTICE, load_demo_pipe
    from .local_pipe import LoadOptions, LocalPipe
    from .model_files import ModelSources
    from .png_output import save_pngs
    from .request import GenerationRequest

    interrupts = interrupts or _Interrupts()
    host = _ConsoleHost(interrupts)
    # The console shows no pictures: skip the per-step latent preview (it costs a device-to-host copy per step).
    options = LoadOptions(device=args.device, dtype=args.dtype, vram_budget_gb=parse_budget(args.budget),
                          quant=args.quant, keep_loaded=args.step_cache_compare is not None, previews=False,
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
        pipe = load_demo_pipe(options, args.variant or "turbo", job=request)  # a budget too small: before it is built
        host.log(DEMO_NOTICE.format(path=pipe.sources.model_dir))
        if loras:
            pipe = pipe.with_loras(loras)
    else:
        sources = ModelSources(model_dir=args.model_dir, dit=args.dit, text_encoder=args.text_encoder, vae=args.vae,
                               tokenizer=args.tokenizer, pe=args.pe, variant=args.variant)
        pipe = LocalPipe.load(sources, options, loras=loras)  # reads the LoRA files, not the weights
    started = time.perf_counter()
    result = pipe.generate(request, host)
    elapsed = time.perf_counter() - started
    used = result.request or request
    settings = {**used.metadata(), "variant": pipe.variant, "prompts_used": result.prompts_used, "demo_model": demo,
                **({"loras": loras.metadata()} if loras else {}),
                **({"step_cache": result.info["step_cache"]} if "step_cache" in result.info else {})}
    host.check_cancel()  # a Ctrl-C that landed while the last step ran: nothing is written
    compared = []  # --step-cache-compare: the uncached twin, side by side (made before any file is written)
    if args.step_cache_compare is not None:
        compared = write_comparison(pipe, request, result, host, args.step_cache_compare)
    paths = save_pngs(result.images, args.out, settings)
    for path in paths + compared:
        print(path)
    described = cli_words(pipe.describe(used), pipe.variant_choice.settings)  # the plan of this job, not a default one
    host.log(f"{len(paths)} image(s) {used.width}x{used.height}, {used.steps} steps, CFG {used.cfg:g}, seed "
             f"{used.seed} in {elapsed:.2f} s; {described}")
    return 0


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


class _Interrupts:
    """SIGINT (Ctrl-C) and SIGTERM as a cancel: the first raises KeyboardInterrupt wherever Python runs (a file step
    that must not be cut in half raises it once done: uninterrupted.py), and is remembered, so code that swallowed
    the KeyboardInterrupt still ends as cancelled (host.check_cancel)."""

    def __init__(self) -> None:
        self.signal_number: Optional[int] = None
        self.ignoring = False  # outputs_written: the signals are ignored from now on
        self._previous: Optional[tuple[dict[int, Any], Any]] = None  # the handlers and unraisable hook install replaced

    def install(self) -> None:
        import signal

        if threading.current_thread() is threading.main_thread():
            previous_hook = sys.unraisablehook
            self._previous = ({number: signal.getsignal(number) for number in (signal.SIGINT, signal.SIGTERM)},
                              previous_hook)
            for number in (signal.SIGINT, signal.SIGTERM):
                signal.signal(number, self._handle)

            def quiet_interrupts(unraisable) -> None:
                # A signal that lands in a finalizer or weakref callback (importlib's module-lock callbacks, say)
                # is printed by Python as "Exception ignored ... KeyboardInterrupt" and dropped; it is remembered
                # here and the run ends as cancelled at its next check, so nothing needs printing.
                if isinstance(unraisable.exc_value, KeyboardInterrupt) and self.signal_number is not None:
                    return
                # A signal that arrived just before outputs_written ignored it: Python reports the handler it no
                # longer finds ("Signal 2 ignored due to race condition"); ignoring it was the point.
                if self.ignoring and isinstance(unraisable.exc_value, OSError) and \
                        "ignored due to race condition" in str(unraisable.exc_value):
                    return
                previous_hook(unraisable)

            sys.unraisablehook = quiet_interrupts

    def restore(self) -> None:
        """Put back the signal handlers and the unraisable hook that `install` replaced (for a caller that goes on
        running in this process: main(argv) from Python or a test)."""
        import signal

        if self._previous is not None and threading.current_thread() is threading.main_thread():
            handlers, hook = self._previous
            for number, handler in handlers.items():
                signal.signal(number, handler if handler is not None else signal.SIG_DFL)
            sys.unraisablehook = hook
            self._previous = None

    def _handle(self, number: int, frame) -> None:
        self.signal_number = number
        if interrupt_now():  # else a file step under way raises it once it is over
            raise KeyboardInterrupt

    @property
    def exit_code(self) -> int:
        import signal

        return 128 + (self.signal_number or signal.SIGINT)

    def raise_if_interrupted(self) -> None:
        if self.signal_number is not None:
            raise KeyboardInterrupt

    def outputs_written(self) -> None:
        """The run's files are complete and about to replace the targets: from now on Ctrl-C and SIGTERM have
        nothing to undo and are ignored while the files are renamed, the command finishes printing and the process
        exits (with the run's own exit code)."""
        import signal

        if threading.current_thread() is threading.main_thread() and self.signal_number is None:
            self.ignoring = True
            for number in (signal.SIGINT, signal.SIGTERM):
                signal.signal(number, signal.SIG_IGN)


def _lazy(module: str, function: str) -> Callable[[Sequence[str]], int]:
    def run(argv: Sequence[str]) -> int:
        import importlib

        try:
            target = getattr(importlib.import_module(module, __package__), function)
        except (ImportError, AttributeError) as error:
            raise ErnieImageError(f"this command is not available in this build ({error})") from None
        return int(target(list(argv)) or 0)

    return run


COMMANDS: dict[str, tuple[str, Callable[[Sequence[str]], int]]] = {
    "generate": ("generate an image (tiny demo model when no weights are given)", main_generate),
    "plan": ("show the VRAM plan for a budget and size (no GPU, no weights)", _lazy(".offload.cli_plan", "main_plan")),
    "quantize": ("write a quantised DiT file (fp8, nvfp4, q8_0, q4_k) once", _lazy(".quant.cli_quantize", "main_quantize")),
    "enhance": ("print the prompt enhancer's revised prompt", _lazy(".text.cli_enhance", "main_enhance")),
    "check-remote": ("check SGLang servers: readiness, model, one tiny generation", _lazy(".remote.check", "main_check_remote")),
}


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run one command. `argv` None: the process's own command line (the `ernie-image` script, `python -m
    ernie_image`): the signal handling stays as it ends until the process exits, so a Ctrl-C after the files are
    committed cannot interrupt the exit. `argv` given (a call from Python): the signal handlers and the unraisable
    hook the caller had are put back when it returns."""
    # Streaming weights through fixed buffers while activations change size fragments the caching allocator;
    # expandable segments avoid that. Set before torch initialises CUDA; a user's own setting wins.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    from .output_files import set_commit_hook

    interrupts = _Interrupts()
    interrupts.install()
    set_commit_hook(interrupts.outputs_written)  # every command's files: too late to cancel from the first rename
    in_process = argv is not None
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if not argv or argv[0] in ("-h", "--help"):
            print(_top_level_help(), file=sys.stdout if argv else sys.stderr)
            return 0 if argv else 2
        if argv[0] not in COMMANDS:
            print(f"error: unknown command {argv[0]!r}: use one of {', '.join(COMMANDS)} (ernie-image --help)",
                  file=sys.stderr)
            return 2
        command = COMMANDS[argv[0]][1]
        code = main_generate(argv[1:], interrupts) if command is main_generate else command(argv[1:])
        interrupts.raise_if_interrupted()
        return code
    except (KeyboardInterrupt, Cancelled):
        STDERR.line("cancelled")
        return interrupts.exit_code
    except ErnieImageError as error:
        # The CLI's flags for the settings the message names; a line break inside (a file name holding one) is
        # shown escaped, so the error stays one line and a name cannot print lines of its own.
        STDERR.line("error: " + cli_message(error).replace("\r", "\\r").replace("\n", "\\n"))
        return 2
    except SystemExit as leaving:  # argparse's --help (exit 0); its errors are InvalidInputError
        return int(leaving.code or 0)
    except Exception:
        if interrupts.signal_number is None:
            raise
        # The interrupt landed inside an extension module's import or a C call that turned it into another error.
        STDERR.line("cancelled")
        return interrupts.exit_code
    finally:
        set_commit_hook(None)
        if in_process:
            interrupts.restore()


def _top_level_help() -> str:
    width = max(len(name) for name in COMMANDS)
    lines = [f"  {name:<{width}}  {summary}" for name, (summary, _) in COMMANDS.items()]
    return ("usage: ernie-image COMMAND [options]   (ernie-image COMMAND --help for its options)\n\ncommands:\n"
            + "\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
