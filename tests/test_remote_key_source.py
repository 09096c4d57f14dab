"""Where the API key comes from, checked by the runtime before anything is sent (ApiKeySource.checked).

The same check serves the CLI's key flags and the sources of the user's keys file (a workflow never names a source:
see test_credentials.py); messages name the flag or the credential. Every refusal is
one InvalidInputError line naming the setting, the cause and the fix, and a value that may be a pasted key
shows no character of it (only a plain variable name, ERNIE_SGLANG_KEY, or a plain path is named).
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from ernie_image.runtime.cli.commands import main
from ernie_image.runtime.core.errors import InvalidInputError
from ernie_image.runtime.net.key_source import MAX_KEY_FILE_BYTES, ApiKeySource
from test_enhancer_remote import ChatServer

PASTED_KEY = "sk-live-0123456789abcdef"
KEY_AS_NAME = "SKlive0123456789abcdef"  # a pasted key that happens to look like a variable name
UNSET = "ERNIE_TEST_KEY_NOBODY_SET"


@pytest.fixture(autouse=True)
def no_stray_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (UNSET, KEY_AS_NAME, "ERNIE_TEST_KEY_EMPTY"):
        monkeypatch.delenv(name, raising=False)


def refusal(env_var=None, file=None, **labels) -> str:
    with pytest.raises(InvalidInputError) as caught:
        ApiKeySource.checked(env_var, file, **labels)
    message = str(caught.value)
    assert "\n" not in message and "\r" not in message, "one line"
    return message


def assert_key_hidden(message: str, value: str) -> None:
    assert value[:3] not in message and "..." not in message, f"a part of {value!r} is shown: {message}"


# ----------------------------------------------------------------------------------------- accepted
def test_blank_means_no_key(monkeypatch: pytest.MonkeyPatch) -> None:
    assert ApiKeySource.checked(None, None) == ApiKeySource()
    assert ApiKeySource.checked("  ", "\t") == ApiKeySource()
    assert ApiKeySource.checked("", "").read() is None


def test_a_set_variable_and_a_key_file_are_accepted_by_name_only(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("ERNIE_TEST_KEY_SET", PASTED_KEY)
    key_file = tmp_path / "server.key"
    key_file.write_text(PASTED_KEY + "\n")
    source = ApiKeySource.checked(" ERNIE_TEST_KEY_SET ", f" {key_file} ")
    assert source == ApiKeySource(env_var="ERNIE_TEST_KEY_SET", file=str(key_file))
    assert PASTED_KEY not in repr(source) and source.read() == PASTED_KEY


def test_an_unset_variable_is_fine_when_a_key_file_backs_it_up(tmp_path: Path) -> None:
    key_file = tmp_path / "server.key"
    key_file.write_text(PASTED_KEY)
    source = ApiKeySource.checked(UNSET, str(key_file))
    assert source.read() == PASTED_KEY  # read() falls back to the file the same way


def test_a_key_file_under_home_is_expanded(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "pe.key").write_text(PASTED_KEY)
    assert ApiKeySource.checked(None, "~/pe.key").read() == PASTED_KEY


# ----------------------------------------------------------------------------------------- refused
def test_a_pasted_key_instead_of_a_variable_name() -> None:
    message = refusal(PASTED_KEY, env_label="--api-key-env")
    assert message == ("--api-key-env must be the NAME of an environment variable (letters, digits, _): the value "
                       "given looks like a key rather than a variable name (not shown); put the key in an "
                       "environment variable and give its name, never the key itself")
    assert_key_hidden(message, PASTED_KEY)


def test_a_pasted_key_that_looks_like_a_name_names_no_variable() -> None:
    message = refusal(KEY_AS_NAME, env_label="--api-key-env", program="ernie-image")
    assert message == ("--api-key-env names no variable of ernie-image's environment, and the value given looks "
                       "like a key rather than a variable name (not shown): export the key in a variable before "
                       "starting ernie-image and give the variable's NAME, or give a key file")
    assert_key_hidden(message, KEY_AS_NAME)


def test_a_key_given_as_the_variable_name_shows_no_character_of_it(capsys) -> None:
    """`--api-key-env sk-ENVSECRET456` printed "not 'sk-E...'": four characters of the key."""
    code = main(["check-remote", "http://127.0.0.1:1", "--no-generate", "--api-key-env", "sk-ENVSECRET456"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "looks like a key rather than a variable name" in err
    assert "sk-" not in err and "ENV" not in err and "SECRET" not in err and "456" not in err


def test_a_variable_that_is_set_but_empty(monkeypatch) -> None:
    monkeypatch.setenv("ERNIE_TEST_KEY_EMPTY", "  ")
    label = "credential 'gpu' (the keys file K): its env"  # as Credential.check names a keys file's source
    message = refusal("ERNIE_TEST_KEY_EMPTY", env_label=label, program="ComfyUI")
    assert message == (f"{label} names a variable (ERNIE_TEST_KEY_EMPTY) that is empty in ComfyUI's environment: "
                       f"export the key in it before starting ComfyUI, or give a key file")


def test_a_multiline_paste_stays_one_line() -> None:
    message = refusal("ab\ncd-" + PASTED_KEY)
    assert "looks like a key rather than a variable name (not shown)" in message
    assert_key_hidden(message, "ab\ncd-" + PASTED_KEY)


def test_a_missing_key_file_is_named_when_it_is_plainly_a_path(tmp_path: Path) -> None:
    missing = tmp_path / "missing.key"
    assert refusal(None, str(missing), file_label="--api-key-file") == (
        f"--api-key-file {missing} is not a file: give the path of a file holding only the key")


def test_a_key_pasted_into_the_key_file_setting_is_not_echoed() -> None:
    message = refusal(None, PASTED_KEY, file_label="--pe-api-key-file")
    assert message == ("--pe-api-key-file is not a file, and the value given looks like a key rather than a path "
                       "(not shown): give the path of a file holding only the key")
    assert_key_hidden(message, PASTED_KEY)
    slashed = "sk/" + PASTED_KEY  # base64 keys may hold a slash; their "folder" does not exist
    assert_key_hidden(refusal(None, slashed), PASTED_KEY)


def test_a_folder_is_not_a_key_file(tmp_path: Path) -> None:
    assert refusal(None, str(tmp_path), file_label="--api-key-file") == (
        f"--api-key-file {tmp_path} is not a file: give the path of a file holding only the key")


def test_a_large_file_is_not_a_key_file(tmp_path: Path) -> None:
    big = tmp_path / "model.safetensors"
    big.write_bytes(b"x" * (MAX_KEY_FILE_BYTES + 1))
    assert refusal(None, str(big), file_label="--api-key-file") == (
        f"--api-key-file {big} is larger than {MAX_KEY_FILE_BYTES} bytes, so it is not a key file: give the path "
        f"of a file holding only the key")


def test_an_empty_key_file(tmp_path: Path) -> None:
    empty = tmp_path / "empty.key"
    empty.write_text(" \n")
    assert refusal(None, str(empty)) == f"the API key file {empty} is empty: write the key into it"


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root reads any file")
def test_an_unreadable_key_file(tmp_path: Path) -> None:
    locked = tmp_path / "locked.key"
    locked.write_text(PASTED_KEY)
    locked.chmod(0)
    try:
        assert refusal(None, str(locked)) == (
            f"the API key file {locked} cannot be read by this process: check its permissions")
    finally:
        locked.chmod(0o600)


# --------------------------------------------------------------------------------------------- CLI
def test_cli_refuses_an_unset_variable_before_anything_is_sent(capsys) -> None:
    with ChatServer() as server:
        code = main(["enhance", "--pe-url", server.url, "--prompt", "a fox", "--api-key-env", UNSET])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert err.startswith(f"error: --api-key-env names a variable ({UNSET}) that ernie-image's environment "
                          "does not have")
    assert not server.received and server.models_asked == 0


def test_cli_never_echoes_a_key_pasted_as_an_option(capsys) -> None:
    code = main(["check-remote", "http://127.0.0.1:1", "--no-generate", f"--api-key-env={PASTED_KEY}"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: --api-key-env must be the NAME")
    assert_key_hidden(err, PASTED_KEY)
    code = main(["check-remote", "http://127.0.0.1:1", "--no-generate", "--api-key-file", PASTED_KEY])
    err = capsys.readouterr().err
    assert code == 2 and err == ("error: --api-key-file is not a file, and the value given looks like a key rather "
                                 "than a path (not shown): give the path of a file holding only the key\n")


def test_check_remote_runs_the_same_check_when_called_directly() -> None:
    from ernie_image.runtime.cli.check_remote import main_check_remote
    from ernie_image.runtime.net.credentials import Credentials
    from ernie_image.runtime.remote.server_check import check_remote

    with pytest.raises(InvalidInputError, match=r"^--api-key-env names a variable"):
        main_check_remote(["http://127.0.0.1:1", "--api-key-env", UNSET])
    with pytest.raises(InvalidInputError, match=r"^the API key variable must be the NAME"):
        Credentials.bound_to(["http://127.0.0.1:1"], PASTED_KEY)
    with pytest.raises(InvalidInputError, match=r"^credential is not the label of any credential of yours \(.*\): add "):
        check_remote(["http://127.0.0.1:1"], credential="pe")


def test_a_remote_pipe_refuses_a_bound_key_source_that_cannot_work(keys_file) -> None:
    from ernie_image.runtime.net.credentials import Credential, Origin
    from ernie_image.runtime.remote.backend import RemotePipe, RemoteSettings
    from ernie_image.runtime.text.remote_enhancer import ChatEndpoint

    path = keys_file({"label": "gpu", "origin": "http://127.0.0.1:1", "env": UNSET})
    with pytest.raises(InvalidInputError, match=rf"^credential 'gpu' \(the keys file {path}\): its env names a "
                                                rf"variable \({UNSET}\)"):
        RemotePipe(["http://127.0.0.1:1"])
    pasted = Credential("pe", Origin.of("http://127.0.0.1:2"), ApiKeySource(file=PASTED_KEY), given_by="the test")
    with pytest.raises(InvalidInputError, match=r"^credential 'pe' \(the test\): its file is not a file, and the "
                                                r"value given looks like a key") as caught:
        RemotePipe(["http://127.0.0.1:3"],
                   RemoteSettings(pe_endpoint=ChatEndpoint(url="http://127.0.0.1:2", credential=pasted)))
    assert_key_hidden(str(caught.value), PASTED_KEY)
