"""Server URLs: checked once, and shown only through `shown_url`, which never lets a credential through.

`shown_url` is the one way a URL reaches a user (messages, logs, tables, routes, result info, PNG metadata):
`user:password@` becomes `***@`, query values become `***`, a fragment is dropped. It never raises, so a
malformed URL can be named in the error that refuses it.

`normalize_base_url` turns what a user typed into the base every request path is appended to, or refuses it in
one line (InvalidInputError): no scheme or an unknown one, no host, a port that is not a number or out of range,
credentials, a query or fragment, spaces. A base path (a reverse proxy's prefix) is kept: the server sees
base + path, and messages name that full URL.
"""
from __future__ import annotations

import re
from typing import Sequence
from urllib.parse import urlsplit

from ..core.errors import InvalidInputError

SCHEMES = ("http", "https")
EXAMPLE = "http://127.0.0.1:30000"
MAX_SHOWN_CHARS = 200
KEYS_FILE = "your keys file"  # where a key is bound to a server; the CLI adds its own flags (errors.naming)
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*):")


def shown_url(url: str) -> str:
    """`url` as it may be shown anywhere: no user name or password, no query value, no fragment, one line."""
    text = "".join(char if char.isprintable() else "_" for char in str(url).strip())
    scheme_end = text.find("://")
    start = scheme_end + 3 if scheme_end >= 0 else 0
    authority_end = len(text)
    for stop in "/?#":
        found = text.find(stop, start)
        if found >= 0:
            authority_end = min(authority_end, found)
    authority = text[start:authority_end]
    if "@" in authority:
        authority = "***@" + authority.rsplit("@", 1)[1]
    rest = text[authority_end:].split("#", 1)[0]
    if "?" in rest:
        path, query = rest.split("?", 1)
        masked = "&".join(f"{part.split('=', 1)[0]}=***" if "=" in part else "***"
                          for part in re.split(r"[&;]", query) if part)
        rest = f"{path}?{masked}" if masked else path
    shown = text[:start] + authority + rest
    return shown if len(shown) <= MAX_SHOWN_CHARS else shown[:MAX_SHOWN_CHARS] + "..."


def normalize_base_url(url: str, *, what: str = "server URL", endpoint_suffixes: Sequence[str] = ()) -> str:
    """The base URL requests are built on (no trailing slash), or InvalidInputError naming what is wrong.

    A URL without a scheme gets http://. `endpoint_suffixes` are paths the client adds itself (e.g. `/v1`): a
    base ending in one is refused, naming the base to give and the URL the server would otherwise see.
    """
    text = str(url).strip()
    if not text:
        raise InvalidInputError(f"empty {what}: give one like {EXAMPLE}")
    shown = shown_url(text)
    if any(char.isspace() or not char.isprintable() for char in text):
        raise InvalidInputError(f"{what} {shown!r} has a space or control character: give one like {EXAMPLE}")
    if "://" not in text:
        scheme = _SCHEME.match(text)
        if text.startswith("/") or (scheme and text[scheme.end():].startswith("/")):
            raise InvalidInputError(f"{what} {shown!r} has no usable scheme: write it as http://HOST:PORT, "
                                    f"e.g. {EXAMPLE}")
        text = "http://" + text  # host:port alone
        shown = shown_url(text)
    try:
        parts = urlsplit(text)
    except ValueError:  # e.g. an unclosed [IPv6 bracket
        raise InvalidInputError(f"{what} {shown!r} cannot be read as a URL: give one like {EXAMPLE}") from None
    scheme = parts.scheme.lower()
    if scheme not in SCHEMES:
        raise InvalidInputError(f"{what} {shown!r} has the scheme {parts.scheme!r}: use http:// or https://")
    if "@" in parts.netloc:
        raise InvalidInputError(f"{what} {shown!r} holds a user name or password: credentials never go into a "
                                f"server URL (it is shown and logged); bind the server's API key in {KEYS_FILE}"
                                ).naming(KEYS_FILE)
    if parts.query or parts.fragment or "?" in text or "#" in text:
        raise InvalidInputError(f"{what} {shown!r} has a query or fragment (?... or #...): give the server's base "
                                f"URL only; a token belongs in {KEYS_FILE}, bound to the server").naming(KEYS_FILE)
    if not parts.hostname:
        raise InvalidInputError(f"{what} {shown!r} has no host name: give one like {EXAMPLE}")
    _check_port(parts.netloc, what, shown)
    base = f"{scheme}://{parts.netloc}{parts.path}".rstrip("/")
    path = parts.path.rstrip("/")
    for suffix in endpoint_suffixes:
        if path.lower().endswith(suffix.lower()):
            root = base[: len(base) - len(suffix)]
            raise InvalidInputError(
                f"{what} {shown!r} ends in {suffix}, a path the client adds itself (the server would see "
                f"{shown_url(base)}{suffix}/...): give the server's base URL {shown_url(root)}")
    return base


def _check_port(netloc: str, what: str, shown: str) -> None:
    host_port = netloc.rsplit("@", 1)[-1]
    if host_port.startswith("["):  # [IPv6]:port
        port_text = host_port.partition("]")[2].removeprefix(":") if "]:" in host_port else ""
    else:
        port_text = host_port.partition(":")[2] if ":" in host_port else ""  # the first ':', as urlsplit reads it
    if ":" in host_port and not port_text and not host_port.startswith("["):
        raise InvalidInputError(f"{what} {shown!r} ends in ':' without a port: give one like {EXAMPLE}")
    if not port_text:
        return
    if not port_text.isdigit() or not port_text.isascii():
        raise InvalidInputError(f"{what} {shown!r} has the port {port_text[:12]!r}, which is not a number: give "
                                f"one like {EXAMPLE}")
    if not 1 <= int(port_text) <= 65535:
        raise InvalidInputError(f"{what} {shown!r} has the port {int(port_text)}, out of range: use 1..65535")


def server_label(url: str) -> str:
    """How a server is named to the user: its URL without credentials, query or trailing slash (urls.shown_url)."""
    return shown_url(url).rstrip("/")
