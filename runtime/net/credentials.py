"""Which API key goes to which server: bindings the user makes on the machine, never the workflow's choice.

As .netrc and git's credential helpers bind a password to a host, a credential binds one key to one server
ORIGIN (scheme, host, port). The user binds keys in one of two places:
- the keys file, a JSON file only the user writes (`keys_file_candidates`: KEYS_FILE_ENV names it; else
  `<ComfyUI user directory>/ernie_image/keys.json` inside ComfyUI, then `~/.config/ernie-image/keys.json`):
      {"credentials": [{"label": "gpu-box", "origin": "http://gpu-box:30000", "env": "SGLANG_API_KEY"},
                       {"label": "pe", "origin": "https://pe.example.com", "file": "~/.config/pe.key"},
                       {"label": "lab", "origin": "http://10.0.0.5:30000", "key": "sk-..."}]}
  (a file holding a "key" itself must be readable by its owner only, as ssh asks of a private key; the file and
  the folders above it must be the user's (or root's) and not writable by others: keys_file.py);
- the command line's --api-key-env / --api-key-file, bound to the servers given on that same command line.

What a workflow may do: name a credential's LABEL (or nothing: each server then gets the key bound to its own
origin, if any). It never names a variable or a file, and learns nothing of a key's value. A label that does not
exist, or is bound to another origin than the server's, is refused in one line that says how to bind one.
The key is read only when a request is sent (no object holds it) and HttpClient sends it only to its origin:
never to another, never after a redirect (none is followed), never in a URL.
"""
from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence
from urllib.parse import urlsplit

from ..core.errors import InvalidInputError
from .errors import AuthenticationError
from .key_source import ApiKeySource, header_safe
from .keys_file import KeysFile, UntrustedKeysFile, keys_file_names
from .urls import shown_url

KEYS_FILE_ENV = "ERNIE_IMAGE_KEYS_FILE"
KEYS_FILE_NAME = "keys.json"
COMFY_KEYS_FOLDER = "ernie_image"  # inside ComfyUI's user directory, beside (not inside) the per-user folders
MAX_KEYS_FILE_BYTES = 1024 * 1024
DEFAULT_PORTS = {"http": 80, "https": 443}
ENTRY_FIELDS = frozenset({"label", "origin", "env", "file", "key"})
SOURCE_FIELDS = ("env", "file", "key")
MAX_LABEL_CHARS = 64


@dataclass(frozen=True)
class Origin:
    """Where a key may go: scheme, host and port, as browsers draw the line between sites."""

    scheme: str
    host: str
    port: int

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}"

    @classmethod
    def of(cls, url: str) -> "Origin":
        """The origin of a URL already checked by urls.normalize_base_url (its path, if any, is left out)."""
        parts = urlsplit(url)
        scheme = parts.scheme.lower()
        try:
            port = parts.port
        except ValueError:  # normalize_base_url refuses such a URL first; never a traceback all the same
            raise InvalidInputError(f"{shown_url(url)!r} has a port that is not a number: give one like "
                                    f"http://gpu-box:30000") from None
        return cls(scheme, (parts.hostname or "").lower(),
                   DEFAULT_PORTS.get(scheme, 0) if port is None else port)  # ":0" is no default port

    @classmethod
    def parse(cls, text: Any, where: str) -> "Origin":
        """An origin as the user writes it in the keys file: scheme://host[:port], nothing else."""
        fix = f"write it as scheme://host:port, e.g. http://gpu-box:30000 ({where})"
        if not isinstance(text, str) or not text.strip():
            raise InvalidInputError(f"an origin is missing or not text: {fix}")
        value = text.strip()
        try:
            parts = urlsplit(value)
            port = parts.port
        except ValueError:
            raise InvalidInputError(f"the origin {value[:80]!r} cannot be read: {fix}") from None
        if parts.scheme.lower() not in DEFAULT_PORTS or not parts.hostname:
            raise InvalidInputError(f"the origin {value[:80]!r} needs http:// or https:// and a host: {fix}")
        if port == 0:
            raise InvalidInputError(f"the origin {value[:80]!r} has port 0, which no server listens on: {fix}")
        if "@" in parts.netloc:
            raise InvalidInputError(f"an origin holds a user name or password: {fix}; the key goes in env, file "
                                    f"or key")
        if parts.path not in ("", "/") or parts.query or parts.fragment:
            raise InvalidInputError(f"the origin {value[:80]!r} has a path, query or fragment: a key is bound to a "
                                    f"whole server; {fix}")
        return cls.of(f"{parts.scheme}://{parts.netloc}")


