"""Which API key goes to which server (runtime/net/credentials.py), as a specification.

The user binds one key to one server ORIGIN (scheme, host, port), in the keys file or with the CLI's key flags; a
workflow may at most pick a binding by its label. A label bound to another origin, a binding that cannot give a
key, a keys file that cannot be read as one: each is refused in one line that names the file or the setting and
says how to fix it, and no message ever holds a key. The key itself is read when a request is sent (no object
holds it), and a client sends it to its own origin only.
"""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any, Callable, Optional

import pytest

from ernie_image.runtime.core.errors import ErnieImageError, InvalidInputError
from ernie_image.runtime.net.client import HttpClient, JsonResponse
from ernie_image.runtime.net.credentials import (
    KEYS_FILE_ENV,
    MAX_KEYS_FILE_BYTES,
    Credential,
    Credentials,
    Origin,
    ServerKeys,
    keys_file_candidates,
    load_credentials,
)
from ernie_image.runtime.net.errors import AuthenticationError
from ernie_image.runtime.net.key_source import ApiKeySource
from ernie_image.runtime.net.keys_file import Accounts, shell_fix, writable_by_others
from ernie_image.runtime.net.loop_thread import run_sync
from ernie_image.runtime.net.settings import HttpSettings

from fake_sglang import FakeSglang

KEY = "sk-live-credentials-0123456789abcdef"
OTHER_KEY = "sk-live-rotated-fedcba9876543210"
KEY_VAR = "ERNIE_TEST_CREDENTIAL_KEY"
UNSET_VAR = "ERNIE_TEST_CREDENTIAL_NOBODY_SET"
GPU_BOX = "http://gpu-box:30000"
PE_BOX = "https://pe.example.com"
KEYS = (KEY, OTHER_KEY, KEY[:12], OTHER_KEY[:12])

WriteKeys = Callable[..., Path]


@pytest.fixture(autouse=True)
def key_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEY_VAR, KEY)
    monkeypatch.delenv(UNSET_VAR, raising=False)


def entry(label: str, origin: str, **source: Any) -> dict[str, Any]:
    return {"label": label, "origin": origin, **source}


def document(*entries: dict[str, Any]) -> str:
    """The text of a keys file holding these entries."""
    return json.dumps({"credentials": list(entries)})


def refused(call: Callable[..., Any], *args: Any, error: type[ErnieImageError] = InvalidInputError,
            **kwargs: Any) -> str:
    """The one-line refusal `call` raises; it holds no character run of any key."""
    with pytest.raises(error) as caught:
        call(*args, **kwargs)
    message = str(caught.value)
    assert "\n" not in message and "\r" not in message, f"not one line: {message!r}"
    for key in KEYS:
        assert key not in message, f"a key is shown: {message}"
    return message


def written(path: Path, text: str, mode: int = 0o600) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    os.chmod(path, mode)
    return path


def get(client: HttpClient, path: str = "/v1/models") -> JsonResponse:
    async def go() -> JsonResponse:
        try:
            return await client.request_json("GET", path)
        finally:
            await client.close()
    return run_sync(go())


# ------------------------------------------------------------------------------------------------ origins
@pytest.mark.parametrize("url, origin", [
    ("http://gpu-box", Origin("http", "gpu-box", 80)),
    ("http://gpu-box:80", Origin("http", "gpu-box", 80)),
    ("https://pe.example.com", Origin("https", "pe.example.com", 443)),
    ("https://pe.example.com:443", Origin("https", "pe.example.com", 443)),
    ("http://gpu-box:30000", Origin("http", "gpu-box", 30000)),
])
def test_an_origin_is_scheme_host_and_port_the_schemes_default_port_when_none_is_written(url: str,
                                                                                        origin: Origin) -> None:
    assert Origin.of(url) == origin
    assert Origin.parse(url, "the test") == origin


def test_scheme_and_host_are_compared_without_case() -> None:
    assert Origin.of("HTTP://GPU-Box:30000") == Origin.of(GPU_BOX)
    assert Origin.parse("HTTPS://PE.Example.COM", "the test") == Origin.of("https://pe.example.com:443")
    assert str(Origin.parse("Http://GPU-BOX:30000/", "the test")) == GPU_BOX


def test_a_base_path_of_a_server_url_is_not_part_of_its_origin() -> None:
    assert Origin.of("http://gpu-box:30000/proxy/sglang") == Origin.of(GPU_BOX)


def test_an_ipv6_origin_is_its_address_and_is_shown_in_brackets() -> None:
    origin = Origin.parse("http://[::1]:30000", "the test")
    assert origin == Origin("http", "::1", 30000) == Origin.of("http://[::1]:30000/")
    assert str(origin) == "http://[::1]:30000"
    assert Origin.of("http://[::1]") == Origin("http", "::1", 80)
    assert Origin.of("http://[::1]:30000") != Origin.of("http://127.0.0.1:30000"), "one machine, two origins"


@pytest.mark.parametrize("other", [
    "https://gpu-box:30000",  # another scheme: a key bound to one is never sent over the other
    "http://gpu-box:30001",  # another port: another server
    "http://gpu-box",  # the default port is 80, not 30000
    "http://gpu-box.example.com:30000",  # another host name, even for the same machine
    "http://gpu-box.:30000",
    "http://10.0.0.5:30000",
])
def test_any_other_scheme_host_or_port_is_another_origin(other: str) -> None:
    assert Origin.of(other) != Origin.parse(GPU_BOX, "the test")


