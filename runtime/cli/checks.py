"""Argument checks every `ernie-image` command runs before any weights are read or any model is built.

Small validators, each raising InvalidInputError with one line naming the option, the cause and the fix, and
`check_generate_args(args, *feature_checks)`, the one place `generate` checks its arguments. A feature that adds
flags to `generate` exposes its own `check(args)` and generate.py lists it in FEATURE_CHECKS; it runs after the checks
here (numbers first, then input files, then the output paths, that no two name one file and that none is an input),
still before anything heavy.
"""
from __future__ import annotations

import argparse
import errno
import math
import os
import stat
import tempfile
from pathlib import Path
from typing import Callable, Iterable, Literal, Optional

from ..core.errors import InvalidInputError, quoted_shortly
from ..core.number_text import DECIMAL_RULE, decimal_from_text, not_allowed
from ..core.request import BATCH_RANGE, CFG_RANGE, SEED_RANGE, SHIFT_RANGE, STEPS_RANGE, validate_size
from ..files.file_kind import not_there
from ..files.inputs_outputs import refuse_colliding_outputs, refuse_outputs_over_inputs
from ..files.output_files import longest_name
from ..files.uninterrupted import uninterrupted

ArgCheck = Callable[[argparse.Namespace], None]
PathKind = Literal["file", "folder", "file or folder"]


# ---- numbers ----------------------------------------------------------------------------------------------

def check_seed(seed: int, option: str = "--seed") -> None:
    """Seeds are 0..2^63-1 everywhere (the noise generator, the prompt enhancer, SGLang and chat servers)."""
    check_int_range(seed, option, *SEED_RANGE)


def check_int_range(value: int, option: str, low: int, high: int, hint: str = "") -> None:
    if not low <= value <= high:
        raise not_allowed(option, str(value), (low, high), hint)


def check_number_range(value: float, option: str, low: float, high: float, hint: str = "") -> None:
    if not math.isfinite(value) or not low <= value <= high:  # NaN passes no comparison: named here
        raise not_allowed(option, str(value), (low, high), hint)


def parse_budget(text: str) -> Optional[float]:
    """`--budget` (generate and plan): GiB as a plain decimal number, or 'auto' (None). The range is
    LoadOptions' own check, so both commands refuse a budget in the library's one wording (cli/names.py gives it
    the CLI's words)."""
    from ..local.options import check_budget_gb

    if text == "auto":
        return None
    shown = text
    try:
        value = decimal_from_text(text, "--budget")
    except InvalidInputError:  # past float's range (`1e999`): refused below as any budget out of range is
        value, shown = math.inf, quoted_shortly(text)
    if value is None:
        raise InvalidInputError(f"--budget {text!r} is not a number of GiB: give e.g. --budget 12 ({DECIMAL_RULE}), "
                                "or auto")
    check_budget_gb(value, shown=shown)
    return value


# ---- paths --------------------------------------------------------------------------------------------------

def _stat(path: Path, option: str) -> Optional[os.stat_result]:
    try:
        return path.stat()
    except FileNotFoundError:
        return None
    except NotADirectoryError:
        blocker = next((parent for parent in path.parents if parent.exists() and not parent.is_dir()), path.parent)
        raise InvalidInputError(f"{option} {path}: {blocker} is a file, not a folder: check the path") from None
    except OSError as error:  # a name too long, a loop of links, no permission to look
        raise InvalidInputError(f"{option} {path} cannot be used: {error.strerror}: check the path") from None


def check_input_path(path: Optional[Path], option: str, kind: PathKind) -> None:
    """An input the option reads: it exists and is a regular file or a folder, as the option expects.

    /dev/null, a FIFO, a socket or a device is refused here: reading one would block or give no weights."""
    if path is None:
        return
    info = _stat(path, option)
    if info is None:
        raise InvalidInputError(f"{option} {path} {not_there(path)}")
    is_dir, is_file = stat.S_ISDIR(info.st_mode), stat.S_ISREG(info.st_mode)
    if kind == "folder" and not is_dir:
        raise InvalidInputError(f"{option} {path} is not a folder: give the folder itself")
    if kind == "file" and not is_file:
        what = "a folder" if is_dir else "not a regular file"
        raise InvalidInputError(f"{option} {path} is {what}: give a regular file")
    if kind == "file or folder" and not (is_dir or is_file):
        raise InvalidInputError(f"{option} {path} is not a regular file or a folder (a device, pipe or socket): "
                                "give the weight file or its folder")
    if not os.access(path, os.R_OK | (os.X_OK if is_dir else 0)):
        raise InvalidInputError(f"{option} {path} cannot be read (permission denied): check its permissions")


