"""The HTTP layer under faults, against real aiohttp servers on loopback (tests/fake_sglang.py)."""
from __future__ import annotations

import time
from typing import Optional

import pytest

from ernie_image.runtime.core.errors import Cancelled, InvalidInputError
from ernie_image.runtime.net import errors
from ernie_image.runtime.net.client import HttpClient
from ernie_image.runtime.net.credentials import Credential, Credentials, Origin
from ernie_image.runtime.net.errors import (AuthenticationError, BadResponse, ConnectionLost, ServerFailed,
                                            ServerRejected, ServerUnavailable, TlsHandshakeFailed)
from ernie_image.runtime.net.key_source import ApiKeySource
from ernie_image.runtime.net.loop_thread import run_sync
from ernie_image.runtime.net.settings import HttpSettings, RetryPolicy, Timeouts

from client_calls import call
from fake_sglang import FakeSglang, UnacceptingListener, free_port
from waiting import PROMPTLY_S, WAIT_S, do_when, press_cancel

GEN = "/v1/images/generations"
BODY = {"prompt": "a red fox", "size": "64x64", "response_format": "b64_json"}
FAST_RETRY = RetryPolicy(attempts=3, base_delay_s=0.01, max_delay_s=0.05)


@pytest.fixture
def server():
    with FakeSglang() as fake:
        yield fake


def test_connect_timeout_is_told_apart_from_read_timeout(server):
    listener = UnacceptingListener()
    try:
        client = HttpClient(listener.url, HttpSettings(timeouts=Timeouts(connect_s=0.3), retry=RetryPolicy(attempts=1)))
        started = time.monotonic()
        with pytest.raises(ServerUnavailable, match="did not accept a connection within 0.3 s"):
            call(client, "GET", "/health")
        assert time.monotonic() - started < 3.0, "0.3 s, not the 5 s default"
    finally:
        listener.close()

    server.faults.append("hang")
    client = HttpClient(server.url, HttpSettings(retry=FAST_RETRY))
    with pytest.raises(ConnectionLost, match=r"within 0.4 s \(read timeout\).*may still be working"):
        call(client, "POST", GEN, BODY, read_timeout_s=0.4)
    assert len(server.generations) == 1, "a POST the server may be working on must never be re-sent"


def test_refused_connection_is_retried_then_reported():
    backoffs: list[int] = []

    class RecordingRetry(RetryPolicy):
        def delay(self, attempt: int, retry_after=None) -> float:
            backoffs.append(attempt)
            return 0.01

    client = HttpClient(f"http://127.0.0.1:{free_port()}", HttpSettings(retry=RecordingRetry(attempts=3)))
    with pytest.raises(ServerUnavailable, match="refused the connection.*not running or still loading"):
        call(client, "POST", GEN, BODY)  # refused: the server never saw it, so even a POST is tried again
    assert backoffs == [0, 1], "3 attempts: two waits between them"


def test_server_started_late_is_reached_by_the_retries():
    port = free_port()
    late = FakeSglang(port=port)

    class StartsTheServerOnceRefused(RetryPolicy):
        def delay(self, attempt: int, retry_after: Optional[float] = None) -> float:
            if attempt == 0:  # the first try was refused: the server comes up before the retry
                late.start()
            return super().delay(attempt, retry_after)

    try:
        patient = StartsTheServerOnceRefused(attempts=3, base_delay_s=0.1, max_delay_s=0.4)
        client = HttpClient(f"http://127.0.0.1:{port}", HttpSettings(retry=patient))
        assert call(client, "GET", "/health").data == {"status": "ok"}
        assert [r.path for r in late.received] == ["/health"], "the retry reached it"
    finally:
        late.stop()


def test_reset_after_a_post_is_not_resent_but_a_get_is_retried(server):
    server.faults.append("reset")
    with pytest.raises(ConnectionLost, match="dropped the connection during POST"):
        call(HttpClient(server.url, HttpSettings(retry=FAST_RETRY)), "POST", GEN, BODY)
    assert len(server.generations) == 1

    server.faults.append("models:reset")
    response = call(HttpClient(server.url, HttpSettings(retry=FAST_RETRY)), "GET", "/v1/models")
    assert response.data["data"][0]["pipeline_name"] == "ErnieImagePipeline"
    assert sum(1 for r in server.received if r.path == "/v1/models") == 2


@pytest.mark.parametrize("status", ["503", "429", "408"])
def test_busy_statuses_are_retried_with_backoff(server, status):
    server.faults.extend([status, status])
    response = call(HttpClient(server.url, HttpSettings(retry=FAST_RETRY)), "POST", GEN, BODY)
    assert response.status == 200 and response.data["data"][0]["b64_json"]
    assert len(server.generations) == 3