@pytest.mark.parametrize("text, said", [
    (None, "an origin is missing or not text"),
    ("", "an origin is missing or not text"),
    (30000, "an origin is missing or not text"),
    ("gpu-box:30000", "needs http:// or https:// and a host"),
    ("ftp://gpu-box:30000", "needs http:// or https:// and a host"),
    ("http://", "needs http:// or https:// and a host"),
    ("http://alice:pw-9876@gpu-box:30000", "an origin holds a user name or password"),
    ("http://gpu-box:30000/v1", "has a path, query or fragment: a key is bound to a whole server"),
    ("http://gpu-box:30000?token=1", "has a path, query or fragment"),
    ("http://gpu-box:30000#x", "has a path, query or fragment"),
    ("http://gpu-box:99999", "cannot be read"),
    ("http://[::1", "cannot be read"),
])
def test_an_origin_in_the_keys_file_is_scheme_host_and_port_and_nothing_else(text: Any, said: str) -> None:
    message = refused(Origin.parse, text, "entry 3 of the keys file K")
    assert said in message and "(entry 3 of the keys file K)" in message
    assert "write it as scheme://host:port, e.g. http://gpu-box:30000" in message
    assert "pw-9876" not in message and "alice" not in message, "a password written in an origin is not shown"


def test_port_0_is_refused_and_never_binds_a_key_to_the_schemes_default_port(keys_file: WriteKeys) -> None:
    """"http://gpu-box:0" must not bind the key to http://gpu-box:80, a server the user never named: refused."""
    with pytest.raises(InvalidInputError, match="port 0"):
        Origin.parse("http://gpu-box:0", "the test")
    keys_file(entry("zero", "http://gpu-box:0", env=KEY_VAR))
    with pytest.raises(InvalidInputError, match="has port 0, which no server listens on"):
        load_credentials()


# ---------------------------------------------------------------------------------- where the file is
def test_without_a_keys_file_nothing_is_bound_and_the_advice_names_where_it_goes(
        keys_file_of_this_test: Path) -> None:
    credentials = load_credentials()
    assert credentials.entries == () and credentials.location == str(keys_file_of_this_test)
    assert credentials.for_server(GPU_BOX) is None
    assert credentials.how_to_bind(Origin.of(GPU_BOX)) == (
        f'add {{"label": "NAME", "origin": "{GPU_BOX}", "env": "VARIABLE"}} (or "file": PATH) to the keys file '
        f"{keys_file_of_this_test}")


def test_inside_comfyui_its_user_directory_is_looked_at_first(tmp_path: Path, keys_file: WriteKeys) -> None:
    config_file = keys_file(entry("from-config", GPU_BOX, env=KEY_VAR))
    comfy_user = tmp_path / "user"
    assert keys_file_candidates(str(comfy_user)) == [comfy_user / "ernie_image" / "keys.json", config_file]
    assert [c.label for c in load_credentials(str(comfy_user)).entries] == ["from-config"], "the first found wins"
    written(comfy_user / "ernie_image" / "keys.json", json.dumps({"credentials": [entry("from-comfy", GPU_BOX,
                                                                                          env=KEY_VAR)]}))
    credentials = load_credentials(str(comfy_user))
    assert [c.label for c in credentials.entries] == ["from-comfy"]
    assert credentials.location == "ComfyUI's user/ernie_image/keys.json", "named without the install's path"


