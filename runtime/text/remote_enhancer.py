"""The prompt enhancer behind an OpenAI-compatible chat endpoint (vLLM or SGLang serving Baidu's PE).

Baidu's "Method 2": the PE runs on its own server, the DiT then gets the revised prompt with the PE off. The
server applies the PE's own chat template (system text fixed inside it); we send only the user message, as JSON
`{"prompt", "width", "height"}`, with the seed, so a server that honours `seed` gives the same revision again.

Transport (timeouts, safe retries, size cap, API key, cancel) is `net/client.py`'s. Failure policy:
- the server is down, times out, fails (5xx), or answers something unusable or empty: the original prompt is
  used and the user is told in one line (an image without the PE beats no image);
- 401/403 and other 4xx (wrong key, wrong model name, wrong URL path) raise: those are settings to fix.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from ..core.errors import RemoteError
from ..core.host import Host, NullHost, show_status
from ..core.request import SEED_MASK
from ..net.client import HttpClient
from ..net.credentials import Credential, Credentials
from ..net.errors import BadResponse, ConnectionLost, ServerFailed, ServerRejected, ServerUnavailable
from ..net.loop_thread import run_sync
from ..net.settings import READ_TIMEOUT, HttpSettings
from ..net.urls import shown_url
from .enhancer import CAPPED, RevisedPrompts, Revision, validate_sampling
from .pe_prompt import chat_messages

CHAT_PATH = "/v1/chat/completions"
MODELS_PATH = "/v1/models"


@dataclass(frozen=True)
class ChatEndpoint:
    """Where the remote PE is. Holds no secret: only the credential the user bound to its origin, if any."""

    url: str
    model: Optional[str] = None  # None: the first model the server lists
    credential: Optional[Credential] = None
    keys: Credentials = field(default=Credentials(), compare=False, repr=False)  # named when a key is asked for
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 120.0
    timeout_setting: str = ""  # the setting that gives read_timeout_s, named when the server is too slow
    retry_attempts: int = 3
    max_response_mb: int = 8

    def __repr__(self) -> str:
        key = self.credential.describe() if self.credential is not None else "no API key"
        return f"ChatEndpoint(url={shown_url(self.url)!r}, model={self.model!r}, {key})"

    @classmethod
    def bound(cls, url: str, credentials: Credentials, label: str = "", *, what: str = "pe_url",
              setting: str = "pe_credential", **fields: Any) -> "ChatEndpoint":
        """The endpoint at `url` with the credential the user bound to its origin (or the one `label` picks, which
        must be bound there); the URL and the credential are checked now, before anything is sent."""
        from ..net.urls import normalize_base_url

        endpoint = cls(url=url.strip(), keys=credentials, **fields)
        base = normalize_base_url(endpoint.base_url(), what=what)
        return dataclasses.replace(endpoint, credential=credentials.for_server(base, label, setting=setting))

    def base_url(self) -> str:
        url = self.url.strip().rstrip("/")
        for suffix in (CHAT_PATH, "/v1"):
            if url.endswith(suffix):
                url = url[: -len(suffix)]
        return url

    def client(self) -> HttpClient:
        return HttpClient(self.base_url(), HttpSettings.of(
            credential=self.credential, connect_timeout_s=self.connect_timeout_s,
            read_timeout_s=self.read_timeout_s, retry_attempts=self.retry_attempts,
            max_response_mb=self.max_response_mb, keys=self.keys,
            read_timeout_setting=self.timeout_setting or READ_TIMEOUT,
            over_cap_fix="a revised prompt is a few kilobytes: check that it is a chat completions server"))


class _Unusable(RemoteError):
    """The reply parsed but holds no revised prompt."""


# Faults after which the original prompt is kept (see the module docstring); 4xx ones raise.
_KEEP_ORIGINAL = (ServerUnavailable, ConnectionLost, ServerFailed, BadResponse, _Unusable)


def _reply_text(data: Any, label: str) -> tuple[str, bool, Optional[int]]:
    """(content, cut at max_tokens, completion tokens) from a chat-completions reply."""
    try:
        choice = data["choices"][0]
        content = choice["message"]["content"]
    except (KeyError, IndexError, TypeError):
        raise _Unusable(f"{label} answered without choices[0].message.content: is it an OpenAI-compatible "
                        f"chat endpoint?") from None
    if content is None:
        content = ""
    if not isinstance(content, str):
        raise _Unusable(f"{label} answered a non-text message content")
    try:
        content.encode("utf-8")
    except UnicodeEncodeError:  # a JSON \ud800 escape: no text a tokenizer takes
        raise _Unusable(f"{label} answered a message content that is not valid Unicode text (a lone surrogate)"
                        ) from None
    usage = data.get("usage") if isinstance(data, dict) else None
    tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
    return content, choice.get("finish_reason") == "length", tokens if isinstance(tokens, int) else None


# The model each endpoint listed when the user named none, by base URL: asked once, not before every prompt.
_listed_models: dict[str, str] = {}


def forget_listed_model(endpoint: ChatEndpoint) -> None:
    """Ask the endpoint's model list again next time (a release may run on another thread: one dict op)."""
    _listed_models.pop(endpoint.base_url(), None)