def check_output_file(path: Path, option: str, suffixes: Iterable[str], example: str,
                      written: Iterable[Path] = ()) -> Path:
    """An output file: the right name, its folder exists and is writable, and it is not itself a folder; `written`:
    the names made from it (a batch's name_0.png ...; none: `path` itself), each short enough for the folder.

    An existing file is replaced only when the new one is complete (writers go through `atomic_output`)."""
    suffixes = tuple(suffixes)
    info = _stat(path, option)
    if info is not None and stat.S_ISDIR(info.st_mode):  # before the name: `--out /tmp` is a folder, not a name
        raise InvalidInputError(f"{option} {path} is a folder: give a file name inside it, e.g. "
                                f"{option} {path / (example + suffixes[0])}")
    if path.suffix.lower() not in suffixes:
        stem = path.stem if not path.stem.startswith(".") else example  # `.gguf` is a hidden name, no suffix
        name = f"{stem or example}{suffixes[0]}"
        given = f"{option}={name}" if name.startswith("-") else f"{option} {name}"  # argparse takes `-x` for an option
        raise InvalidInputError(f"{option} {path} is not a {' or '.join(suffixes)} file name: give e.g. {given}")
    if info is not None and not stat.S_ISREG(info.st_mode):
        raise InvalidInputError(f"{option} {path} is not a regular file (a device, pipe or socket): pick another "
                                "output path")
    folder = path.parent
    folder_info = _stat(folder, option)
    if folder_info is None:
        raise InvalidInputError(f"{option} {path}: the folder {folder} does not exist: create it first")
    if not stat.S_ISDIR(folder_info.st_mode):
        raise InvalidInputError(f"{option} {path}: {folder} is a file, not a folder: pick another output path")
    _check_writable_folder(folder, path, option, tuple(written) or (path,))
    return path


def _check_writable_folder(folder: Path, path: Path, option: str, written: tuple[Path, ...]) -> None:
    """Create and remove a scratch file: the only test that holds for read-only mounts, ACLs and root alike. Made
    and removed uninterrupted, so a Ctrl-C at any moment leaves no scratch file behind."""
    try:
        with uninterrupted(), tempfile.NamedTemporaryFile(dir=folder, prefix=f".{path.name[:40]}.", suffix=".check"):
            pass
    except OSError as error:
        if error.errno == errno.ENAMETOOLONG:
            raise InvalidInputError(f"{option} {path} cannot be used: {error.strerror}: pick a shorter output "
                                    "path") from None
        raise InvalidInputError(f"{option} {path} cannot be written: {_why_unwritable(folder, error)}: pick a "
                                "writable folder") from None
    longest = max(reversed(written), key=lambda name: len(os.fsencode(name.name)))  # of a tie, the last
    if len(os.fsencode(longest.name)) > longest_name(folder):
        made = "" if longest == path else f" (a batch's {longest.name[-len(longest.suffix) - 3:]})"
        raise InvalidInputError(f"{option} {path} cannot be used: File name too long{made}: pick a shorter output "
                                "path")


# File systems of the kernel's own (its state as files): they take no new files, whatever the permissions say.
KERNEL_FILE_SYSTEMS = frozenset({"proc", "sysfs", "cgroup", "cgroup2", "devpts", "debugfs", "tracefs", "securityfs",
                                 "configfs", "pstore", "bpf", "efivarfs", "fusectl", "binfmt_misc", "mqueue"})


def _why_unwritable(folder: Path, error: OSError) -> str:
    """Why a new file cannot be made in `folder`, in plain words (ENOENT in /proc, EACCES in /sys say nothing)."""
    mount_point, file_system = _mount_of(folder)
    if file_system in KERNEL_FILE_SYSTEMS:
        return f"{mount_point} is the kernel's {file_system} file system, which takes no files"
    reasons = {errno.EROFS: f"{folder} is on a read-only file system",
               errno.EACCES: f"the folder {folder} is not writable (permission denied)",
               errno.EPERM: f"the folder {folder} is not writable (operation not permitted)",
               errno.ENOSPC: f"no space is left on the device of {folder}",
               errno.EDQUOT: f"the disk quota of {folder} is used up"}
    return reasons.get(error.errno or 0, f"{folder}: {error.strerror or error}")