def test_the_keys_file_variable_names_the_one_file_looked_at(tmp_path: Path, keys_file: WriteKeys,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    keys_file(entry("from-config", GPU_BOX, env=KEY_VAR))
    chosen = written(tmp_path / "elsewhere.json", json.dumps({"credentials": [entry("chosen", GPU_BOX, env=KEY_VAR)]}))
    monkeypatch.setenv(KEYS_FILE_ENV, str(chosen))
    assert keys_file_candidates(str(tmp_path / "user")) == [chosen]
    assert [c.label for c in load_credentials(str(tmp_path / "user")).entries] == ["chosen"]


def test_the_keys_file_variable_naming_a_missing_file_is_one_line(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    missing = tmp_path / "nowhere" / "keys.json"
    monkeypatch.setenv(KEYS_FILE_ENV, str(missing))
    assert refused(load_credentials) == (f"{KEYS_FILE_ENV} names {missing}, which does not exist: write the keys "
                                         f"file there or unset {KEYS_FILE_ENV}")


# ----------------------------------------------------------------------------------- what the file says
def test_each_entry_binds_one_label_to_one_origin_and_one_source(keys_file: WriteKeys, tmp_path: Path) -> None:
    key_path = written(tmp_path / "pe.key", OTHER_KEY + "\n")
    path = keys_file(entry("gpu-box", GPU_BOX, env=KEY_VAR), entry(" pe ", PE_BOX, file=str(key_path)),
                     entry("lab", "http://10.0.0.5:30000", key=KEY))
    credentials = load_credentials()
    assert credentials.location == str(path)
    gpu, pe, lab = credentials.entries
    assert (gpu.label, gpu.origin, gpu.source) == ("gpu-box", Origin.of(GPU_BOX), ApiKeySource(env_var=KEY_VAR))
    assert (pe.label, pe.origin, pe.source) == ("pe", Origin.of("https://pe.example.com:443"),
                                                ApiKeySource(file=str(key_path)))
    assert (lab.label, lab.keys_file and lab.keys_file.path, lab.source) == ("lab", path, ApiKeySource())
    assert (gpu.read(), pe.read(), lab.read()) == (KEY, OTHER_KEY, KEY)
    for shown in (repr(credentials), str(credentials), gpu.describe(), lab.describe()):
        assert KEY not in shown and OTHER_KEY not in shown, "no object holds a key, not even one written in the file"
    assert lab.describe() == f"credential 'lab' (the keys file {path})"


@pytest.mark.parametrize("text, said", [
    ("{not json", "is not valid JSON (line 1): fix it"),
    ("", "is not valid JSON (line 1)"),
    ("[]", 'must be a JSON object {"credentials": [...]}'),
    ('{"keys": []}', 'must be a JSON object {"credentials": [...]}'),
    ('{"credentials": {"label": "a"}}', 'must be a JSON object {"credentials": [...]}'),
    ('{"credentials": ["gpu-box"]}', "entry 1 of the keys file {path} is not an object with label, origin and env, "
                                     "file or key"),
    (document(entry("a", GPU_BOX, env=KEY_VAR, token=KEY)),
     "entry 1 of the keys file {path} has the unknown field 'token': use label, origin and one of env, file, key"),
    (document(entry("a", GPU_BOX, env=KEY_VAR), entry("a", PE_BOX, key=KEY)),
     "entry 2 of the keys file {path}: the label 'a' is used twice: give each credential its own"),
    (document({"origin": GPU_BOX, "env": KEY_VAR}), "entry 1 of the keys file {path} needs a label"),
    (document(entry("x" * 65, GPU_BOX, env=KEY_VAR)), "needs a label: a short name (up to 64"),
    (document(entry("a", GPU_BOX)),
     "entry 1 of the keys file {path} ('a') needs exactly one of env (a variable's name), file (a path) or key"),
    (document(entry("a", GPU_BOX, env="")), "('a') needs exactly one of env"),
    (document(entry("a", GPU_BOX, env=KEY_VAR, key=KEY)), "('a') needs exactly one of env"),
    (document(entry("a", GPU_BOX, env=KEY_VAR, file="/k.key")), "('a') needs exactly one of env"),
    (document(entry("a", GPU_BOX, env=5)), "entry 1 of the keys file {path} ('a'): env must be text"),
    (document(entry("a", "gpu-box:30000", key=KEY)),
     "the origin 'gpu-box:30000' needs http:// or https:// and a host"),
])
def test_a_keys_file_that_cannot_be_read_as_one_is_one_line_naming_the_file(keys_file_of_this_test: Path,
                                                                            text: str, said: str) -> None:
    path = written(keys_file_of_this_test, text)
    message = refused(load_credentials)
    assert said.replace("{path}", str(path)) in message and str(path) in message


def test_a_folder_or_a_huge_file_is_not_a_keys_file(keys_file_of_this_test: Path) -> None:
    keys_file_of_this_test.mkdir(parents=True)
    assert refused(load_credentials) == (f"the keys file {keys_file_of_this_test} is not a regular file: write the "
                                         f"keys there as JSON")
    keys_file_of_this_test.rmdir()
    written(keys_file_of_this_test, " " * (MAX_KEYS_FILE_BYTES + 1))
    assert "is larger than 1024 KiB: it is not a keys file" in refused(load_credentials)


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644, 0o650], ids=oct)
def test_a_key_written_in_a_keys_file_other_users_can_read_is_refused_with_chmod_600_advice(
        keys_file: WriteKeys, mode: int) -> None:
    path = keys_file(entry("lab", GPU_BOX, key=KEY))
    os.chmod(path, mode)
    reason = (f"the keys file {path} holds a key and other users can read it: run chmod 600 {path}, or name a "
              f"variable (env) or a file instead of writing the key")
    credentials = load_credentials()  # a server that needs no key runs on, told why the file is not used
    assert credentials.notice() == f"the keys file is not used (no server here needs it): {reason}"
    assert credentials.for_server("http://127.0.0.1:9") is None
    for needs_it in (lambda: credentials.for_server(GPU_BOX), lambda: credentials.for_server(GPU_BOX, "lab")):
        assert refused(needs_it).endswith(f"needs the keys file, which is not used: {reason}")


def test_a_key_written_in_a_keys_file_its_private_group_can_change_says_change(keys_file: WriteKeys) -> None:
    """Group-writable by the owner's private group passes the trust check; a key written there is still refused."""
    mode = 0o620
    path = keys_file(entry("lab", GPU_BOX, key=KEY))
    os.chmod(path, mode)
    assert f"holds a key and other users can change it: run chmod 600 {path}" in refused(
        lambda: load_credentials().for_server(GPU_BOX, "lab"))


def test_a_keys_file_naming_only_variables_and_files_may_be_readable_by_others(keys_file: WriteKeys) -> None:
    path = keys_file(entry("gpu-box", GPU_BOX, env=KEY_VAR))
    os.chmod(path, 0o644)
    assert load_credentials().for_server(GPU_BOX).read() == KEY


def test_a_written_key_is_refused_when_sent_if_the_file_became_readable_by_others(keys_file: WriteKeys) -> None:
    path = keys_file(entry("lab", GPU_BOX, key=KEY))
    credential = load_credentials().for_server(GPU_BOX, "lab")
    os.chmod(path, 0o644)
    assert "holds a key and other users can read it: run chmod 600" in refused(credential.read)