async def _model_name(client: HttpClient, endpoint: ChatEndpoint) -> str:
    if endpoint.model:
        return endpoint.model
    key = endpoint.base_url()
    listed = _listed_models.get(key)  # one get, not `in` then [], so a forget between them cannot raise
    if listed is None:
        reply = await client.request_json("GET", MODELS_PATH, small_answer=True)
        try:
            listed = str(reply.data["data"][0]["id"])
        except (KeyError, IndexError, TypeError):
            raise _Unusable(f"{client.label} lists no model at {MODELS_PATH}: give the PE model name") from None
        _listed_models[key] = listed
    return listed


def _model_not_found(error: ServerRejected) -> bool:
    """vLLM answers 404 "The model `x` does not exist."; other servers say "not found" with a 4xx."""
    text = str(error).lower()
    return error.status == 404 or "does not exist" in text or "not found" in text


async def _chat(client: HttpClient, endpoint: ChatEndpoint, model: str, body: dict, notes: list[str]
                ) -> tuple[Any, str]:
    """The chat reply and the model that gave it. A listed model the server no longer serves (restarted with
    another) is looked up again, once, and the request repeated under the new name."""
    try:
        return await client.request_json("POST", CHAT_PATH, {**body, "model": model}), model
    except ServerRejected as error:
        if endpoint.model or not _model_not_found(error):
            raise
        forget_listed_model(endpoint)
        renamed = await _model_name(client, endpoint)
        if renamed == model:
            raise  # listed again under the same name: the name is not what is wrong
    notes.append(f"the PE server at {client.label} now serves {renamed} instead of {model}: using it")
    return await client.request_json("POST", CHAT_PATH, {**body, "model": renamed}), renamed


async def _revise_all(endpoint: ChatEndpoint, prompts: Sequence[str], width: int, height: int, seed: int,
                      temperature: float, top_p: float, max_new_tokens: int, notes: list[str],
                      keep_original: bool = True) -> list[Revision]:
    client = endpoint.client()
    revisions: list[Revision] = []
    try:
        try:
            model = await _model_name(client, endpoint)
        except _KEEP_ORIGINAL as error:
            if not keep_original:
                raise
            notes.append(_fallback_note(error))
            return [Revision(p, p, 0, 0.0, "original") for p in prompts]
        for prompt in prompts:
            body = {
                "messages": chat_messages(prompt, width, height),
                "temperature": temperature,
                "top_p": top_p,
                "max_tokens": max_new_tokens,
                "seed": int(seed) & SEED_MASK,  # vLLM and SGLang take a signed 64-bit seed
                "stream": False,
            }
            started = time.perf_counter()
            try:
                reply, model = await _chat(client, endpoint, model, body, notes)
                content, truncated, tokens = _reply_text(reply.data, client.label)
            except _KEEP_ORIGINAL as error:
                if not keep_original:
                    raise
                slow = isinstance(error, ConnectionLost) and error.timed_out
                notes.append(_fallback_note(_slow_server(error, endpoint) if slow else error))
                revisions.append(Revision(prompt, prompt, 0, time.perf_counter() - started, "original"))
                continue
            seconds = time.perf_counter() - started
            revised = content.strip()
            if not revised:
                empty = f"remote prompt enhancer at {client.label} returned an empty prompt"
                if not keep_original:
                    raise _Unusable(empty)
                notes.append(f"{empty}: the original prompt is used")
                revisions.append(Revision(prompt, prompt, tokens or 0, seconds, "original"))
                continue
            if truncated:
                notes.append(f"remote prompt enhancer stopped at the {max_new_tokens}-token cap: {CAPPED}")
            revisions.append(Revision(prompt, revised, tokens or 0, seconds, "remote", truncated))
        return revisions
    finally:
        await client.close()


