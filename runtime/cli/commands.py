"""`ernie-image`: the runtime from the command line (no ComfyUI needed).

Subcommands: generate, plan, quantize, enhance, check-remote. Errors print one line and exit 2; Ctrl-C prints
"cancelled" and exits 130 (SIGTERM: 143), leaving no file behind. Help goes to stdout with exit 0.
"""
from __future__ import annotations

import os
import sys
from typing import Callable, Optional, Sequence

from ..core.errors import Cancelled, ErnieImageError
from .console import STDERR
from .generate import main_generate
from .interrupts import Interrupts
from .names import cli_message
from .terminal_text import one_terminal_line

CANCELLED_EXIT_CODES = (130, 143)  # 128 + SIGINT, 128 + SIGTERM


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
    "plan": ("show the VRAM plan for a budget and size (no GPU, no weights)", _lazy(".plan", "main_plan")),
    "quantize": ("write a quantised DiT file (fp8, nvfp4, q8_0, q4_k) once", _lazy(".quantize", "main_quantize")),
    "enhance": ("print the prompt enhancer's revised prompt", _lazy(".enhance", "main_enhance")),
    "check-remote": ("check SGLang servers: readiness, model, one tiny generation", _lazy(".check_remote", "main_check_remote")),
}


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run one command. `argv` None: the process's own command line (the `ernie-image` script, `python -m
    ernie_image`): the signal handling stays as it ends until the process exits, so a Ctrl-C after the files are
    committed cannot interrupt the exit. `argv` given (a call from Python): the signal handlers and the unraisable
    hook the caller had are put back when it returns."""
    # Streaming weights through fixed buffers while activations change size fragments the caching allocator;
    # expandable segments avoid that. Set before torch initialises CUDA; a user's own setting wins.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    from ..files.output_files import set_commit_hook

    interrupts = Interrupts()
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
        return _cancelled(interrupts, in_process)
    except ErnieImageError as error:
        # The CLI's flags for the settings the message names; a control character inside (a file name holding a
        # line break or an escape sequence) is shown escaped, so the error stays one line of plain text.
        STDERR.end_progress()
        STDERR.line("error: " + one_terminal_line(cli_message(error)))
        return 2
    except SystemExit as leaving:  # argparse's --help (exit 0); its errors are InvalidInputError
        return int(leaving.code or 0)
    except Exception:
        if interrupts.signal_number is None:
            raise
        # The interrupt landed inside an extension module's import or a C call that turned it into another error.
        return _cancelled(interrupts, in_process)
    finally:
        STDERR.end_progress()
        set_commit_hook(None)
        if in_process:
            interrupts.restore()


def _cancelled(interrupts: Interrupts, in_process: bool) -> int:
    """Say "cancelled" and give the exit code; the process's own command ends here and now: its teardown, the
    collection of a loaded model's objects, took a second after the line was shown, and nothing is left to write."""
    STDERR.end_progress()
    STDERR.line("cancelled")
    if not in_process:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(interrupts.exit_code)
    return interrupts.exit_code


def _top_level_help() -> str:
    width = max(len(name) for name in COMMANDS)
    lines = [f"  {name:<{width}}  {summary}" for name, (summary, _) in COMMANDS.items()]
    return ("usage: ernie-image COMMAND [options]   (ernie-image COMMAND --help for its options)\n\ncommands:\n"
            + "\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
