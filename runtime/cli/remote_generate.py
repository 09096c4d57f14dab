"""`ernie-image generate --server URL ...`: the same request, checks, PNGs and metadata as a local generation,
with the work done by SGLang servers (a RemotePipe from cli_args.remote_pipe_from_args)."""
from __future__ import annotations

import argparse
import time

from ..core.host import Host
from ..core.phrases import counted
from ..core.request import VARIANT_DEFAULTS, GenerationRequest
from ..net.credentials import Credentials
from ..remote.backend import RemotePipe

DEFAULT_SIDE = 1024


def _request(args: argparse.Namespace, steps: int, cfg: float) -> GenerationRequest:
    return GenerationRequest(
        prompt=args.prompt, negative_prompt=args.negative,
        width=DEFAULT_SIDE if args.width is None else args.width,
        height=DEFAULT_SIDE if args.height is None else args.height,
        steps=steps, cfg=cfg, shift=args.shift, seed=args.seed, batch=args.batch, use_pe=args.use_pe,
        # --variant's defaults sent to a server of the other variant: a notice (steps and CFG both given: the user's)
        settings_for=args.variant if args.steps is None or args.cfg is None else None,
    )


def _announced_variant(pipe: RemotePipe, host: Host) -> str:
    """The served model's variant (ServerModel.variant), told to the user with the defaults it brings."""
    model = pipe.served_model(host)
    defaults = VARIANT_DEFAULTS[model.variant]
    host.log(f"the servers serve {model.id}: defaults of ERNIE-Image {'Turbo' if model.variant == 'turbo' else '(base)'}"
             f" ({int(defaults['steps'])} steps, CFG {defaults['cfg']:g}); --variant, --steps and --cfg set them")
    return model.variant


def _servers_that_made(images: list[dict]) -> str:
    """Each server that made an image, with how many (one that made none is not named)."""
    counts: dict[str, int] = {}
    for image in images:
        counts[image["server"]] = counts.get(image["server"], 0) + 1
    return ", ".join(f"{server} ({count})" for server, count in counts.items())


def generate_on_servers(args: argparse.Namespace, pipe: RemotePipe, host: Host) -> int:
    from ..files.outputs_seen import OutputsSeen
    from ..files.png_output import png_paths, save_pngs

    from .remote_args import key_destinations

    notice = key_destinations(pipe.settings.credentials or Credentials())
    if notice:
        host.log(notice)
    try:
        # Every value given is checked before any network work (steps and CFG may still come from the server).
        _request(args, 1 if args.steps is None else args.steps, 1.0 if args.cfg is None else args.cfg).validate()
        variant = args.variant or (None if args.steps is not None and args.cfg is not None else
                                   _announced_variant(pipe, host))
        defaults = VARIANT_DEFAULTS[variant or "base"]
        request = _request(args, int(defaults["steps"]) if args.steps is None else args.steps,
                           defaults["cfg"] if args.cfg is None else args.cfg)
        seen = OutputsSeen(png_paths(args.out, request.batch))
        started = time.perf_counter()
        result = pipe.generate(request, host)
        elapsed = time.perf_counter() - started
        served = result.info["variant"]  # what made the images, whatever --variant said (the pipe gave a notice)
        settings = {**request.metadata(), "variant": served, "model": result.info["model"],
                    "prompts_used": result.prompts_used, "backend": "remote",
                    "servers": [image["server"] for image in result.info["images"]]}
        paths = save_pngs(result.images, args.out, settings, lambda: seen.say_changed(host.log))
    finally:
        pipe.release()
    for path in paths:
        print(path)
    host.log(result.info["summary"])
    host.log(f"{counted(len(paths), 'image')} {request.width}x{request.height} in {elapsed:.2f} s by "
             f"{result.info['model']} on {_servers_that_made(result.info['images'])}")
    return 0