@pytest.mark.parametrize("mode", [0o602, 0o646, 0o666], ids=oct)
def test_a_keys_file_other_users_can_write_is_refused(keys_file: WriteKeys, mode: int) -> None:
    """BUG: only a file holding a key itself is checked (_require_private). A keys file any user may WRITE lets any
    of them rebind the user's key to their own server ("origin") or make it send any file of the user's ("file":
    "~/.ssh/id_rsa") there; ssh refuses a config file others can write for the same reason."""
    path = keys_file(entry("gpu-box", GPU_BOX, env=KEY_VAR))
    os.chmod(path, mode)
    message = refused_needing()
    assert str(path) in message and "chmod" in message


# ------------------------------------------------------------------- the folders above the keys file (StrictModes)
def folders_above(path: Path, top: Path) -> list[Path]:
    """The keys file's folders from its own up to `top` (a folder of the test's own)."""
    return [folder for folder in path.parents if folder == top or top in folder.parents]


def refused_needing(comfy_user_dir: Optional[str] = None) -> str:
    """The refusal of the keys file when a server bound to one of its entries needs it (its refusal alone)."""
    message = refused(lambda: load_credentials(comfy_user_dir).for_server(GPU_BOX))
    assert message.startswith(NEEDED), message
    return message[len(NEEDED):]


NEEDED = f"{Origin.of(GPU_BOX)}, bound to a key there, needs the keys file, which is not used: "


def refused_at(path: Path) -> str:
    """The refusal of the keys file at `path`, named by ERNIE_IMAGE_KEYS_FILE as the command line would."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(KEYS_FILE_ENV, str(path))
        return refused_needing()


@pytest.mark.parametrize("mode", [0o777, 0o775, 0o770, 0o757, 0o730, 0o703], ids=oct)
@pytest.mark.parametrize("level", [0, 1, 2], ids=["its folder", "the folder above", "two above"])
def test_a_keys_file_in_a_folder_others_can_write_is_refused_naming_the_folder(keys_file_of_this_test: Path,
                                                                              tmp_path_factory, level: int,
                                                                              mode: int, monkeypatch) -> None:
    """Another user who may rename or remove entries in any folder above the keys file can put a keys file of their
    own in its place (with keys.json itself 600): refused as ssh's StrictModes refuses it."""
    top = tmp_path_factory.mktemp("shared")
    path = written(top / "a" / "b" / "keys.json", document(entry("gpu-box", GPU_BOX, env=KEY_VAR)))
    folder = folders_above(path, top)[level]
    monkeypatch.setattr(Accounts, "of_system", classmethod(lambda cls: Accounts()))  # no group is private
    os.chmod(folder, mode)
    try:
        message = refused_at(path)
    finally:
        os.chmod(folder, 0o755)
    assert message == (f"the folder {folder} holding the keys file can be changed by other users, who could put "
                       f"another keys file in its place and send your keys elsewhere: run chmod go-w {folder}")


@pytest.mark.parametrize("mode", [0o1777, 0o1775, 0o755, 0o750, 0o700], ids=oct)
def test_a_folder_with_the_sticky_bit_or_writable_by_its_owner_alone_is_trusted(tmp_path_factory,
                                                                               mode: int) -> None:
    """As /tmp: in a sticky folder others may add entries but not rename or remove yours."""
    top = tmp_path_factory.mktemp("shared")
    path = written(top / "a" / "keys.json", document(entry("gpu-box", GPU_BOX, env=KEY_VAR)))
    os.chmod(path.parent, mode)
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv(KEYS_FILE_ENV, str(path))
            assert [c.label for c in load_credentials().entries] == ["gpu-box"]
    finally:
        os.chmod(path.parent, 0o755)


def test_a_keys_file_reached_through_a_link_is_checked_where_the_link_leads_too(tmp_path_factory) -> None:
    top = tmp_path_factory.mktemp("linked")
    real = written(top / "shared" / "keys.json", document(entry("gpu-box", GPU_BOX, env=KEY_VAR)))
    os.chmod(real.parent, 0o777)
    link = top / "mine" / "keys.json"
    link.parent.mkdir()
    link.symlink_to(real)
    try:
        assert refused_at(link) == (
            f"the folder {real.parent} holding the keys file can be changed by other users, who could put another "
            f"keys file in its place and send your keys elsewhere: run chmod go-w {real.parent}")
        os.chmod(real.parent, 0o755)
        os.chmod(link.parent, 0o777)
        assert f"the folder {link.parent} holding the keys file can be changed" in refused_at(link)
    finally:
        os.chmod(real.parent, 0o755)
        os.chmod(link.parent, 0o755)


ME, MY_GID, SHARED_GID = 1000, 1000, 100
ACCOUNTS = Accounts(primary_gids=((ME, MY_GID), (1001, 1001), (1002, SHARED_GID), (1003, SHARED_GID), (0, 0)),
                    names=((ME, "me"), (1001, "ann"), (1002, "bob"), (1003, "cy"), (0, "root")),
                    members=((MY_GID, ()), (1001, ("ann",)), (SHARED_GID, ()), (2000, ("me", "ann")), (3000, ("me",))))


def folder_stat(mode: int, uid: int, gid: int) -> os.stat_result:
    return os.stat_result((stat.S_IFDIR | mode, 0, 0, 1, uid, gid, 0, 0, 0, 0))


