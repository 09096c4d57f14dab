"""A server's error answer as one line a user can act on: the message inside its body (FastAPI detail, OpenAI
error, plain text), shown as printable text with API keys and bearer tokens masked, and the RemoteError subclass
its HTTP status means (urls.shown_url names the server)."""
from __future__ import annotations

import json
import re
from typing import Any, Mapping, Optional

from ..core.errors import RemoteError
from .credentials import Credential, Origin
from .errors import AuthenticationError, ServerFailed, ServerRejected, ServerUnavailable
from .settings import HttpSettings

RETRYABLE_STATUSES = frozenset({408, 429, 503})


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
        except (ValueError, RecursionError):  # RecursionError: nested deeper than json reads
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


def status_error(label: str, method: str, url: str, status: int, reason: str, body: bytes,
                  content_type: str, settings: HttpSettings) -> RemoteError:
    """The error for an HTTP error status; `url` is the full URL asked, as shown (no credentials)."""
    credential = settings.credential
    message = without_secrets(_server_message(body, content_type), credential)
    reason = without_secrets(reason, credential) or ""
    if status in (401, 403):
        if credential is not None:
            verb = "refused the API key" if status == 401 else "denied access with this API key"
            hint = f"check the key of {credential.describe()}"
        else:
            verb = "asks for an API key" if status == 401 else "denied access without an API key"
            hint = f"no key is bound to it: {settings.keys.how_to_bind(Origin.of(url))}"
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


def retry_after(headers: Mapping[str, str]) -> Optional[float]:
    value = headers.get("Retry-After")
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None