def test_busy_status_gives_up_after_the_bounded_attempts(server):
    server.faults.extend(["503"] * 5)
    with pytest.raises(ServerUnavailable, match=r"not ready or overloaded \(HTTP 503\)"):
        call(HttpClient(server.url, HttpSettings(retry=FAST_RETRY)), "POST", GEN, BODY)
    assert len(server.generations) == 3


def test_4xx_shows_the_servers_own_message(server):
    with pytest.raises(ServerRejected, match=r"HTTP 422\): prompt: Field required"):
        call(HttpClient(server.url), "POST", GEN, {"size": "64x64"})
    with pytest.raises(ServerRejected, match=r"HTTP 400\): seed must be a non-negative int"):
        call(HttpClient(server.url), "POST", GEN, {**BODY, "seed": -1})
    assert len(server.generations) == 2, "4xx answers are not retried"


def test_bare_500_is_explained(server):
    server.faults.append("500")
    with pytest.raises(ServerFailed) as caught:
        call(HttpClient(server.url, HttpSettings(retry=FAST_RETRY)), "POST", GEN, BODY)
    assert "the server failed to generate; see the server log" in str(caught.value)
    assert len(server.generations) == 1

    server.faults.append("500_json")
    with pytest.raises(ServerFailed, match="CUDA out of memory"):
        call(HttpClient(server.url), "POST", GEN, BODY)


def test_garbage_json_is_rejected(server):
    server.faults.append("garbage")
    with pytest.raises(BadResponse, match="not JSON.*right server URL"):
        call(HttpClient(server.url), "POST", GEN, BODY)


def test_huge_body_is_refused_over_the_cap(server):
    server.faults.append("huge")
    started = time.monotonic()
    with pytest.raises(BadResponse, match="more than 1 MiB; refused"):
        call(HttpClient(server.url, HttpSettings(max_body_bytes=1024 * 1024)), "POST", GEN, BODY)
    assert time.monotonic() - started < 5


def test_cancel_returns_at_once_while_the_server_hangs(server):
    server.faults.append("hang")
    cancelled_at: list[float] = []

    def should_cancel() -> bool:  # the user cancels once the server holds the request
        if server.generations and not cancelled_at:
            cancelled_at.append(time.monotonic())
        return bool(cancelled_at)

    with pytest.raises(Cancelled):
        call(HttpClient(server.url), "POST", GEN, BODY, cancel=should_cancel)
    assert time.monotonic() - cancelled_at[0] < PROMPTLY_S, "back at the Cancel, not when the server answers"


def test_host_check_cancel_works_as_the_cancel_callable(server):
    from ernie_image.runtime.core.host import NullHost

    host = NullHost()
    server.faults.append("hang")
    cancelled = do_when(lambda: server.generations, lambda: press_cancel(host))
    with pytest.raises(Cancelled):
        call(HttpClient(server.url), "POST", GEN, BODY, cancel=host.check_cancel)
    assert time.monotonic() - cancelled.result(WAIT_S) < PROMPTLY_S


SECRET = "sk-test-very-secret-123"


def bound(url: str, env_var: str | None = None, file: str | None = None) -> Credential:
    """The credential a user binds to the server at `url` (here as the CLI's key flags bind one)."""
    credential = Credentials.bound_to([url], env_var, file, env_flag="--api-key-env",
                                      file_flag="--api-key-file").for_server(url)
    assert credential is not None
    return credential


def test_api_key_is_sent_as_bearer_and_never_shown(monkeypatch, tmp_path):
    monkeypatch.setenv("ERNIE_TEST_KEY", SECRET)
    with FakeSglang(api_key=SECRET) as server:
        client = HttpClient(server.url, HttpSettings(credential=bound(server.url, "ERNIE_TEST_KEY")))
        assert SECRET not in repr(client)
        call(client, "GET", "/v1/models")
        assert server.received[-1].headers["Authorization"] == f"Bearer {SECRET}"

        key_file = tmp_path / "key.txt"
        key_file.write_text(SECRET + "\n")
        call(HttpClient(server.url, HttpSettings(credential=bound(server.url, file=str(key_file)))), "GET",
             "/v1/models")
        assert server.received[-1].headers["Authorization"] == f"Bearer {SECRET}"

        with pytest.raises(AuthenticationError) as missing:
            call(HttpClient(server.url), "GET", "/v1/models")
        assert "HTTP 401" in str(missing.value) and "asks for an API key (HTTP 401): no key is bound to it: add" in str(missing.value)
        assert f'"origin": "{server.url}"' in str(missing.value) and "to the keys file" in str(missing.value)

        monkeypatch.setenv("ERNIE_TEST_KEY", "wrong-" + SECRET)
        with pytest.raises(AuthenticationError) as wrong:
            call(HttpClient(server.url, HttpSettings(credential=bound(server.url, "ERNIE_TEST_KEY"))), "GET",
                 "/v1/models")
        assert "HTTP 403" in str(wrong.value) and "--api-key-env ERNIE_TEST_KEY" in str(wrong.value)
        assert SECRET not in str(wrong.value)


