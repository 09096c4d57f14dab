"""HTTP routes the pack adds to ComfyUI's server, for its web extensions.

POST /ernie_image/test_connection: readiness and served model of the Remote Backend's servers. Not a proxy:
only each server's fixed health/model/version endpoints are asked, with a short total timeout, no redirects
and a size cap (runtime/remote/http.py), and only a summary goes back, never a server's raw body.
GET /ernie_image/memory: the pack's live pipes and whether their weights are loaded.
POST /ernie_image/free: release the weights of every live pipe (ComfyUI's own "unload models" cannot reach them).
"""
from __future__ import annotations

import asyncio
import logging
import sys
from typing import TYPE_CHECKING, Any

from ..runtime.errors import ErnieImageError
from . import live_pipes
from .remote import checked_key_source, parse_urls

if TYPE_CHECKING:
    from ..runtime.remote.http import ApiKeySource

log = logging.getLogger("ernie_image")

ROUTE_PREFIX = "/ernie_image"
CHECK_TOTAL_TIMEOUT_S = 15.0
MAX_CONNECT_TIMEOUT_S = 5.0
MAX_SERVERS_PER_CHECK = 8
MAX_BODY_BYTES = 16 * 1024


async def _check_rows(urls: list[str], api_key: "ApiKeySource", connect_timeout_s: float) -> list[dict[str, Any]]:
    from ..runtime.remote.check import check_one
    from ..runtime.remote.urls import shown_url

    async def one(url: str) -> dict[str, Any]:
        try:
            row = await asyncio.wait_for(
                check_one(url, api_key, generate=False, connect_timeout_s=connect_timeout_s,
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
    from ..runtime.remote.http import run_sync

    urls = parse_urls(str(body.get("server_urls", "")))[:MAX_SERVERS_PER_CHECK]
    api_key = checked_key_source(str(body.get("api_key_env", "")), str(body.get("api_key_file", "")))
    from ..runtime.remote.http import checked_seconds

    connect_timeout_s = checked_seconds(body.get("connect_timeout_s", MAX_CONNECT_TIMEOUT_S), "connect_timeout_s")
    connect_timeout_s = min(MAX_CONNECT_TIMEOUT_S, max(0.5, connect_timeout_s))
    rows = run_sync(_check_rows(urls, api_key, connect_timeout_s))
    return {"ok": all(row["ok"] for row in rows), "servers": rows, "text": format_rows(rows)}


def format_rows(rows: list[dict[str, Any]]) -> str:
    lines = []
    for row in rows:
        mark = "OK " if row["ok"] else "!! "
        detail = f"{row.get('model') or '-'} ({row.get('gpus') or '?'} GPU, {row.get('precision') or '?'})" if row.get("model") else ""
        lines.append(f"{mark}{row['url']}: {row['status']} {detail}".rstrip())
        lines.extend(f"    {problem}" for problem in row.get("problems") or [])
    return "\n".join(lines)


def register_routes() -> bool:
    """Add the routes when running inside ComfyUI's server; a no-op anywhere else (tests, CLI)."""
    server_module = sys.modules.get("server")
    prompt_server = getattr(getattr(server_module, "PromptServer", None), "instance", None)
    if prompt_server is None or getattr(prompt_server, "_ernie_image_routes", False):
        return False  # outside ComfyUI, or already added (aiohttp refuses a route registered twice)
    prompt_server._ernie_image_routes = True
    from aiohttp import web

    routes = prompt_server.routes

    @routes.post(f"{ROUTE_PREFIX}/test_connection")
    async def test_connection(request: web.Request) -> web.Response:
        if request.content_length is not None and request.content_length > MAX_BODY_BYTES:
            return web.json_response({"ok": False, "error": "request too large"}, status=413)
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise ValueError("body must be a JSON object")
        except ValueError as error:
            return web.json_response({"ok": False, "error": f"bad request: {error}"}, status=400)
        try:
            result = await asyncio.get_running_loop().run_in_executor(None, check_servers, body)
        except ErnieImageError as error:
            return web.json_response({"ok": False, "error": str(error)}, status=400)
        return web.json_response(result)

    @routes.get(f"{ROUTE_PREFIX}/memory")
    async def memory(request: web.Request) -> web.Response:
        return web.json_response(live_pipes.summary())

    @routes.post(f"{ROUTE_PREFIX}/free")
    async def free(request: web.Request) -> web.Response:
        released = await asyncio.get_running_loop().run_in_executor(None, live_pipes.release_all)
        return web.json_response({"released": released})

    return True
