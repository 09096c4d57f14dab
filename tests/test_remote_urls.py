"""Server URLs: every malformed one is one line naming the fix, credentials are never shown, a base path is exact."""
from __future__ import annotations

import pytest

from ernie_image.runtime.core.errors import InvalidInputError
from ernie_image.runtime.net.urls import normalize_base_url, shown_url
from ernie_image.runtime.remote.server_check import check_remote
from ernie_image.runtime.remote.sglang import SglangClient

from fake_sglang import FakeSglang


@pytest.mark.parametrize("url, shown", [
    ("http://user:s3cret@host:30000/x", "http://***@host:30000/x"),
    ("https://tok@host", "https://***@host"),
    ("user:s3cret@host:30000", "***@host:30000"),
    ("http://host:1/v1?token=s3cret&x=1#frag", "http://host:1/v1?token=***&x=***"),
    ("http://host:1/?s3cret", "http://host:1/?***"),
    ("http://a:b@c:d@host:1", "http://***@host:1"),
    ("http://host:1/p@th", "http://host:1/p@th"),
    ("http://ho\nst:1", "http://ho_st:1"),
])
def test_shown_url_hides_credentials_and_query_values(url, shown):
    assert shown_url(url) == shown


@pytest.mark.parametrize("url, expected", [
    ("", "empty server URL"),
    ("   ", "empty server URL"),
    ("http://127.0.0.1:99999", "port 99999, out of range: use 1..65535"),
    ("http://127.0.0.1:0", "port 0, out of range"),
    ("http://127.0.0.1:abc", "port 'abc', which is not a number"),
    ("http://127.0.0.1:30000x", "port '30000x', which is not a number"),
    ("http://127.0.0.1:", "ends in ':' without a port"),
    ("ftp://127.0.0.1:30000", "has the scheme 'ftp': use http:// or https://"),
    ("//127.0.0.1:30000", "has no usable scheme"),
    ("http:/127.0.0.1:30000", "has no usable scheme"),
    ("http://:30000", "has no host name"),
    ("http://", "has no host name"),
    ("http://[::1", "cannot be read as a URL"),
    ("http://gpu box:30000", "has a space or control character"),
    ("http://127.0.0.1:30000/?token=abc", "has a query or fragment"),
    ("http://bob:s3cret@127.0.0.1:30000", "holds a user name or password"),
])
def test_every_malformed_url_is_one_line_never_a_traceback(url, expected):
    with pytest.raises(InvalidInputError) as caught:
        SglangClient(url)
    message = str(caught.value)
    assert expected in message and "\n" not in message
    assert "s3cret" not in message and "token=abc" not in message and "bob" not in message


@pytest.mark.parametrize("url, base", [
    ("http://127.0.0.1:30000", "http://127.0.0.1:30000"),
    ("127.0.0.1:30000/", "http://127.0.0.1:30000"),
    ("localhost:30000", "http://localhost:30000"),
    ("HTTPS://gpu-box", "https://gpu-box"),
    ("http://[::1]:30000", "http://[::1]:30000"),
    ("http://gateway:8080/sglang/", "http://gateway:8080/sglang"),
])
def test_good_urls_become_the_base_requests_are_built_on(url, base):
    assert normalize_base_url(url) == base


@pytest.mark.parametrize("suffix", ["/v1", "/v1/", "/v1/images/generations", "/health", "/v1/models"])
def test_a_base_url_ending_in_an_endpoint_path_names_the_url_to_give(suffix):
    with pytest.raises(InvalidInputError) as caught:
        SglangClient(f"http://127.0.0.1:30000{suffix}")
    message = str(caught.value)
    assert message.endswith("give the server's base URL http://127.0.0.1:30000")
    assert f"the server would see http://127.0.0.1:30000{suffix.rstrip('/')}" in message


def test_a_proxy_prefix_is_kept_and_errors_name_the_full_url_the_server_saw():
    """A base path is sent as is; when the server has nothing there, the message names that very URL."""
    with FakeSglang() as server:
        rows = check_remote([f"{server.url}/sglang"], generate=False)
        paths = [r.path for r in server.received]
    assert paths == ["/sglang/health"]
    assert f"answers HTTP 404 on GET {server.url}/sglang/health: not an SGLang server" in rows[0].problems[0]


def test_check_remote_rows_never_show_credentials():
    rows = check_remote(["http://bob:s3cret@127.0.0.1:30000", "http://127.0.0.1:99999"], generate=False)
    assert rows[0].url == "http://***@127.0.0.1:30000" and rows[0].readiness == "bad URL"
    assert "out of range" in rows[1].problems[0]
    assert "s3cret" not in repr(rows) and "bob" not in repr(rows)
