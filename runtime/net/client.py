"""HttpClient: JSON over HTTP on aiohttp to one remote server (SGLang, an OpenAI-compatible chat endpoint).

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
from .cancellation import CancelCheck, sleep_cancellable, wait_cancellable
from .credentials import Origin
from .error_answers import retry_after, server_text, status_error, without_secrets
from .errors import BadResponse, ConnectionLost, ServerUnavailable, TlsHandshakeFailed
from .settings import HttpSettings, RetryPolicy
from .urls import normalize_base_url, server_label, shown_url

IDEMPOTENT_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


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
            error = status_error(self.label, method, shown, status, "", raw, content_type, self.settings)
            if isinstance(error, ServerUnavailable):
                error.retry_after = retry_after(resp_headers)
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
