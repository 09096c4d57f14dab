"""HTTP routes the pack adds to ComfyUI's server, for its web extensions.

POST /ernie_image/test_connection: readiness and served model of the Remote Backend's servers. Not a proxy:
only each server's fixed health/model/version endpoints are asked, with a short total timeout, no redirects
and a size cap (runtime/net/client.py), and only a summary goes back, never a server's raw body. It takes the
server URLs, a credential LABEL and a timeout, nothing else: it reads no variable or file a request names, and a
server gets only the key the user bound to its origin (runtime/net/credentials.py).
GET /ernie_image/memory: the pack's live pipes and their memory (`?holders=1`: what holds a dropped pipe's weights).
POST /ernie_image/free: release the weights of every live pipe (ComfyUI's own "unload models" cannot reach them).

Every route answers ComfyUI's own page (and scripts) only: any web page the user visits can send requests to
127.0.0.1:8188, so a request whose Origin is another site, or which a browser marks cross-site, is refused with 403
before anything runs, as is a POST that is not JSON (a form or text/plain POST skips the browser's preflight).
"""
from __future__ import annotations

import asyncio
import functools
import logging
import sys
from typing import TYPE_CHECKING, Any, Optional
from urllib.parse import urlsplit

from ..runtime.core.errors import ErnieImageError, InvalidInputError
from . import live_pipes
from .heap_holders import HolderWalks
from .remote import parse_urls

if TYPE_CHECKING:
    from aiohttp import web

    from ..runtime.net.credentials import ServerKeys

log = logging.getLogger("ernie_image")

ROUTE_PREFIX = "/ernie_image"
CHECK_TOTAL_TIMEOUT_S = 15.0
MAX_CONNECT_TIMEOUT_S = 5.0
MAX_SERVERS_PER_CHECK = 8
MAX_BODY_BYTES = 16 * 1024
HOLDER_WALKS = HolderWalks()
CHECK_FIELDS = frozenset({"server_urls", "credential", "connect_timeout_s"})
SAME_SITE_FETCHES = frozenset({"same-origin", "none"})


def foreign_request(headers: Any) -> Optional[str]:
    """Why a request must be refused as not coming from ComfyUI's own page, or None when it may run. A request with no
    Origin and no Sec-Fetch-Site is no browser page's (a script, the headless API): allowed, as ComfyUI allows it."""
    origin = headers.get("Origin")
    if origin is not None:
        own = headers.get("Host", "")
        parsed = urlsplit(origin)
        if origin == "null" or not own or parsed.netloc.lower() != own.lower():
            return "this route answers ComfyUI's own page only (the request came from another origin)"
    fetch_site = headers.get("Sec-Fetch-Site")
    if fetch_site is not None and fetch_site.lower() not in SAME_SITE_FETCHES:
        return "this route answers ComfyUI's own page only (the browser marked the request cross-site)"
    return None


async def _check_rows(urls: list[str], keys: "ServerKeys", connect_timeout_s: float) -> list[dict[str, Any]]:
    from ..runtime.net.urls import shown_url
    from ..runtime.remote.server_check import check_one

    async def one(url: str) -> dict[str, Any]:
        try:
            row = await asyncio.wait_for(
                check_one(url, keys, generate=False, connect_timeout_s=connect_timeout_s,
                          generation_timeout_s=CHECK_TOTAL_TIMEOUT_S),
                timeout=CHECK_TOTAL_TIMEOUT_S,
            )
        except asyncio.TimeoutError:
            return {"url": shown_url(url), "ok": False, "status": "timeout",
                    "problems": [f"no answer within {CHECK_TOTAL_TIMEOUT_S:g} s: check the URL and that the server is up"]}
        return {
            "url": row.url, "ok": row.ok, "status": row.readiness, "model": row.model_id, "pipeline": row.pipeline,
            "gpus": row.num_gpus, "precision": row.precision, "version": row.version, "problems": row.problems,
        }

    return list(await asyncio.gather(*(one(url) for url in urls)))


