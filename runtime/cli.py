"""`ernie-image`: the runtime from the command line (no ComfyUI needed).

Subcommands: generate, plan, quantize, enhance, check-remote. Errors print one line and exit 2.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

from .cli_parser import OneLineParser
from .errors import ErnieImageError, InvalidInputError
from .host import NullHost

# How the key options of `enhance` and `check-remote` are named in messages (the nodes name their widgets).
CLI_KEY_LABELS = dict(env_label="--api-key-env", file_label="--api-key-file", program="ernie-image")

DEMO_NOTICE = (
    "no model given: using a tiny random ERNIE-Image model built in code at {path}. "
    "Its pixels are noise from a demo model, not a real image; pass --model-dir or --dit/--text-encoder/--vae."
)


def default_cache_dir() -> Path:
    root = os.environ.get("ERNIE_IMAGE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "ernie-image")
    return Path(root)


def demo_model_sources(variant: str = "turbo"):
    """The tiny demo model, built once in the cache folder (a marker file says it is complete)."""
    from .tiny import build_tiny_model

    folder = default_cache_dir() / f"tiny-{variant}-v1"
    marker = folder / ".complete"
    if not marker.exists():
        import shutil

        shutil.rmtree(folder, ignore_errors=True)
        try:
            sources = build_tiny_model(folder, layout="diffusers", variant=variant)  # type: ignore[arg-type]
            marker.write_text("ok")
        except BaseException as error:
            shutil.rmtree(folder, ignore_errors=True)  # no half-built demo model left behind
            if isinstance(error, OSError):
                raise ErnieImageError(f"cannot build the demo model in {folder}: {error.strerror or error}: set "
                                      "ERNIE_IMAGE_CACHE to a writable folder, or pass --model-dir") from None
            raise
        return sources
    from .model_files import ModelSources

    return ModelSources(model_dir=folder)


def _add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-dir", type=Path, help="diffusers ERNIE-Image folder (model_index.json, transformer/, ...)")
    parser.add_argument("--dit", type=Path, help="DiT file (safetensors, GGUF, FP8/NVFP4); overrides the folder's")
    parser.add_argument("--text-encoder", type=Path, help="text-encoder file; overrides the folder's")
    parser.add_argument("--vae", type=Path, help="VAE file (flux2-vae.safetensors or diffusers layout)")
    parser.add_argument("--tokenizer", type=Path, help="tokenizer folder or tokenizer.json (single files embed one)")
    parser.add_argument("--pe", type=Path, help="prompt-enhancer folder or file")
    parser.add_argument("--variant", choices=["base", "turbo"], help="default: detected")
    parser.add_argument("--prompt", default="a red fox in fresh snow, morning light")
    parser.add_argument("--negative", default="")
    parser.add_argument("--width", type=int, default=None, help="multiple of 16 in 256..4096 (default 1024; demo 256)")
    parser.add_argument("--height", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None, help="default: 50 base, 8 turbo")
    parser.add_argument("--cfg", type=float, default=None, help="default: 4.0 base, 1.0 turbo")
    parser.add_argument("--shift", type=float, default=4.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--use-pe", action="store_true", help="rewrite the prompt with the prompt enhancer first")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp16", "fp32"])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--budget", default="auto", help="VRAM budget in GB, or auto")
    parser.add_argument("--quant", default="none", help="none, auto, fp8, q8_0, nvfp4 (quantise on load)")
    parser.add_argument("--out", type=Path, default=Path("ernie.png"), help="output PNG (batch: name_0.png, ...)")


def _png_paths(out: Path, count: int) -> list[Path]:
    if count == 1:
        return [out]
    return [out.with_name(f"{out.stem}_{index}{out.suffix}") for index in range(count)]


def check_out_path(out: Path) -> None:
    """Refuse an --out that cannot be written as a PNG before any weights are read."""
    if out.suffix.lower() != ".png":
        raise InvalidInputError(f"--out {out} is not a .png file name: give e.g. --out {out.stem or 'ernie'}.png")
    try:
        is_dir = out.is_dir()
        blocker = next((parent for parent in out.parents if parent.exists()), None)
    except OSError as error:  # e.g. a name longer than the file system allows
        raise InvalidInputError(f"--out {out} cannot be used: {error.strerror}: pick a shorter output path") from None
    if is_dir:
        raise InvalidInputError(f"--out {out} is a folder: give a file name inside it, e.g. --out {out / 'ernie.png'}")
    if blocker is not None and not blocker.is_dir():
        raise InvalidInputError(f"--out {out}: {blocker} is a file, not a folder: pick another output path")


def save_pngs(images, out: Path, settings: dict) -> list[Path]:
    from PIL import Image
    from PIL.PngImagePlugin import PngInfo

    paths = _png_paths(out, images.shape[0])
    written: list[Path] = []
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        for index, path in enumerate(paths):
            info = PngInfo()
            info.add_text("ernie-image", json.dumps({**settings, "batch_index": index}))
            pixels = (images[index].clamp(0, 1) * 255).round().to("cpu").byte().numpy()
            Image.fromarray(pixels, mode="RGB").save(path, format="PNG", pnginfo=info)  # PIL removes a partial file
            written.append(path)
    except OSError as error:
        for path in written:  # no half-written batch left behind
            path.unlink(missing_ok=True)
        raise ErnieImageError(f"cannot write {out}: {error.strerror or error}: pick a writable --out path") from None
    return paths


def parse_budget(text: str) -> Optional[float]:
    if text == "auto":
        return None
    try:
        return float(text)
    except ValueError:
        raise InvalidInputError(f"--budget {text!r} is not a number of GB: give e.g. --budget 12 or auto") from None


class _ConsoleHost(NullHost):
    """Progress and notices on stderr; Ctrl-C (KeyboardInterrupt) is the cancel."""

    def progress(self, value: int, total: int, preview=None) -> None:
        print(f"\rstep {value}/{total}", end="" if value < total else "\n", file=sys.stderr, flush=True)

    def log(self, message: str) -> None:
        print(message, file=sys.stderr)


def main_generate(argv: Sequence[str]) -> int:
    from .local_pipe import LoadOptions, LocalPipe
    from .model_files import ModelSources
    from .request import GenerationRequest

    from .remote.cli_args import add_remote_arguments, pe_endpoint_from_args, remote_pipe_from_args

    parser = OneLineParser(prog="ernie-image generate", description="Generate an image with ERNIE-Image.")
    _add_generate_arguments(parser)
    add_remote_arguments(parser)  # --server URL (a fleet when repeated), its timeouts and key, --pe-url
    args = parser.parse_args(argv)
    check_out_path(args.out)
    remote = remote_pipe_from_args(args)  # None without --server; its options are checked before any work
    if remote is not None:
        from .remote.cli_generate import generate_on_servers

        return generate_on_servers(args, remote, _ConsoleHost())
    # The console shows no pictures: skip the per-step latent preview (it costs a device-to-host copy per step).
    options = LoadOptions(device=args.device, dtype=args.dtype, vram_budget_gb=parse_budget(args.budget),
                          quant=args.quant, keep_loaded=False, previews=False, pe_endpoint=pe_endpoint_from_args(args))
    options.validate()  # before the demo model is built or any file read
    host = _ConsoleHost()
    demo = not any([args.model_dir, args.dit, args.text_encoder, args.vae])
    if demo:
        sources = demo_model_sources(args.variant or "turbo")
        host.log(DEMO_NOTICE.format(path=sources.model_dir))
    else:
        sources = ModelSources(model_dir=args.model_dir, dit=args.dit, text_encoder=args.text_encoder, vae=args.vae,
                               tokenizer=args.tokenizer, pe=args.pe, variant=args.variant)
    pipe = LocalPipe.load(sources, options)
    default_side = 256 if demo else 1024
    request = GenerationRequest(
        prompt=args.prompt, negative_prompt=args.negative,
        width=default_side if args.width is None else args.width,
        height=default_side if args.height is None else args.height,
        steps=int(pipe.defaults["steps"]) if args.steps is None else args.steps,
        cfg=args.cfg if args.cfg is not None else pipe.defaults["cfg"],
        shift=args.shift, seed=args.seed, batch=args.batch, use_pe=args.use_pe,
    )
    started = time.perf_counter()
    result = pipe.generate(request, host)
    elapsed = time.perf_counter() - started
    settings = {**request.metadata(), "variant": pipe.variant, "prompts_used": result.prompts_used,
                "demo_model": demo}
    paths = save_pngs(result.images, args.out, settings)
    for path in paths:
        print(path)
    host.log(f"{len(paths)} image(s) {request.width}x{request.height} in {elapsed:.2f} s ({pipe.describe()})")
    return 0


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
    "quantize": ("write a quantised DiT file (fp8, q8_0, nvfp4) once", _lazy(".quant.writer", "main_quantize")),
    "enhance": ("print the prompt enhancer's revised prompt", _lazy(".text.enhancer", "main_enhance")),
    "check-remote": ("check SGLang servers: readiness, model, one tiny generation", _lazy(".remote.check", "main_check_remote")),
}


def main(argv: Optional[Sequence[str]] = None) -> int:
    # Streaming weights through fixed buffers while activations change size fragments the caching allocator;
    # expandable segments avoid that. Set before torch initialises CUDA; a user's own setting wins.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] not in COMMANDS and argv[0] not in ("-h", "--help"):
        print(f"error: unknown command {argv[0]!r}: use one of {', '.join(COMMANDS)} (ernie-image --help)",
              file=sys.stderr)
        return 2
    if not argv or argv[0] in ("-h", "--help"):
        width = max(len(name) for name in COMMANDS)
        lines = [f"  {name:<{width}}  {summary}" for name, (summary, _) in COMMANDS.items()]
        print("usage: ernie-image COMMAND [options]\n\ncommands:\n" + "\n".join(lines), file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    try:
        return COMMANDS[argv[0]][1](argv[1:])
    except ErnieImageError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ncancelled", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
