"""`ernie-image generate --server URL` (a fleet when repeated) and `check-remote`, in-process against loopback servers.

The same request semantics and one-line errors as a local generation: every bad value exits 2 before any network
work (the servers receive nothing), the PNGs carry the same metadata plus the servers that made them.
"""
from __future__ import annotations

import json
import signal
import socket
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest
from PIL import Image

from ernie_image.runtime.cli.commands import main
from ernie_image.runtime.cli.parser import OneLineParser
from ernie_image.runtime.cli.remote_args import add_remote_arguments, remote_pipe_from_args

from fake_sglang import FakeSglang, dead_url
from test_cli import ANOTHER_COMMAND_WRITES, _Run, _env, another_command_writes
from test_enhancer_remote import ChatServer
from waiting import PROMPTLY_S


def png_settings(path: Path) -> dict:
    with Image.open(path) as image:
        return json.loads(image.text["ernie-image"])


def one_line_error(capsys) -> str:
    lines = [line for line in capsys.readouterr().err.strip().splitlines()
             if not line.startswith("no --prompt given: the example prompt")]
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


def test_generate_on_a_fleet_writes_the_batch_with_the_turbo_defaults_of_the_served_model(capsys, tmp_path):
    out = tmp_path / "fox.png"
    with FakeSglang(service_time_s=0.05) as a, FakeSglang(service_time_s=0.05) as b:
        code = main(["generate", "--server", a.url, "--server", b.url, "--prompt", "a fox", "--width", "256",
                     "--height", "320", "--batch", "3", "--seed", "5", "--out", str(out)])
        sent = [g.body for server in (a, b) for g in server.generations]
    captured = capsys.readouterr()
    assert code == 0, captured.err
    paths = [Path(line) for line in captured.out.split()]
    assert paths == [tmp_path / f"fox_{i}.png" for i in range(3)]
    assert sorted(body["seed"] for body in sent) == [5, 6, 7]
    assert {(body["num_inference_steps"], body["guidance_scale"]) for body in sent} == {(8, 1.0)}
    assert "the servers serve baidu/ERNIE-Image-Turbo: defaults of ERNIE-Image Turbo (8 steps, CFG 1)" in captured.err
    settings = png_settings(paths[1])
    assert settings["backend"] == "remote" and settings["batch_index"] == 1 and settings["variant"] == "turbo"
    assert (settings["width"], settings["height"], settings["steps"], settings["seed"]) == (256, 320, 8, 5)
    assert set(settings["servers"]) <= {a.url, b.url}
    with Image.open(paths[0]) as image:
        assert image.size == (256, 320)


@pytest.mark.parametrize("batch, said", [("1", "1 image 256x256 in "), ("2", "2 images 256x256 in ")])
def test_the_run_line_counts_the_images_in_words_that_read_right(capsys, tmp_path, batch, said):
    with FakeSglang() as server:
        code = main(["generate", "--server", server.url, "--prompt", "a fox", "--width", "256", "--height", "256",
                     "--batch", batch, "--out", str(tmp_path / "fox.png")])
    err = capsys.readouterr().err
    assert code == 0, err
    assert any(line.startswith(said) for line in err.splitlines()), err