@pytest.mark.parametrize("mode, gid, open_to_others", [
    (0o755, MY_GID, False), (0o775, MY_GID, False), (0o770, MY_GID, False),  # the owner's private group (umask 002)
    (0o775, 1001, True),  # another user's private group
    (0o775, SHARED_GID, True),  # a primary group other users share
    (0o775, 2000, True),  # a group listing other members
    (0o775, 3000, True),  # listing the owner alone, but not the owner's primary group
    (0o777, MY_GID, True), (0o757, MY_GID, True), (0o703, MY_GID, True),  # writable by everyone
    (0o1777, SHARED_GID, False), (0o1775, 2000, False),  # sticky: others may not rename or remove what is yours
], ids=lambda value: oct(value) if isinstance(value, int) and value > 0o700 else str(value))
def test_a_folder_writable_by_its_group_is_trusted_only_when_the_group_is_its_owners_private_one(
        mode: int, gid: int, open_to_others: bool) -> None:
    """Debian OpenSSH's user-group-modes: a user private group has the owner alone in it."""
    assert writable_by_others(folder_stat(mode, ME, gid), ACCOUNTS, folder=True) is open_to_others


def test_roots_private_group_is_private_to_root() -> None:
    assert not writable_by_others(folder_stat(0o775, 0, 0), ACCOUNTS, folder=True)
    assert writable_by_others(folder_stat(0o775, ME, 0), ACCOUNTS, folder=True)


@pytest.mark.parametrize("names, fix", [
    (["/srv/a b", "/srv"], "run chmod go-w '/srv/a b' /srv"),
    (["~/.config/ernie-image", "~"], "run chmod go-w ~/.config/ernie-image ~"),
    (["ComfyUI's user/ernie_image", "ComfyUI's user", "ComfyUI's user/..", "ComfyUI's user/../.."],
     "run chmod go-w on ComfyUI's user/ernie_image folder, ComfyUI's user folder, ComfyUI's folder, "
     "the folder 1 above ComfyUI's folder"),
])
def test_the_fix_is_a_shell_command_for_paths_and_words_for_comfyuis_folders(names: list[str], fix: str) -> None:
    assert shell_fix(names) == fix


def test_every_folder_others_can_change_is_named_in_one_line(tmp_path_factory, monkeypatch) -> None:
    top = tmp_path_factory.mktemp("shared")
    path = written(top / "a" / "b" / "keys.json", document(entry("gpu-box", GPU_BOX, env=KEY_VAR)))
    monkeypatch.setattr(Accounts, "of_system", classmethod(lambda cls: Accounts()))
    bad = [path.parent, path.parent.parent]
    for folder in bad:
        os.chmod(folder, 0o775)
    try:
        message = refused_at(path)
    finally:
        for folder in bad:
            os.chmod(folder, 0o755)
    assert message == (f"the folders {bad[0]}, {bad[1]} above the keys file can be changed by other users, who could "
                       f"put another keys file in their place and send your keys elsewhere: run chmod go-w {bad[0]} "
                       f"{bad[1]}")


def untrusted_keys_file(tmp_path_factory) -> Path:
    top = tmp_path_factory.mktemp("open")
    path = written(top / "a" / "keys.json", document(entry("gpu-box", GPU_BOX, env=KEY_VAR)))
    os.chmod(path.parent, 0o777)
    return path


def test_an_untrusted_keys_file_is_ignored_with_a_notice_while_no_server_needs_it(tmp_path_factory,
                                                                                  monkeypatch) -> None:
    path = untrusted_keys_file(tmp_path_factory)
    monkeypatch.setenv(KEYS_FILE_ENV, str(path))
    keys = ServerKeys.resolve(load_credentials(), ["http://127.0.0.1:1"])
    assert keys.bound == ()
    assert keys.notice == (f"the keys file is not used (no server here needs it): the folder {path.parent} holding "
                           f"the keys file can be changed by other users, who could put another keys file in its "
                           f"place and send your keys elsewhere: run chmod go-w {path.parent}")
    os.chmod(path.parent, 0o755)
    assert ServerKeys.resolve(load_credentials(), ["http://127.0.0.1:1"]).notice == ""


@pytest.mark.parametrize("url, label", [("http://127.0.0.1:1", "gpu-box"), ("http://127.0.0.1:1", "other"),
                                        (GPU_BOX, "")], ids=["its label", "any label", "a server bound there"])
def test_a_server_that_needs_an_untrusted_keys_file_is_refused(tmp_path_factory, monkeypatch, url: str,
                                                               label: str) -> None:
    path = untrusted_keys_file(tmp_path_factory)
    monkeypatch.setenv(KEYS_FILE_ENV, str(path))
    message = refused(ServerKeys.resolve, load_credentials(), [url], label)
    assert "needs the keys file, which is not used: the folder" in message and f"chmod go-w {path.parent}" in message


OTHER_UID = 54321  # nobody's: a user who is not the one running the tests, nor root


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="giving a file to another user needs root")
@pytest.mark.parametrize("whose", ["the keys file", "its folder", "the folder above"])
def test_a_keys_file_or_folder_of_another_user_is_refused(tmp_path_factory, whose: str) -> None:
    top = tmp_path_factory.mktemp("owned")
    path = written(top / "a" / "keys.json", document(entry("gpu-box", GPU_BOX, env=KEY_VAR)))
    owned = {"the keys file": path, "its folder": path.parent, "the folder above": path.parent.parent}[whose]
    os.chown(owned, OTHER_UID, -1)
    try:
        message = refused_at(path)
    finally:
        os.chown(owned, os.getuid(), -1)
    if owned == path:
        assert message == (f"the keys file {path} belongs to another user (uid {OTHER_UID}), who decides where your "
                           f"keys go: write your own keys file (see the README)")
    else:
        assert message == (f"the folder {owned} holding the keys file belongs to another user (uid {OTHER_UID}), "
                           f"who could put another keys file in its place and send your keys elsewhere: keep the "
                           f"keys file in a folder of your own")


