"""`ernie-image enhance`: the prompt enhancer's revised prompt, alone on stdout (local PE or a chat endpoint)."""
from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Sequence

from ..core.errors import InvalidInputError
from ..core.number_text import range_text
from ..core.phrases import pe_work
from ..core.request import (MAX_NEW_TOKENS_RANGE, SEED_RANGE, SIDE_MULTIPLE, SIDE_RANGE, TEMPERATURE_RANGE,
                            TOP_P_RULE, validate_size)
from ..formats.sources import ModelSources
from ..local.options import LoadOptions, resolve_device, resolve_dtype
from ..net.settings import checked_seconds
from ..net.urls import normalize_base_url
from ..text.enhancer import LocalEnhancer, revise_prompts, validate_sampling
from ..text.remote_enhancer import ChatEndpoint, revise_prompts_remote
from .checks import check_input_path, check_seed
from .console import ConsoleHost
from .parser import DecimalNumber, OneLineParser, PathOption, WholeNumber
from .remote_args import cli_credentials
from .terminal_text import plain_terminal_lines


def _parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="ernie-image enhance",
        description="Print the prompt enhancer's revised prompt (only that, on stdout).",
    )
    parser.add_argument("--model-dir", action=PathOption, help="diffusers ERNIE-Image folder with pe/ and pe_tokenizer/")
    parser.add_argument("--pe", action=PathOption, help="prompt-enhancer file (ernie-image-prompt-enhancer.safetensors) or folder")
    parser.add_argument("--tokenizer", type=Path, help="tokenizer folder, when the PE file embeds none")
    parser.add_argument("--text-encoder", type=Path, help="text-encoder file whose embedded tokenizer the PE may share")
    parser.add_argument("--pe-url", help="OpenAI-compatible server serving the PE (vLLM, SGLang), e.g. http://host:8000")
    parser.add_argument("--pe-model", help="model name on that server (default: the first one it lists)")
    parser.add_argument("--api-key-env", help="environment variable holding the server's API key")
    parser.add_argument("--api-key-file", help="file holding the server's API key")
    parser.add_argument("--pe-timeout", default=None, metavar="S",
                        help="seconds to wait for the server's revised prompt (default 120)")
    parser.add_argument("--prompt", required=True)
    side = f"a multiple of {SIDE_MULTIPLE} in {range_text(SIDE_RANGE)} (default %(default)s)"
    parser.add_argument("--width", action=WholeNumber, example="1024", default=1024, allowed=SIDE_RANGE,
                        help=f"the width of the image the prompt is revised for: {side}")
    parser.add_argument("--height", action=WholeNumber, example="1024", default=1024, allowed=SIDE_RANGE,
                        help=f"its height: {side}")
    parser.add_argument("--seed", action=WholeNumber, once=True, example="7", default=0, allowed=SEED_RANGE,
                        repeat_hint=" (run the command once per seed)",
                        help=f"{range_text(SEED_RANGE)}, as generate's --seed")
    parser.add_argument("--temperature", action=DecimalNumber, example="0.6", default=0.6, allowed=TEMPERATURE_RANGE,
                        help=f"{range_text(TEMPERATURE_RANGE)} (default %(default)s, Baidu's; 0 is greedy)")
    # No `allowed`: top-p's range is open at 0, which no LOW..HIGH says; validate_sampling refuses it in TOP_P_RULE.
    parser.add_argument("--top-p", action=DecimalNumber, example="0.95", default=0.95,
                        help=f"{TOP_P_RULE} (default %(default)s, Baidu's)")
    parser.add_argument("--max-new-tokens", action=WholeNumber, example="512", default=512,
                        allowed=MAX_NEW_TOKENS_RANGE,
                        help=f"tokens the revised prompt may take at most, {range_text(MAX_NEW_TOKENS_RANGE)} "
                             "(default %(default)s)")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp16", "fp32"])
    parser.add_argument("--quiet", action="store_true", help="no timing line on stderr")
    return parser


def check_enhance_args(args: argparse.Namespace) -> None:
    """Every argument, before the PE is read or a server asked (the same ranges generate and the runtime use)."""
    validate_size(args.width, args.height)
    check_seed(args.seed)
    validate_sampling(args.temperature, args.top_p, args.max_new_tokens)
    if args.pe_timeout is not None:
        if not args.pe_url:
            raise InvalidInputError("--pe-timeout is for a PE server: give its URL with --pe-url")
        checked_seconds(args.pe_timeout, "--pe-timeout")
    if not args.pe_url:
        LoadOptions(device=args.device, dtype=args.dtype).validate()
        check_input_path(args.model_dir, "--model-dir", "folder")
        for option in ("pe", "tokenizer", "text_encoder"):
            check_input_path(getattr(args, option), "--" + option.replace("_", "-"), "file or folder")


def main_enhance(argv: Sequence[str]) -> int:
    args = _parser().parse_args(list(argv))
    check_enhance_args(args)
    host = ConsoleHost()  # the local PE's progress in tokens, notices on stderr
    started = time.perf_counter()
    if args.pe_url:
        base = normalize_base_url(ChatEndpoint(url=args.pe_url).base_url(), what="--pe-url")
        endpoint = ChatEndpoint.bound(args.pe_url, cli_credentials([base], args.api_key_env, args.api_key_file),
                                      what="--pe-url", model=args.pe_model, timeout_setting="--pe-timeout",
                                      read_timeout_s=120.0 if args.pe_timeout is None else
                                      checked_seconds(args.pe_timeout, "--pe-timeout"))
        # Rewriting is this command's only job: a fault is its error, not the original prompt passed off as one.
        result = revise_prompts_remote(endpoint, [args.prompt], args.width, args.height, args.seed,
                                       args.temperature, args.top_p, args.max_new_tokens, host, keep_original=False)
    else:
        if args.model_dir is None and args.pe is None:
            raise InvalidInputError("no prompt enhancer given: pass --model-dir, --pe FILE or --pe-url URL")
        sources = ModelSources(model_dir=args.model_dir, pe=args.pe, tokenizer=args.tokenizer,
                               text_encoder=args.text_encoder)
        if not sources.has_pe():  # the library's words would offer turning the enhancer off: this command is it
            raise InvalidInputError(f"no prompt enhancer in --model-dir {args.model_dir}: give a diffusers folder "
                                    "with pe/ and pe_tokenizer/, the ernie-image-prompt-enhancer.safetensors file "
                                    "(--pe FILE), or a chat server serving it (--pe-url URL)")
        device = resolve_device(args.device)
        enhancer = LocalEnhancer.load(sources, device, resolve_dtype(args.dtype, device), host=host)
        try:
            settings = enhancer.settings(args.temperature, args.top_p, args.max_new_tokens)
            result = revise_prompts(enhancer, [args.prompt], args.width, args.height, args.seed, settings, host)
        finally:
            enhancer.release()
    print(plain_terminal_lines(result.prompts[0]))  # a remote PE's text may hold terminal escape codes
    if not args.quiet:
        info = result.info()
        host.log(f"prompt enhancer ({info.get('pe', '?')}): {pe_work(info)}; total "
                 f"{time.perf_counter() - started:.2f} s")
    return 0
