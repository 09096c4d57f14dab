"""A fake SGLang diffusion server (aiohttp, loopback) that speaks the protocol measured on sglang 0.5.23.

It reproduces what a client meets on the real server (shared/facts/SGLANG.md, examples.json): every field
has the server's default (50 steps, CFG 5.0, seed 42, JPEG, relative URL); sizes are floored to multiples of
16 without a word; 422 pydantic bodies and 400 `{"detail": ...}` bodies; a bare text/plain 500 for any
pipeline failure (n > 1, 8x8); /health 503 with an empty body while warming up; requests served strictly
one at a time in arrival order. On top of that it injects faults SGLang will not produce on demand: hangs,
connection resets, garbage JSON, huge bodies, 401/403, 429 with Retry-After, wrong image sizes, bad base64.

Behaviours a fleet meets (each counted: `generations` is every POST received, `ran` the seeds it generated):
- dead from the start: `dead_url()` (nothing listens: connection refused);
- slow: `service_time_s` / `per_step_s`;
- still working, however long the client waits: `hold_answers=True` (every image is made but not answered until the
  test calls `let_answers_go()`): a client's read timeout is met for certain, and the test picks the moment the
  server finishes;
- dies after N images: `die_after=N` (stops listening once the Nth image is sent: later requests are refused);
- dies while working: `die_during=N` (drops the connection in the middle of the Nth image: it may have run);
- 503 / 429 before any work: `faults=["503", "429"]`, or `flaky_every=K` (every Kth POST answers 503);
  a 400 whose body quotes the Authorization header: `faults=["400_echo_auth"]`;
  `retry_after_s` is the Retry-After of a 429;
- broken for good: `every_post="500"` (or "reset", ...) answers every generation POST with that fault;
- hostile answers: "trickle" answers 200 and then one byte every `trickle_every_s`, forever (`trickling` is set
  as the first byte goes out); "gzip" answers gzip-compressed (Content-Encoding: gzip) whatever the client asked
  for, "gzip_bomb" 256 MiB of zeros gzip-compressed (256 KiB on the wire); "big" 2 MiB of JSON; "500_huge" a 500
  whose body is 64 MiB; "nested" (200) and "500_nested" (500) JSON nested 100,000 deep. Each works on generation,
  and as "health:..." / "models:..." on those endpoints;
- ignores output_format: `faults=["jpeg"]` / `["webp"]` answers that format whatever was asked;
- loading: `warmup_s` (/health answers 503, POSTs are held until ready, as SGLang does);
- misbehaving images: `image_b64` answers that image (any PNG: 16-bit, with alpha, ...) to every generation,
  `images_per_answer` puts that many entries in `data` (the request asks for n=1);
- a redirect: `redirect_to=URL` answers `redirect_status` (307) with `Location: URL + path` on every path, or on
  `redirect_path` alone (the client must never follow it, least of all with the API key).

`wire` holds every request exactly as it arrived (method, path and query, every header, the raw body), whatever
the path and whatever the answer: what a server learnt, for tests that search it for secrets.

Each server runs its own event loop on a thread, so sync client code (the pipe) can be tested from
ordinary test functions:

    with FakeSglang(service_time_s=0.05) as server:
        ... server.url ... server.received ...
"""
from __future__ import annotations

import asyncio
import base64
import gzip
import hashlib
import io
import json
import socket
import struct
import threading
import time
import uuid
import zlib
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
from aiohttp import web
from PIL import Image

SEED_MAX = (1 << 64) - 1


@dataclass
class Received:
    path: str
    body: Any
    headers: dict[str, str]
    at: float
    peer_port: int = 0  # the client's port: requests on one connection share it


@dataclass
class WireRequest:
    """One request as it arrived: nothing of it left out."""

    method: str
    path_qs: str
    headers: list[tuple[str, str]]
    body: bytes

    def text(self) -> str:
        """All of it as text, for searching."""
        lines = [f"{self.method} {self.path_qs}", *(f"{name}: {value}" for name, value in self.headers)]
        return "\n".join(lines) + "\n\n" + self.body.decode("utf-8", errors="replace")


