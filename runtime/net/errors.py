"""The remote client's failures, told apart where they happen (see client.py for when each is raised)."""
from __future__ import annotations

from typing import Optional

from ..core.errors import RemoteError


class ServerUnavailable(RemoteError):
    """The server did not take the request, so it cannot have started it: safe to send again, here or elsewhere.

    `reason`: "refused" (nothing listening), "unreachable" (no such host, connect timeout) or "busy" (it answered
    503/429/408); `retry_after`: the seconds the server asked for (Retry-After), if any.
    """

    def __init__(self, message: str, reason: str = "busy", status: Optional[int] = None,
                 retry_after: Optional[float] = None, cause: Optional[str] = None) -> None:
        super().__init__(message)
        self.reason = reason
        self.status = status
        self.retry_after = retry_after
        self.cause = cause or message  # what happened, in plain words, without the server's name or the fix


class ConnectionLost(RemoteError):
    """The request went out, then the connection broke or no answer came in time: the server may still be working
    on it, so sending it again could run the same job twice."""

    def __init__(self, message: str, cause: Optional[str] = None, timed_out: bool = False,
                 answered_in_part: bool = False) -> None:
        super().__init__(message)
        self.cause = cause or message  # what happened, in plain words, without the server's name or the fix
        self.timed_out = timed_out  # no whole answer within the read timeout (else: the connection broke)
        self.answered_in_part = answered_in_part  # timed out after the answer began: it came too slowly


class ServerRejected(RemoteError):
    """The server answered 4xx: the request itself is wrong; another server would answer the same."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class AuthenticationError(ServerRejected):
    """401/403: the API key is missing or wrong."""


class ServerFailed(RemoteError):
    """The server answered 5xx (other than 503): it failed while working on the request."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class BadResponse(RemoteError):
    """The server answered something unusable: not JSON, wrong shape, too large, a redirect."""


class TlsHandshakeFailed(BadResponse):
    """An https:// URL whose TLS handshake failed (a plain-HTTP server, a certificate not trusted): nothing was
    sent, and waiting will not change it, so it is a setup error, not a server still loading."""
