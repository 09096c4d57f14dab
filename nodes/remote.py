"""ErnieImageRemoteBackend: SGLang server URL(s) in, the same ERNIE_PIPE as the Loader out."""
from __future__ import annotations

from typing import Any, Optional

from ..runtime.core.errors import InvalidInputError
from .comfy_names import speaks_comfy
from .common import CATEGORY, PIPE_TYPE, shown_on_node
from .live_pipes import track

DEFAULT_URL = "http://127.0.0.1:30000"


def parse_urls(server_urls: str, required: bool = True) -> list[str]:
    """One URL per line (commas work too); blank lines and # comments are skipped."""
    urls: list[str] = []
    for line in server_urls.replace(",", "\n").splitlines():
        url = line.split("#", 1)[0].strip()
        if url and url not in urls:
            urls.append(url)
    if not urls and required:
        raise InvalidInputError(f"no server URL given: write one SGLang server per line, e.g. {DEFAULT_URL}")
    return urls


# Widgets of earlier versions that named where a key is read from (any variable, any file): a workflow may no longer
# do that. Declared hidden so that ComfyUI hands their values over, and a workflow still carrying one is refused.
LEGACY_KEY_INPUTS = ("api_key_env", "api_key_file", "pe_api_key_env", "pe_api_key_file")
LEGACY_HIDDEN = {name: "ERNIE_LEGACY_KEY_SOURCE" for name in LEGACY_KEY_INPUTS}
CREDENTIAL_TOOLTIP = ("Label of one of YOUR API keys, from the keys file on this machine "
                      "(<ComfyUI>/user/ernie_image/keys.json, see the README). Empty: each server gets the key "
                      "bound to its own origin there, if any. A workflow never holds a key nor says where one is read.")


def refuse_legacy_key_inputs(values: dict[str, Any], credentials: Any, server_url: str) -> Optional[str]:
    """The credential label an old workflow's key widget maps to, or None when it carried none. Its value is a
    variable's name or a path; it maps only to a credential the user labelled with that very name and bound to
    `server_url`'s origin (Credentials.for_server checks both); anything else is refused in one line."""
    given = [(name, str(value).strip()) for name, value in values.items() if str(value or "").strip()]
    if not given:
        return None
    name, value = given[0]
    try:
        credentials.for_server(server_url, value, setting=name)
    except InvalidInputError:
        raise InvalidInputError(
            f"this workflow names where an API key is read from ({name}, a widget of earlier versions); a workflow "
            f"may no longer do that: bind the key to the server in your keys file ({credentials.location}) and "
            f"leave {'pe_' if name.startswith('pe_') else ''}credential empty, or pick it by its label") from None
    return value


def refuse_url_credentials(**urls: Optional[str]) -> "bool | str":
    """VALIDATE_INPUTS: a user name or password in a URL, or a query or fragment (where tokens are passed), is
    refused before the prompt is queued, so it never reaches the queue or /history. Links (None) are checked when
    the node runs."""
    from ..runtime.net.urls import shown_url

    for name, text in urls.items():
        if not isinstance(text, str):
            continue
        # server_urls lists URLs with # comments; pe_url is one URL, whose # would start a fragment
        given = parse_urls(text, required=False) if name == "server_urls" else [text.strip()] if text.strip() else []
        for url in given:
            if "@" in url.split("://", 1)[-1].split("/", 1)[0]:
                held = "holds a user name or password"
            elif "?" in url or "#" in url:
                held = "has a query or fragment (?... or #..., where tokens are passed)"
            else:
                continue
            return (f"{name}: {shown_url(url)} {held}, which a workflow would carry and ComfyUI would keep in its "
                    f"history: give the server's base URL only and bind its key in your keys file (see the README)")
    return True


def chat_endpoint(pe_url: str, pe_model: str, pe_credential: str, connect_timeout_s: float = 5.0,
                  legacy: Optional[dict[str, Any]] = None) -> Optional[Any]:
    """The PE chat endpoint the widgets describe, with the credential bound to its origin; None when pe_url is
    empty. Checked now, before anything is sent."""
    from ..runtime.net.urls import normalize_base_url
    from ..runtime.text.remote_enhancer import ChatEndpoint
    from .comfy_env import user_credentials

    url = pe_url.strip()
    if not url:
        return None
    credentials = user_credentials()
    base = normalize_base_url(ChatEndpoint(url=url).base_url(), what="pe_url")
    label = refuse_legacy_key_inputs(legacy or {}, credentials, base) or pe_credential
    return ChatEndpoint.bound(url, credentials, label, model=pe_model.strip() or None,
                              connect_timeout_s=float(connect_timeout_s))


def make_remote_pipe(urls: list[str], connect_timeout_s: float, read_timeout_s: float, credential: str = "",
                     pe_endpoint: Optional[Any] = None, wait_for_servers_s: float = 600.0,
                     resend_unanswered: bool = False, legacy: Optional[dict[str, Any]] = None) -> Any:
    from ..runtime.net.settings import checked_seconds
    from ..runtime.net.urls import normalize_base_url
    from ..runtime.remote.backend import RemotePipe, RemoteSettings
    from .comfy_env import user_credentials

    credentials = user_credentials()
    label = refuse_legacy_key_inputs(legacy or {}, credentials, normalize_base_url(urls[0])) or credential
    settings = RemoteSettings(
        credentials=credentials,
        credential=label,
        connect_timeout_s=checked_seconds(connect_timeout_s, "connect_timeout_s"),
        read_timeout_base_s=checked_seconds(read_timeout_s, "read_timeout_s"),
        wait_for_servers_s=checked_seconds(wait_for_servers_s, "wait_for_servers_s", allow_zero=True),
        resend_unanswered=bool(resend_unanswered),
        pe_endpoint=pe_endpoint,
    )
    return RemotePipe(urls, settings)