# --------------------------------------------------------------------------- how messages name the keys file
def comfy_keys_file(tmp_path: Path, text: str, mode: int = 0o600) -> tuple[Path, Path]:
    """ComfyUI's user folder under `tmp_path`/ComfyUI, and the keys file written in it."""
    user = tmp_path / "ComfyUI" / "user"
    return user, written(user / "ernie_image" / "keys.json", text, mode)


@pytest.mark.parametrize("text, mode, folder_mode, said", [
    ("{not json", 0o600, 0o755, "the keys file ComfyUI's user/ernie_image/keys.json is not valid JSON (line 1)"),
    (document(entry("lab", GPU_BOX, key=KEY)), 0o644, 0o755,
     "the keys file ComfyUI's user/ernie_image/keys.json holds a key and other users can read it: run chmod 600 "
     "ComfyUI's user/ernie_image/keys.json"),
    (document(entry("a", GPU_BOX, env=KEY_VAR)), 0o666, 0o755,
     "the keys file ComfyUI's user/ernie_image/keys.json can be changed by other users"),
    (document(entry("a", GPU_BOX, env=KEY_VAR)), 0o600, 0o777,
     "the folder ComfyUI's user/ernie_image holding the keys file can be changed by other users, who could put "
     "another keys file in its place and send your keys elsewhere: run chmod go-w on ComfyUI's user/ernie_image folder"),
    (document({"label": "a", "origin": GPU_BOX}), 0o600, 0o755,
     "entry 1 of the keys file ComfyUI's user/ernie_image/keys.json ('a') needs exactly one of env"),
])
def test_inside_comfyui_a_keys_file_error_names_it_by_comfyuis_user_folder_not_its_path(
        tmp_path: Path, text: str, mode: int, folder_mode: int, said: str) -> None:
    """Inside ComfyUI the error goes to /history, which anyone with the page reads: no install or home path in it.
    The fix still says what to change, where."""
    user, path = comfy_keys_file(tmp_path, text, mode)
    os.chmod(path.parent, folder_mode)
    try:
        message = refused(lambda: load_credentials(str(user)).for_server(GPU_BOX))
    finally:
        os.chmod(path.parent, 0o755)
    assert said in message and str(tmp_path) not in message
    # the command line, whose user gave the path, names it in full
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(KEYS_FILE_ENV, str(path))
        os.chmod(path.parent, folder_mode)
        try:
            assert str(path.parent) in refused(lambda: load_credentials().for_server(GPU_BOX))
        finally:
            os.chmod(path.parent, 0o755)


def test_inside_comfyui_a_folder_above_its_user_folder_is_named_relative_to_it(tmp_path: Path) -> None:
    user, path = comfy_keys_file(tmp_path, document(entry("a", GPU_BOX, env=KEY_VAR)))
    os.chmod(user.parent, 0o777)  # the ComfyUI folder itself
    try:
        message = refused_needing(str(user))
    finally:
        os.chmod(user.parent, 0o755)
    assert message.endswith("run chmod go-w on ComfyUI's folder") and str(tmp_path) not in message


def test_inside_comfyui_the_advice_on_binding_a_key_names_the_keys_file_without_its_path(tmp_path: Path,
                                                                                        monkeypatch) -> None:
    user = tmp_path / "ComfyUI" / "user"
    user.mkdir(parents=True)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "home" / ".config"))
    credentials = load_credentials(str(user))
    assert credentials.location == "ComfyUI's user/ernie_image/keys.json"
    assert credentials.how_to_bind(Origin.of(GPU_BOX)).endswith("to the keys file ComfyUI's user/ernie_image/keys.json")
    written(tmp_path / "home" / ".config" / "ernie-image" / "keys.json", "{broken", 0o600)
    assert refused(load_credentials, str(user)).startswith(
        "the keys file ~/.config/ernie-image/keys.json is not valid JSON"), "the home folder is ~"


# ---------------------------------------------------------------------------------- which key a server gets
@pytest.fixture
def two_servers(keys_file: WriteKeys, tmp_path: Path) -> Credentials:
    key_path = written(tmp_path / "pe.key", OTHER_KEY)
    keys_file(entry("gpu-box", GPU_BOX, env=KEY_VAR), entry("pe", PE_BOX, file=str(key_path)))
    return load_credentials()


def test_without_a_label_a_server_gets_the_key_bound_to_its_origin_and_an_unbound_server_none(
        two_servers: Credentials) -> None:
    assert two_servers.for_server(GPU_BOX).label == "gpu-box"
    assert two_servers.for_server("http://GPU-BOX:30000/sglang").label == "gpu-box", "the same origin"
    assert two_servers.for_server("https://pe.example.com:443").label == "pe"
    for unbound in ("http://gpu-box:30001", "https://gpu-box:30000", "http://pe.example.com", "http://attacker:30000"):
        assert two_servers.for_server(unbound) is None


def test_a_label_picks_its_credential_for_the_server_it_is_bound_to(two_servers: Credentials) -> None:
    assert two_servers.for_server(GPU_BOX, " gpu-box ").label == "gpu-box"
    assert two_servers.for_server(PE_BOX, "pe", setting="pe_credential").read() == OTHER_KEY


