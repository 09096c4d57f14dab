"""A small JSON-over-HTTP layer on aiohttp for remote servers (SGLang, OpenAI-compatible chat endpoints).

What it guarantees:
- separate connect and read timeouts (the read timeout is per call, so callers can scale it with the work);
- two kinds of failure, told apart where they happen: `ServerUnavailable` when the server cannot have started
  the work (the connection was refused or timed out while connecting, or the server answered 503, 429 or
  408), `ConnectionLost` when it may have (the request went out, then the connection broke or the answer did
  not come in time). Only the first kind is retried (with exponential backoff) for a POST; a POST always goes
  out on a fresh connection, so a pooled connection the server closed meanwhile cannot blur the two;
- responses read in chunks and refused over a size cap; redirects are never followed;
- the credential the user bound to this server's origin (credentials.py), read when a request is sent, sent as
  `Authorization: Bearer` to that origin only (a client or request for another origin is refused), never shown
  in repr, logs or error text;
- cancellation polled every 0.1 s (`cancel` may return True or raise `Cancelled`, so `Host.check_cancel`
  fits as it is), so a cancel stops the wait within a second;
- one-line `RemoteError` subclasses that say what failed and what to do, naming the full URL the server saw,
  shown without credentials (urls.shown_url).

`run_sync` runs a coroutine on a private event-loop thread, for sync callers (ComfyUI node functions, the CLI).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import json
import os
import random
import math
import re
import threading
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Coroutine, Mapping, Optional, TypeVar
import aiohttp

from ..core.errors import Cancelled, InvalidInputError, RemoteError
from .credentials import Credential, Credentials, Origin
from .errors import (
    AuthenticationError,
    BadResponse,
    ConnectionLost,
    ServerFailed,
    ServerRejected,
    ServerUnavailable,
    TlsHandshakeFailed,
)
from .urls import normalize_base_url, shown_url

T = TypeVar("T")
CancelCheck = Callable[[], Optional[bool]]

CANCEL_POLL_S = 0.1
DEFAULT_MAX_BODY_BYTES = 256 * 1024 * 1024
IDEMPOTENT_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
RETRYABLE_STATUSES = frozenset({408, 429, 503})


# -------------------------------------------------------------------------------------------- settings
def checked_seconds(value: object, label: str, *, allow_zero: bool = False) -> float:
    """A number of seconds a user gave (a timeout, a wait): finite and positive (or zero where `allow_zero`).
    InvalidInputError, one line, naming `label` (a widget or a CLI flag), otherwise."""
    try:
        seconds = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise InvalidInputError(f"{label} {str(value)[:20]!r} is not a number of seconds: give e.g. 30") from None
    if isinstance(value, bool) or not math.isfinite(seconds) or seconds < 0 or (seconds == 0 and not allow_zero):
        least = "0 or more" if allow_zero else "more than 0"
        raise InvalidInputError(f"{label} {str(value)[:20]} is not allowed: give a finite number of seconds, {least}")
    return seconds


@dataclass(frozen=True)
class Timeouts:
    connect_s: float = 5.0
    read_s: float = 300.0  # default wait for a response; callers pass a scaled value per request


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 4  # total tries for a safe-to-retry failure
    base_delay_s: float = 0.5
    max_delay_s: float = 8.0

    def delay(self, attempt: int, retry_after: Optional[float] = None) -> float:
        backoff = min(self.max_delay_s, self.base_delay_s * (2 ** attempt))
        backoff *= 0.8 + 0.4 * random.random()  # jitter, so a fleet of clients does not retry in lockstep
        if retry_after is not None:
            backoff = max(backoff, min(retry_after, self.max_delay_s))
        return backoff


@dataclass(frozen=True)
class HttpSettings:
    """How a client talks to its server: the credential bound to it, timeouts, retries, the response cap."""

    credential: Optional[Credential] = None  # sent only to its own origin (HttpClient refuses any other)
    timeouts: Timeouts = Timeouts()
    retry: RetryPolicy = RetryPolicy()
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    keys: Credentials = Credentials()  # where the user binds keys, named when a server asks for one

    @classmethod
    def of(cls, *, credential: Optional[Credential], connect_timeout_s: float, read_timeout_s: float,
           retry_attempts: int, max_response_mb: int, keys: Credentials = Credentials()) -> "HttpSettings":
        """From the flat values a node or CLI exposes."""
        return cls(
            credential=credential,
            timeouts=Timeouts(connect_s=connect_timeout_s, read_s=read_timeout_s),
            retry=RetryPolicy(attempts=max(1, retry_attempts)),
            max_body_bytes=max_response_mb * 1024 * 1024,
            keys=keys,
        )


@dataclass
class JsonResponse:
    status: int
    data: Any
    headers: Mapping[str, str]
    num_bytes: int
    elapsed_s: float


def server_label(url: str) -> str:
    """How a server is named to the user: its URL without credentials, query or trailing slash (urls.shown_url)."""
    return shown_url(url).rstrip("/")


# ---------------------------------------------------------------------------------------- error text
def server_text(value: object, limit: int = 300) -> str:
    """Text a server sent, as it may be shown: one line of printable characters (a control character, an escape
    sequence or a line break from a stranger's server could forge log lines or restyle a terminal), at most
    `limit` characters."""
    text = "".join(char if char.isprintable() else "?" for char in str(value))
    return text if len(text) <= limit else text[:limit] + "..."


def _server_message(body: bytes, content_type: str) -> Optional[str]:
    """The human message inside an error body (FastAPI detail, OpenAI error, plain text), one line."""
    text = body.decode("utf-8", errors="replace").strip()
    if not text:
        return None
    message = _message_in(text, content_type)
    return server_text(message) if message is not None else None


def _message_in(text: str, content_type: str) -> Optional[str]:
    if "json" in content_type or text[:1] in "{[":
        try:
            data = json.loads(text)
        except ValueError:
            data = None
        if data is not None:
            return _message_from_json(data)
    if "html" in content_type or text[:1] == "<":
        return "an HTML page, not an API answer"  # a web server's error page: its markup says nothing to the user
    first_line = text.splitlines()[0]
    return first_line[:300]


def _message_from_json(data: Any) -> Optional[str]:
    if isinstance(data, dict):
        for key in ("detail", "error", "message"):
            if key in data:
                value = data[key]
                if isinstance(value, str):
                    return value[:300]
                if isinstance(value, dict):
                    return _message_from_json(value)
                if isinstance(value, list):
                    return "; ".join(_pydantic_item(item) for item in value[:5])[:300]
        return None
    if isinstance(data, list):
        return "; ".join(_pydantic_item(item) for item in data[:5])[:300]
    return str(data)[:300]


def _pydantic_item(item: Any) -> str:
    if isinstance(item, dict) and "msg" in item:
        loc = [str(part) for part in item.get("loc", []) if part != "body"]
        return f"{'.'.join(loc)}: {item['msg']}" if loc else str(item["msg"])
    return str(item)


_BEARER = re.compile(r"(?i)\b(bearer\s+)[^\s,;\"']+")


def without_secrets(text: Optional[str], credential: Optional[Credential]) -> Optional[str]:
    """`text` from a server (an error body may echo the request's headers) with the API key and any bearer token
    masked, so that it can be shown."""
    if not text:
        return text
    try:
        key = credential.read() if credential is not None else None
    except RemoteError:  # unreadable now: nothing of it to mask beyond bearer tokens
        key = None
    if key:
        text = text.replace(key, "***")
    return _BEARER.sub(r"\1***", text)


def _status_error(label: str, method: str, url: str, status: int, reason: str, body: bytes,
                  content_type: str, settings: HttpSettings) -> RemoteError:
    """The error for an HTTP error status; `url` is the full URL asked, as shown (no credentials)."""
    credential = settings.credential
    message = without_secrets(_server_message(body, content_type), credential)
    reason = without_secrets(reason, credential) or ""
    if status in (401, 403):
        if credential is not None:
            hint = f"check the key of {credential.describe()}"
        else:
            hint = f"this server needs an API key: {settings.keys.how_to_bind(Origin.of(url))}"
        verb = "refused the API key" if status == 401 else "denied access with this API key"
        return AuthenticationError(f"{label} {verb} (HTTP {status}): {hint}", status)
    if status in RETRYABLE_STATUSES:
        detail = f": {message}" if message else ""
        return ServerUnavailable(f"{label} is not ready or overloaded (HTTP {status}){detail}; try again later",
                                 reason="busy", status=status, cause=f"not ready or overloaded (HTTP {status}){detail}")
    if 400 <= status < 500:
        detail = message or reason or "no reason given"
        return ServerRejected(f"{label} rejected {method} {url} (HTTP {status}): {detail}", status)
    if message and message.lower() != "internal server error":
        return ServerFailed(f"{label} failed (HTTP {status}): {message.rstrip('.')}; see the server log", status)
    if method != "POST":  # a readiness or model look, not a generation
        return ServerFailed(f"{label} failed on {method} {url} (HTTP {status}); see the server log", status)
    return ServerFailed(f"{label}: the server failed to generate; see the server log (HTTP {status})", status)


def _retry_after(headers: Mapping[str, str]) -> Optional[float]:
    value = headers.get("Retry-After")
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None


# ---------------------------------------------------------------------------------------- cancellation
def _cancel_requested(cancel: CancelCheck) -> bool:
    return bool(cancel())  # a Host.check_cancel raises Cancelled itself and returns None otherwise


async def wait_cancellable(awaitable: Awaitable[T], cancel: Optional[CancelCheck],
                           message: str = "cancelled while waiting for the server") -> T:
    """Await `awaitable`, polling `cancel` every 0.1 s; on cancel the awaitable is cancelled and Cancelled raised.
    Without `cancel` it is a plain await (run_sync's poll cancels the whole task), not a 0.1 s wake-up loop."""
    if cancel is None:
        return await awaitable
    task = asyncio.ensure_future(awaitable)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=CANCEL_POLL_S)
            if done:
                return task.result()
            if _cancel_requested(cancel):
                raise Cancelled(message)
    finally:
        if not task.done():
            task.cancel()
            try:
                await task
            except BaseException:  # noqa: BLE001 - the task's own outcome no longer matters
                pass


async def sleep_cancellable(seconds: float, cancel: Optional[CancelCheck]) -> None:
    if cancel is None:
        await asyncio.sleep(seconds)
        return
    deadline = time.monotonic() + seconds
    while True:
        if _cancel_requested(cancel):
            raise Cancelled("cancelled while waiting to retry the server")
        left = deadline - time.monotonic()
        if left <= 0:
            return
        await asyncio.sleep(min(CANCEL_POLL_S, left))


# --------------------------------------------------------------------------------------------- client
class HttpClient:
    """JSON over HTTP to one server. Create and use it on one event loop (the private one for sync callers)."""

    def __init__(self, base_url: str, settings: HttpSettings = HttpSettings(), *,
                 user_agent: str = "ernie-image-comfyui") -> None:
        self.base_url = normalize_base_url(base_url)
        self.label = server_label(self.base_url)
        self.settings = settings
        self.user_agent = user_agent
        self._session: Optional[aiohttp.ClientSession] = None
        self._fresh_session: Optional[aiohttp.ClientSession] = None
        if settings.credential is not None:
            self._require_bound_origin(self.base_url)

    def _require_bound_origin(self, url: str) -> None:
        """The credential goes to its own origin only: a client or request for any other is refused."""
        credential = self.settings.credential
        if credential is not None and Origin.of(url) != credential.origin:
            raise InvalidInputError(f"{credential.describe()} is bound to {credential.origin}, so it is not sent to "
                                    f"{self.label}: bind a key to {Origin.of(url)} for that server")

    def __repr__(self) -> str:
        key = self.settings.credential.describe() if self.settings.credential else "no API key"
        return f"HttpClient({self.label}, {key})"

    async def _get_session(self, method: str) -> aiohttp.ClientSession:
        if method not in IDEMPOTENT_METHODS:
            # A POST on a pooled connection the server has just closed fails after it was written, and then
            # nobody can tell whether the server started it. On a fresh connection, a failure to connect means
            # it was never sent. One TCP handshake per image is nothing beside the image.
            if self._fresh_session is None or self._fresh_session.closed:
                self._fresh_session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True),
                                                            trust_env=False)
            return self._fresh_session
        if self._session is None or self._session.closed:
            # keep-alive shorter than uvicorn's 5 s, so a pooled connection is not reused just as the server closes it
            connector = aiohttp.TCPConnector(limit_per_host=4, keepalive_timeout=4.0)
            self._session = aiohttp.ClientSession(connector=connector, trust_env=False)
        return self._session

    async def close(self) -> None:
        for session in (self._session, self._fresh_session):
            if session is not None and not session.closed:
                await session.close()
        self._session = self._fresh_session = None

    async def request_json(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        read_timeout_s: Optional[float] = None,
        cancel: Optional[CancelCheck] = None,
        accept_statuses: frozenset[int] = frozenset(),
        retry: Optional[RetryPolicy] = None,
    ) -> JsonResponse:
        """Send one request, retrying only where safe; return the parsed JSON of a 2xx answer.

        Statuses in `accept_statuses` are returned (with `data` None when the body is not JSON) instead of
        raised, e.g. 503 for a readiness probe that wants to tell "warming up" from "down".
        """
        method = method.upper()
        policy = retry or self.settings.retry
        attempt = 0
        while True:
            try:
                return await wait_cancellable(
                    self._request_once(method, path, body, read_timeout_s, accept_statuses), cancel
                )
            except ServerUnavailable as exc:
                last: RemoteError = exc
                retry_after = exc.retry_after
            except ConnectionLost as exc:
                if method not in IDEMPOTENT_METHODS:
                    raise  # the server may have started the work: never re-send it silently
                last, retry_after = exc, None
            attempt += 1
            if attempt >= policy.attempts:
                raise last
            await sleep_cancellable(policy.delay(attempt - 1, retry_after), cancel)

    async def _request_once(self, method: str, path: str, body: Any, read_timeout_s: Optional[float],
                            accept_statuses: frozenset[int]) -> JsonResponse:
        session = await self._get_session(method)
        url = self.base_url + path
        shown = shown_url(url)
        headers = {"Accept": "application/json", "User-Agent": self.user_agent}
        if self.settings.credential is not None:
            self._require_bound_origin(url)
            headers["Authorization"] = f"Bearer {self.settings.credential.read()}"
        read_s = read_timeout_s if read_timeout_s is not None else self.settings.timeouts.read_s
        timeout = aiohttp.ClientTimeout(total=None, connect=None, sock_connect=self.settings.timeouts.connect_s,
                                        sock_read=read_s)
        started = time.monotonic()
        try:
            async with session.request(method, url, json=body, headers=headers, timeout=timeout,
                                       allow_redirects=False) as resp:
                raw = await self._read_capped(resp, method, path)
                status, content_type = resp.status, resp.headers.get("Content-Type", "")
                resp_headers = dict(resp.headers)
        except aiohttp.ConnectionTimeoutError:
            cause = f"it did not accept a connection within {self.settings.timeouts.connect_s:g} s"
            raise ServerUnavailable(f"{self.label}: {cause}: check the URL and that the server is running",
                                    reason="unreachable", cause=cause) from None
        except aiohttp.ClientConnectorDNSError:
            cause = "no such host (the name does not resolve)"
            raise ServerUnavailable(f"{self.label}: {cause}: check the URL", reason="unreachable",
                                    cause=cause) from None
        except aiohttp.ClientSSLError as exc:  # before ClientConnectorError: a connector error too, not transient
            raise _tls_error(self.label, exc) from None
        except aiohttp.ClientConnectorError as exc:
            raise _connect_error(self.label, exc.os_error) from None
        except aiohttp.SocketTimeoutError:
            cause = f"it sent no answer to {method} {shown} within {read_s:.1f} s (read timeout)"
            raise ConnectionLost(
                f"{self.label} sent no answer to {method} {shown} within {read_s:.1f} s (read timeout); the server "
                f"may still be working on it: raise the read timeout for large images or many steps", cause=cause,
                timed_out=True) from None
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError, aiohttp.ClientPayloadError) as exc:
            raise ConnectionLost(
                f"{self.label} dropped the connection during {method} {shown} ({type(exc).__name__}): the server "
                f"may have crashed or restarted, and may still be working on it; see the server log"
            ) from None
        except aiohttp.ClientResponseError as exc:
            raise BadResponse(f"{self.label} sent a malformed HTTP response to {method} {shown} "
                              f"({str(exc.message)[:100]})") from None
        elapsed = time.monotonic() - started

        if 300 <= status < 400:
            location = server_label(resp_headers.get("Location", "")) if resp_headers.get("Location") else "elsewhere"
            raise BadResponse(
                f"{self.label} redirected {method} {shown} to {location} (HTTP {status}); redirects are not "
                f"followed: use the final server URL"
            )
        if status >= 400 and status not in accept_statuses:
            error = _status_error(self.label, method, shown, status, "", raw, content_type, self.settings)
            if isinstance(error, ServerUnavailable):
                error.retry_after = _retry_after(resp_headers)
            raise error
        data: Any = None
        if raw.strip():
            try:
                data = json.loads(raw)
            except ValueError:
                if status < 400:
                    snippet = without_secrets(raw[:60].decode("utf-8", errors="replace").replace("\n", " "),
                                              self.settings.credential)
                    raise BadResponse(
                        f"{self.label} answered {method} {shown} with something that is not JSON "
                        f"({server_text(content_type, 60) or 'no content type'}: {snippet!r}): is this the right "
                        f"server URL?"
                    ) from None
        return JsonResponse(status=status, data=data, headers=resp_headers, num_bytes=len(raw), elapsed_s=elapsed)

    async def _read_capped(self, resp: aiohttp.ClientResponse, method: str, path: str) -> bytes:
        cap = self.settings.max_body_bytes
        too_big = BadResponse(
            f"{self.label} answered {method} {shown_url(self.base_url + path)} with more than {cap // (1024 * 1024)} MiB; refused "
            f"(a server answering this much is misbehaving; for images really that large, raise "
            f"RemoteSettings.max_response_mb)"
        )
        if resp.content_length is not None and resp.content_length > cap:
            raise too_big
        chunks: list[bytes] = []
        total = 0
        async for chunk in resp.content.iter_chunked(1 << 16):
            total += len(chunk)
            if total > cap:
                resp.close()
                raise too_big
            chunks.append(chunk)
        return b"".join(chunks)


