"""What a remote batch promises beyond failover: one model makes it, a busy server is asked again soon, a wait says
what it waits for (on the node too), a slow prompt-enhancer server is told and named with the setting that fixes
it, and no connection is left open when a pipe is dropped or fails."""
from __future__ import annotations

import gc
import json
import warnings

import pytest
from ernie_image.runtime.files.png_output import read_png_settings

from ernie_image.runtime.cli.commands import main
from ernie_image.runtime.core.errors import RemoteError
from ernie_image.runtime.core.host import NullHost
from ernie_image.runtime.core.request import GenerationRequest
from ernie_image.runtime.remote.backend import RemotePipe, RemoteSettings
from ernie_image.runtime.text import remote_enhancer
from ernie_image.runtime.text.remote_enhancer import ChatEndpoint, revise_prompts_remote

from fake_sglang import FakeSglang, dead_url
from test_enhancer_remote import ChatServer

TURBO, BASE = "baidu/ERNIE-Image-Turbo", "baidu/ERNIE-Image"


def request(batch: int = 1, **fields) -> GenerationRequest:
    return GenerationRequest(prompt="a red fox in snow", width=256, height=256, seed=7, batch=batch, **fields)


def settings(**fields) -> RemoteSettings:
    return RemoteSettings(**{"probe_every_s": 0.05, "retry_attempts": 1, **fields})


# --------------------------------------------------------------------------------------------- one model
def test_a_batch_is_made_by_one_model_and_a_server_of_another_is_set_aside_in_one_line() -> None:
    host = NullHost()
    with FakeSglang(model_id=TURBO, service_time_s=0.3) as turbo, FakeSglang(model_id=BASE, warmup_s=0.2) as base:
        pipe = RemotePipe([turbo.url, base.url], settings())
        result = pipe.generate(request(batch=4), host)
        pipe.release()
    assert base.generations == [] and len(turbo.generations) == 4
    assert {g.body["num_inference_steps"] for g in turbo.generations} == {8}
    assert result.info["model"] == TURBO and result.info["variant"] == "turbo"
    set_aside = [m for m in host.messages if base.url in m and BASE in m]
    assert len(set_aside) == 1 and f"not {TURBO}" in set_aside[0], host.messages


HF_CACHE = "/root/.cache/huggingface/hub/models--baidu--ERNIE-Image-Turbo/snapshots/0123abcd"


def batch_on_two(first: dict, second: dict) -> tuple[FakeSglang, FakeSglang, NullHost]:
    """A batch of 4 on two servers answering as `first` and `second` say (both ready, both able to take images)."""
    host = NullHost()
    with FakeSglang(service_time_s=0.2, **first) as one, FakeSglang(service_time_s=0.2, **second) as other:
        pipe = RemotePipe([one.url, other.url], settings())
        pipe.generate(request(batch=4), host)
        pipe.release()
    return one, other, host


@pytest.mark.parametrize("first, second", [
    (dict(model_id=TURBO), dict(model_id="/models/ERNIE-Image-Turbo")),  # a repo id, a download of it
    (dict(model_id=TURBO), dict(model_id="turbo", model_path="/models/ERNIE-Image-Turbo/")),  # --served-model-name
    (dict(model_id=TURBO), dict(model_id=HF_CACHE)),  # the repo, through the Hugging Face cache
    (dict(model_id="a", model_path="/ckpt/ernie-turbo-ft"), dict(model_id="b", model_path="/ckpt/ernie-turbo-ft")),
], ids=["path-of-the-release", "served-model-name", "hf-cache", "same-path-other-names"])
def test_servers_of_one_model_under_other_names_make_one_batch_together(first, second) -> None:
    one, other, host = batch_on_two(first, second)
    assert one.generations and other.generations, host.messages
    assert not any("giving up" in m for m in host.messages), host.messages


@pytest.mark.parametrize("first, second", [
    (dict(model_id="/ckpt/ernie-turbo-ft-a"), dict(model_id="/ckpt/ernie-turbo-ft-b")),  # two fine-tunes
    (dict(model_id="ernie", model_path="/ckpt/a/ERNIE-Turbo-ft"), dict(model_id="ernie",
                                                                 model_path="/ckpt/b/ERNIE-Turbo-ft")),
    (dict(model_id=TURBO), dict(model_id="someone/ERNIE-Image-Turbo")),  # another repo of the same name
], ids=["two-fine-tunes", "one-served-name-two-paths", "another-repo"])
def test_servers_of_different_weights_never_share_a_batch_whatever_they_are_called(first, second) -> None:
    one, other, host = batch_on_two(first, second)
    made, idle = (one, other) if one.generations else (other, one)
    assert len(made.generations) == 4 and idle.generations == []
    set_aside = [m for m in host.messages if m.startswith(f"giving up on {idle.url} for this batch: it serves ")]
    assert len(set_aside) == 1 and f"which makes this batch; the batch goes on with {made.url}" in set_aside[0]


def test_the_cli_records_the_model_that_made_the_images_and_names_only_the_servers_that_did(tmp_path, capsys) -> None:
    with FakeSglang(model_id=BASE) as base, FakeSglang(model_id=TURBO, warmup_s=0.3) as turbo:
        code = main(["generate", "--server", base.url, "--server", turbo.url, "--prompt", "a fox", "--width", "256",
                     "--height", "256", "--steps", "2", "--cfg", "4", "--batch", "2", "--out", str(tmp_path / "f.png")])
    assert code == 0
    assert turbo.generations == []
    for path in sorted(tmp_path.glob("f*.png")):
        recorded = read_png_settings(path)
        assert recorded["variant"] == "base" and recorded["model"] == BASE
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"by {BASE} on {base.url} (2)" in last and turbo.url not in last