@pytest.mark.parametrize("when", ANOTHER_COMMAND_WRITES)
def test_an_output_another_command_wrote_during_the_run_is_replaced_with_a_notice(capsys, tmp_path, monkeypatch, when):
    from ernie_image.runtime.remote.backend import RemotePipe

    out = tmp_path / "fox.png"
    another_command_writes(when, out, RemotePipe, monkeypatch)
    with FakeSglang(service_time_s=0.01) as server:
        code = main(["generate", "--server", server.url, "--prompt", "a fox", "--width", "256", "--height", "256",
                     "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 0, err
    assert f"{out} changed while this command ran (another command writing the same output?)" in err, err
    assert png_settings(out)["backend"] == "remote"


def test_a_base_model_gets_the_base_defaults_and_given_values_win(capsys, tmp_path):
    with FakeSglang(model_id="baidu/ERNIE-Image") as server:
        assert main(["generate", "--server", server.url, "--width", "256", "--height", "256",
                     "--out", str(tmp_path / "a.png")]) == 0
        assert main(["generate", "--server", server.url, "--width", "256", "--height", "256", "--steps", "3",
                     "--cfg", "2.5", "--out", str(tmp_path / "b.png")]) == 0
        sent = [(g.body["num_inference_steps"], g.body["guidance_scale"]) for g in server.generations]
    assert sent == [(50, 4.0), (3, 2.5)]
    assert sum(r.path == "/v1/models" for r in server.received) == 2, "asked only when steps or CFG are not given"


@pytest.mark.parametrize("extra, expected", [
    (["--read-timeout", "nan"], "--read-timeout 'nan' is not a number of seconds: give e.g. 30"),
    (["--read-timeout", "0"], "--read-timeout 0 is not allowed"),
    (["--read-timeout", "-5"], "--read-timeout -5 is not allowed"),
    (["--connect-timeout", "inf"], "--connect-timeout 'inf' is not a number of seconds"),
    (["--connect-timeout", "1e999"], "--connect-timeout '1e999' is not allowed: give a finite number of seconds, "
                                     "more than 0"),
    (["--connect-timeout", "soon"], "--connect-timeout 'soon' is not a number of seconds"),
    (["--wait-for-servers", "-1"], "--wait-for-servers -1 is not allowed: give a finite number of seconds, 0 or more"),
    (["--width", "1000"], "width 1000 is not allowed: ERNIE-Image needs a multiple of 16 between 256 and 4096; "
                          "use 1008"),
    (["--width", "8"], "width 8 is not allowed"),
    (["--steps", "0"], "steps 0 is not allowed"),
    (["--cfg", "nan"], "--cfg 'nan' is not a number"),
    (["--server", "http://127.0.0.1:99999"], "--server 'http://127.0.0.1:99999' has the port 99999, out of range"),
    (["--server", "http://bob:pw99@127.0.0.1:1"], "--server 'http://***@127.0.0.1:1' holds a user name or password"),
    (["--server", "ftp://127.0.0.1:1"], "has the scheme 'ftp'"),
    (["--model-dir", "/tmp"], "--model-dir is for a local model, but --server sends the work to SGLang servers"),
    (["--quant", "fp8"], "--quant is for a local model"),
    (["--api-key-env", "sk-pasted-0123456789"], "--api-key-env must be the NAME of an environment variable"),
    (["--pe-model", "pe"], "--pe-model is for the PE chat server: give its URL with --pe-url"),
    (["--pe-url", "http://127.0.0.1:0", "--use-pe"], "--pe-url 'http://127.0.0.1:0' has the port 0, out of range"),
    (["--pe-url", "http://127.0.0.1:1"], "--pe-url revises the prompt only with --use-pe: add --use-pe, or drop --pe-url"),
    (["--pe-url", "http://127.0.0.1:1", "--use-pe", "--pe-timeout", "0"], "--pe-timeout 0 is not allowed"),
    (["--pe-timeout", "5"], "--pe-timeout is for the PE chat server: give its URL with --pe-url"),
])
def test_every_bad_value_is_one_line_and_exit_2_before_any_network_work(capsys, tmp_path, extra, expected):
    with FakeSglang() as server:
        code = main(["generate", "--server", server.url, "--width", "256", "--height", "256",
                     "--out", str(tmp_path / "x.png"), *extra])
        assert server.received == [], "nothing was sent"
    assert code == 2
    assert expected in one_line_error(capsys)
    assert list(tmp_path.iterdir()) == []


def test_a_v1_base_url_names_the_url_to_give(capsys, tmp_path):
    assert main(["generate", "--server", "http://127.0.0.1:30000/v1", "--out", str(tmp_path / "x.png")]) == 2
    assert one_line_error(capsys).endswith("give the server's base URL http://127.0.0.1:30000")


@pytest.mark.parametrize("flag, value", [("--read-timeout", "30"), ("--api-key-file", "/etc/hostname"),
                                         ("--resend-unanswered", None), ("--connect-timeout", "3")])
def test_server_options_without_a_server_are_refused(capsys, tmp_path, flag, value):
    argv = ["generate", "--out", str(tmp_path / "x.png"), flag] + ([value] if value is not None else [])
    assert main(argv) == 2
    line = one_line_error(capsys)
    assert f"{flag} is for SGLang servers: give one with --server URL" in line
    assert ("--pe-api-key-env" in line) == flag.startswith("--api-key"), line  # the PE's key options for keys only


def test_the_options_reach_the_pipe():
    parser = OneLineParser()
    add_remote_arguments(parser)
    args = parser.parse_args(["--server", "http://a:1", "--server", "http://b:2", "--read-timeout", "900",
                              "--connect-timeout", "2.5", "--wait-for-servers", "0", "--resend-unanswered"])
    for name, default in (("model_dir", None), ("quant", "none"), ("dtype", "auto"), ("device", "auto"),
                          ("budget", "auto"), ("dit", None), ("text_encoder", None), ("vae", None),
                          ("tokenizer", None), ("pe", None)):
        setattr(args, name, default)
    pipe = remote_pipe_from_args(args)
    assert pipe is not None and pipe.urls == ["http://a:1", "http://b:2"]
    settings = pipe.settings
    assert (settings.read_timeout_base_s, settings.connect_timeout_s, settings.wait_for_servers_s) == (900.0, 2.5, 0.0)
    assert settings.resend_unanswered is True and settings.pe_endpoint is None


def test_pe_url_revises_the_prompt_before_a_remote_generation(capsys, tmp_path):
    with ChatServer() as chat, FakeSglang() as server:
        code = main(["generate", "--server", server.url, "--pe-url", chat.url, "--use-pe", "--prompt", "a fox",
                     "--width", "256", "--height", "256", "--seed", "3", "--out", str(tmp_path / "x.png")])
        sent = server.generations[0].body
    assert code == 0, capsys.readouterr().err
    assert sent["prompt"] == "revised: a fox @3" and sent["use_pe"] is False
    assert png_settings(tmp_path / "x.png")["prompts_used"] == ["revised: a fox @3"]


def test_pe_url_serves_a_local_generation_too(capsys, tmp_path, tiny_turbo_folder):
    with ChatServer() as chat:
        code = main(["generate", "--model-dir", str(tiny_turbo_folder), "--pe-url", chat.url, "--use-pe",
                     "--prompt", "a fox", "--width", "256", "--height", "256", "--steps", "1", "--seed", "4",
                     "--out", str(tmp_path / "x.png")])
        asked = len(chat.received)
    assert code == 0, capsys.readouterr().err
    assert asked == 1 and png_settings(tmp_path / "x.png")["prompts_used"] == ["revised: a fox @4"]


CLI_KEY = "sk-cli-bound-0123456789"
PE_KEY = "sk-cli-pe-9876543210"


def authorization_headers(*servers: FakeSglang) -> set[str]:
    return {dict(request.headers).get("Authorization", "") for server in servers for request in server.wire}


def test_the_key_flags_bind_a_key_to_the_servers_of_that_command_line_and_no_other(capsys, tmp_path, monkeypatch,
                                                                                  keys_file_of_this_test):
    monkeypatch.setenv("ERNIE_TEST_CLI_KEY", CLI_KEY)
    (tmp_path / "pe.key").write_text(PE_KEY)
    written = keys_file_of_this_test
    written.parent.mkdir(parents=True)
    written.write_text("{not json")  # the flags win: the keys file is not even read
    with FakeSglang(api_key=CLI_KEY) as first, FakeSglang(api_key=CLI_KEY) as second, \
            ChatServer(api_key=PE_KEY) as chat:
        code = main(["generate", "--server", first.url, "--server", second.url, "--api-key-env", "ERNIE_TEST_CLI_KEY",
                     "--pe-url", chat.url, "--pe-api-key-file", str(tmp_path / "pe.key"), "--use-pe", *TURBO,
                     "--batch", "2", "--out", str(tmp_path / "x.png")])
        err = capsys.readouterr().err
        assert code == 0, err
        assert authorization_headers(first, second) == {f"Bearer {CLI_KEY}"}
        assert {headers["Authorization"] for headers in chat.headers} == {f"Bearer {PE_KEY}"}, "the PE's own key"
        code = main(["enhance", "--pe-url", chat.url, "--prompt", "a fox", "--api-key-env", "ERNIE_TEST_CLI_KEY"])
    assert code == 2 and "HTTP 401" in one_line_error(capsys), "enhance's --api-key-env is the PE server's key"


def test_without_key_flags_the_keys_file_gives_each_server_the_key_bound_to_it(capsys, tmp_path, monkeypatch,
                                                                               keys_file):
    monkeypatch.setenv("ERNIE_TEST_CLI_KEY", CLI_KEY)
    with FakeSglang(api_key=CLI_KEY) as bound, FakeSglang() as unbound, ChatServer(api_key=PE_KEY) as chat:
        keys_file({"label": "gpu", "origin": bound.url, "env": "ERNIE_TEST_CLI_KEY"},
                  {"label": "pe", "origin": chat.url, "key": PE_KEY})
        code = main(["check-remote", bound.url, unbound.url, "--no-generate"])
        assert code == 0, capsys.readouterr()
        assert authorization_headers(bound) == {f"Bearer {CLI_KEY}"} and authorization_headers(unbound) == {""}
        code = main(["generate", "--server", bound.url, "--pe-url", chat.url, "--use-pe", *TURBO,
                     "--out", str(tmp_path / "x.png")])
        err = capsys.readouterr().err
        assert code == 0, err
        assert {headers["Authorization"] for headers in chat.headers} == {f"Bearer {PE_KEY}"}
        assert main(["enhance", "--pe-url", chat.url, "--prompt", "a fox", "--quiet"]) == 0
    assert PE_KEY not in capsys.readouterr().out


def test_a_broken_keys_file_is_one_line_naming_it_before_anything_is_sent(capsys, tmp_path, keys_file_of_this_test):
    keys_file_of_this_test.parent.mkdir(parents=True)
    keys_file_of_this_test.write_text('{"credentials": [{"label": "gpu"}]}')
    with FakeSglang() as server:
        code = main(["generate", "--server", server.url, *TURBO, "--out", str(tmp_path / "x.png")])
        assert server.wire == []
    assert code == 2 and one_line_error(capsys) == (
        f"error: an origin is missing or not text: write it as scheme://host:port, e.g. http://gpu-box:30000 (entry 1 "
        f"of the keys file {keys_file_of_this_test})")


def test_a_dead_fleet_fails_in_one_line_naming_each_server(capsys, tmp_path):
    first, second = dead_url(), dead_url()
    code = main(["generate", "--server", first, "--server", second, "--wait-for-servers", "0",
                 "--steps", "8", "--cfg", "1", "--width", "256", "--height", "256", "--out", str(tmp_path / "x.png")])
    assert code == 2
    assert one_line_error(capsys) == (
        f"error: no server could take the image: {first}: nothing is listening there (connection "
        f"refused); {second}: nothing is listening there (connection refused): start or fix the servers, check the "
        f"URLs, or give a server that is still loading time with --wait-for-servers SECONDS")
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------------------- check-remote
@pytest.mark.parametrize("flag, value, said", [
    ("--connect-timeout", "0", "--connect-timeout 0 is not allowed"),
    ("--connect-timeout", "-1", "--connect-timeout -1 is not allowed"),
    ("--read-timeout", "0", "--read-timeout 0 is not allowed"),
    ("--read-timeout", "1e999", "--read-timeout '1e999' is not allowed"),
])
def test_check_remote_refuses_timeouts_that_cannot_work(capsys, flag, value, said):
    assert main(["check-remote", "http://127.0.0.1:1", flag, value]) == 2
    assert said in one_line_error(capsys)


@pytest.mark.parametrize("flag, value", [("--connect-timeout", "nan"), ("--read-timeout", "inf"),
                                         ("--read-timeout", "3_0"), ("--connect-timeout", " 5")])
def test_check_remote_refuses_timeouts_that_are_not_plain_numbers(capsys, flag, value):
    assert main(["check-remote", "http://127.0.0.1:1", flag, value]) == 2
    assert f"{flag} {value!r} is not a number of seconds: give e.g. 30 (an optional sign, digits" in one_line_error(capsys)


def test_check_remote_advice_names_an_option_it_has(capsys):
    """A slow tiny generation says to raise the read timeout, and check-remote has --read-timeout."""
    with FakeSglang(service_time_s=1.0) as server:
        assert main(["check-remote", server.url, "--read-timeout", "0.3"]) == 1
    out = capsys.readouterr().out
    assert "within 0.3 s (read timeout)" in out and "raise --read-timeout" in out
    with FakeSglang() as server:
        assert main(["check-remote", server.url, "--read-timeout", "30", "--connect-timeout", "2"]) == 0


# ------------------------------------------------------------------------ a server that is not there
TURBO = ["--steps", "8", "--cfg", "1", "--width", "256", "--height", "256"]


@contextmanager
def unaccepting_server() -> Iterator[str]:
    """A port whose backlog is full: the kernel drops new connection attempts, so a connect hangs (a host that
    went away, a firewall that drops)."""
    with socket.socket() as listener, socket.socket() as filler:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)  # room for one connection not yet accepted: the filler's
        filler.connect(listener.getsockname())
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"


@contextmanager
def silent_server() -> Iterator[str]:
    """A port that accepts connections (in the kernel) and never answers a request: a hung server."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"


def test_a_dead_server_is_one_line_naming_it_the_cause_and_the_fix(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("ERNIE_TEST_KEY", "sk-never-shown-7781")
    url = dead_url()
    code = main(["generate", "--server", url, "--wait-for-servers", "0", "--api-key-env", "ERNIE_TEST_KEY",
                 "--out", str(tmp_path / "x.png")])
    assert code == 2  # the exit code of every error the user can act on
    assert one_line_error(capsys) == (
        f"error: {url}: nothing is listening there (connection refused): start the server, check the URL, or give "
        f"a server that is still loading time with --wait-for-servers SECONDS")
    assert list(tmp_path.iterdir()) == []


def test_after_a_wait_the_line_says_how_long_and_to_wait_longer(capsys, tmp_path):
    url = dead_url()
    assert main(["generate", "--server", url, "--wait-for-servers", "1", *TURBO, "--out", str(tmp_path / "x.png")]) == 2
    assert one_line_error(capsys) == (
        f"error: {url}: nothing is listening there (connection refused), still after 1 s: start the server, check "
        f"the URL, or wait longer with --wait-for-servers SECONDS")


def test_a_host_name_that_does_not_resolve_is_named_so(capsys, tmp_path):
    assert main(["generate", "--server", "http://no-such-host.invalid:30000", "--wait-for-servers", "0", *TURBO,
                 "--out", str(tmp_path / "x.png")]) == 2
    assert one_line_error(capsys).startswith(
        "error: http://no-such-host.invalid:30000: no such host (the name does not resolve): start the server, "
        "check the URL")


@pytest.mark.parametrize("server, cause", [
    (unaccepting_server, "no answer within 1 s (the connection was not accepted or /health not answered): start the "
                         "server"),
    (silent_server, "no answer within 1 s (the connection was not accepted or /health not answered): start the server"),
    (lambda: _closed_port(), "nothing is listening there (connection refused), still after 1 s"),
], ids=["connection not accepted", "accepted, never answered", "connection refused"])
def test_the_wait_ends_at_its_deadline_whatever_the_server_does(capsys, tmp_path, server, cause):
    """A connection attempt may take 30 s here (--connect-timeout 30) and a /health answer is awaited 10 s: a look
    under way is cut at the 1 s deadline."""
    with server() as url:
        started = time.monotonic()
        code = main(["generate", "--server", url, "--wait-for-servers", "1", "--connect-timeout", "30", *TURBO,
                     "--out", str(tmp_path / "x.png")])
        elapsed = time.monotonic() - started
    assert code == 2 and 1.0 <= elapsed < 1.0 + PROMPTLY_S, f"{elapsed:.2f} s"
    assert one_line_error(capsys).startswith(f"error: {url}: {cause}")


def test_wait_zero_still_hears_a_first_answer_but_not_for_long(capsys, tmp_path):
    with silent_server() as url:
        started = time.monotonic()
        assert main(["generate", "--server", url, "--wait-for-servers", "0", *TURBO,
                     "--out", str(tmp_path / "x.png")]) == 2
        elapsed = time.monotonic() - started
    assert elapsed < 1.0 + PROMPTLY_S, f"{elapsed:.2f} s: a first look gets 1 s, not the 10 s a /health answer gets"
    assert "no answer within 1 s" in one_line_error(capsys)
    with FakeSglang() as server:  # a working server answers at once: wait 0 takes it
        assert main(["generate", "--server", server.url, "--wait-for-servers", "0", *TURBO,
                     "--out", str(tmp_path / "x.png")]) == 0


@contextmanager
def _closed_port() -> Iterator[str]:
    yield dead_url()


def test_ctrl_c_while_waiting_for_servers_prints_cancelled_without_a_blank_line(tmp_path):
    """The waiting line, then `cancelled` on the next line: the blank line was for a progress line never opened."""
    url = dead_url()
    run = _Run(["generate", "--server", url, "--prompt", "a fox", "--wait-for-servers", "600", "--out",
                str(tmp_path / "x.png")],
               _env(tmp_path / "cache"), tmp_path)
    run.wait_for(b"waiting for")
    run.process.send_signal(signal.SIGINT)
    code, _ = run.finish()
    err = run.err.decode()
    assert code == 130, err
    assert err == (f"waiting for {url}: refused (nothing listening: not started, loading its weights, or dead), 0 s "
                   f"(up to 600 s; cancelling the run stops the wait)\ncancelled\n")
    assert list(tmp_path.iterdir()) == [tmp_path / "site"]  # the test's own package link: no PNG, no cache


def test_a_live_and_a_dead_server_tell_the_dead_one_once_and_finish(capsys, tmp_path):
    dead = dead_url()
    with FakeSglang() as live:
        assert main(["generate", "--server", dead, "--server", live.url, *TURBO, "--batch", "2",
                     "--out", str(tmp_path / "x.png")]) == 0
    err = capsys.readouterr().err
    about_dead = [line for line in err.splitlines() if line.startswith(dead)]
    assert about_dead == [f"{dead} refused the connection: nothing is listening there; the server is not running or "
                          f"still loading its weights; images go to {live.url} meanwhile"], err


def test_a_fleet_with_a_server_answering_500_to_every_image_saves_the_whole_batch(capsys, tmp_path):
    with FakeSglang(service_time_s=0.02) as live, FakeSglang(every_post="500") as broken:
        code = main(["generate", "--server", live.url, "--server", broken.url, *TURBO, "--batch", "6",
                     "--out", str(tmp_path / "x.png")])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert [Path(p) for p in captured.out.split()] == [tmp_path / f"x_{i}.png" for i in range(6)]
    about = [line for line in captured.err.splitlines() if broken.url in line and not line.startswith(" ")]
    assert len(about) == 1 and about[0].startswith(f"giving up on {broken.url} for this batch: ") and \
        "HTTP 500" in about[0], captured.err


def test_https_to_a_plain_http_server_is_one_line_at_once_with_the_default_wait(capsys, tmp_path):
    with FakeSglang() as plain:
        url = plain.url.replace("http://", "https://")
        started = time.monotonic()
        code = main(["generate", "--server", url, *TURBO, "--out", str(tmp_path / "x.png")])
        elapsed = time.monotonic() - started
        sent = plain.generations
    line = one_line_error(capsys)
    assert code == 2 and elapsed < PROMPTLY_S, f"rc {code} after {elapsed:.1f} s, not the 600 s wait"
    assert line == (f"error: {url}: the TLS handshake failed (wrong version number): use http:// if the server "
                    f"speaks plain HTTP, or check its certificate"), line
    assert sent == [] and not list(tmp_path.iterdir())


def test_a_fleet_with_one_https_url_to_a_plain_server_goes_on_with_the_other(capsys, tmp_path):
    with FakeSglang() as plain, FakeSglang() as live:
        url = plain.url.replace("http://", "https://")
        assert main(["generate", "--server", url, "--server", live.url, *TURBO, "--batch", "2",
                     "--out", str(tmp_path / "x.png")]) == 0
    about = [line for line in capsys.readouterr().err.splitlines() if line.startswith(f"giving up on {url}")]
    assert len(about) == 1 and "TLS handshake failed" in about[0], about


# ------------------------------------------------------------------------------ check-remote: bad URLs
@pytest.mark.parametrize("url, expected", [
    ("http://a b:1", "error: URL 'http://a b:1' has a space or control character: give one like "
                     "http://127.0.0.1:30000"),
    ("ftp://127.0.0.1:1", "error: URL 'ftp://127.0.0.1:1' has the scheme 'ftp': use http:// or https://"),
    ("http://127.0.0.1:99999", "error: URL 'http://127.0.0.1:99999' has the port 99999, out of range: use 1..65535"),
    ("http://bob:pw99@127.0.0.1:1", "error: URL 'http://***@127.0.0.1:1' holds a user name or password"),
])
def test_check_remote_refuses_a_malformed_url_as_a_usage_error_before_asking_any_server(capsys, url, expected):
    with FakeSglang() as good:
        assert main(["check-remote", good.url, url]) == 2
        assert good.received == [], "no server is asked when one URL is malformed"
    line = one_line_error(capsys)
    assert line.startswith(expected) and "pw99" not in line
    assert capsys.readouterr().out == ""


# ------------------------------------------------------------------------ a web server that is not SGLang
@contextmanager
def plain_web_server(folder: Path) -> Iterator[str]:
    """`python3 -m http.server`: answers every unknown path, /health too, with HTTP 404 and an HTML page."""
    import functools
    import threading
    from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

    class QuietHandler(SimpleHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(QuietHandler, directory=str(folder)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_a_web_server_that_is_not_sglang_is_one_line_saying_so_without_its_html(capsys, tmp_path):
    (tmp_path / "site-root").mkdir()
    with plain_web_server(tmp_path / "site-root") as url:
        code = main(["generate", "--server", url, "--wait-for-servers", "1", *TURBO, "--out", str(tmp_path / "x.png")])
    assert code == 2
    assert one_line_error(capsys) == (
        f"error: {url} answers HTTP 404 on GET {url}/health: not an SGLang server (check the URL and port)")
    assert not (tmp_path / "x.png").exists()


def test_check_remote_says_a_web_server_is_not_sglang(capsys, tmp_path):
    with plain_web_server(tmp_path) as url:
        assert main(["check-remote", url]) == 1
    out = capsys.readouterr().out
    assert f"! {url} answers HTTP 404 on GET {url}/health: not an SGLang server (check the URL and port)" in out
    assert "<!DOCTYPE" not in out and "<html" not in out.lower()


def test_giving_up_on_one_server_of_a_fleet_is_told_while_another_takes_the_batch(capsys, tmp_path):
    (tmp_path / "site-root").mkdir()
    with plain_web_server(tmp_path / "site-root") as web, FakeSglang() as live:
        assert main(["generate", "--server", web, "--server", live.url, *TURBO, "--batch", "2",
                     "--out", str(tmp_path / "x.png")]) == 0
    err = capsys.readouterr().err
    assert (f"giving up on {web} for this batch: {web} answers HTTP 404 on GET {web}/health: not an SGLang server (check "
            f"the URL and port); the batch goes on with {live.url}") in err.splitlines(), err
    assert sorted(path.name for path in tmp_path.glob("*.png")) == ["x_0.png", "x_1.png"]


def test_check_remote_awaits_health_for_the_read_timeout_given_and_names_that_flag(capsys):
    """A server that accepts and never answers: /health is awaited --read-timeout seconds (not a fixed 10 s), and
    the advice names --read-timeout, the flag that governs that wait."""
    with silent_server() as url:
        started = time.monotonic()
        assert main(["check-remote", url, "--read-timeout", "1", "--connect-timeout", "1"]) == 1
        elapsed = time.monotonic() - started
    assert 1.0 <= elapsed < 1.0 + PROMPTLY_S, f"{elapsed:.2f} s, not the 10 s of the default"
    out = capsys.readouterr().out
    assert (f"! {url} accepted the connection but sent no answer to GET /health within 1 s: the server is hung or "
            f"overloaded (see its log); raise --read-timeout if it is only slow") in out.splitlines(), out


@pytest.mark.parametrize("fault, said", [
    ("health:trickle", "answered GET /health too slowly: the whole answer took longer than 1 s: the server is hung, "
                       "overloaded or misbehaving (see its log); raise --read-timeout if it is only slow"),
    ("models:trickle", "answered GET {url}/v1/models too slowly: the whole answer took longer than 1 s (read "
                       "timeout), coming in bit by bit; check the server (its log, its network, a proxy in front of "
                       "it), or raise --read-timeout if it is only slow"),
    ("trickle", "answered POST {url}/v1/images/generations too slowly: the whole answer took longer than 1 s (read "
                "timeout), coming in bit by bit; check the server (its log, its network, a proxy in front of it), or "
                "raise --read-timeout if it is only slow"),
])
def test_check_remote_read_timeout_bounds_every_whole_answer_however_slowly_it_comes(capsys, fault, said):
    """--read-timeout "bounds every answer it waits for": an answer trickling in one byte every 0.05 s included."""
    with FakeSglang(faults=[fault]) as server:
        started = time.monotonic()
        assert main(["check-remote", server.url, "--read-timeout", "1"]) == 1
        elapsed = time.monotonic() - started
        assert server.trickling.is_set()
    assert 1.0 <= elapsed < 1.0 + PROMPTLY_S
    out = capsys.readouterr().out
    assert f"! {server.url} {said.format(url=server.url)}" in out.splitlines(), out


def test_generate_read_timeout_bounds_a_whole_image_answer_however_slowly_it_comes(capsys, tmp_path):
    with FakeSglang(faults=["trickle"]) as server:
        started = time.monotonic()
        code = main(["generate", "--server", server.url, "--read-timeout", "1", "--steps", "1", "--cfg", "1",
                     "--width", "256", "--height", "256", "--out", str(tmp_path / "x.png")])
        elapsed = time.monotonic() - started
    assert code == 2
    assert 1.2 <= elapsed < 1.2 + PROMPTLY_S, "1 s grown with 1 step at 256x256: 1.2 s for the whole answer"
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1
    line = errors[0]
    assert (f"{server.url} answered POST {server.url}/v1/images/generations too slowly: the whole answer took longer "
            f"than 1.2 s (read timeout)") in line
    assert "raise --read-timeout if it is only slow" in line and "read_timeout_s" not in line
    assert not list(tmp_path.glob("*.png"))


def test_check_remote_connect_timeout_bounds_a_connection_never_accepted(capsys):
    with unaccepting_server() as url:
        started = time.monotonic()
        assert main(["check-remote", url, "--connect-timeout", "1"]) == 1
        elapsed = time.monotonic() - started
    assert 1.0 <= elapsed < 4.0, f"{elapsed:.2f} s, not the 5 s of the default"
    assert f"! {url}: it did not accept a connection within 1 s" in capsys.readouterr().out


def test_an_html_error_page_is_described_not_quoted(tmp_path):
    """Any 4xx whose body is a web page (a proxy's, a plain web server's) says so instead of quoting its markup."""
    from ernie_image.runtime.net.errors import ServerRejected
    from ernie_image.runtime.net.loop_thread import run_sync
    from ernie_image.runtime.remote.sglang import SglangClient

    async def models(url: str) -> None:
        client = SglangClient(url)
        try:
            await client.models()
        finally:
            await client.close()

    with plain_web_server(tmp_path) as url:
        with pytest.raises(ServerRejected) as caught:
            run_sync(models(url))
    assert str(caught.value) == f"{url} rejected GET {url}/v1/models (HTTP 404): an HTML page, not an API answer"


def test_a_read_timeout_below_the_readiness_looks_own_caps_that_look_too(capsys, tmp_path):
    with silent_server() as url:
        code = main(["generate", "--server", url, "--read-timeout", "2", "--wait-for-servers", "3", *TURBO,
                     "--out", str(tmp_path / "x.png")])
    assert code == 2
    assert one_line_error(capsys).startswith(f"error: {url}: /health not answered within 2 s (read timeout), still "
                                             f"after 3 s: start the server")