def _fallback_note(error: Exception) -> str:
    return f"remote prompt enhancer failed, the original prompt is used: {error}"


WAIT_NOTICE_EVERY_S = 10.0


def _slow_server(error: ConnectionLost, endpoint: ChatEndpoint) -> ConnectionLost:
    """A read timeout in the enhancer's words: the transport's own advice names the image read timeout."""
    longer = (f", or give it longer with {endpoint.timeout_setting}" if endpoint.timeout_setting else "")
    where = f"the prompt enhancer at {shown_url(endpoint.base_url())}"
    if error.answered_in_part:
        return ConnectionLost(f"{where} answered too slowly: the whole answer took longer than "
                              f"{endpoint.read_timeout_s:g} s, coming in bit by bit; check the server (its log, its "
                              f"network, a proxy in front of it){longer}", cause=error.cause, timed_out=True,
                              answered_in_part=True)
    return ConnectionLost(f"{where} sent no revised prompt within {endpoint.read_timeout_s:g} s: it may be "
                          f"overloaded or still loading its model; check the server{longer}", cause=error.cause,
                          timed_out=True)


def revise_prompts_remote(endpoint: ChatEndpoint, prompts: Sequence[str], width: int, height: int, seed: int,
                          temperature: float = 0.6, top_p: float = 0.95, max_new_tokens: int = 512,
                          host: Optional[Host] = None, keep_original: bool = True) -> RevisedPrompts:
    """Revise each distinct prompt on the endpoint. Blocks; Cancel is checked on this thread every 0.1 s.

    Raises `AuthenticationError` (401/403) and `ServerRejected` (other 4xx) with a one-line fix; every other fault
    keeps the original prompt and is reported through `host.log`, or, with `keep_original=False` (a caller whose
    only job is the revision), is raised too.
    """
    validate_sampling(temperature, top_p, max_new_tokens)
    host = host or NullHost()
    unique = list(dict.fromkeys(prompts))
    notes: list[str] = []
    started = time.monotonic()
    next_notice = started + WAIT_NOTICE_EVERY_S

    def poll() -> None:  # every 0.1 s on this thread: Cancel, and what a long wait is for
        nonlocal next_notice
        host.check_cancel()
        now = time.monotonic()
        if now >= next_notice:
            waited = f"{now - started:.0f} s (up to {endpoint.read_timeout_s:g} s a prompt)"
            line = f"waiting for the prompt enhancer at {shown_url(endpoint.base_url())}: {waited}"
            host.log(line)
            show_status(host, line)
            next_notice = now + WAIT_NOTICE_EVERY_S

    try:
        revisions = run_sync(
            _revise_all(endpoint, unique, width, height, seed, temperature, top_p, max_new_tokens, notes,
                        keep_original),
            poll,
        )
    except ServerRejected as error:
        raise _rejected(error, endpoint) from None
    except ConnectionLost as error:
        raise (_slow_server(error, endpoint) if error.timed_out else error) from None
    finally:
        for note in notes:
            host.log(note)
    done = dict(zip(unique, revisions))
    return RevisedPrompts([done[p].revised for p in prompts], revisions)


def _rejected(error: ServerRejected, endpoint: ChatEndpoint) -> ServerRejected:
    if error.status in (0, 401, 403):
        return error  # already says which key source to check
    named = f"the PE model name {endpoint.model!r}" if endpoint.model else "the PE model name"
    hint = f"check {named} and that {endpoint.base_url()} serves the OpenAI API at {CHAT_PATH}"
    return type(error)(f"remote prompt enhancer: {str(error).rstrip('. ')}; {hint}", error.status)