@dataclass(frozen=True)
class Credential:
    """One key bound to one origin. Holds where the key is read from, never the key."""

    label: str
    origin: Origin
    source: ApiKeySource = ApiKeySource()  # a variable or a file
    keys_file: Optional[KeysFile] = None  # the keys file it is written in; set alone when the key is written there
    given_by: str = ""  # how the user gave it, for messages: "the keys file ..." or "--api-key-env"

    def describe(self) -> str:
        name = f"credential {self.label!r}" if self.label else "the API key"
        return f"{name} ({self.given_by or self.source.describe()})"

    def check(self) -> None:
        """Refuse, in one line and before anything is sent, a source that cannot give a key now."""
        if self.source.env_var or self.source.file:
            ApiKeySource.checked(self.source.env_var, self.source.file, env_label=f"{self.describe()}: its env",
                                 file_label=f"{self.describe()}: its file", program="this program")
        else:
            _written_key(self)

    def read(self) -> str:
        """The key, read now; AuthenticationError (status 0) in one line when it cannot be read."""
        if self.source.env_var or self.source.file:
            key = self.source.read()
            if key:
                return key
            raise AuthenticationError(f"{self.describe()} gives no key: set it", status=0)
        return _written_key(self)


@dataclass(frozen=True)
class Credentials:
    """The user's bindings, and where they are written (named in the advice on binding one)."""

    entries: tuple[Credential, ...] = ()
    location: str = ""  # the keys file read, or the one the user would write, as messages name it
    # A keys file others could change is not used: why (its refusal, one line), and the origins it binds keys to.
    # A server that needs it (its label asked for, or its origin bound there) is refused with that line.
    untrusted: str = ""
    untrusted_origins: tuple[Origin, ...] = ()

    def notice(self) -> str:
        """One line for the user when the keys file was ignored, else ""."""
        return f"the keys file is not used (no server here needs it): {self.untrusted}" if self.untrusted else ""

    @classmethod
    def bound_to(cls, urls: Sequence[str], env_var: Optional[str] = None, file: Optional[str] = None, *,
                 env_flag: str = "the API key variable", file_flag: str = "the API key file",
                 program: str = "this program") -> "Credentials":
        """One key the user names (the CLI's --api-key-env/--api-key-file, a library caller), checked now, bound to
        each server in `urls` (and to no other)."""
        source = ApiKeySource.checked(env_var, file, env_label=env_flag, file_label=file_flag, program=program)
        if source.env_var is None and source.file is None:
            return cls()
        given_by = f"{env_flag} {source.env_var}" if source.env_var else f"{file_flag} {source.file}"
        origins = dict.fromkeys(Origin.of(url) for url in urls)
        return cls(tuple(Credential("", origin, source, given_by=given_by) for origin in origins))

    def how_to_bind(self, origin: Origin) -> str:
        where = f"the keys file {self.location}" if self.location else "the keys file"
        return (f'add {{"label": "NAME", "origin": "{origin}", "env": "VARIABLE"}} (or "file": PATH) to '
                f"{where}")

    def for_server(self, url: str, label: str = "", *, setting: str = "credential") -> Optional[Credential]:
        """The credential for the server at `url`: the one labelled `label`, which must be bound to the server's
        origin, or with no label the one bound to that origin (None: the server gets no key). Checked now."""
        origin = Origin.of(url)
        label = (label or "").strip()
        if self.untrusted and (label or origin in self.untrusted_origins):
            needs = f"{setting} {label!r}" if label else f"{origin}, bound to a key there,"
            raise UntrustedKeysFile(f"{needs} needs the keys file, which is not used: {self.untrusted}")
        if label:
            credential = self._labelled(label, setting, origin)
            if credential.origin != origin:
                raise InvalidInputError(
                    f"{setting} {label!r} is not bound to {origin}: a key is sent only to the server it is bound to; "
                    f"{self.how_to_bind(origin)}, or leave {setting} empty")
        else:
            bound = [entry for entry in self.entries if entry.origin == origin]
            if len(bound) > 1:
                labels = ", ".join(repr(entry.label) for entry in bound)
                raise InvalidInputError(f"several credentials are bound to {origin} ({labels}): pick one by its label "
                                        f"in {setting}")
            if not bound:
                return None
            credential = bound[0]
        credential.check()
        return credential

    def _labelled(self, label: str, setting: str, origin: Origin) -> Credential:
        for entry in self.entries:
            if entry.label == label:
                return entry
        # Never shown: a key pasted where its label belongs would go into the node's error, the log and /history.
        bound = [entry.label for entry in self.entries if entry.origin == origin]
        yours = f"; those bound to {origin}: {', '.join(repr(b) for b in bound)}" if bound else ""
        raise InvalidInputError(f"{setting} is not the label of any credential of yours (what it holds is not "
                                f"repeated, in case it is a key){yours}: {self.how_to_bind(origin)} with that label, "
                                f"or leave {setting} empty")


