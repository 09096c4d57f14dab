"""A headless Chromium driven over the Chrome DevTools Protocol (its WebSocket, through aiohttp): open a page,
evaluate JavaScript in it (awaiting promises), collect the page's uncaught exceptions and console errors.

ERNIE_CHROMIUM: the browser binary (default: chromium, chromium-browser or google-chrome on PATH).
"""
from __future__ import annotations

import asyncio
import itertools
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import aiohttp

START_TIMEOUT_S = 30


def chromium_binary() -> Optional[str]:
    named = os.environ.get("ERNIE_CHROMIUM")
    if named:
        return named if Path(named).is_file() else shutil.which(named)
    return next((found for name in ("chromium", "chromium-browser", "google-chrome")
                 if (found := shutil.which(name))), None)


class JavaScriptError(AssertionError):
    """An expression the page could not evaluate (its exception text)."""


class Browser:
    """One headless Chromium process with one page; `async with Browser() as page:`."""

    def __init__(self, binary: str) -> None:
        self.binary = binary
        self.profile = tempfile.TemporaryDirectory(prefix="ernie-chromium-", ignore_cleanup_errors=True)
        self.process: Optional[subprocess.Popen] = None
        self.session: Optional[aiohttp.ClientSession] = None
        self.socket: Optional[aiohttp.ClientWebSocketResponse] = None
        self.errors: list[str] = []  # uncaught exceptions and console.error lines, in order
        self._ids = itertools.count(1)
        self._answers: dict[int, asyncio.Future] = {}
        self._reader: Optional[asyncio.Task] = None

    async def __aenter__(self) -> "Browser":
        self.process = subprocess.Popen(
            [self.binary, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
             "--no-first-run", "--remote-debugging-port=0", f"--user-data-dir={self.profile.name}",
             "--window-size=1600,1000", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=self._environment())
        port = await self._debugging_port()
        self.session = aiohttp.ClientSession()
        async with self.session.get(f"http://127.0.0.1:{port}/json/list") as answer:
            pages = [target for target in await answer.json() if target["type"] == "page"]
        self.socket = await self.session.ws_connect(pages[0]["webSocketDebuggerUrl"], max_msg_size=0)
        self._reader = asyncio.create_task(self._read())
        await self.send("Runtime.enable")
        await self.send("Page.enable")
        return self

    async def __aexit__(self, *exc_info) -> None:
        if self._reader is not None:
            self._reader.cancel()
        if self.socket is not None:
            await self.socket.close()
        if self.session is not None:
            await self.session.close()
        if self.process is not None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        for _ in range(20):  # its helper processes may still write into the profile for a moment
            self.profile.cleanup()
            if not Path(self.profile.name).exists():
                break
            await asyncio.sleep(0.25)

    def _environment(self) -> dict[str, str]:
        """Chromium's own temporary folders (its singleton socket's, left behind when it is stopped) go inside the
        profile, which is removed on exit, not into the machine's /tmp."""
        scratch = Path(self.profile.name) / "tmp"
        scratch.mkdir()
        return {**os.environ, "TMPDIR": str(scratch)}

    async def _debugging_port(self) -> int:
        """Chromium writes the port it picked (for --remote-debugging-port=0) into its profile folder."""
        marker = Path(self.profile.name) / "DevToolsActivePort"
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.binary} exited with {self.process.returncode} while starting")
            if marker.is_file() and marker.read_text().strip():
                return int(marker.read_text().splitlines()[0])
            await asyncio.sleep(0.1)
        raise RuntimeError(f"{self.binary} did not open its debugging port within {START_TIMEOUT_S} s")

    async def _read(self) -> None:
        async for message in self.socket:
            if message.type != aiohttp.WSMsgType.TEXT:
                continue
            event = json.loads(message.data)
            if "id" in event and event["id"] in self._answers:
                self._answers.pop(event["id"]).set_result(event)
            elif event.get("method") == "Runtime.exceptionThrown":
                details = event["params"]["exceptionDetails"]
                self.errors.append((details.get("exception") or {}).get("description") or details.get("text", ""))
            elif event.get("method") == "Runtime.consoleAPICalled" and event["params"]["type"] == "error":
                self.errors.append(" ".join(str(arg.get("value", arg.get("description", "")))
                                            for arg in event["params"]["args"]))

    async def send(self, method: str, **params: Any) -> dict[str, Any]:
        message_id = next(self._ids)
        answer = asyncio.get_running_loop().create_future()
        self._answers[message_id] = answer
        await self.socket.send_str(json.dumps({"id": message_id, "method": method, "params": params}))
        event = await asyncio.wait_for(answer, 120)
        if "error" in event:
            raise RuntimeError(f"{method}: {event['error']}")
        return event["result"]

    async def open(self, url: str) -> None:
        await self.send("Page.navigate", url=url)

    async def evaluate(self, expression: str) -> Any:
        """The JSON value of `expression` in the page (an async function body's result when it returns a promise)."""
        result = await self.send("Runtime.evaluate", expression=expression, awaitPromise=True, returnByValue=True)
        if "exceptionDetails" in result:
            details = result["exceptionDetails"]
            raise JavaScriptError((details.get("exception") or {}).get("description") or details.get("text"))
        return result["result"].get("value")

    async def screenshot(self, path: Path) -> Path:
        """The page as it shows now, as a PNG file."""
        import base64

        shot = await self.send("Page.captureScreenshot", format="png")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(shot["data"]))
        return path

    async def wait_for(self, expression: str, timeout_s: float, what: str) -> Any:
        """Evaluate `expression` until it is truthy; its value."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                value = await self.evaluate(expression)
            except JavaScriptError:
                value = None
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"the page never showed {what} within {timeout_s} s; errors: {self.errors[-5:]}")
            await asyncio.sleep(0.25)