def _tls_error(label: str, exc: aiohttp.ClientSSLError) -> TlsHandshakeFailed:
    """A failed TLS handshake in plain words (aiohttp's own text reads as errno 1, "operation not permitted")."""
    if isinstance(exc, aiohttp.ClientConnectorCertificateError):
        why = getattr(exc.certificate_error, "verify_message", "") or type(exc.certificate_error).__name__
        return TlsHandshakeFailed(f"{label}: the TLS handshake failed: its certificate was not accepted ({why}): "
                                  f"check the server's certificate, or use http:// if the server speaks plain HTTP")
    ssl_error = getattr(exc, "os_error", None)
    why = getattr(ssl_error, "reason", None) or type(ssl_error).__name__
    return TlsHandshakeFailed(f"{label}: the TLS handshake failed ({str(why).lower().replace('_', ' ')}): use "
                              f"http:// if the server speaks plain HTTP, or check its certificate")


def _connect_error(label: str, os_error: Optional[OSError]) -> ServerUnavailable:
    """A connection that failed before anything was sent, in plain words (asyncio's own text, "Connect call failed
    ('127.0.0.1', 1)", says nothing a user can act on)."""
    number = getattr(os_error, "errno", None)
    if number == errno.ECONNREFUSED:
        cause = "nothing is listening there (connection refused)"
        return ServerUnavailable(f"{label} refused the connection: nothing is listening there; the server is not "
                                 f"running or still loading its weights", reason="refused", cause=cause)
    words = os.strerror(number).lower() if number else type(os_error).__name__
    cause = f"it cannot be reached ({words})"
    return ServerUnavailable(f"{label}: {cause}: check the URL and the network", reason="unreachable", cause=cause)


