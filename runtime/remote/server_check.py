"""`ernie-image check-remote URL...` and the node's "Test connection": one row per server.

Readiness (/health), the served model (/v1/models: must be an ERNIE-Image pipeline), GPUs, precision,
version (/server_info) and the time of one tiny generation (256x256, 1 step), as a text table.
"""
from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

from ..cli.parser import OneLineParser
from ..core.errors import ErnieImageError
from ..net.credentials import Credentials, ServerKeys, load_credentials
from ..net.loop_thread import run_sync
from ..net.settings import HttpSettings, RetryPolicy, Timeouts, checked_seconds
from ..net.urls import normalize_base_url, shown_url
from .sglang import ENDPOINT_SUFFIXES, PROBE_READ_S, ImageParams, ReadTimeoutPolicy, SglangClient

TINY_IMAGE = ImageParams(prompt="a red fox in snow", negative_prompt="", width=256, height=256, steps=1,
                         guidance_scale=1.0, seed=0, use_pe=False)
GENERATION_TIMEOUT_S = 120.0


@dataclass
class CheckRow:
    url: str
    readiness: str = "?"
    model_id: Optional[str] = None
    pipeline: Optional[str] = None
    num_gpus: Optional[int] = None
    precision: Optional[str] = None
    version: Optional[str] = None
    generation_s: Optional[float] = None
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.readiness == "ready" and not self.problems


async def check_one(url: str, keys: ServerKeys, generate: bool, connect_timeout_s: float,
                    generation_timeout_s: float, probe_read_s: float = PROBE_READ_S,
                    read_timeout_label: Optional[str] = None) -> CheckRow:
    """One server's row. `probe_read_s`: how long readiness, model list and version are awaited;
    `read_timeout_label`: the setting that governs it, named in the advice to raise it; `keys`: each server's
    credential, resolved before any server is asked."""
    row = CheckRow(url=shown_url(url))  # never the URL as typed: it may hold a password
    try:
        credential = keys.for_url(normalize_base_url(url))
        settings = HttpSettings(credential, Timeouts(connect_s=connect_timeout_s), RetryPolicy(attempts=1),
                                keys=keys.advice)
        client = SglangClient(url, settings, ReadTimeoutPolicy(base_s=generation_timeout_s, per_step_megapixel_s=0.0),
                              probe_read_s=probe_read_s, probe_read_label=read_timeout_label)
    except ErnieImageError as exc:
        row.readiness, row.problems = "bad URL", [str(exc)]
        return row
    row.url = client.label
    try:
        readiness = await client.health()
        row.readiness = readiness.state
        if not readiness.ready:
            row.problems.append(readiness.detail)
            return row
        models = await client.models()
        try:
            ernie = client.choose_ernie(models)
        except ErnieImageError as exc:
            row.problems.append(str(exc))
            ernie = models[0] if models else None
        if ernie is not None:
            row.model_id, row.pipeline = ernie.id, ernie.pipeline_name or "not named"
            row.num_gpus, row.precision = ernie.num_gpus, ernie.dit_precision
        if row.problems:
            return row
        row.version = await client.version()
        if generate:
            started = time.monotonic()
            await client.generate(TINY_IMAGE)
            row.generation_s = time.monotonic() - started
    except ErnieImageError as exc:
        row.problems.append(str(exc))
    finally:
        await client.close()
    return row


def check_remote(urls: Sequence[str], credentials: Optional[Credentials] = None, credential: str = "",
                 generate: bool = True, connect_timeout_s: float = 5.0,
                 generation_timeout_s: float = GENERATION_TIMEOUT_S) -> list[CheckRow]:
    """Check every server concurrently; never raises for a server problem (it lands in the row).

    Each server gets the key bound to its origin in `credentials` (None: the user's keys file), or the one the label
    `credential` picks; a label that cannot be used is InvalidInputError, before any server is asked.
    """
    return _check_all(urls, server_keys(urls, credentials, credential), generate, connect_timeout_s,
                      generation_timeout_s)