@pytest.mark.parametrize("url", ["http://attacker:30000", "http://gpu-box:30001", "https://gpu-box:30000",
                                 "http://gpu-box"])
def test_a_label_bound_to_another_origin_is_refused_naming_how_to_bind_one(two_servers: Credentials,
                                                                           url: str) -> None:
    origin = Origin.of(url)
    assert refused(two_servers.for_server, url, "gpu-box") == (
        f"credential 'gpu-box' is not bound to {origin}: a key is sent only to the server it is bound to; add "
        f'{{"label": "NAME", "origin": "{origin}", "env": "VARIABLE"}} (or "file": PATH) to the keys file '
        f"{two_servers.location}, or leave credential empty")


def test_an_unknown_label_is_refused_naming_the_setting_and_how_to_bind_one(two_servers: Credentials) -> None:
    message = refused(two_servers.for_server, PE_BOX, "HF_TOKEN", setting="pe_credential")
    assert message.startswith("pe_credential is not the label of any credential of yours (what it holds is not "
                              "repeated, in case it is a key); those bound to https://pe.example.com:443: 'pe': add "
                              ) and "HF_TOKEN" not in message
    assert message.endswith(
        f'{{"label": "NAME", "origin": "https://pe.example.com:443", "env": "VARIABLE"}} (or "file": PATH) to the '
        f"keys file {two_servers.location} with that label, or leave pe_credential empty")
    assert "\x00" not in refused(two_servers.for_server, PE_BOX, "a\x00b")


def test_several_credentials_on_one_origin_need_a_label(keys_file: WriteKeys) -> None:
    keys_file(entry("alice", GPU_BOX, env=KEY_VAR), entry("bob", "HTTP://gpu-box:30000/", env=KEY_VAR))
    credentials = load_credentials()
    assert refused(credentials.for_server, GPU_BOX) == (
        f"several credentials are bound to {GPU_BOX} ('alice', 'bob'): pick one by its label in credential")
    assert credentials.for_server(GPU_BOX, "bob").label == "bob"


def test_a_credential_that_cannot_give_a_key_now_is_refused_when_it_is_chosen(keys_file: WriteKeys,
                                                                              tmp_path: Path) -> None:
    path = keys_file(entry("unset", GPU_BOX, env=UNSET_VAR), entry("pasted", PE_BOX, env=KEY),
                     entry("missing", "http://lab:1", file=str(tmp_path / "missing.key")))
    credentials = load_credentials()  # loading checks the file, not the sources: another label may still work
    assert refused(credentials.for_server, GPU_BOX).startswith(
        f"credential 'unset' (the keys file {path}): its env names a variable ({UNSET_VAR}) that this program's "
        f"environment does not have")
    assert "looks like a key rather than a variable name (not shown)" in refused(credentials.for_server, PE_BOX)
    assert refused(credentials.for_server, "http://lab:1") == (
        f"credential 'missing' (the keys file {path}): its file {tmp_path / 'missing.key'} is not a file: give the "
        f"path of a file holding only the key")


def test_one_label_resolves_for_every_server_of_a_pipe_only_if_each_is_its_origin(two_servers: Credentials) -> None:
    keys = ServerKeys.resolve(two_servers, [GPU_BOX, PE_BOX, "http://unbound:1"])
    assert keys.for_url(GPU_BOX).label == "gpu-box" and keys.for_url(PE_BOX + ":443").label == "pe"
    assert keys.for_url("http://unbound:1") is None and keys.advice.location == two_servers.location
    assert "is not bound to http://unbound:1" in refused(ServerKeys.resolve, two_servers, [GPU_BOX, "http://unbound:1"],
                                                         "gpu-box")


def test_a_key_the_command_line_names_is_bound_to_the_servers_of_that_command_line_only() -> None:
    credentials = Credentials.bound_to([GPU_BOX, "http://gpu-box:30000/", "http://10.0.0.5:30000"], KEY_VAR,
                                       env_flag="--api-key-env")
    assert [str(c.origin) for c in credentials.entries] == [GPU_BOX, "http://10.0.0.5:30000"]
    assert credentials.for_server(GPU_BOX).describe() == f"the API key (--api-key-env {KEY_VAR})"
    assert credentials.for_server("http://attacker:30000") is None
    assert Credentials.bound_to([GPU_BOX], " ", None) == Credentials(), "blank: no key"
    message = refused(Credentials.bound_to, [GPU_BOX], KEY, env_flag="--api-key-env")
    assert message.startswith("--api-key-env must be the NAME of an environment variable")


# ----------------------------------------------------------------------------------------------- sending
@pytest.fixture
def server() -> FakeSglang:
    with FakeSglang() as fake:
        yield fake


def authorizations(server: FakeSglang) -> list[str]:
    return [dict(request.headers).get("Authorization", "") for request in server.wire]


