"""HttpClient: JSON over HTTP on aiohttp to one remote server (SGLang, an OpenAI-compatible chat endpoint).

What it guarantees:
- separate connect and read timeouts (the read timeout is per call, so callers can scale it with the work); the
  read timeout bounds the whole answer, headers and body, from the moment the connection is made
  (answer_deadline.py): a server that answers one byte at a time cannot hold a run longer than that;
- two kinds of failure, told apart where they happen: `ServerUnavailable` when the server cannot have started
  the work (the connection was refused or timed out while connecting, or the server answered 503, 429 or
  408), `ConnectionLost` when it may have (the request went out, then the connection broke or the answer did
  not come in time). Only the first kind is retried (with exponential backoff) for a POST, and an answer that
  took the whole read timeout is not asked for again; a POST always goes out on a fresh connection, so a pooled
  connection the server closed meanwhile cannot blur the two;
- answers asked for uncompressed (Accept-Encoding: identity) and never decompressed, so a size cap bounds the
  memory an answer takes (a few MB of gzip grow to hundreds); an answer sent compressed all the same is refused;
- responses read in chunks and refused over a size cap (small for the JSON of a probe, larger for an image; an
  error body is cut at the small cap); redirects are never followed;
- the credential the user bound to this server's origin (credentials.py), read when a request is sent, sent as
  `Authorization: Bearer` to that origin only (a client or request for another origin is refused), never shown
  in repr, logs or error text;
- a wait the user can cancel within a second (cancellation.py);
- one-line `RemoteError` subclasses (errors.py) that say what failed and what to do, naming the full URL the
  server saw, shown without credentials (urls.shown_url); an error answer's own words go through
  error_answers.py.

Settings (timeouts, retries, the size cap, the credential) are settings.py's; sync callers run the client's
coroutines on loop_thread.py's private event loop.
"""
from __future__ import annotations

import errno
import json
import os
import time
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import aiohttp

from ..core.errors import InvalidInputError, RemoteError
from .answer_deadline import AnswerClock, AnswerOverdue, trace_config, until_due
from .cancellation import CancelCheck, sleep_cancellable, wait_cancellable
from .credentials import Origin
from .error_answers import retry_after, server_text, status_error, without_secrets
from .errors import BadResponse, ConnectionLost, ServerUnavailable, TlsHandshakeFailed
from .settings import SMALL_ANSWER_BYTES, HttpSettings, RetryPolicy
from .urls import normalize_base_url, server_label, shown_url

IDEMPOTENT_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
UNCOMPRESSED = frozenset({"", "identity"})