def check_servers(body: dict[str, Any]) -> dict[str, Any]:
    """Blocking: run on a worker thread. Raises ErnieImageError for bad input."""
    from ..runtime.net.loop_thread import run_sync

    from ..runtime.net.settings import checked_seconds
    from ..runtime.remote.server_check import server_keys
    from .comfy_env import user_credentials

    unknown = sorted(str(name)[:40] for name in body if name not in CHECK_FIELDS)
    if unknown:
        raise InvalidInputError(f"test_connection takes server_urls, credential and connect_timeout_s only, not "
                                f"{unknown[0]!r}: API keys are bound to servers in your keys file (see the README's "
                                f"security section)")
    urls = parse_urls(str(body.get("server_urls", "")))[:MAX_SERVERS_PER_CHECK]
    keys = server_keys(urls, user_credentials(), str(body.get("credential", "") or ""))

    connect_timeout_s = checked_seconds(body.get("connect_timeout_s", MAX_CONNECT_TIMEOUT_S), "connect_timeout_s")
    connect_timeout_s = min(MAX_CONNECT_TIMEOUT_S, max(0.5, connect_timeout_s))
    rows = run_sync(_check_rows(urls, keys, connect_timeout_s))
    return {"ok": all(row["ok"] for row in rows), "servers": rows, "text": format_rows(rows)}


def format_rows(rows: list[dict[str, Any]]) -> str:
    lines = []
    for row in rows:
        mark = "OK " if row["ok"] else "!! "
        detail = f"{row.get('model') or '-'} ({row.get('gpus') or '?'} GPU, {row.get('precision') or '?'})" if row.get("model") else ""
        lines.append(f"{mark}{row['url']}: {row['status']} {detail}".rstrip())
        lines.extend(f"    {problem}" for problem in row.get("problems") or [])
    return "\n".join(lines)


def _json(data: dict[str, Any], status: int = 200) -> "web.Response":
    from aiohttp import web

    return web.json_response(data, status=status)


def _refuse_foreign(request: "web.Request") -> "Optional[web.Response]":
    why = foreign_request(request.headers)
    if why is None:
        return None
    log.warning("[ERNIE-Image] refused %s %s: %s", request.method, request.path, why)
    return _json({"ok": False, "error": why}, status=403)


async def test_connection(request: "web.Request") -> "web.Response":
    refused = _refuse_foreign(request)
    if refused is not None:
        return refused
    if request.content_type != "application/json":  # a form or text/plain POST skips a browser's preflight
        return _json({"ok": False, "error": "send JSON (Content-Type: application/json)"}, status=415)
    if request.content_length is not None and request.content_length > MAX_BODY_BYTES:
        return _json({"ok": False, "error": "request too large"}, status=413)
    try:
        body = await request.json()
        if not isinstance(body, dict):
            raise ValueError("body must be a JSON object")
    except ValueError as error:
        return _json({"ok": False, "error": f"bad request: {error}"}, status=400)
    try:
        result = await asyncio.get_running_loop().run_in_executor(None, check_servers, body)
    except ErnieImageError as error:
        return _json({"ok": False, "error": str(error)}, status=400)
    return _json(result)


async def memory(request: "web.Request") -> "web.Response":
    """The live pipes' memory; `?holders=1` also walks the heap for what holds a dropped pipe's weights (slow: a
    diagnosis, not a status, and rationed: live_pipes.HolderWalks). ComfyUI's own page and scripts only: a page
    elsewhere could make the walk stall prompts, and the plans name servers."""
    refused = _refuse_foreign(request)
    if refused is not None:
        return refused
    holders = request.query.get("holders") == "1"
    answer = functools.partial(live_pipes.summary, holders, HOLDER_WALKS)
    return _json(await asyncio.get_running_loop().run_in_executor(None, answer))


async def free(request: "web.Request") -> "web.Response":
    refused = _refuse_foreign(request)
    if refused is not None:
        return refused
    released = await asyncio.get_running_loop().run_in_executor(None, live_pipes.release_all)
    return _json({"released": released})


def add_routes(routes: "web.RouteTableDef") -> None:
    routes.post(f"{ROUTE_PREFIX}/test_connection")(test_connection)
    routes.get(f"{ROUTE_PREFIX}/memory")(memory)
    routes.post(f"{ROUTE_PREFIX}/free")(free)


def register_routes() -> bool:
    """Add the routes when running inside ComfyUI's server; a no-op anywhere else (tests, CLI)."""
    server_module = sys.modules.get("server")
    prompt_server = getattr(getattr(server_module, "PromptServer", None), "instance", None)
    if prompt_server is None or getattr(prompt_server, "_ernie_image_routes", False):
        return False  # outside ComfyUI, or already added (aiohttp refuses a route registered twice)
    prompt_server._ernie_image_routes = True
    add_routes(prompt_server.routes)
    return True
