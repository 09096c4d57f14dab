"""ErnieImageRemoteBackend: SGLang server URL(s) in, the same ERNIE_PIPE as the Loader out."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from ..runtime.errors import InvalidInputError
from .common import CATEGORY, PIPE_TYPE, shown_on_node
from .live_pipes import track

if TYPE_CHECKING:
    from ..runtime.remote.http import ApiKeySource

DEFAULT_URL = "http://127.0.0.1:30000"


def parse_urls(server_urls: str) -> list[str]:
    """One URL per line (commas work too); blank lines and # comments are skipped."""
    urls: list[str] = []
    for line in server_urls.replace(",", "\n").splitlines():
        url = line.split("#", 1)[0].strip()
        if url and url not in urls:
            urls.append(url)
    if not urls:
        raise InvalidInputError(f"no server URL given: write one SGLang server per line, e.g. {DEFAULT_URL}")
    return urls


def checked_key_source(api_key_env: str, api_key_file: str, widget_prefix: str = "") -> "ApiKeySource":
    """Where the key lives, checked by the runtime; the key itself is read only when a request is sent.
    `widget_prefix` names the widgets in the messages ("pe_" for the PE endpoint's)."""
    from ..runtime.remote.http import ApiKeySource

    return ApiKeySource.checked(api_key_env, api_key_file, env_label=f"{widget_prefix}api_key_env",
                                file_label=f"{widget_prefix}api_key_file", program="ComfyUI")


def chat_endpoint(pe_url: str, pe_model: str, pe_api_key_env: str, pe_api_key_file: str,
                  connect_timeout_s: float = 5.0) -> Optional[Any]:
    """The PE chat endpoint the widgets describe, checked now; None when pe_url is empty."""
    from ..runtime.remote.urls import normalize_base_url
    from ..runtime.text.remote_enhancer import ChatEndpoint

    url = pe_url.strip()
    if not url:
        return None
    key = checked_key_source(pe_api_key_env, pe_api_key_file, widget_prefix="pe_")
    endpoint = ChatEndpoint(url=url, model=pe_model.strip() or None, api_key_env=key.env_var, api_key_file=key.file,
                            connect_timeout_s=float(connect_timeout_s))
    normalize_base_url(endpoint.base_url(), what="pe_url")  # a malformed URL fails here, before anything is sent
    return endpoint


def make_remote_pipe(urls: list[str], connect_timeout_s: float, read_timeout_s: float,
                     api_key_env: Optional[str], api_key_file: Optional[str], pe_endpoint: Optional[Any] = None,
                     wait_for_servers_s: float = 600.0, resend_unanswered: bool = False) -> Any:
    from ..runtime.remote.backend import RemotePipe, RemoteSettings
    from ..runtime.remote.http import checked_seconds

    settings = RemoteSettings(
        api_key_env=api_key_env,
        api_key_file=api_key_file,
        connect_timeout_s=checked_seconds(connect_timeout_s, "connect_timeout_s"),
        read_timeout_base_s=checked_seconds(read_timeout_s, "read_timeout_s"),
        wait_for_servers_s=checked_seconds(wait_for_servers_s, "wait_for_servers_s", allow_zero=True),
        resend_unanswered=bool(resend_unanswered),
        pe_endpoint=pe_endpoint,
    )
    return RemotePipe(urls, settings)


def pe_endpoint_inputs(role: str) -> dict[str, Any]:
    """Optional widgets naming a PE chat endpoint (vLLM or SGLang serving the PE); the key only by name or path."""
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
        "pe_api_key_env": (
            "STRING",
            {"default": "", "tooltip": "NAME of the environment variable holding the PE server's API key. "
             "Never the key itself. Empty: no key."},
        ),
        "pe_api_key_file": (
            "STRING",
            {"default": "", "tooltip": "PATH of a file holding only the PE server's API key. Empty: no key file."},
        ),
    }


class ErnieImageRemoteBackend:
    DESCRIPTION = (
        "Runs ERNIE-Image on one or more SGLang diffusion servers instead of this machine. Outputs the same pipe "
        "as the Loader: connect it to a Sampler. Several URLs spread a batch and fail over. The API key is read "
        "from an environment variable or a key file, never stored in the workflow."
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
                     "tooltip": "Base seconds to wait for an image; it grows with steps and size."},
                ),
                "api_key_env": (
                    "STRING",
                    {"default": "", "tooltip": "NAME of the environment variable holding the server's API key "
                     "(e.g. SGLANG_API_KEY). Never the key itself. Empty: no key."},
                ),
                "api_key_file": (
                    "STRING",
                    {"default": "", "tooltip": "PATH of a file holding only the API key, read when a request is sent. "
                     "Empty: no key file."},
                ),
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
        }

    def connect(self, server_urls: str, connect_timeout_s: float, read_timeout_s: float, api_key_env: str,
                api_key_file: str, pe_url: str = "", pe_model: str = "", pe_api_key_env: str = "",
                pe_api_key_file: str = "", wait_for_servers_s: float = 600.0,
                resend_unanswered: bool = False) -> dict[str, Any]:
        urls = parse_urls(server_urls)
        key = checked_key_source(api_key_env, api_key_file)
        pe_endpoint = chat_endpoint(pe_url, pe_model, pe_api_key_env, pe_api_key_file, connect_timeout_s)
        pipe = track(make_remote_pipe(urls, connect_timeout_s, read_timeout_s, key.env_var, key.file, pe_endpoint,
                                      wait_for_servers_s, resend_unanswered))
        description = pipe.describe()
        return shown_on_node(description, pipe, description)