# ------------------------------------------------------------------------------------------ sync bridge
class _LoopThread:
    """A private event loop on a daemon thread; never the host's own loop (ComfyUI runs one elsewhere)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._thread: Optional[threading.Thread] = None

    def loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None or not self._thread or not self._thread.is_alive():
                loop = asyncio.new_event_loop()
                ready = threading.Event()

                def serve() -> None:
                    asyncio.set_event_loop(loop)
                    loop.call_soon(ready.set)
                    loop.run_forever()

                thread = threading.Thread(target=serve, name="ernie-image-remote-loop", daemon=True)
                thread.start()
                ready.wait()
                self._loop, self._thread = loop, thread
            return self._loop

    def in_loop_thread(self) -> bool:
        return self._thread is not None and threading.current_thread() is self._thread


_LOOP = _LoopThread()


def run_soon(coro: Coroutine[Any, Any, Any]) -> None:
    """Start `coro` on the private loop and return at once (closing connections from a finalizer)."""
    asyncio.run_coroutine_threadsafe(coro, _LOOP.loop())


def run_sync(coro: Coroutine[Any, Any, T], poll: Optional[Callable[[], None]] = None) -> T:
    """Run `coro` on the private loop thread and block this (non-loop) thread until it finishes.

    Blocking here is fine: ComfyUI runs node functions on a worker thread, not on its asyncio loop. `poll` runs
    on this thread every 0.1 s while waiting (`Host.check_cancel`, progress): whatever it raises (Cancelled)
    cancels the coroutine and propagates, and so does Ctrl-C in the CLI.
    """
    if _LOOP.in_loop_thread():
        coro.close()
        raise RuntimeError("run_sync called from the remote loop thread itself; await the coroutine instead")
    future = asyncio.run_coroutine_threadsafe(coro, _LOOP.loop())
    try:
        while True:
            try:
                return future.result(timeout=CANCEL_POLL_S if poll is not None else None)
            except concurrent.futures.TimeoutError:
                if future.done() or poll is None:
                    raise  # the coroutine's own TimeoutError, not the end of a poll slice
                poll()
    except BaseException:
        future.cancel()  # no-op once the coroutine has finished (it raised)
        raise