@dataclass(frozen=True)
class ServerKeys:
    """The credential each server of a pipe gets, resolved once when the pipe is made."""

    bound: tuple[tuple[Origin, Credential], ...] = ()
    advice: Credentials = Credentials()
    notice: str = ""  # the keys file was ignored, and why ("" when it was used or there is none)

    @classmethod
    def resolve(cls, credentials: Credentials, urls: Sequence[str], label: str = "",
                setting: str = "credential") -> "ServerKeys":
        bound: dict[Origin, Credential] = {}
        for url in urls:
            credential = credentials.for_server(url, label, setting=setting)
            if credential is not None:
                bound[Origin.of(url)] = credential
        return cls(tuple(bound.items()), Credentials(location=credentials.location), credentials.notice())

    def for_url(self, url: str) -> Optional[Credential]:
        origin = Origin.of(url)
        return next((credential for bound, credential in self.bound if bound == origin), None)


# ------------------------------------------------------------------------------------------ the keys file
def keys_file_candidates(comfy_user_dir: Optional[str] = None) -> list[Path]:
    """Where the keys file is looked for, first found wins: KEYS_FILE_ENV alone when set."""
    override = os.environ.get(KEYS_FILE_ENV, "").strip()
    if override:
        return [Path(override).expanduser()]
    candidates = [Path(comfy_user_dir) / COMFY_KEYS_FOLDER / KEYS_FILE_NAME] if comfy_user_dir else []
    config_home = os.environ.get("XDG_CONFIG_HOME", "").strip() or os.path.join(os.path.expanduser("~"), ".config")
    return [*candidates, Path(config_home) / "ernie-image" / KEYS_FILE_NAME]


def load_credentials(comfy_user_dir: Optional[str] = None) -> Credentials:
    """The user's bindings from the first keys file found; none (naming where one would go) when there is none.
    Inside ComfyUI (`comfy_user_dir` given) messages name the file relative to its user folder or ~ (keys_file.py:
    an error there goes to /history), on the command line in full."""
    candidates = keys_file_candidates(comfy_user_dir)
    names = keys_file_names(comfy_user_dir)
    for path in candidates:
        if path.exists() or path.is_symlink():
            keys_file = KeysFile(path, names)
            try:
                return Credentials(tuple(_read_entries(keys_file)), keys_file.shown)
            except UntrustedKeysFile as refusal:
                return Credentials(location=keys_file.shown, untrusted=str(refusal),
                                   untrusted_origins=_origins_named(keys_file))
    if os.environ.get(KEYS_FILE_ENV, "").strip():
        raise InvalidInputError(f"{KEYS_FILE_ENV} names {names(candidates[0])}, which does not exist: write the keys "
                                f"file there or unset {KEYS_FILE_ENV}")
    return Credentials(location=names(candidates[0]))


def _read_document(keys_file: KeysFile) -> dict[str, Any]:
    path = keys_file.path
    where = f"the keys file {keys_file.shown}"
    if not path.is_file():
        raise InvalidInputError(f"{where} is not a regular file: write the keys there as JSON")
    keys_file.require_trusted()
    if path.stat().st_size > MAX_KEYS_FILE_BYTES:
        raise InvalidInputError(f"{where} is larger than {MAX_KEYS_FILE_BYTES // 1024} KiB: it is not a keys file")
    try:
        document = json.loads(path.read_bytes())
    except OSError as error:
        raise InvalidInputError(f"{where} cannot be read ({error.strerror or type(error).__name__}): check its "
                                f"permissions") from None
    except (ValueError, RecursionError) as error:
        line = f" (line {error.lineno})" if isinstance(error, json.JSONDecodeError) else ""
        raise InvalidInputError(f"{where} is not valid JSON{line}: fix it (the README's keys file section shows "
                                f"one)") from None
    if not isinstance(document, dict) or not isinstance(document.get("credentials"), list):
        raise InvalidInputError(f'{where} must be a JSON object {{"credentials": [...]}}: see the README\'s keys '
                                f"file section")
    return document