@dataclass
class JsonResponse:
    status: int
    data: Any
    headers: Mapping[str, str]
    num_bytes: int
    elapsed_s: float


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
                self._fresh_session = _session(aiohttp.TCPConnector(force_close=True))
            return self._fresh_session
        if self._session is None or self._session.closed:
            # keep-alive shorter than uvicorn's 5 s, so a pooled connection is not reused just as the server closes it
            self._session = _session(aiohttp.TCPConnector(limit_per_host=4, keepalive_timeout=4.0))
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
        small_answer: bool = False,
    ) -> JsonResponse:
        """Send one request, retrying only where safe; return the parsed JSON of a 2xx answer.

        Statuses in `accept_statuses` are returned (with `data` None when the body is not JSON) instead of
        raised, e.g. 503 for a readiness probe that wants to tell "warming up" from "down". `read_timeout_s`: the
        seconds the whole answer may take once connected (default: the settings'); `small_answer`: a short JSON
        answer is expected (a probe, a model list), capped at SMALL_ANSWER_BYTES instead of the settings' cap.
        """
        method = method.upper()
        policy = retry or self.settings.retry
        attempt = 0
        while True:
            try:
                return await wait_cancellable(
                    self._request_once(method, path, body, read_timeout_s, accept_statuses, small_answer), cancel
                )
            except ServerUnavailable as exc:
                last: RemoteError = exc
                retry_after = exc.retry_after
            except ConnectionLost as exc:
                if method not in IDEMPOTENT_METHODS:
                    raise  # the server may have started the work: never re-send it silently
                if exc.timed_out:
                    raise  # it took the whole read timeout, and would again: the user's timeout bounds the wait
                last, retry_after = exc, None
            attempt += 1
            if attempt >= policy.attempts:
                try:
                    raise last
                finally:
                    del last  # this frame, which the error's traceback holds, must not hold the error (a cycle)
            await sleep_cancellable(policy.delay(attempt - 1, retry_after), cancel)

    async def _request_once(self, method: str, path: str, body: Any, read_timeout_s: Optional[float],
                            accept_statuses: frozenset[int], small_answer: bool) -> JsonResponse:
        session = await self._get_session(method)
        url = self.base_url + path
        shown = shown_url(url)
        headers = {"Accept": "application/json", "Accept-Encoding": "identity", "User-Agent": self.user_agent}
        if self.settings.credential is not None:
            self._require_bound_origin(url)
            headers["Authorization"] = f"Bearer {self.settings.credential.read()}"
        read_s = read_timeout_s if read_timeout_s is not None else self.settings.timeouts.read_s
        connect_s = self.settings.timeouts.connect_s
        # No per-read timeout: the answer's deadline (AnswerClock) bounds the whole of it.
        timeout = aiohttp.ClientTimeout(total=None, connect=None, sock_connect=connect_s, sock_read=None)
        clock = AnswerClock(connect_s, read_s)

        async def exchange() -> tuple[int, str, dict[str, str], bytes]:
            async with session.request(method, url, json=body, headers=headers, timeout=timeout,
                                       allow_redirects=False, trace_request_ctx=clock) as resp:
                clock.answer_began()
                self._refuse_compressed(resp, method, shown)
                raw = await self._read_capped(resp, method, shown, small_answer)
                return resp.status, resp.headers.get("Content-Type", ""), dict(resp.headers), raw

        started = time.monotonic()
        try:
            status, content_type, resp_headers, raw = await until_due(clock, exchange())
        except AnswerOverdue:
            raise self._overdue(clock, method, shown, connect_s) from None
        except aiohttp.ConnectionTimeoutError:
            cause = f"it did not accept a connection within {connect_s:g} s"
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
            # raised as it is made: an error held in a local of this frame, which its traceback holds, is a cycle
            raise self._status_error(method, shown, status, raw, content_type, resp_headers)
        data: Any = None
        if raw.strip():
            try:
                data = json.loads(raw)
            except (ValueError, RecursionError):  # RecursionError: nested deeper than json reads
                if status < 400:
                    snippet = without_secrets(raw[:60].decode("utf-8", errors="replace").replace("\n", " "),
                                              self.settings.credential)
                    raise BadResponse(
                        f"{self.label} answered {method} {shown} with something that is not JSON "
                        f"({server_text(content_type, 60) or 'no content type'}: {snippet!r}): is this the right "
                        f"server URL?"
                    ) from None
        return JsonResponse(status=status, data=data, headers=resp_headers, num_bytes=len(raw), elapsed_s=elapsed)

    def _status_error(self, method: str, shown: str, status: int, raw: bytes, content_type: str,
                      resp_headers: Mapping[str, str]) -> RemoteError:
        error = status_error(self.label, method, shown, status, "", raw, content_type, self.settings)
        if isinstance(error, ServerUnavailable):
            error.retry_after = retry_after(resp_headers)
        return error

    def _overdue(self, clock: AnswerClock, method: str, shown: str, connect_s: float) -> RemoteError:
        """The answer's deadline ran out: nothing was sent yet, nothing came back, or it came too slowly."""
        read_s, setting = _seconds(clock.read_s), self.settings.read_timeout_setting
        if not clock.connected:  # a name that would not resolve, a pool that stayed full: nothing was sent
            cause = f"no connection within {_seconds(connect_s + clock.read_s)} s"
            return ServerUnavailable(f"{self.label}: {cause}: check the URL and that the server is running",
                                     reason="unreachable", cause=cause)
        if not clock.answering:
            cause = f"it sent no answer to {method} {shown} within {read_s} s (read timeout)"
            return ConnectionLost(
                f"{self.label} sent no answer to {method} {shown} within {read_s} s (read timeout); the server "
                f"may still be working on it: raise {setting} for large images or many steps", cause=cause,
                timed_out=True).naming(setting)
        cause = (f"it answered {method} {shown} too slowly: the whole answer took longer than {read_s} s "
                 f"(read timeout)")
        return ConnectionLost(
            f"{self.label} answered {method} {shown} too slowly: the whole answer took longer than {read_s} s "
            f"(read timeout), coming in bit by bit; check the server (its log, its network, a proxy in front of it), "
            f"or raise {setting} if it is only slow", cause=cause, timed_out=True,
            answered_in_part=True).naming(setting)

    def _refuse_compressed(self, resp: aiohttp.ClientResponse, method: str, shown: str) -> None:
        """The answer was asked for uncompressed; one compressed anyway is refused before a byte of it is read (it
        is never decompressed: a few MB of gzip can grow to gigabytes)."""
        encoding = resp.headers.get("Content-Encoding", "").strip().lower()
        if encoding not in UNCOMPRESSED:
            raise BadResponse(
                f"{self.label} answered {method} {shown} compressed (Content-Encoding: "
                f"{server_text(encoding, 40)}) although it was asked for an uncompressed answer (Accept-Encoding: "
                f"identity); refused: check the server, or the proxy in front of it")

    async def _read_capped(self, resp: aiohttp.ClientResponse, method: str, shown: str, small_answer: bool) -> bytes:
        """The body: an error answer's first SMALL_ANSWER_BYTES (only its message is shown; the rest is left
        unread), a 2xx answer whole, refused over its cap (SMALL_ANSWER_BYTES for `small_answer`, else the
        settings' max_body_bytes)."""
        cap = SMALL_ANSWER_BYTES if small_answer else self.settings.max_body_bytes
        if resp.status >= 300:
            return await _read_at_most(resp, min(cap, SMALL_ANSWER_BYTES))
        if small_answer:
            too_big = BadResponse(
                f"{self.label} answered {method} {shown} with more than {_size(cap)}, where a short JSON answer is "
                f"expected; refused: is this the server's URL? (a server answering this much is misbehaving)")
        else:
            too_big = BadResponse(
                f"{self.label} answered {method} {shown} with more than {_size(cap)}; refused (a server answering "
                f"this much is misbehaving; {self.settings.over_cap_fix})")
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


def _session(connector: aiohttp.TCPConnector) -> aiohttp.ClientSession:
    """A session that never decompresses (answers are asked for uncompressed) and tells each request's AnswerClock
    when its connection is made."""
    return aiohttp.ClientSession(connector=connector, trust_env=False, auto_decompress=False,
                                 trace_configs=[trace_config()])


async def _read_at_most(resp: aiohttp.ClientResponse, limit: int) -> bytes:
    chunks: list[bytes] = []
    total = 0
    while total < limit:
        chunk = await resp.content.read(limit - total)
        if not chunk:
            break
        chunks.append(chunk)
        total += len(chunk)
    return b"".join(chunks)


def _seconds(seconds: float) -> str:
    """Seconds as a message shows them: to a tenth (a read timeout grown with steps and size is no round number)."""
    return f"{round(seconds, 1):g}"


def _size(num_bytes: int) -> str:
    if num_bytes >= 1024 * 1024:
        return f"{num_bytes / (1024 * 1024):g} MiB"
    return f"{num_bytes / 1024:g} KiB"


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
