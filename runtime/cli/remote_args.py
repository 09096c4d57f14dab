"""The `ernie-image generate` options for SGLang servers and a PE chat endpoint, and their checks.

`add_remote_arguments(parser)` adds them; `remote_pipe_from_args(args)` is the RemotePipe they describe (None
without --server) and `pe_endpoint_from_args(args)` the PE chat endpoint (None without --pe-url), which serves a
local generation as well as a remote one. Every bad value is refused here, in one line naming the flag, before
any network work: timeouts that are NaN, 0 or negative, malformed URLs, key sources that cannot work, and local
model options given together with --server (the server has its own model and precision).
"""
from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Optional

from ..core.errors import InvalidInputError
from ..net.credentials import Credentials, load_credentials
from ..net.settings import checked_seconds
from .parser import Option

if TYPE_CHECKING:
    from ..remote.backend import RemotePipe
    from ..text.remote_enhancer import ChatEndpoint

DEFAULT_CONNECT_TIMEOUT_S = 5.0
DEFAULT_READ_TIMEOUT_S = 120.0
DEFAULT_WAIT_FOR_SERVERS_S = 600.0
DEFAULT_PE_TIMEOUT_S = 120.0
# Local-model options that mean nothing to a server, with the default that means "not given".
LOCAL_ONLY = {"model_dir": None, "dit": None, "text_encoder": None, "vae": None, "tokenizer": None, "pe": None,
              "dtype": "auto", "device": "auto", "budget": "auto", "quant": "none"}


def add_remote_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("SGLang servers (instead of a local model)")
    group.add_argument("--server", action="append", default=[], metavar="URL", dest="servers",
                       help="SGLang diffusion server base URL, e.g. http://gpu-box:30000; repeat for a fleet "
                            "(images are spread over the servers that work)")
    group.add_argument("--connect-timeout", default=None, metavar="S",
                       help=f"seconds to wait for a server to accept a connection "
                            f"(default {DEFAULT_CONNECT_TIMEOUT_S:g})")
    group.add_argument("--read-timeout", default=None, metavar="S",
                       help=f"base seconds a server has for its whole answer with one image; it grows with steps "
                            f"and size (default {DEFAULT_READ_TIMEOUT_S:g})")
    group.add_argument("--wait-for-servers", default=None, metavar="S",
                       help=f"seconds to wait while no server can take work, e.g. still loading, counted "
                            f"from the start (default {DEFAULT_WAIT_FOR_SERVERS_S:g}; 0 fails unless a server "
                            f"answers ready at its first look, within 1 s)")
    group.add_argument("--resend-unanswered", action="store_true",
                       help="send an image again when its server gave no answer (timeout, dropped connection); "
                            "that server may still be working on it, so the job may run twice")
    group.add_argument("--api-key-env", action=Option, once=True, quiet=True, default=None, metavar="NAME",
                       help="NAME of the environment variable holding the servers' API key (never the key)")
    group.add_argument("--api-key-file", action=Option, once=True, quiet=True, default=None, metavar="PATH",
                       help="file holding only the servers' API key")
    pe = parser.add_argument_group("prompt enhancer on a chat server (local or remote generation)")
    pe.add_argument("--pe-url", action=Option, once=True, default=None, metavar="URL",
                    help="OpenAI-compatible chat server serving ERNIE-Image's prompt enhancer (vLLM, SGLang); "
                         "with --use-pe the prompt is revised there")
    pe.add_argument("--pe-model", action=Option, once=True, default=None, metavar="NAME",
                    help="model name on the PE server (default: the first it lists)")
    pe.add_argument("--pe-api-key-env", action=Option, once=True, quiet=True, default=None, metavar="NAME",
                    help="NAME of the environment variable holding the PE server's API key")
    pe.add_argument("--pe-api-key-file", action=Option, once=True, quiet=True, default=None, metavar="PATH",
                    help="file holding only the PE server's API key")
    pe.add_argument("--pe-timeout", default=None, metavar="S",
                    help=f"seconds the PE server has for its whole answer with a revised prompt (default "
                         f"{DEFAULT_PE_TIMEOUT_S:g})")


def check_one_key_source(env_var: Optional[str], file: Optional[str], prefix: str = "") -> None:
    """A key comes from a variable or a file: both given is refused (which one is meant cannot be told)."""
    if (env_var or "").strip() and (file or "").strip():
        raise InvalidInputError(f"--{prefix}api-key-env and --{prefix}api-key-file both name the API key: give one "
                                f"of them")


def cli_credentials(urls: list[str], env_var: Optional[str], file: Optional[str], prefix: str = "") -> Credentials:
    """The key the command line names, bound to the servers given on it; without one, the user's keys file."""
    check_one_key_source(env_var, file, prefix)
    if not (env_var or "").strip() and not (file or "").strip():
        return load_credentials()
    return Credentials.bound_to(urls, env_var, file, env_flag=f"--{prefix}api-key-env",
                                file_flag=f"--{prefix}api-key-file", program="ernie-image")