def _mount_of(folder: Path) -> tuple[str, str]:
    """The mount point holding `folder` and its file-system type, from /proc/self/mounts ("", "" where unknown)."""
    try:
        resolved = os.path.realpath(folder)
        with open("/proc/self/mounts", encoding="utf-8", errors="replace") as mounts:
            entries = [line.split()[1:3] for line in mounts if len(line.split()) >= 3]
    except OSError:
        return "", ""
    best = ("", "")
    for mount_point, file_system in entries:
        mount_point = mount_point.replace("\\040", " ")
        inside = resolved == mount_point or resolved.startswith(mount_point.rstrip("/") + "/")
        if inside and len(mount_point) >= len(best[0]):
            best = (mount_point, file_system)
    return best


# ---- generate -------------------------------------------------------------------------------------------------

DEMO_SIDE = 256  # the demo model's default size (the real models': 1024)
REAL_SIDE = 1024
DEMO_VARIANT = "turbo"  # the demo model's variant unless --variant says another


def uses_demo_model(args: argparse.Namespace) -> bool:
    return not any([args.model_dir, args.dit, args.text_encoder, args.vae])


def default_side(args: argparse.Namespace) -> int:
    """--width/--height when not given: 256 for the demo model, 1024 (Baidu's ~1 MP) for real weights."""
    return DEMO_SIDE if uses_demo_model(args) else REAL_SIDE


def known_steps(args: argparse.Namespace) -> Optional[int]:
    """The steps the run will take, where the command line tells them: --steps, else the default of the variant
    --variant sets (the demo model's: Turbo unless set). None where the model's files decide the variant."""
    from ..core.variant import VARIANT_DEFAULTS

    if args.steps is not None:
        return args.steps
    variant = args.variant or (DEMO_VARIANT if uses_demo_model(args) else None)
    return None if variant is None else int(VARIANT_DEFAULTS[variant]["steps"])


def cpu_budget_notice(args: argparse.Namespace) -> Optional[str]:
    """The notice for a --budget number on the CPU: what it does there (LocalPipe plans with the CPU standing in
    for the GPU, which is how the tests run the streamer), and that it saves nothing."""
    from ..local.options import resolve_device

    if parse_budget(args.budget) is None or resolve_device(args.device).type != "cpu":
        return None
    return (f"--budget {args.budget} has no GPU memory to save on the CPU (the weights are in host memory either "
            "way): the run is placed within it as if the CPU were a GPU, so blocks that do not fit are copied every "
            "step, which only costs time; leave --budget out without a CUDA device")


def unused_pe_notice(args: argparse.Namespace) -> Optional[str]:
    """The notice for --pe FILE without --use-pe: the prompt is used as written."""
    if getattr(args, "pe", None) is None or getattr(args, "use_pe", False):
        return None
    return "--pe is not used without --use-pe"


def _check_flags_that_need_another(args: argparse.Namespace) -> None:
    if getattr(args, "lora_mode", None) is not None and not getattr(args, "lora", None):
        raise InvalidInputError(f"--lora-mode {args.lora_mode} says how LoRAs run: give --lora PATH too, or leave "
                                "it out")
    if not getattr(args, "servers", None):  # with --server, remote_args refuses every local-model option
        _check_prompt_enhancer_files(args)


def _check_prompt_enhancer_files(args: argparse.Namespace) -> None:
    """--pe and --tokenizer belong to a model given on the command line; --pe is refused beside a PE server, which
    would revise the prompt instead (each would be silently unused). --pe without --use-pe is told, not refused
    (unused_pe_notice): a script may give --pe on every run and turn the prompt enhancer on and off with --use-pe."""
    if uses_demo_model(args):
        for option in ("pe", "tokenizer"):
            if getattr(args, option) is not None:
                flag = "--" + option
                why, alone = ((" has no prompt enhancer, nor the vocabulary a real one shares with its text encoder",
                               " (`ernie-image enhance --pe FILE --prompt TEXT` shows its rewrite alone)")
                              if option == "pe" else (" has a tokenizer of its own", ""))
                raise InvalidInputError(f"{flag} {getattr(args, option)} needs a model: without --model-dir or "
                                        f"--dit/--text-encoder/--vae the tiny demo model runs, which{why}: give the "
                                        f"model too, or leave out {flag}{alone}")
    if args.pe is not None and args.pe_url:
        raise InvalidInputError("--pe and --pe-url both name a prompt enhancer, and the PE server would revise the "
                                "prompt: give one of them")


