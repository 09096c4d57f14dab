"""The client for one SGLang diffusion server, speaking the protocol as measured on sglang 0.5.23.

SGLang's defaults are traps (seed 42, JPEG, 50 steps / CFG 5 even for Turbo, n > 1 fails for ERNIE, a
relative URL instead of the image), so every request sets every field explicitly.
"""
from __future__ import annotations

import asyncio
import dataclasses
import re
from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..core.request import SEED_MASK, SIDE_MULTIPLE
from ..core.variant import VariantChoice, name_variant
from ..net.client import HttpClient
from ..net.error_answers import server_text
from ..net.errors import (AuthenticationError, BadResponse, ConnectionLost, ServerFailed, ServerRejected,
                          ServerUnavailable)
from ..net.settings import HttpSettings, RetryPolicy
from ..net.urls import normalize_base_url, shown_url
from .image_answer import answered_images, decode_image

ERNIE_PIPELINE = "ErnieImagePipeline"
GENERATE_PATH = "/v1/images/generations"
# Paths the client adds itself: a base URL ending in one would make the server see /v1/v1/... or /health/health.
ENDPOINT_SUFFIXES = (GENERATE_PATH, "/v1/models", "/v1", "/health", "/server_info")
# Readiness probes must answer fast and must not be retried for long: the caller polls them.
PROBE_RETRY = RetryPolicy(attempts=1)
PROBE_READ_S = 10.0


@dataclass(frozen=True)
class ReadTimeoutPolicy:
    """How long to wait for one image: a base plus a budget per step and megapixel (slow cards, CPU offload)."""

    base_s: float = 120.0
    per_step_megapixel_s: float = 3.0
    scale: float = 1.0  # user knob: 2.0 doubles every wait

    def seconds(self, steps: int, width: int, height: int) -> float:
        megapixels = width * height / 1e6
        return self.scale * (self.base_s + self.per_step_megapixel_s * steps * max(megapixels, 0.0625))


# Baidu's releases by the folder name a download of them gets (`hf download baidu/ERNIE-Image-Turbo --local-dir
# ERNIE-Image-Turbo`): a server that loaded such a folder serves that release (ServerModel.identity).
RELEASE_FOLDERS = {"ernie-image": "baidu/ernie-image", "ernie-image-turbo": "baidu/ernie-image-turbo"}
_HF_CACHE = re.compile(r"models--([^/\\]+?)--([^/\\]+?)(?:[/\\]snapshots[/\\][^/\\]+)?$")


def _last_name(path: str) -> str:
    return re.split(r"[/\\]", path)[-1]


def _is_repo_id(text: str) -> bool:
    """`owner/name` as the Hugging Face Hub names a model (not a path: no leading /, ./ or ~, no backslash)."""
    return text.count("/") == 1 and "\\" not in text and not text.startswith(("/", ".", "~"))


def model_identity(loaded: str) -> str:
    """Which weights a server runs, from the model path it loaded (or its model id when it did not say): the same
    for two servers only when it is the same model. A Hugging Face repo id and that repo's cache folder
    (`.../models--baidu--ERNIE-Image-Turbo/snapshots/...`) are the repo (case aside); a folder named as one of Baidu's
    releases (RELEASE_FOLDERS) is that release; any other path is itself, exactly: two fine-tunes in different
    folders never count as one."""
    text = loaded.rstrip("/\\")
    cached = _HF_CACHE.search(text)
    if cached:
        return f"{cached.group(1)}/{cached.group(2)}".casefold()
    if _is_repo_id(text):
        return text.casefold()
    return RELEASE_FOLDERS.get(_last_name(text).casefold(), text)