def _origins_named(keys_file: KeysFile) -> tuple[Origin, ...]:
    """The origins an untrusted keys file binds keys to, as far as they can be read (its keys are never used)."""
    try:
        document = json.loads(keys_file.path.read_bytes()[:MAX_KEYS_FILE_BYTES])
        raw_entries = document.get("credentials") if isinstance(document, dict) else None
    except (OSError, ValueError, RecursionError):
        return ()
    origins: list[Origin] = []
    for raw in raw_entries if isinstance(raw_entries, list) else ():
        try:
            origins.append(Origin.parse(raw.get("origin") if isinstance(raw, dict) else None, "the keys file"))
        except InvalidInputError:
            continue
    return tuple(dict.fromkeys(origins))


def _read_entries(keys_file: KeysFile) -> list[Credential]:
    document = _read_document(keys_file)
    entries: list[Credential] = []
    for index, raw in enumerate(document["credentials"]):
        where = f"entry {index + 1} of the keys file {keys_file.shown}"
        if not isinstance(raw, dict):
            raise InvalidInputError(f"{where} is not an object with label, origin and env, file or key")
        unknown = sorted(str(name)[:20] for name in raw if name not in ENTRY_FIELDS)
        if unknown:
            raise InvalidInputError(f"{where} has the unknown field {unknown[0]!r}: use label, origin and one of "
                                    f"env, file, key")
        label = raw.get("label")
        if not isinstance(label, str) or not label.strip() or len(label) > MAX_LABEL_CHARS or not label.isprintable():
            raise InvalidInputError(f"{where} needs a label: a short name (up to {MAX_LABEL_CHARS} printable "
                                    f"characters) that workflows may pick it by")
        label = label.strip()
        if any(entry.label == label for entry in entries):
            raise InvalidInputError(f"{where}: the label {label!r} is used twice: give each credential its own")
        origin = Origin.parse(raw.get("origin"), where)
        given = [name for name in SOURCE_FIELDS if raw.get(name) not in (None, "")]
        if len(given) != 1:
            raise InvalidInputError(f"{where} ({label!r}) needs exactly one of env (a variable's name), file (a "
                                    f"path) or key (the key itself)")
        entries.append(_entry(keys_file, label, origin, given[0], raw[given[0]], where))
    return entries


def _entry(keys_file: KeysFile, label: str, origin: Origin, kind: str, value: Any, where: str) -> Credential:
    if not isinstance(value, str):
        raise InvalidInputError(f"{where} ({label!r}): {kind} must be text")
    given_by = f"the keys file {keys_file.shown}"
    if kind == "env":
        return Credential(label, origin, ApiKeySource(env_var=value.strip()), given_by=given_by)
    if kind == "file":
        return Credential(label, origin, ApiKeySource(file=value.strip()), given_by=given_by)
    _require_private(keys_file)
    return Credential(label, origin, keys_file=keys_file, given_by=given_by)


def _require_private(keys_file: KeysFile) -> None:
    """A keys file that holds a key itself must not be readable by other users (ssh's rule for a private key)."""
    if os.name != "posix":
        return
    mode = keys_file.path.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        shown = keys_file.shown
        can = "read" if mode & (stat.S_IRGRP | stat.S_IROTH) else "change"
        raise UntrustedKeysFile(f"the keys file {shown} holds a key and other users can {can} it: run chmod 600 "
                                f"{shown}, or name a variable (env) or a file instead of writing the key")


def _written_key(credential: Credential) -> str:
    """The "key" written in the keys file for this credential, read from the file now."""
    keys_file = credential.keys_file or KeysFile(Path(""))
    for raw in _read_document(keys_file)["credentials"]:
        if isinstance(raw, dict) and str(raw.get("label", "")).strip() == credential.label:
            _require_private(keys_file)
            key = raw.get("key")
            if isinstance(key, str) and key.strip():
                return header_safe(key.strip(), f"{credential.describe()}'s key")
    raise AuthenticationError(f"{credential.describe()} has no key in {keys_file.shown} any more: write it again",
                              status=0)