@dataclass
class FakeSglang:
    model_id: str = "baidu/ERNIE-Image-Turbo"  # the served model name: /v1/models' id
    model_path: Optional[str] = None  # what it loaded (/server_info's model_path); None: the model id, as SGLang
    pipeline_name: str = "ErnieImagePipeline"
    num_gpus: int = 1
    dit_precision: str = "bf16"
    version: str = "0.5.23"
    service_time_s: float = 0.0  # fixed time per generation, on top of `per_step_s`
    per_step_s: float = 0.0
    peak_memory_mb: Optional[float] = 31600.0
    api_key: Optional[str] = None  # when set, generation and discovery need `Authorization: Bearer <key>`
    warmup_s: float = 0.0  # /health answers 503 (empty body) for this long after start
    image_side_cap: int = 512  # images larger than this are drawn small and upscaled (keeps tests fast)
    faults: list[str] = field(default_factory=list)  # consumed one per generation request, in order
    received: list[Received] = field(default_factory=list)
    port: int = 0
    die_after: Optional[int] = None  # stop listening once this many images have been sent
    die_during: Optional[int] = None  # drop the connection and stop listening while working on this image (1-based)
    flaky_every: int = 0  # every Nth generation POST answers 503 before any work
    retry_after_s: float = 0.0  # Retry-After of a "429" fault
    image_b64: Optional[str] = None  # when set, every generation answers this base64 image (a bad or hostile PNG)
    images_per_answer: Optional[int] = None  # entries in `data` of every answer (None: the n asked for)
    every_post: Optional[str] = None  # a fault for every generation POST (a server broken for good)
    redirect_to: Optional[str] = None  # when set, answer a redirect to this URL (+ the path asked) instead
    redirect_status: int = 307
    redirect_path: Optional[str] = None  # redirect this path only (None: every path)
    wire: list[WireRequest] = field(default_factory=list)
    hold_answers: bool = False  # every image waits for `let_answers_go()` before it is answered
    trickle_every_s: float = 0.05  # the pace of a "trickle" answer: one byte each time

    def __post_init__(self) -> None:
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._thread: Optional[threading.Thread] = None
        self._runner: Optional[web.AppRunner] = None
        self._started_at = 0.0
        self._served = 0
        self._kill_after = self.die_after
        self.completed: list[float] = []  # monotonic times at which generations finished
        self.ran: list[int] = []  # seeds of the images generated (started work), in order
        self.trickling = threading.Event()  # a "trickle" answer has begun

    # ------------------------------------------------------------------------------------ lifecycle
    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def generations(self) -> list[Received]:
        return [r for r in self.received if r.path == "/v1/images/generations"]

    def __enter__(self) -> "FakeSglang":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        ready = threading.Event()
        self._loop = asyncio.new_event_loop()

        def serve() -> None:
            asyncio.set_event_loop(self._loop)
            self._loop.run_until_complete(self._start_site())
            ready.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=serve, name="fake-sglang", daemon=True)
        self._thread.start()
        ready.wait(10)

    async def _start_site(self) -> None:
        app = web.Application(client_max_size=64 * 1024 * 1024, middlewares=[self._on_the_wire])
        app.router.add_get("/health", self._health)
        app.router.add_get("/liveness", self._liveness)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/server_info", self._server_info)
        app.router.add_post("/v1/images/generations", self._generate)
        app.router.add_route("*", "/{tail:.*}", self._not_found)  # FastAPI's 404, recorded like the rest
        self._lock = asyncio.Lock()  # asyncio.Lock wakes waiters in FIFO order: SGLang's one-at-a-time queue
        self._answers_go = asyncio.Event()
        if not self.hold_answers:
            self._answers_go.set()
        self._runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self._started_at = time.monotonic()

    def stop(self) -> None:
        """Stop the server: later connections are refused (a server that died)."""
        if self._loop is None:
            return
        loop = self._loop

        async def shutdown() -> None:
            if self._runner is not None:
                await self._runner.cleanup()
            current = asyncio.current_task()
            pending = [t for t in asyncio.all_tasks() if t is not current]
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shutdown(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(10)
        loop.close()
        self._loop = None

    def let_answers_go(self) -> None:
        """With `hold_answers`: answer the image held now, and every later one as soon as it is made."""
        assert self._loop is not None, "the server is not running"
        self._loop.call_soon_threadsafe(self._answers_go.set)

    def kill_after(self, generations: int) -> None:
        """Die (stop listening, drop connections) once this many generations have been served."""
        self._kill_after = generations

    # -------------------------------------------------------------------------------------- helpers
    def _record(self, request: web.Request, body: Any) -> None:
        peer = request.transport.get_extra_info("peername") if request.transport is not None else None
        self.received.append(Received(request.path, body, dict(request.headers), time.monotonic(),
                                      peer[1] if peer else 0))

    def _auth_error(self, request: web.Request) -> Optional[web.Response]:
        if self.api_key is None:
            return None
        header = request.headers.get("Authorization", "")
        if not header:
            return web.json_response({"error": "Unauthorized: missing bearer token"}, status=401)
        if header != f"Bearer {self.api_key}":
            return web.json_response({"error": "Forbidden: invalid API key"}, status=403)
        return None

    @web.middleware
    async def _on_the_wire(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """Record the request as it arrived, before any handler; answer the redirect asked for."""
        headers = [(name.decode("latin-1"), value.decode("latin-1")) for name, value in request.raw_headers]
        self.wire.append(WireRequest(request.method, request.path_qs, headers, await request.read()))
        if self.redirect_to is not None and self.redirect_path in (None, request.path):
            return web.Response(status=self.redirect_status, headers={"Location": self.redirect_to + request.path_qs})
        return await handler(request)

    # ------------------------------------------------------------------------------------- handlers
    async def _health(self, request: web.Request) -> web.Response:
        self._record(request, None)
        fault = self._peek_fault("health")
        if fault:
            return await self._apply_fault(fault, request)
        if time.monotonic() - self._started_at < self.warmup_s:
            return web.Response(status=503)
        return web.json_response({"status": "ok"})

    async def _not_found(self, request: web.Request) -> web.Response:
        self._record(request, None)
        return web.json_response({"detail": "Not Found"}, status=404)

    async def _liveness(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _models(self, request: web.Request) -> web.Response:
        self._record(request, None)
        fault = self._peek_fault("models")
        if fault:
            return await self._apply_fault(fault, request)
        denied = self._auth_error(request)
        if denied:
            return denied
        return web.json_response({"object": "list", "data": [{
            "id": self.model_id, "object": "model", "created": int(time.time()), "owned_by": "sglang",
            "root": self.model_id, "parent": None, "max_model_len": None, "num_gpus": self.num_gpus,
            "task_type": "T2I", "supported_task_types": ["T2I"], "dit_precision": self.dit_precision,
            "vae_precision": "fp32", "pipeline_name": self.pipeline_name,
            "pipeline_class": self.pipeline_name,
        }]})

    async def _server_info(self, request: web.Request) -> web.Response:
        self._record(request, None)
        denied = self._auth_error(request)
        if denied:
            return denied
        return web.json_response({"model_path": self.model_path or self.model_id,
                                  "served_model_name": self.model_id, "tp_size": 1, "dp_size": 1,
                                  "version": self.version})

    def _peek_fault(self, where: str) -> Optional[str]:
        """Faults named 'health:...' / 'models:...' apply to those endpoints, the rest to generation."""
        if self.faults and self.faults[0].startswith(where + ":"):
            return self.faults.pop(0).split(":", 1)[1]
        return None

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        try:
            body = json.loads(raw)
        except ValueError:
            body = raw.decode("utf-8", errors="replace")
        self._record(request, body)
        denied = self._auth_error(request)
        if denied:
            return denied
        fault = None
        if self.faults and ":" not in self.faults[0]:
            fault = self.faults.pop(0)
        if self.flaky_every and len(self.generations) % self.flaky_every == 0:
            fault = "503"
        if self.every_post is not None:
            fault = self.every_post
        if fault in ("503", "429", "408", "reset", "garbage", "huge", "hang", "500_json", "400_echo_auth", "trickle",
                     "gzip", "gzip_bomb", "big", "500_huge", "nested", "500_nested"):
            return await self._apply_fault(fault, request)
        if not isinstance(body, dict):
            return web.json_response({"detail": [{"type": "model_attributes_type", "loc": ["body"],
                                                  "msg": "Input should be a valid dictionary or object to extract fields from",
                                                  "input": body}]}, status=422)
        invalid = self._validate(body)
        if invalid is not None:
            return invalid
        while time.monotonic() - self._started_at < self.warmup_s:  # SGLang holds a POST while warming up
            await asyncio.sleep(0.01)
        async with self._lock:
            return await self._serve_one(body, fault)

    def _validate(self, body: dict[str, Any]) -> Optional[web.Response]:
        if "prompt" not in body:
            return web.json_response({"detail": [{"type": "missing", "loc": ["body", "prompt"],
                                                  "msg": "Field required", "input": body}]}, status=422)
        seed = body.get("seed", 42)
        if isinstance(seed, float) and not seed.is_integer():
            return web.json_response({"detail": [{"type": "int_from_float", "loc": ["body", "seed", "int"],
                                                  "msg": "Input should be a valid integer, got a number with a fractional part",
                                                  "input": seed}]}, status=422)
        if isinstance(seed, int) and seed < 0:
            return web.json_response({"detail": f"seed must be a non-negative int or list of ints, got {seed}"}, status=400)
        size = body.get("size", "1024x1024")
        try:
            w, h = (int(v) for v in str(size).lower().split("x"))
            assert w > 0 and h > 0
        except (ValueError, AssertionError):
            return web.json_response({"detail": "size must be formatted as positive WIDTHxHEIGHT"}, status=400)
        if int(body.get("num_inference_steps", 50)) <= 0:
            return web.json_response({"detail": "num_inference_steps must be positive"}, status=400)
        guidance = float(body.get("guidance_scale", 5.0))
        if guidance < 0:
            return web.json_response({"detail": f"guidance_scale must be non-negative, got {guidance}"}, status=400)
        fmt = body.get("response_format", "url")
        if fmt not in ("url", "b64_json"):
            return web.json_response({"detail": f"response_format={fmt} is not supported"}, status=400)
        return None

    async def _serve_one(self, body: dict[str, Any], fault: Optional[str]) -> web.Response:
        w, h = (int(v) for v in str(body.get("size", "1024x1024")).lower().split("x"))
        w, h = int(body.get("width", w)), int(body.get("height", h))
        w, h = (w // 16) * 16, (h // 16) * 16  # SGLang floors silently: 1000 -> 992
        steps = int(body.get("num_inference_steps", 50))
        seed = int(body.get("seed", 42))
        if int(body.get("n", 1)) > 1 or w < 16 or h < 16 or fault == "500" or seed > SEED_MAX:
            await asyncio.sleep(self.service_time_s)
            return web.Response(status=500, text="Internal Server Error", content_type="text/plain")
        started = time.monotonic()
        self.ran.append(seed)
        if self.die_during is not None and len(self.ran) == self.die_during:
            await asyncio.sleep(self.service_time_s / 2)
            self._stop_listening()
            asyncio.ensure_future(self._die())
            await asyncio.sleep(3600)  # the connection is dropped by the shutdown
        await asyncio.sleep(self.service_time_s + self.per_step_s * steps)
        await self._answers_go.wait()
        if fault == "wrong_size":
            w, h = w // 2, h // 2
        fmt = str(body.get("output_format") or "jpeg").lower()
        if fault in ("jpeg", "webp"):  # a server that ignores output_format
            fmt = fault
        b64 = self._encoded(str(body.get("prompt", "")), str(body.get("negative_prompt", " ")), seed, steps,
                            float(body.get("guidance_scale", 5.0)), bool(body.get("use_pe", True)), w, h, fmt)
        if fault == "bad_b64":
            b64 = "!!not base64!!" + b64[:40]
        if self.image_b64 is not None:
            b64 = self.image_b64
        image_id = str(uuid.uuid4())
        item: dict[str, Any] = {"b64_json": None, "url": None, "revised_prompt": body.get("prompt"),
                                "file_path": None}
        if body.get("response_format", "url") == "b64_json":
            item["b64_json"] = b64
        else:
            item["url"] = f"/v1/images/{image_id}/content"
        count = int(body.get("n", 1)) if self.images_per_answer is None else self.images_per_answer
        payload: dict[str, Any] = {"id": image_id, "created": int(time.time()), "data": [item] * count,
                                   "peak_memory_mb": self.peak_memory_mb,
                                   "inference_time_s": round(time.monotonic() - started, 4), "usage": None}
        if fault == "missing_data":
            payload.pop("data")
        self._served += 1
        self.completed.append(time.monotonic())
        kill_after = self._kill_after
        if kill_after is not None and self._served >= kill_after:
            self._stop_listening()  # before the answer goes out: the next request is refused, never half-taken
            asyncio.get_running_loop().call_later(0.01, lambda: asyncio.ensure_future(self._die()))
        return web.json_response(payload)

    def _encoded(self, prompt: str, negative: str, seed: int, steps: int, guidance: float, use_pe: bool,
                 width: int, height: int, fmt: str) -> str:
        """base64 of the encoded image; memoised (the image is a pure function of its settings), so the
        fake's own encoding time does not blur client benchmarks."""
        key = (prompt, negative, seed, steps, guidance, use_pe, width, height, fmt)
        cache = self.__dict__.setdefault("_image_cache", {})
        if key not in cache:
            image = render(prompt, negative, seed, steps, guidance, use_pe, width, height, self.image_side_cap)
            buffer = io.BytesIO()
            image.save(buffer, format={"png": "PNG", "webp": "WEBP"}.get(fmt, "JPEG"),
                       **({} if fmt == "png" else {"quality": 75}))
            if len(cache) > 64:
                cache.clear()
            cache[key] = base64.b64encode(buffer.getvalue()).decode("ascii")
        return cache[key]

    def _stop_listening(self) -> None:
        if self._runner is not None:
            for site in self._runner.sites:
                server = getattr(site, "_server", None)
                if server is not None:
                    server.close()

    async def _die(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _apply_fault(self, fault: str, request: web.Request) -> web.StreamResponse:
        if fault in ("503", "408"):
            return web.Response(status=int(fault))
        if fault == "500":  # SGLang's answer to any failure: the reason only in its log
            return web.Response(status=500, text="Internal Server Error", content_type="text/plain")
        if fault == "429":
            return web.json_response({"detail": "Too many requests"}, status=429,
                                     headers={"Retry-After": f"{self.retry_after_s:g}"})
        if fault == "500_json":
            return web.json_response({"detail": "CUDA out of memory"}, status=500)
        if fault == "400_echo_auth":  # a proxy that quotes the request's headers in its error
            return web.json_response({"detail": f"invalid request, auth was {request.headers.get('Authorization')}"},
                                     status=400)
        if fault == "garbage":
            return web.Response(status=200, text="<html>not json{", content_type="application/json")
        if fault == "huge":
            resp = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
            await resp.prepare(request)
            chunk = b"[" + b"0," * (1 << 19)
            for _ in range(64):  # 64 MiB streamed without a Content-Length
                await resp.write(chunk)
            return resp
        if fault == "hang":
            await asyncio.sleep(3600)
        if fault == "trickle":
            return await self._trickle(request)
        if fault in ("gzip", "gzip_bomb"):
            body = gzip_bomb() if fault == "gzip_bomb" else gzip.compress(json.dumps({"status": "ok"}).encode())
            return web.Response(status=200, body=body, headers={"Content-Type": "application/json",
                                                                 "Content-Encoding": "gzip"})
        if fault in ("nested", "500_nested"):  # valid JSON nested deeper than Python's json reads
            return web.Response(status=500 if fault == "500_nested" else 200, body=b"[" * 100_000 + b"]" * 100_000,
                                content_type="application/json")
        if fault == "big":
            return web.Response(status=200, body=b'{"status": "ok", "padding": "' + b"x" * (2 << 20) + b'"}',
                                content_type="application/json")
        if fault == "500_huge":
            resp = web.StreamResponse(status=500, headers={"Content-Type": "text/plain"})
            await resp.prepare(request)
            try:
                await resp.write(b"Internal Server Error\n")
                for _ in range(64):
                    await resp.write(b"x" * (1 << 20))
            except (ConnectionResetError, RuntimeError):
                pass  # the client stopped reading, as it should
            return resp
        if fault == "reset":
            transport = request.transport
            if transport is not None:
                sock = transport.get_extra_info("socket")
                if sock is not None:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                transport.abort()
            await asyncio.sleep(1)
            return web.Response(status=200)
        raise ValueError(f"unknown fault {fault!r}")


    async def _trickle(self, request: web.Request) -> web.StreamResponse:
        """200 with a well-formed JSON answer, sent one byte every `trickle_every_s` until the client goes."""
        body = json.dumps({"status": "ok", "data": [], "padding": "x" * 4096}).encode()
        resp = web.StreamResponse(status=200, headers={"Content-Type": "application/json",
                                                       "Content-Length": str(len(body))})
        await resp.prepare(request)
        self.trickling.set()
        try:
            for index in range(len(body)):
                await resp.write(body[index:index + 1])
                await asyncio.sleep(self.trickle_every_s)
        except (ConnectionResetError, RuntimeError):
            pass  # the client gave up on it
        return resp


_GZIP_BOMB: list[bytes] = []


def gzip_bomb() -> bytes:
    """256 MiB of zeros, gzip-compressed (256 KiB), made once."""
    if not _GZIP_BOMB:
        packer = zlib.compressobj(9, zlib.DEFLATED, 31)  # 31: the gzip format
        zeros = bytes(1 << 20)
        _GZIP_BOMB.append(b"".join(packer.compress(zeros) for _ in range(256)) + packer.flush())
    return _GZIP_BOMB[0]


def render(prompt: str, negative: str, seed: int, steps: int, guidance: float, use_pe: bool, width: int,
           height: int, side_cap: int) -> Image.Image:
    """A deterministic image from every setting that changes SGLang's output (noise, here)."""
    key = f"{prompt}|{negative}|{seed}|{steps}|{guidance}|{use_pe}".encode()
    rng = np.random.default_rng(int.from_bytes(hashlib.sha256(key).digest()[:8], "little"))
    small_w, small_h = min(width, side_cap), min(height, side_cap)
    pixels = rng.integers(0, 256, size=(small_h, small_w, 3), dtype=np.uint8)
    image = Image.fromarray(pixels, "RGB")
    if (small_w, small_h) != (width, height):
        image = image.resize((width, height), Image.NEAREST)
    return image


class UnacceptingListener:
    """A port whose accept queue is full, so a new connection attempt hangs (connect timeout)."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(0)
        self.port = self.sock.getsockname()[1]
        self.fillers: list[socket.socket] = []
        for _ in range(3):  # fill the backlog; later SYNs are dropped by the kernel
            filler = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            filler.setblocking(False)
            try:
                filler.connect(("127.0.0.1", self.port))
            except BlockingIOError:
                pass
            self.fillers.append(filler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        for filler in self.fillers:
            filler.close()
        self.sock.close()


def dead_url() -> str:
    """The URL of a server that is not running: nothing listens there, so connections are refused."""
    return f"http://127.0.0.1:{free_port()}"


def free_port() -> int:
    """A loopback port nobody listens on (connection refused)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