@dataclass(frozen=True)
class ServerModel:
    id: str  # the served model name (/v1/models: --served-model-name, else the model path)
    pipeline_name: Optional[str]  # None: /v1/models did not say
    num_gpus: Optional[int]
    dit_precision: Optional[str]
    task_type: Optional[str]
    server: str = ""  # the server that listed it
    model_path: Optional[str] = None  # what the server loaded (/server_info); None: it did not say

    @property
    def is_ernie(self) -> bool:
        """The server says it runs ERNIE-Image's pipeline, or says no pipeline and the model id names ERNIE-Image
        (the only hint such a server gives)."""
        if self.pipeline_name is None:
            return "ernie-image" in self.id.lower()
        return self.pipeline_name == ERNIE_PIPELINE

    @property
    def identity(self) -> str:
        """Which weights it is (model_identity of the model path, else of the id): a batch is made by one."""
        return model_identity(self.model_path or self.id)

    @property
    def variant_choice(self) -> VariantChoice:
        """Turbo or the base model by what the server calls it, word by word (core/variant.py name_variant): the
        model path first (or the repo's name in a Hugging Face cache path), then the served name; the API gives
        no other hint."""
        for text, what in ((self.model_path, "model path"), (self.id, "model name")):
            if text:
                cached = _HF_CACHE.search(text.rstrip("/\\"))
                said = name_variant(cached.group(2) if cached else _last_name(text.rstrip("/\\")))
                if said is not None:
                    return VariantChoice(said, "name", f"by its {what}")
        return VariantChoice("base", "default", "by default: its names do not say which")

    @property
    def variant(self) -> str:
        """"turbo" or "base" (variant_choice)."""
        return self.variant_choice.variant

    def named(self) -> str:
        """The served name, with the model path when it is another ("ernie (/models/ERNIE-Image-Turbo)")."""
        return self.id if self.model_path in (None, self.id) else f"{self.id} ({self.model_path})"


READY = "ready"
LOADING = "loading"  # the server answers /health with 503: warming up; it will be ready
REFUSED = "refused"  # nothing listening: not started, still loading its weights (SGLang listens only after), or dead
UNHEALTHY = "unhealthy"  # /health 503 naming a failed worker, or a 5xx
UNREACHABLE = "unreachable"  # no such host, no answer to connect, or the connection broke


@dataclass(frozen=True)
class Readiness:
    state: str  # READY, LOADING, REFUSED, UNHEALTHY, UNREACHABLE
    detail: str  # the line for the user, naming the server
    cause: str = ""  # what the server did, in plain words, without its name or the fix (e.g. "still loading")

    @property
    def ready(self) -> bool:
        return self.state == "ready"


@dataclass(frozen=True)
class ImageParams:
    """One image as SGLang must be asked for it. Sizes must already be multiples of 16."""

    prompt: str
    negative_prompt: str
    width: int
    height: int
    steps: int
    guidance_scale: float
    seed: int
    use_pe: bool


@dataclass
class GeneratedImage:
    image: torch.Tensor  # float32 [H, W, 3] in 0..1
    seed: int
    server: str
    inference_time_s: Optional[float]
    peak_memory_mb: Optional[float]
    elapsed_s: float


def mask_seed(seed: int) -> int:
    """SGLang takes 0..2^63-1 (negative -> 400, larger overflows in its generator)."""
    return int(seed) & SEED_MASK


def build_payload(params: ImageParams, model: str) -> dict[str, Any]:
    if params.width % SIDE_MULTIPLE or params.height % SIDE_MULTIPLE:
        # The server would silently floor the size and the image would not match what was asked.
        raise ValueError(f"size {params.width}x{params.height} must be rounded to multiples of 16 first")
    return {
        "model": model,
        "prompt": params.prompt,
        "negative_prompt": params.negative_prompt,
        "width": params.width,
        "height": params.height,
        "num_inference_steps": int(params.steps),
        "guidance_scale": float(params.guidance_scale),
        "seed": mask_seed(params.seed),
        "n": 1,
        "response_format": "b64_json",
        "output_format": "png",
        "use_pe": bool(params.use_pe),
    }