def test_a_key_from_a_variable_is_read_when_each_request_is_sent(server: FakeSglang, keys_file: WriteKeys,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    keys_file(entry("local", server.url, env=KEY_VAR))
    settings = HttpSettings(credential=load_credentials().for_server(server.url))
    get(HttpClient(server.url, settings))
    monkeypatch.setenv(KEY_VAR, OTHER_KEY)
    get(HttpClient(server.url, settings))
    assert authorizations(server) == [f"Bearer {KEY}", f"Bearer {OTHER_KEY}"]


def test_a_key_from_a_file_or_written_in_the_keys_file_is_read_when_each_request_is_sent(
        server: FakeSglang, keys_file: WriteKeys, tmp_path: Path) -> None:
    key_path = written(tmp_path / "server.key", KEY + "\n")
    path = keys_file(entry("by-file", server.url, file=str(key_path)), entry("written", server.url, key=KEY))
    credentials = load_credentials()
    by_file = HttpSettings(credential=credentials.for_server(server.url, "by-file"))
    written_in = HttpSettings(credential=credentials.for_server(server.url, "written"))
    get(HttpClient(server.url, by_file))
    get(HttpClient(server.url, written_in))
    written(key_path, OTHER_KEY)
    written(path, json.dumps({"credentials": [entry("by-file", server.url, file=str(key_path)),
                                              entry("written", server.url, key=OTHER_KEY)]}))
    get(HttpClient(server.url, by_file))
    get(HttpClient(server.url, written_in))
    assert authorizations(server) == [f"Bearer {KEY}"] * 2 + [f"Bearer {OTHER_KEY}"] * 2


def test_a_key_that_cannot_be_read_when_sending_is_one_line_and_nothing_is_sent(
        server: FakeSglang, keys_file: WriteKeys, monkeypatch: pytest.MonkeyPatch) -> None:
    path = keys_file(entry("env", server.url, env=KEY_VAR), entry("written", server.url, key=KEY))
    credentials = load_credentials()
    by_env = HttpClient(server.url, HttpSettings(credential=credentials.for_server(server.url, "env")))
    written_in = HttpClient(server.url, HttpSettings(credential=credentials.for_server(server.url, "written")))
    monkeypatch.delenv(KEY_VAR)
    assert refused(get, by_env, error=AuthenticationError) == (
        f"the environment variable {KEY_VAR} holding the API key is not set: export it before starting ComfyUI or "
        f"the CLI")
    written(path, json.dumps({"credentials": [entry("env", server.url, env=KEY_VAR)]}))
    assert refused(get, written_in, error=AuthenticationError) == (
        f"credential 'written' (the keys file {path}) has no key in {path} any more: write it again")
    monkeypatch.setenv(KEY_VAR, "sk-A\nB")
    assert "holds a line break or control character inside the API key" in refused(get, by_env,
                                                                                    error=AuthenticationError)
    assert server.wire == []


def test_a_client_refuses_a_credential_bound_to_another_origin(server: FakeSglang, keys_file: WriteKeys) -> None:
    keys_file(entry("gpu-box", GPU_BOX, env=KEY_VAR))
    credential = load_credentials().for_server(GPU_BOX)
    assert refused(HttpClient, server.url, HttpSettings(credential=credential)) == (
        f"credential 'gpu-box' (the keys file {load_credentials().location}) is bound to {GPU_BOX}, so it is not "
        f"sent to {server.url}: bind a key to {server.url} for that server")
    assert server.wire == []


def test_a_server_that_asks_for_a_key_it_was_not_given_names_how_to_bind_one(server: FakeSglang,
                                                                             keys_file_of_this_test: Path) -> None:
    server.api_key = KEY
    client = HttpClient(server.url, HttpSettings(keys=load_credentials()))
    message = refused(get, client, error=AuthenticationError)
    assert message == (f"{server.url} asks for an API key (HTTP 401): no key is bound to it: add "
                       f'{{"label": "NAME", "origin": "{server.url}", "env": "VARIABLE"}} (or "file": PATH) to the '
                       f"keys file {keys_file_of_this_test}")


@pytest.mark.parametrize("status, says", [(401, "asks for an API key"), (403, "denied access without an API key")])
def test_a_refusal_of_a_request_that_carried_no_key_never_speaks_of_the_key(keys_file_of_this_test: Path, status: int,
                                                                            says: str) -> None:
    from ernie_image.runtime.net.error_answers import status_error

    error = status_error("http://169.254.169.254", "GET", "http://169.254.169.254/health", status, "Forbidden", b"",
                         "text/plain", HttpSettings(keys=load_credentials()))
    assert str(error) == (f"http://169.254.169.254 {says} (HTTP {status}): no key is bound to it: add "
                          '{"label": "NAME", "origin": "http://169.254.169.254:80", "env": "VARIABLE"} (or "file": PATH) '
                          f"to the keys file {keys_file_of_this_test}")


def test_a_credential_never_shows_the_key_it_gives(keys_file: WriteKeys) -> None:
    keys_file(entry("written", GPU_BOX, key=KEY))
    credential: Credential = load_credentials().for_server(GPU_BOX)
    assert credential.read() == KEY
    for shown in (repr(credential), str(credential), credential.describe(), repr(HttpSettings(credential=credential)),
                  repr(HttpClient(GPU_BOX, HttpSettings(credential=credential)))):
        assert KEY not in shown


def test_a_keyless_remote_pipe_is_made_beside_an_untrusted_keys_file_and_says_so_once(tmp_path_factory,
                                                                                      monkeypatch) -> None:
    from ernie_image.runtime.remote.backend import RemotePipe, RemoteSettings

    path = untrusted_keys_file(tmp_path_factory)
    monkeypatch.setenv(KEYS_FILE_ENV, str(path))
    pipe = RemotePipe(["http://127.0.0.1:1"], RemoteSettings())
    assert pipe.keys.bound == () and pipe.keys.notice.startswith("the keys file is not used (no server here needs it)")
    message = refused(RemotePipe, ["http://127.0.0.1:1"], RemoteSettings(credential="gpu-box"))
    assert "credential 'gpu-box' needs the keys file, which is not used" in message