# -------------------------------------------------------------------------------------------- busy server
def test_a_busy_answer_is_asked_again_after_about_a_second_not_the_down_pause() -> None:
    host = NullHost()
    with FakeSglang(faults=["503"]) as busy:
        pipe = RemotePipe([busy.url], settings(retry_down_after_s=30.0))
        result = pipe.generate(request(), host)
        pipe.release()
    assert result.images.shape[0] == 1
    first, second = busy.generations[0].at, busy.generations[1].at
    assert second - first < 10.0, "a server that answered busy is not paused like a dead one"
    assert any("asked again in 1 s" in m for m in host.messages), host.messages


# ----------------------------------------------------------------------------------------------- waiting
def test_a_wait_for_servers_is_shown_as_a_status_naming_the_server_its_state_and_the_seconds() -> None:
    host = NullHost()
    url = dead_url()
    pipe = RemotePipe([url], settings(wait_for_servers_s=1.5, connect_timeout_s=0.5))
    with pytest.raises(RemoteError):
        pipe.generate(request(), host)
    pipe.release()
    assert host.statuses, "the node is told what the batch waits for"
    assert all(status.startswith(f"waiting for {url}: ") for status in host.statuses)
    assert any("refused" in status and "s (up to 1.5 s" in status for status in host.statuses), host.statuses


def test_a_slow_prompt_enhancer_is_told_while_waited_for_and_its_timeout_names_the_setting(monkeypatch) -> None:
    monkeypatch.setattr(remote_enhancer, "WAIT_NOTICE_EVERY_S", 0.2)
    host = NullHost()
    with ChatServer(faults=["hang"]) as chat:
        endpoint = ChatEndpoint(url=chat.url, model="pe", read_timeout_s=1.0, retry_attempts=1,
                                timeout_setting="--pe-timeout")
        with pytest.raises(RemoteError) as slow:
            revise_prompts_remote(endpoint, ["a fox"], 1024, 1024, seed=0, host=host, keep_original=False)
    assert any(m.startswith(f"waiting for the prompt enhancer at {chat.url}: ") for m in host.messages)
    assert host.statuses and "up to 1 s a prompt" in host.statuses[-1]
    assert "sent no revised prompt within 1 s" in str(slow.value) and "--pe-timeout" in str(slow.value)
    assert "read timeout for large images" not in str(slow.value)


# ------------------------------------------------------------------------------------------- connections
@pytest.fixture
def unclosed_sessions_fail():
    """aiohttp warns (ResourceWarning) for a session or connector garbage collected while open: none may be."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        yield
        gc.collect()
    unclosed = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
    assert [message for message in unclosed if message.startswith("Unclosed")] == []  # aiohttp's own words


def test_a_dropped_pipe_leaves_no_connection_open(unclosed_sessions_fail) -> None:
    with FakeSglang() as server:
        pipe = RemotePipe([server.url], settings())
        pipe.generate(request(), NullHost())
        del pipe  # as when a changed widget makes ComfyUI replace the node's output
        gc.collect()
        replacement = RemotePipe([server.url], settings())
        replacement.generate(request(), NullHost())
        replacement.release()


def test_a_failed_run_leaves_no_connection_open(unclosed_sessions_fail) -> None:
    with FakeSglang(every_post="500") as broken:
        pipe = RemotePipe([broken.url], settings())
        with pytest.raises(RemoteError):
            pipe.generate(request(), NullHost())
        del pipe
        gc.collect()


# ---------------------------------------------------------------------------------------- a server's words
FORGED = "baidu/ERNIE-Image-Turbo\x1b[31m\r\nFAKE LOG LINE: all good\x07"


def test_text_a_server_sends_is_shown_as_one_printable_line_never_as_terminal_codes_or_log_lines() -> None:
    from ernie_image.runtime.remote.server_check import check_remote, format_check_table

    with FakeSglang(model_id=FORGED, pipeline_name="ErnieImagePipeline\x1b]0;title\x07") as forging:
        rows = check_remote([forging.url], generate=False)
        with FakeSglang(model_id=FORGED, pipeline_name="Other\r\nPipeline") as wrong:
            other = check_remote([wrong.url], generate=False)
    shown = "\n".join([format_check_table(rows), *rows[0].problems, *other[0].problems, str(rows[0].model_id)])
    assert rows[0].model_id and all(char.isprintable() or char == "\n" for char in shown)
    assert not any(line.startswith("FAKE LOG LINE") for line in shown.splitlines())
    assert other[0].problems and "\n" not in other[0].problems[0] and "\x1b" not in other[0].problems[0]


def test_a_command_line_key_going_to_several_servers_names_each_of_them(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("ERNIE_TEST_FLEET_KEY", "sk-fleet")
    with FakeSglang(api_key="sk-fleet") as one, FakeSglang(api_key="sk-fleet") as two:
        code = main(["generate", "--server", one.url, "--server", two.url, "--api-key-env", "ERNIE_TEST_FLEET_KEY",
                     "--prompt", "a fox", "--width", "256", "--height", "256", "--out", str(tmp_path / "f.png")])
    assert code == 0
    told = [line for line in capsys.readouterr().err.splitlines() if "goes to each of these servers" in line]
    assert told == [f"the key --api-key-env ERNIE_TEST_FLEET_KEY names goes to each of these servers: "
                    f"{one.url}, {two.url}"]