def server_keys(urls: Sequence[str], credentials: Optional[Credentials], label: str = "",
                setting: str = "credential") -> ServerKeys:
    """Each well-formed URL's credential (a malformed one gets its row's error instead)."""
    bases = []
    for url in urls:
        try:
            bases.append(normalize_base_url(url))
        except ErnieImageError:
            continue
    return ServerKeys.resolve(credentials if credentials is not None else load_credentials(), bases, label, setting)


def _check_all(urls: Sequence[str], keys: ServerKeys, generate: bool, connect_timeout_s: float,
               generation_timeout_s: float, probe_read_s: float = PROBE_READ_S,
               read_timeout_label: Optional[str] = None) -> list[CheckRow]:
    async def run() -> list[CheckRow]:
        return list(await asyncio.gather(*(
            check_one(url, keys, generate, connect_timeout_s, generation_timeout_s, probe_read_s,
                      read_timeout_label) for url in urls)))

    return run_sync(run())


def format_check_table(rows: Sequence[CheckRow]) -> str:
    headers = ("server", "status", "model", "pipeline", "GPUs", "precision", "version", "256px 1-step")
    table = [headers]
    for row in rows:
        table.append((
            row.url,
            row.readiness if row.ok or row.readiness != "ready" else "PROBLEM",
            row.model_id or "-",
            row.pipeline or "-",
            str(row.num_gpus) if row.num_gpus is not None else "-",
            row.precision or "-",
            row.version or "-",
            f"{row.generation_s:.2f} s" if row.generation_s is not None else "-",
        ))
    widths = [max(len(line[i]) for line in table) for i in range(len(headers))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip() for line in table]
    for row in rows:
        for problem in row.problems:
            lines.append(f"! {problem}")
    return "\n".join(lines)


def main_check_remote(argv: Optional[Sequence[str]] = None) -> int:
    parser = OneLineParser(prog="ernie-image check-remote",
                           description="Check SGLang ERNIE-Image servers: readiness, model, version, one tiny generation.")
    parser.add_argument("urls", nargs="+", metavar="URL", help="server base URL, e.g. http://127.0.0.1:30000")
    parser.add_argument("--api-key-env", default=None, help="environment variable holding the API key")
    parser.add_argument("--api-key-file", default=None, help="file holding the API key")
    parser.add_argument("--no-generate", action="store_true", help="skip the tiny test generation")
    parser.add_argument("--connect-timeout", default=5.0, metavar="S",
                        help="seconds to wait for a server to accept the connection (default 5)")
    parser.add_argument("--read-timeout", default=None, metavar="S",
                        help=f"seconds to wait for each answer: readiness, model list and the tiny test image "
                             f"(default {PROBE_READ_S:g} for the first two, {GENERATION_TIMEOUT_S:g} for the image)")
    args = parser.parse_args(argv)
    for url in args.urls:  # a malformed URL is a usage error (exit 2), before any server is asked
        normalize_base_url(url, what="URL", endpoint_suffixes=ENDPOINT_SUFFIXES)
    connect_s = checked_seconds(args.connect_timeout, "--connect-timeout")
    read_s = None if args.read_timeout is None else checked_seconds(args.read_timeout, "--read-timeout")
    from ..cli.remote_args import cli_credentials, key_destinations

    bases = [normalize_base_url(url) for url in args.urls]
    credentials = cli_credentials(bases, args.api_key_env, args.api_key_file)
    if key_destinations(credentials):
        print(key_destinations(credentials), file=sys.stderr)
    keys = ServerKeys.resolve(credentials, bases)
    rows = _check_all(args.urls, keys, generate=not args.no_generate, connect_timeout_s=connect_s,
                      generation_timeout_s=GENERATION_TIMEOUT_S if read_s is None else read_s,
                      probe_read_s=PROBE_READ_S if read_s is None else read_s, read_timeout_label="--read-timeout")
    print(format_check_table(rows))
    return 0 if all(row.ok for row in rows) else 1


if __name__ == "__main__":
    from ..cli.commands import main  # one-line errors and exit code 2, as `ernie-image check-remote`

    sys.exit(main(["check-remote", *sys.argv[1:]]))
