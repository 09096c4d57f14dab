"""Checking SGLang servers for `ernie-image check-remote` and the node's "Test connection": one row per server.

Readiness (/health), the served model (/v1/models: must be an ERNIE-Image pipeline), GPUs, precision,
version (/server_info) and the time of one tiny generation (256x256, 1 step), as a text table.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

from ..core.errors import ErnieImageError
from ..net.credentials import Credentials, ServerKeys, load_credentials
from ..net.loop_thread import run_sync
from ..net.settings import READ_TIMEOUT, HttpSettings, RetryPolicy, Timeouts
from ..net.urls import normalize_base_url, shown_url
from .sglang import PROBE_READ_S, ImageParams, ReadTimeoutPolicy, SglangClient

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
                                keys=keys.advice, read_timeout_setting=read_timeout_label or READ_TIMEOUT)
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
    return check_with_keys(urls, server_keys(urls, credentials, credential), generate, connect_timeout_s,
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


def check_with_keys(urls: Sequence[str], keys: ServerKeys, generate: bool, connect_timeout_s: float,
                    generation_timeout_s: float, probe_read_s: float = PROBE_READ_S,
                    read_timeout_label: Optional[str] = None) -> list[CheckRow]:
    """Every server checked concurrently with the credentials `keys` resolved for them."""
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
