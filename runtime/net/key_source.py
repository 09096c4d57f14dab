"""Where one API key is read from: an environment variable or a file the USER named (a CLI flag, the keys file).

Never the key itself: the key is read when a request is sent, so no object holds it. A workflow never names a
source (see credentials.py): only the user's own shell and configuration do.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ..core.errors import InvalidInputError
from .errors import AuthenticationError

MAX_KEY_FILE_BYTES = 4096  # a key is a few hundred bytes at most; anything larger is the wrong file
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# A variable name as people write them (ERNIE_SGLANG_KEY): upper-case words joined by "_". Keys are not written
# so (sk-..., ghp_MixedCase..., AKIA... without "_"), so only such a name is shown; any other value may be the key.
_PLAIN_ENV_NAME = re.compile(r"[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+")


@dataclass(frozen=True)
class ApiKeySource:
    """Where the API key comes from: an environment variable and/or a file. Never the key itself.

    The key is read at request time, so it is never stored in an object that could be pickled, logged or
    put into workflow JSON.
    """

    env_var: Optional[str] = None
    file: Optional[str] = None

    @classmethod
    def checked(cls, env_var: Optional[str], file: Optional[str], *, env_label: str = "the API key variable",
                file_label: str = "the API key file", program: str = "this program") -> "ApiKeySource":
        """The source the user named, checked before anything is sent; blank or None means none.

        The variable must be a valid name that `program`'s environment has (set and not blank) unless a key file
        is also given; the file must be a readable, non-empty file of at most MAX_KEY_FILE_BYTES. Raises
        InvalidInputError, one line, naming the setting by `env_label` / `file_label` (a widget or a CLI flag).
        A value that is not plainly a variable's name or a path may be the key itself, pasted in the wrong place,
        so no character of it appears in a message. The key itself is still read only when a request is sent.
        """
        env_name = (env_var or "").strip() or None
        key_file = (file or "").strip() or None
        if env_name is not None:
            _check_env_name(env_name, has_file=key_file is not None, label=env_label, program=program)
        if key_file is not None:
            _check_key_file(key_file, label=file_label)
        return cls(env_var=env_name, file=key_file)

    def describe(self) -> str:
        parts = []
        if self.env_var:
            parts.append(f"environment variable {self.env_var}")
        if self.file:
            parts.append(f"key file {self.file}")
        return " or ".join(parts) if parts else "no API key configured"

    def read(self) -> Optional[str]:
        """The key, or None when neither source is configured. A configured source that is empty is an error."""
        if self.env_var:
            value = (user_named_variable(self.env_var) or "").strip()
            if value:
                return header_safe(value, f"the environment variable {self.env_var}")
        if self.file:
            path = Path(self.file).expanduser()
            try:
                value = path.read_text(encoding="utf-8").strip()
            except OSError as exc:
                raise AuthenticationError(
                    f"cannot read the API key file {path} ({exc.strerror or type(exc).__name__}): "
                    f"check the path and its permissions", status=0
                ) from None
            if not value:
                raise AuthenticationError(f"the API key file {path} is empty: write the key into it", status=0)
            return header_safe(value, f"the API key file {path}")
        if self.env_var and not self.file:
            # The user named a variable that is not set: say so instead of silently sending no key.
            raise AuthenticationError(
                f"the environment variable {self.env_var} holding the API key is not set: export it "
                f"before starting ComfyUI or the CLI", status=0
            )
        return None


def user_named_variable(name: str) -> Optional[str]:
    """The value of the environment variable `name`, None when unset: the package's one read of a variable whose
    name is not written in the code. `name` comes only from the user, never from a workflow, a node input or a
    route: a --api-key-env flag typed in their own shell, or an "env" entry of their own keys file, which
    credentials.py refuses when others can write it (tests/test_secret_sources.py keeps it so, structurally;
    tests/test_secrets_attacks.py tries it as an attacker)."""
    return os.environ.get(name)


def header_safe(key: str, where: str) -> str:
    """The key, refused in one line (never shown) when it holds a line break or another control character, which
    no HTTP header may carry."""
    if any(ord(char) < 32 or ord(char) == 127 for char in key):
        raise AuthenticationError(f"{where} holds a line break or control character inside the API key: keep only "
                                  f"the key itself, on one line", status=0)
    return key


def _plain_name(value: str) -> Optional[str]:
    """`value` when it is plainly a variable's name (shown in full), else None: it may be a key, shown not at all."""
    return value if len(value) <= 64 and _PLAIN_ENV_NAME.fullmatch(value) else None


LOOKS_LIKE_A_KEY = "the value given looks like a key rather than a variable name (not shown)"


def _check_env_name(name: str, *, has_file: bool, label: str, program: str) -> None:
    if not _ENV_NAME.fullmatch(name):
        raise InvalidInputError(
            f"{label} must be the NAME of an environment variable (letters, digits, _): {LOOKS_LIKE_A_KEY}; put "
            f"the key in an environment variable and give its name, never the key itself"
        )
    if has_file:
        return  # an unset variable falls back to the key file, as ApiKeySource.read does
    shown = _plain_name(name)
    value = user_named_variable(name)
    if value is None:
        if shown is None:
            raise InvalidInputError(
                f"{label} names no variable of {program}'s environment, and {LOOKS_LIKE_A_KEY}: export the key in "
                f"a variable before starting {program} and give the variable's NAME, or give a key file")
        raise InvalidInputError(
            f"{label} names a variable ({shown}) that {program}'s environment does not have: export it "
            f"before starting {program}, or give a key file; write only the variable's NAME there, never the key"
        )
    if not value.strip():
        raise InvalidInputError(
            f"{label} names a variable ({shown or 'its name not shown'}) that is empty in {program}'s environment: "
            f"export the key in it before starting {program}, or give a key file"
        )


def _shown_path(value: str) -> Optional[str]:
    """A path as typed when it is plainly one (it exists, its folder does, or it ends in a file suffix such as .txt
    or .key); else None: it may be a pasted key, shown not at all. A path is no secret; the file's contents are."""
    path = os.path.expanduser(value)
    folder = os.path.dirname(path)
    if value.isprintable() and (os.path.exists(path) or (folder and os.path.isdir(folder))):
        return value
    suffix = os.path.splitext(path)[1][1:]
    if value.isprintable() and " " not in value and 1 <= len(suffix) <= 5 and suffix.isalnum():
        return value  # nokey.txt, keys/api.key: keys carry no such suffix
    return None


def _check_key_file(value: str, *, label: str) -> None:
    path = os.path.expanduser(value)
    fix = "give the path of a file holding only the key"
    shown = _shown_path(value)
    if shown is None:  # nothing exists there, so it is no file either
        raise InvalidInputError(f"{label} is not a file, and the value given looks like a key rather than a path "
                                f"(not shown): {fix}")
    if not os.path.isfile(path):
        raise InvalidInputError(f"{label} {shown} is not a file: {fix}")
    size = os.path.getsize(path)
    if size > MAX_KEY_FILE_BYTES:
        raise InvalidInputError(f"{label} {shown} is larger than {MAX_KEY_FILE_BYTES} bytes, so it is not a key "
                                f"file: {fix}")
    try:
        content = Path(path).read_bytes()
    except OSError:
        raise InvalidInputError(f"{label} {shown} cannot be read by this process: check its permissions") from None
    if not content.strip():
        raise InvalidInputError(f"{label} {shown} is empty: write the key into it")
