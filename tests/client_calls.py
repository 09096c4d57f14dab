"""One JSON request through the pack's HTTP client, from a test's own thread, with the client closed after it."""
from __future__ import annotations

from ernie_image.runtime.net.client import HttpClient
from ernie_image.runtime.net.loop_thread import run_sync


def call(client: HttpClient, method: str, path: str, body=None, **kwargs):
    async def go():
        try:
            return await client.request_json(method, path, body, **kwargs)
        finally:
            await client.close()
    return run_sync(go())