def _check_numbers(args: argparse.Namespace) -> None:
    side = default_side(args)
    validate_size(side if args.width is None else args.width, side if args.height is None else args.height)
    if args.steps is not None:
        check_int_range(args.steps, "--steps", *STEPS_RANGE, " (50 for ERNIE-Image, 8 for Turbo)")
    if args.cfg is not None:
        check_number_range(args.cfg, "--cfg", *CFG_RANGE, " (4.0 for ERNIE-Image, 1.0 for Turbo)")
    check_number_range(args.shift, "--shift", *SHIFT_RANGE, " (4.0 is Baidu's)")
    check_seed(args.seed)
    check_int_range(args.batch, "--batch", *BATCH_RANGE)


def _check_prompts(args: argparse.Namespace) -> None:
    """The prompts as the request checks them (text that encodes as UTF-8), before the demo model is built."""
    from ..core.request import GenerationRequest

    GenerationRequest(prompt=args.prompt, negative_prompt=args.negative).validate()


def _check_load_options(args: argparse.Namespace) -> None:
    from ..local.options import LoadOptions, resolve_device  # the pipe's own checks, not a copy of them

    LoadOptions(device=args.device, dtype=args.dtype, vram_budget_gb=parse_budget(args.budget),
                quant=args.quant).validate()
    resolve_device(args.device)  # cuda asked for where PyTorch sees none


def _check_model_paths(args: argparse.Namespace) -> None:
    check_input_path(args.model_dir, "--model-dir", "folder")
    for option, kind in (("dit", "file or folder"), ("text_encoder", "file or folder"), ("vae", "file or folder"),
                         ("tokenizer", "file or folder"), ("pe", "file or folder")):
        check_input_path(getattr(args, option), "--" + option.replace("_", "-"), kind)  # type: ignore[arg-type]


# Every PNG option of `generate`, with the name its example fix gives; each writes png_paths(path, --batch).
GENERATE_OUTPUTS = (("out", "ernie"), ("step_cache_compare", "compare"))


def _outputs_given(args: argparse.Namespace) -> list[tuple[str, Path, str]]:
    """(the option, the path given, the example name) of each output option the command line gave."""
    given = [("--" + name.replace("_", "-"), getattr(args, name, None), example) for name, example in GENERATE_OUTPUTS]
    return [(option, Path(path), example) for option, path, example in given if path is not None]


def _files_written(args: argparse.Namespace) -> list[tuple[str, Path, Path]]:
    """(the option, the path given, a file written from it): every PNG a run writes, batch names included."""
    from ..files.png_output import png_paths

    return [(option, given, path) for option, given, _ in _outputs_given(args)
            for path in png_paths(given, args.batch)]


def _check_outputs(args: argparse.Namespace) -> None:
    """Each output a writable .png name, none of its batch names a folder, and no two outputs one file."""
    from ..files.png_output import png_paths

    for option, given, example in _outputs_given(args):
        check_output_file(given, option, (".png",), example, png_paths(given, args.batch))
    for option, given, path in _files_written(args) if args.batch > 1 else ():  # name_0.png, name_1.png, ...
        if path.is_dir():
            raise InvalidInputError(f"{option} {given}: batch image {path} is a folder: pick another output name")
    refuse_colliding_outputs(_files_written(args))


GENERATE_INPUTS = ("model_dir", "dit", "text_encoder", "vae", "tokenizer", "pe", "init_image", "mask", "api_key_file",
                   "pe_api_key_file")


def _check_inputs_are_not_outputs(args: argparse.Namespace) -> None:
    """No PNG the run writes (`--out`, `--step-cache-compare`, or a batch's name_N.png) is a file it reads."""
    from .lora_args import parse_lora_argument

    inputs = [("--" + name.replace("_", "-"), getattr(args, name, None)) for name in GENERATE_INPUTS]
    inputs += [("--lora", parse_lora_argument(value).path) for value in getattr(args, "lora", None) or ()]
    refuse_outputs_over_inputs([(option, Path(path) if path is not None else None) for option, path in inputs],
                               _files_written(args))


# The order users meet the errors in: a size error before a file error, a file error before the output's.
GENERATE_CHECKS: tuple[ArgCheck, ...] = (_check_flags_that_need_another, _check_numbers, _check_prompts, _check_load_options, _check_model_paths,
                                         _check_outputs, _check_inputs_are_not_outputs)


def check_generate_args(args: argparse.Namespace, *feature_checks: ArgCheck) -> None:
    """Every `generate` argument, then each feature's own check: all before any weights are read."""
    for check in (*GENERATE_CHECKS, *feature_checks):
        check(args)
