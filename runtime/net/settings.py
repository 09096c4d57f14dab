"""How a client talks to its server: the credential bound to it, connect and read timeouts, retries with backoff,
the response size caps; and the check of a number of seconds a user gives for any of them."""
from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Optional

from ..core.errors import InvalidInputError, quoted_shortly
from ..core.number_text import DECIMAL_RULE, decimal_from_text
from .credentials import Credential, Credentials

DEFAULT_MAX_BODY_BYTES = 256 * 1024 * 1024
# What a small JSON answer may weigh (/health, /v1/models, /server_info, an error body): sglang 0.5.23 answers each
# in under 1 KB (shared facts: examples.json), a FastAPI 422 that quotes a long prompt in a few KB. Images and chat
# replies have their own cap (max_body_bytes).
SMALL_ANSWER_BYTES = 1024 * 1024
READ_TIMEOUT = "the read timeout"  # how a message names the read timeout when the caller gives no setting
# What a reply over the cap is told, where the caller says nothing of its own: the image backends' words.
LARGE_IMAGES = "for images really that large, raise RemoteSettings.max_response_mb"


def checked_seconds(value: object, label: str, *, allow_zero: bool = False) -> float:
    """A number of seconds a user gave (a timeout, a wait): finite and positive (or zero where `allow_zero`).
    Text is read as a plain decimal only (core/number_text: `1_0`, `nan`, ` 30 ` are refused). InvalidInputError,
    one line, naming `label` (a widget or a CLI flag), otherwise."""
    shown = str(value)[:20]
    try:
        seconds = decimal_from_text(value, label) if isinstance(value, str) else float(value)  # type: ignore[arg-type]
        if seconds is None:
            raise ValueError(value)
    except InvalidInputError:  # past float's range (`1e999`): refused below as any number out of range is
        seconds, shown = math.inf, quoted_shortly(str(value))
    except (TypeError, ValueError):
        raise InvalidInputError(f"{label} {str(value)[:20]!r} is not a number of seconds: give e.g. 30 "
                                f"({DECIMAL_RULE})") from None
    if isinstance(value, bool) or not math.isfinite(seconds) or seconds < 0 or (seconds == 0 and not allow_zero):
        least = "0 or more" if allow_zero else "more than 0"
        raise InvalidInputError(f"{label} {shown} is not allowed: give a finite number of seconds, {least}")
    return seconds


@dataclass(frozen=True)
class Timeouts:
    connect_s: float = 5.0  # for a server to accept the connection
    read_s: float = 300.0  # for the whole answer, once connected; callers pass a scaled value per request


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
    read_timeout_setting: str = READ_TIMEOUT  # the setting that gives the read timeout, named in its errors
    over_cap_fix: str = LARGE_IMAGES  # what a reply over max_body_bytes is told, after "misbehaving"

    @classmethod
    def of(cls, *, credential: Optional[Credential], connect_timeout_s: float, read_timeout_s: float,
           retry_attempts: int, max_response_mb: int, keys: Credentials = Credentials(),
           read_timeout_setting: str = READ_TIMEOUT, over_cap_fix: str = LARGE_IMAGES) -> "HttpSettings":
        """From the flat values a node or CLI exposes."""
        return cls(
            credential=credential,
            timeouts=Timeouts(connect_s=connect_timeout_s, read_s=read_timeout_s),
            retry=RetryPolicy(attempts=max(1, retry_attempts)),
            max_body_bytes=max_response_mb * 1024 * 1024,
            keys=keys,
            read_timeout_setting=read_timeout_setting,
            over_cap_fix=over_cap_fix,
        )