def _number(value: Any) -> Optional[float]:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _text_field(entry: dict, name: str) -> Optional[str]:
    value = entry.get(name)
    return server_text(value, 60) if isinstance(value, str) else None


class SglangClient:
    """One SGLang server: readiness, discovery and one-image generation. Use on one event loop."""

    def __init__(self, base_url: str, settings: HttpSettings = HttpSettings(),
                 read_timeout: ReadTimeoutPolicy = ReadTimeoutPolicy(), probe_read_s: float = PROBE_READ_S,
                 probe_read_label: Optional[str] = None) -> None:
        self.http = HttpClient(normalize_base_url(base_url, endpoint_suffixes=ENDPOINT_SUFFIXES), settings)
        self.read_timeout = read_timeout
        self.probe_read_s = probe_read_s  # how long /health, /v1/models and /server_info are awaited
        self.probe_read_label = probe_read_label  # the setting that governs it, as the user knows it (None: fixed)
        self.model_id: Optional[str] = None

    @property
    def label(self) -> str:
        return self.http.label

    def __repr__(self) -> str:
        return f"SglangClient({self.label})"

    async def close(self) -> None:
        await self.http.close()

    # ---------------------------------------------------------------------------------- readiness
    async def health(self) -> Readiness:
        """What /health says, as far as the server lets it be told. Raises only what a wait cannot fix: a 4xx
        (wrong URL or path, refused key) or a body that is not SGLang's."""
        try:
            response = await self.http.request_json("GET", "/health", read_timeout_s=self.probe_read_s,
                                                    accept_statuses=frozenset({503}), retry=PROBE_RETRY,
                                                    small_answer=True)
        except ServerUnavailable as exc:
            return Readiness(REFUSED if exc.reason == "refused" else UNREACHABLE, str(exc), exc.cause)
        except ConnectionLost as exc:
            if exc.timed_out:
                advice = f"; raise {self.probe_read_label} if it is only slow" if self.probe_read_label else ""
                if exc.answered_in_part:
                    cause = f"/health answered too slowly (the whole answer took longer than {self.probe_read_s:g} s)"
                    return Readiness(UNREACHABLE, f"{self.label} answered GET /health too slowly: the whole answer took "
                                                  f"longer than {self.probe_read_s:g} s: the server is hung, overloaded "
                                                  f"or misbehaving (see its log){advice}", cause)
                cause = f"/health not answered within {self.probe_read_s:g} s (read timeout)"
                return Readiness(UNREACHABLE, f"{self.label} accepted the connection but sent no answer to GET /health "
                                              f"within {self.probe_read_s:g} s: the server is hung or overloaded (see "
                                              f"its log){advice}", cause)
            return Readiness(UNREACHABLE, str(exc), exc.cause)
        except ServerFailed as exc:
            return Readiness(UNHEALTHY, str(exc), f"/health failed (HTTP {exc.status})")
        except ServerRejected as exc:
            if exc.status not in (404, 405) or isinstance(exc, AuthenticationError):
                raise
            raise BadResponse(f"{self.label} answers HTTP {exc.status} on GET {shown_url(self.http.base_url + '/health')}: "
                              f"not an SGLang server (check the URL and port)") from None
        if response.status == 503:
            if isinstance(response.data, dict) and response.data.get("error"):
                cause = f"a worker failed ({str(response.data['error'])[:200]})"
                return Readiness(UNHEALTHY, f"{self.label}: {cause}; restart the server", cause)
            return Readiness(LOADING, f"{self.label} is loading (/health answers HTTP 503): it takes images once ready",
                             "still loading (/health answers HTTP 503)")
        return Readiness(READY, f"{self.label} is ready", "ready")

    # ---------------------------------------------------------------------------------- discovery
    async def models(self) -> list[ServerModel]:
        response = await self.http.request_json("GET", "/v1/models", read_timeout_s=self.probe_read_s,
                                                small_answer=True)
        data = response.data.get("data") if isinstance(response.data, dict) else None
        if not isinstance(data, list):
            raise BadResponse(f"{self.label}/v1/models has no model list: is this an SGLang diffusion server?")
        models = []
        for entry in data:
            if not isinstance(entry, dict) or not isinstance(entry.get("id"), str):
                continue
            num_gpus = entry.get("num_gpus")
            pipeline = entry.get("pipeline_name") or entry.get("pipeline_class")
            models.append(ServerModel(  # every text as it may be shown: it comes from a server nobody vetted
                id=server_text(entry["id"], 200),
                pipeline_name=server_text(pipeline, 200) if pipeline else None,
                num_gpus=int(num_gpus) if isinstance(num_gpus, int) else None,
                dit_precision=_text_field(entry, "dit_precision"),
                task_type=_text_field(entry, "task_type"),
                server=self.label,
            ))
        return models

    async def ernie_model(self) -> ServerModel:
        """The served ERNIE-Image model, with the path it loaded (/server_info); raises when the server serves
        something else."""
        model = self.choose_ernie(await self.models())
        return dataclasses.replace(model, model_path=await self._loaded_path())

    def choose_ernie(self, models: list[ServerModel]) -> ServerModel:
        """The ERNIE-Image model among the listed ones, used from now on; raises when there is none."""
        named = [model for model in models if model.is_ernie and model.pipeline_name is not None]
        for model in named or [model for model in models if model.is_ernie]:
            self.model_id = model.id
            return model
        start = "`sglang serve --model-path baidu/ERNIE-Image-Turbo` (or baidu/ERNIE-Image)"
        if models and all(model.pipeline_name is None for model in models):
            served = ", ".join(model.id for model in models)
            raise BadResponse(
                f"{self.label} serves {served} and names no pipeline for it (/v1/models), so ERNIE-Image could not be "
                f"confirmed: check the server's version (sglang 0.5.23 names its pipelines) and that it was started "
                f"with {start}"
            )
        served = ", ".join(f"{m.id} ({m.pipeline_name or 'pipeline not named'})" for m in models) or "nothing"
        raise BadResponse(f"{self.label} serves {served}, not an ERNIE-Image pipeline: start it with {start}")

    async def _server_info(self) -> dict:
        response = await self.http.request_json("GET", "/server_info", read_timeout_s=self.probe_read_s,
                                                small_answer=True)
        return response.data if isinstance(response.data, dict) else {}

    async def version(self) -> Optional[str]:
        version = (await self._server_info()).get("version")
        return server_text(version, 60) if version is not None else None

    async def _loaded_path(self) -> Optional[str]:
        """The model path the server loaded (/server_info `model_path`); None when it does not say (a proxy or a
        server without /server_info, a 5xx): the model id then stands for it."""
        try:
            path = (await self._server_info()).get("model_path")
        except AuthenticationError:
            raise
        except (ServerRejected, ServerFailed, BadResponse):
            return None
        return server_text(path, 200) if isinstance(path, str) and path else None

    # --------------------------------------------------------------------------------- generation
    async def generate(self, params: ImageParams, retry: Optional[RetryPolicy] = None) -> GeneratedImage:
        payload = build_payload(params, self.model_id or "")
        wait_s = self.read_timeout.seconds(params.steps, params.width, params.height)
        response = await self.http.request_json("POST", GENERATE_PATH, payload, read_timeout_s=wait_s, retry=retry)
        body = response.data
        (b64,) = answered_images(body, payload["n"], self.label)
        # decoding a large PNG takes tens of ms: off the loop, so other servers' responses keep flowing
        image = await asyncio.to_thread(decode_image, b64, params.width, params.height, self.label)
        return GeneratedImage(
            image=image,
            seed=payload["seed"],
            server=self.label,
            inference_time_s=_number(body.get("inference_time_s")),
            peak_memory_mb=_number(body.get("peak_memory_mb")),
            elapsed_s=response.elapsed_s,
        )