def key_destinations(credentials: Credentials) -> Optional[str]:
    """A notice naming every server a key from the command line goes to, when it goes to more than one origin (a
    fleet command copied from elsewhere may hold a server that is not yours)."""
    flagged = [entry for entry in credentials.entries if entry.given_by.startswith("--")]
    if len(flagged) < 2:
        return None
    return (f"the key {flagged[0].given_by} names goes to each of these servers: "
            f"{', '.join(str(entry.origin) for entry in flagged)}")


def pe_endpoint_from_args(args: argparse.Namespace) -> Optional["ChatEndpoint"]:
    """The PE chat endpoint --pe-url names, checked (URL, key source); None without --pe-url."""
    from ..net.urls import normalize_base_url
    from ..text.remote_enhancer import ChatEndpoint

    url = (args.pe_url or "").strip()
    if not url:
        given = [flag for flag, value in (("--pe-model", args.pe_model), ("--pe-api-key-env", args.pe_api_key_env),
                                          ("--pe-api-key-file", args.pe_api_key_file),
                                          ("--pe-timeout", args.pe_timeout)) if value]
        if given:
            raise InvalidInputError(f"{given[0]} is for the PE chat server: give its URL with --pe-url")
        return None
    if not args.use_pe:
        raise InvalidInputError("--pe-url revises the prompt only with --use-pe: add --use-pe, or drop --pe-url")
    connect_s = _seconds(args.connect_timeout, "--connect-timeout", DEFAULT_CONNECT_TIMEOUT_S)
    base = normalize_base_url(ChatEndpoint(url=url).base_url(), what="--pe-url")
    credentials = cli_credentials([base], args.pe_api_key_env, args.pe_api_key_file, "pe-")
    return ChatEndpoint.bound(url, credentials, what="--pe-url", model=(args.pe_model or "").strip() or None,
                              connect_timeout_s=connect_s, timeout_setting="--pe-timeout",
                              read_timeout_s=_seconds(args.pe_timeout, "--pe-timeout", DEFAULT_PE_TIMEOUT_S))


def remote_pipe_from_args(args: argparse.Namespace) -> Optional["RemotePipe"]:
    """The RemotePipe the --server options describe, checked but not yet connected; None without --server."""
    from ..net.urls import normalize_base_url
    from ..remote.backend import RemotePipe, RemoteSettings
    from ..remote.sglang import ENDPOINT_SUFFIXES

    connect_s = _seconds(args.connect_timeout, "--connect-timeout", DEFAULT_CONNECT_TIMEOUT_S)
    if not args.servers:
        given = [flag for flag, value in (("--connect-timeout", args.connect_timeout if not args.pe_url else None),
                                          ("--read-timeout", args.read_timeout),
                                          ("--wait-for-servers", args.wait_for_servers),
                                          ("--resend-unanswered", args.resend_unanswered),
                                          ("--api-key-env", args.api_key_env),
                                          ("--api-key-file", args.api_key_file)) if value]
        if given:
            keys = " (the PE chat server's key options are --pe-api-key-env/--pe-api-key-file)" \
                if given[0].startswith("--api-key") else ""
            raise InvalidInputError(f"{given[0]} is for SGLang servers: give one with --server URL{keys}")
        return None
    local = [name for name, unset in LOCAL_ONLY.items() if getattr(args, name, unset) != unset]
    if local:
        flag = "--" + local[0].replace("_", "-")
        raise InvalidInputError(f"{flag} is for a local model, but --server sends the work to SGLang servers, which "
                                f"load their own model and precision: drop {flag} or --server")
    bases = [normalize_base_url(url, what="--server", endpoint_suffixes=ENDPOINT_SUFFIXES) for url in args.servers]
    settings = RemoteSettings(
        credentials=cli_credentials(bases, args.api_key_env, args.api_key_file), connect_timeout_s=connect_s,
        read_timeout_base_s=_seconds(args.read_timeout, "--read-timeout", DEFAULT_READ_TIMEOUT_S),
        wait_for_servers_s=_seconds(args.wait_for_servers, "--wait-for-servers", DEFAULT_WAIT_FOR_SERVERS_S,
                                    allow_zero=True),
        resend_unanswered=bool(args.resend_unanswered),
        pe_endpoint=pe_endpoint_from_args(args),
    )
    return RemotePipe(args.servers, settings)


def _seconds(value: Optional[str], flag: str, default: float, allow_zero: bool = False) -> float:
    return default if value is None else checked_seconds(value, flag, allow_zero=allow_zero)