def test_a_key_goes_to_its_own_origin_only_and_never_after_a_redirect(monkeypatch):
    monkeypatch.setenv("ERNIE_TEST_KEY_HTTP", "sk-http-redirect")
    with FakeSglang() as elsewhere, FakeSglang() as server:
        credential = bound(server.url, "ERNIE_TEST_KEY_HTTP")
        with pytest.raises(InvalidInputError, match=f"is bound to {server.url}, so it is not sent to "
                                                    f"{elsewhere.url}: bind a key to {elsewhere.url}"):
            HttpClient(elsewhere.url, HttpSettings(credential=credential))
        server.redirect_to = elsewhere.url
        with pytest.raises(BadResponse, match=r"redirected GET .* \(HTTP 307\); redirects are not followed"):
            call(HttpClient(server.url, HttpSettings(credential=credential)), "GET", "/v1/models")
    assert elsewhere.wire == [], "nothing reached the other server, least of all the key"
    assert [dict(r.headers)["Authorization"] for r in server.wire] == ["Bearer sk-http-redirect"]


def test_the_client_raises_the_errors_of_errors_py():
    from ernie_image.runtime.net import client, error_answers

    for module in (client, error_answers):
        for name in ("AuthenticationError", "BadResponse", "ConnectionLost", "ServerFailed", "ServerRejected",
                     "ServerUnavailable", "TlsHandshakeFailed"):
            assert getattr(module, name, getattr(errors, name)) is getattr(errors, name)
    assert Origin.of("http://127.0.0.1:1") == Origin("http", "127.0.0.1", 1)


def test_unset_key_variable_and_unreadable_key_file_are_clear(monkeypatch, tmp_path):
    monkeypatch.delenv("ERNIE_UNSET_KEY", raising=False)
    with pytest.raises(AuthenticationError, match="ERNIE_UNSET_KEY .* is not set"):
        ApiKeySource(env_var="ERNIE_UNSET_KEY").read()
    with pytest.raises(AuthenticationError, match="cannot read the API key file"):
        ApiKeySource(file=str(tmp_path / "missing")).read()


def test_credentials_in_the_url_are_refused_without_showing_them():
    with pytest.raises(InvalidInputError, match="holds a user name or password") as caught:
        HttpClient("http://alice:pw1234@127.0.0.1:1")
    assert "alice" not in str(caught.value) and "pw1234" not in str(caught.value)


def test_a_post_goes_out_on_a_fresh_connection_and_a_get_reuses_one(server):
    """A pooled connection the server closed meanwhile would make a POST's failure ambiguous (sent or not?)."""
    client = HttpClient(server.url)

    async def go():
        try:
            for _ in range(2):
                await client.request_json("GET", "/health")
            await client.request_json("POST", GEN, BODY)
            await client.request_json("POST", GEN, BODY)
        finally:
            await client.close()
    run_sync(go())
    ports = {r.path: set() for r in server.received}
    for r in server.received:
        ports[r.path].add(r.peer_port)
    assert len(ports["/health"]) == 1 and len(ports[GEN]) == 2


def test_https_to_a_plain_http_server_is_a_tls_setup_error_at_once(server):
    retries: list[int] = []

    class RecordingRetry(RetryPolicy):
        def delay(self, attempt: int, retry_after: Optional[float] = None) -> float:
            retries.append(attempt)
            return 0.01

    client = HttpClient(server.url.replace("http://", "https://"), HttpSettings(retry=RecordingRetry(attempts=3)))
    with pytest.raises(TlsHandshakeFailed) as caught:
        call(client, "GET", "/health")
    assert retries == [], "a failed handshake is not retried"
    message = str(caught.value)
    assert "\n" not in message and "TLS handshake failed (wrong version number)" in message
    assert "use http:// if the server speaks plain HTTP" in message and "operation not permitted" not in message