def pe_endpoint_inputs(role: str) -> dict[str, Any]:
    """Optional widgets naming a PE chat endpoint (vLLM or SGLang serving the PE); a key only by its label."""
    return {
        "pe_url": (
            "STRING",
            {"default": "", "tooltip": f"Base URL of an OpenAI-compatible chat server serving ERNIE-Image's prompt "
             f"enhancer (vLLM, SGLang), e.g. http://pe-box:8000. {role}"},
        ),
        "pe_model": (
            "STRING",
            {"default": "", "tooltip": "Model name on the PE server. Empty: the first model it lists at /v1/models."},
        ),
        "pe_credential": ("STRING", {"default": "", "tooltip": CREDENTIAL_TOOLTIP}),
    }


class ErnieImageRemoteBackend:
    DESCRIPTION = (
        "Runs ERNIE-Image on one or more SGLang diffusion servers instead of this machine. Outputs the same pipe "
        "as the Loader: connect it to a Sampler. Several URLs spread a batch and fail over. API keys are "
        "bound to servers in your keys file on this machine; a workflow can only pick one by its label."
    )
    CATEGORY = CATEGORY
    FUNCTION = "connect"
    RETURN_TYPES = (PIPE_TYPE, "STRING")
    RETURN_NAMES = ("pipe", "servers")
    OUTPUT_TOOLTIPS = ("The remote model, for a Sampler or Turbo Sampler.", "The servers this pipe uses.")

    @classmethod
    def INPUT_TYPES(cls) -> dict[str, Any]:
        return {
            "required": {
                "server_urls": (
                    "STRING",
                    {"multiline": True, "default": DEFAULT_URL,
                     "tooltip": "SGLang server base URLs, one per line (e.g. http://gpu-box:30000). "
                     "With several, images are spread over them and a failed server is skipped."},
                ),
                "connect_timeout_s": (
                    "FLOAT",
                    {"default": 5.0, "min": 0.5, "max": 120.0, "step": 0.5,
                     "tooltip": "Seconds to wait for a server to accept the connection before trying another."},
                ),
                "read_timeout_s": (
                    "FLOAT",
                    {"default": 120.0, "min": 5.0, "max": 3600.0, "step": 5.0,
                     "tooltip": "Base seconds a server has for its whole answer with an image (it grows with steps "
                     "and size); a server that answers slower, even byte by byte, is given up on."},
                ),
                "credential": ("STRING", {"default": "", "tooltip": CREDENTIAL_TOOLTIP}),
            },
            "optional": {
                **pe_endpoint_inputs(
                    "When set, a Sampler's use_pe revises the prompt there first and the SGLang server gets the "
                    "revised prompt with its own PE off (Baidu's Method 2); the Sampler outputs that prompt. Empty: "
                    "the SGLang server's own PE."
                ),
                # after the pe_ widgets: workflows saved before these existed keep their widget values in place
                "wait_for_servers_s": (
                    "FLOAT",
                    {"default": 600.0, "min": 0.0, "max": 86400.0, "step": 30.0,
                     "tooltip": "Seconds a Sampler waits while no server can take work (still loading its weights, "
                     "not started yet); Cancel stops the wait. 0: fail at once."},
                ),
                "resend_unanswered": (
                    "BOOLEAN",
                    {"default": False,
                     "tooltip": "Send an image again when its server gave no answer (read timeout, dropped "
                     "connection). That server may still be working on it, so the same job may run twice. "
                     "Off: the run stops and says so."},
                ),
            },
            "hidden": dict(LEGACY_HIDDEN),
        }

    @classmethod
    def VALIDATE_INPUTS(cls, server_urls: Optional[str] = None, pe_url: Optional[str] = None) -> "bool | str":
        return refuse_url_credentials(server_urls=server_urls, pe_url=pe_url)

    @speaks_comfy
    def connect(self, server_urls: str, connect_timeout_s: float, read_timeout_s: float, credential: str = "",
                pe_url: str = "", pe_model: str = "", pe_credential: str = "", wait_for_servers_s: float = 600.0,
                resend_unanswered: bool = False, **legacy: Any) -> dict[str, Any]:
        urls = parse_urls(server_urls)
        unknown = sorted(set(legacy) - set(LEGACY_KEY_INPUTS))
        if unknown:
            raise InvalidInputError(f"unknown input {unknown[0]!r}: update the pack or remove it from the workflow")
        pe_endpoint = chat_endpoint(pe_url, pe_model, pe_credential, connect_timeout_s,
                                    legacy={k: v for k, v in legacy.items() if k.startswith("pe_")})
        pipe = track(make_remote_pipe(urls, connect_timeout_s, read_timeout_s, credential, pe_endpoint,
                                      wait_for_servers_s, resend_unanswered,
                                      legacy={k: v for k, v in legacy.items() if not k.startswith("pe_")}))
        description = pipe.describe()
        return shown_on_node(description, pipe, description)
