"""`RemotePipe`: the ErniePipe that runs on one or more SGLang servers.

The samplers call `generate(request, host)` exactly as on the local pipe. The work runs on the private event
loop thread; the calling thread (ComfyUI's worker, the CLI) waits in 0.1 s slices, checks the host for
Cancel, and forwards progress and notices to the host, so every host call happens on the caller's thread.
The server itself cannot cancel a generation: cancelling the run stops the wait, the server finishes the image
anyway.
Requests are checked exactly as the local pipe checks them (GenerationRequest.validate: no rounding, no clamping).
"""
from __future__ import annotations

import dataclasses
import queue
import time
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import torch

from ..core.errors import Cancelled, InvalidInputError, RemoteError, naming_line
from ..core.host import Host, show_progress_phase, show_status
from ..core.pipe import check_generate_call
from ..core.request import LOCAL_PIPE, GenerationRequest, GenerationResult, refuse_image_inputs
from ..core.variant import other_settings, own_settings, variant_words
from ..net.credentials import Credentials, ServerKeys, load_credentials
from ..net.loop_thread import run_soon, run_sync
from ..net.settings import HttpSettings, checked_seconds
from ..net.urls import normalize_base_url, server_label
from .fleet import Fleet, FleetSettings
from .sglang import ENDPOINT_SUFFIXES, GeneratedImage, ImageParams, ReadTimeoutPolicy, ServerModel

if TYPE_CHECKING:
    from ..text.enhancer import RevisedPrompts
    from ..text.remote_enhancer import ChatEndpoint

URLS_SETTING = "urls"  # RemotePipe's servers, named in lines for a front end to show its own name (--server)
READ_TIMEOUT_SETTING = "read_timeout_s"  # the base read timeout as the node names it (the CLI: --read-timeout)
# Scheduler shift of both released checkpoints; the server uses its own scheduler config, shift is not sent.
SERVER_SHIFT = 4.0
REMOTE_LORA_REFUSAL = (
    "LoRAs run only on a local pipe: SGLang's /v1/set_lora loads LoRA files from the server's own disk, which this "
    f"pack does not drive yet; run LoRAs on {LOCAL_PIPE}, or load the LoRA on the server yourself")


@dataclass(frozen=True)
class RemoteSettings:
    """Everything the Remote Backend node exposes. No secret here, nor where one is read from: the user's
    bindings (net/credentials.py) decide which key each server gets; `credential` may only pick one by its label.
    `credentials` None: the user's keys file (load_credentials)."""

    credentials: Optional[Credentials] = None
    credential: str = ""
    connect_timeout_s: float = 5.0
    read_timeout_base_s: float = 120.0
    read_timeout_per_step_megapixel_s: float = 3.0
    read_timeout_scale: float = 1.0
    retry_attempts: int = 4
    retry_down_after_s: float = 10.0
    max_response_mb: int = 256
    wait_for_servers_s: float = 600.0  # how long a batch waits while no server can take work (loading, refused)
    resend_unanswered: bool = False  # send an image again after it got no answer: the server may be running it
    probe_every_s: float = 1.0  # how often a server that is not ready (loading, refused) is asked again
    # Baidu's "Method 2": the PE on its own OpenAI-compatible chat server. When set, prompts of a request with
    # use_pe are revised there and the DiT server gets the revised prompts with its own PE off.
    pe_endpoint: Optional["ChatEndpoint"] = None

    def validate(self) -> None:
        """Refuse a timeout or wait that cannot work (NaN, 0, negative) in one line, before anything is sent."""
        checked_seconds(self.connect_timeout_s, "connect timeout")
        checked_seconds(self.read_timeout_base_s, "read timeout")
        checked_seconds(self.read_timeout_per_step_megapixel_s, "read timeout per step and megapixel", allow_zero=True)
        checked_seconds(self.read_timeout_scale, "read timeout scale")
        checked_seconds(self.retry_down_after_s, "retry pause", allow_zero=True)
        checked_seconds(self.wait_for_servers_s, "wait for servers", allow_zero=True)
        checked_seconds(self.probe_every_s, "probe interval")

    def server_keys(self, urls: Sequence[str]) -> ServerKeys:
        """The credential each server gets, checked now (one line for a label that cannot be used)."""
        credentials = self.credentials if self.credentials is not None else load_credentials()
        return ServerKeys.resolve(credentials, urls, self.credential)

    def fleet_settings(self, keys: ServerKeys = ServerKeys()) -> FleetSettings:
        return FleetSettings(
            http=HttpSettings.of(
                credential=None, connect_timeout_s=self.connect_timeout_s, read_timeout_s=self.read_timeout_base_s,
                retry_attempts=self.retry_attempts, max_response_mb=self.max_response_mb, keys=keys.advice,
                read_timeout_setting=READ_TIMEOUT_SETTING),
            keys=keys,
            read_timeout=ReadTimeoutPolicy(base_s=self.read_timeout_base_s,
                                           per_step_megapixel_s=self.read_timeout_per_step_megapixel_s,
                                           scale=self.read_timeout_scale),
            retry_down_after_s=self.retry_down_after_s,
            wait_for_servers_s=self.wait_for_servers_s,
            resend_unanswered=self.resend_unanswered,
            probe_every_s=self.probe_every_s,
        )


def image_jobs(request: GenerationRequest) -> list[ImageParams]:
    """One request per image: SGLang 0.5.23 fails n > 1 for ERNIE, so the batch is seed, seed+1, ..."""
    return [
        ImageParams(prompt=prompt, negative_prompt=request.negative_prompt, width=request.width,
                    height=request.height, steps=request.steps, guidance_scale=request.cfg,
                    seed=request.seed + index, use_pe=request.use_pe)
        for index, prompt in enumerate(request.prompt_list())
    ]


def summarize(images: Sequence[GeneratedImage], wall_s: float) -> str:
    lines = []
    for index, image in enumerate(images):
        inference = f"{image.inference_time_s:.2f} s" if image.inference_time_s is not None else "n/a"
        memory = f"{image.peak_memory_mb:.0f} MB" if image.peak_memory_mb is not None else "n/a"
        lines.append(f"image {index + 1}: seed {image.seed}, {image.server}, inference {inference}, peak memory {memory}")
    lines.append(f"{len(images)} image(s) in {wall_s:.2f} s wall time")
    return "\n".join(lines)


class RemotePipe:
    """ErniePipe over SGLang servers. Safe to share between prompts; release() closes the connections."""

    kind = "remote"

    def __init__(self, urls: Sequence[str], settings: RemoteSettings = RemoteSettings()) -> None:
        self.settings = settings
        self.urls = [u for u in (u.strip() for u in urls) if u]
        # Fail on a bad URL, setting or credential now (the node shows it at once), before any connection is tried.
        settings.validate()
        for url in self.urls:
            normalize_base_url(url, endpoint_suffixes=ENDPOINT_SUFFIXES)
        self.keys = settings.server_keys([normalize_base_url(url) for url in self.urls])
        self._keys_notice = self.keys.notice  # said once, with the first run's notices
        if settings.pe_endpoint is not None:
            normalize_base_url(settings.pe_endpoint.base_url(), what="PE endpoint URL")
            if settings.pe_endpoint.credential is not None:
                settings.pe_endpoint.credential.check()
        Fleet(self.urls, settings.fleet_settings(self.keys))
        self._fleet: Optional[Fleet] = None
        # A pipe ComfyUI drops from its cache (a changed widget replaces it) closes its connections as it goes.
        self._built: list[Fleet] = []
        finalizer = weakref.finalize(self, _close_soon, self._built)
        finalizer.atexit = False

    def __repr__(self) -> str:
        return f"RemotePipe({', '.join(server_label(url) for url in self.urls)})"

    def _get_fleet(self) -> Fleet:
        if self._fleet is None:
            async def build() -> Fleet:  # asyncio objects of the fleet belong to the private loop
                return Fleet(self.urls, self.settings.fleet_settings(self.keys))
            self._fleet = run_sync(build())
            self._built.append(self._fleet)
        return self._fleet

    def _close_connections(self) -> None:
        """After a failed or cancelled run: no connection stays open; the fleet's knowledge of its servers stays."""
        if self._fleet is not None:
            try:
                run_sync(self._fleet.close())
            except RemoteError:
                pass

    def describe(self) -> str:
        fleet = self._fleet or Fleet(self.urls, self.settings.fleet_settings(self.keys))  # no I/O: names and models
        lines = [f"remote: {len(fleet.slots)} SGLang server(s)"]
        for slot in fleet.slots:
            model = slot.model
            about = f" serving {model.named()} ({model.num_gpus} GPU, {model.dit_precision})" if model else ""
            lines.append(f"  {slot.label}{about}")
        if self.settings.pe_endpoint is not None:
            lines.append(f"prompt enhancer: chat endpoint {server_label(self.settings.pe_endpoint.base_url())} "
                         f"(the SGLang server gets the revised prompt with its PE off)")
        return "\n".join(lines)

    def with_loras(self, loras) -> "RemotePipe":
        """LoRAs are not sent to SGLang servers: refused in one line (REMOTE_LORA_REFUSAL)."""
        raise InvalidInputError(REMOTE_LORA_REFUSAL).naming(LOCAL_PIPE)

    def is_loaded(self) -> bool:
        """Whether connections to the servers are open (what `release` closes)."""
        return self._fleet is not None

    def has_enhancer(self) -> bool:
        """Whether `enhance` can run: only with a PE chat endpoint (SGLang's own PE never returns its text)."""
        return self.settings.pe_endpoint is not None

    def enhance(self, prompt: str, width: int, height: int, seed: int, temperature: float = 0.6, top_p: float = 0.95,
                max_new_tokens: int = 512, host: Optional[Host] = None) -> "RevisedPrompts":
        """The revised prompt for one prompt from the PE chat endpoint (the standalone enhancer node)."""
        from ..text.remote_enhancer import revise_prompts_remote

        if self.settings.pe_endpoint is None:
            raise InvalidInputError("this remote pipe has no PE endpoint (an SGLang server never returns the prompt "
                                    "its PE wrote): give one (pe_endpoint)").naming("pe_endpoint")
        return revise_prompts_remote(self.settings.pe_endpoint, [prompt], width, height, seed, temperature, top_p,
                                     max_new_tokens, host)

    def _revise(self, request: GenerationRequest, host: Host) -> tuple[GenerationRequest, Optional["RevisedPrompts"]]:
        """Method 2: prompts revised on the PE endpoint, then the request as the DiT server gets it (PE off)."""
        if not request.use_pe or self.settings.pe_endpoint is None:
            return request, None
        from ..text.remote_enhancer import revise_prompts_remote

        revised = revise_prompts_remote(self.settings.pe_endpoint, request.prompt_list(), request.width,
                                        request.height, request.seed, request.pe_temperature, request.pe_top_p,
                                        request.pe_max_new_tokens, host)
        return dataclasses.replace(request, prompts=tuple(revised.prompts), use_pe=False), revised

    def served_model(self, host: Host, images: int = 0) -> ServerModel:
        """The model of the first server that is ready (waiting for one as a batch would): its id is the only hint
        whether it serves Turbo or the base model. `images`: the batch it is sought for, named if none gets ready."""
        fleet = self._get_fleet()
        events: "queue.SimpleQueue[tuple[str, Any]]" = queue.SimpleQueue()

        def poll() -> None:
            _drain(events, host)
            host.check_cancel()

        try:
            return run_sync(fleet.first_model(lambda message: events.put(("log", message)),
                                              on_wait=_waiting(events), images=images), poll)
        except BaseException:
            self._close_connections()
            raise
        finally:
            _drain(events, host)

    def served_variant(self, host: Host) -> str:
        """"turbo" when the first ready server serves a Turbo model, else "base" (ServerModel.variant)."""
        return self.served_model(host).variant

    def generate(self, request: GenerationRequest, host: Host) -> GenerationResult:
        check_generate_call(request, host)
        refuse_image_inputs(request, "the remote SGLang backend (SGLang serves ERNIE-Image as text-to-image only: "
                                     "its /v1/images/edits refuses input images)")
        from ..step_cache.view import refuse_remote

        refuse_remote(request)
        # The local pipe's rules and messages, before anything is sent: a size it refuses is refused here too (the
        # steps and CFG left to the served model's defaults cannot be wrong, whichever they turn out to be).
        request.with_defaults("base").validate()
        # The first ready server's model makes the whole batch (a server of another is set aside for it).
        model = self.served_model(host, images=len(request.prompt_list()))
        if request.steps is None or request.cfg is None:  # the served variant's defaults, as the local pipe does
            request = request.with_defaults(model.variant)
        _notice_other_variant(request, model, host)
        if self._keys_notice:
            host.log(self._keys_notice)
            self._keys_notice = ""
        as_run = request  # what the result records: before the PE's prompts replace the user's
        request, revised = self._revise(request, host)
        if request.shift != SERVER_SHIFT:
            host.log(f"shift {request.shift:g} is not sent: the SGLang server uses its own scheduler (shift {SERVER_SHIFT:g})")
        if request.unused_negative_notice():
            host.log(request.unused_negative_notice())
        jobs = image_jobs(request)
        fleet = self._get_fleet()
        events: "queue.SimpleQueue[tuple[str, Any]]" = queue.SimpleQueue()
        estimate_s = max(0.5, fleet.estimate_batch_seconds(jobs))
        start_notice = (f"sending {len(jobs)} image(s) to {len(fleet.slots)} SGLang server(s), "
                        f"{_estimate_text(fleet.estimate_batch_seconds(jobs), fleet.measured())}; "
                        f"cancelling the run stops the wait, but a server finishes an image it has started")
        sent_at: list[float] = []  # when the first image went out (appended on the loop thread)

        def first_sent() -> None:
            events.put(("log", start_notice))
            events.put(("status", f"sending {len(jobs)} image(s) to {len(fleet.slots)} SGLang server(s)"))
            sent_at.append(time.monotonic())  # after the notice: whoever sees this time finds the notice queued

        async def run() -> list[GeneratedImage]:
            return await fleet.generate(jobs, notify=lambda message: events.put(("log", message)),
                                        on_image=lambda index, image: events.put(("image", index)),
                                        on_first_send=first_sent, on_wait=_waiting(events), model=model,
                                        after_first_look=True)

        started = time.monotonic()
        done_images = 0
        # Progress in the batch's denoising steps, estimated from the time the servers are known to take (a server
        # reports none while it works); it stops one short of the end until the last image is in.
        total_steps = max(1, int(request.steps)) * len(jobs)

        counting = False

        def poll() -> None:  # on this thread every 0.1 s while the fleet works
            nonlocal done_images, counting
            sending = bool(sent_at)
            done_images += _drain(events, host)
            host.check_cancel()
            if sending:  # no progress while no server has an image: the wait has its own lines
                if not counting:
                    show_progress_phase(host, "sampling on the servers (estimated)", "step")
                    counting = True
                elapsed = time.monotonic() - sent_at[0]
                fraction = max(done_images / len(jobs), elapsed / estimate_s)
                host.progress(min(total_steps - 1, int(fraction * total_steps)), total_steps)

        try:
            images = run_sync(run(), poll)  # anything raised cancels the fleet's task; open connections close
        except Cancelled:
            self._close_connections()
            raise Cancelled("cancelled: stopped waiting for the SGLang server(s); a server cannot cancel and "
                            "finishes the image it started") from None
        except BaseException:
            self._close_connections()
            raise
        finally:
            _drain(events, host)
        if not counting:
            show_progress_phase(host, "sampling on the servers (estimated)", "step")
        host.progress(total_steps, total_steps)
        wall_s = time.monotonic() - started
        info = {
            "backend": "remote",
            "servers": [slot.label for slot in fleet.slots],
            "model": model.id,
            "variant": model.variant,
            "images": [
                {"seed": image.seed, "server": image.server, "inference_time_s": image.inference_time_s,
                 "peak_memory_mb": image.peak_memory_mb, "request_s": round(image.elapsed_s, 3)}
                for image in images
            ],
            "inference_time_s": [image.inference_time_s for image in images],
            "peak_memory_mb": [image.peak_memory_mb for image in images],
            "wall_time_s": round(wall_s, 3),
            "summary": summarize(images, wall_s),
            "prompt_enhancer": _pe_note(request, revised),
            **(revised.info() if revised is not None else {}),
        }
        return GenerationResult(
            images=torch.stack([image.image for image in images]),
            latents=None,
            prompts_used=request.prompt_list(),
            info=info,
            request=as_run if revised is None else as_run.as_enhanced(revised.enhanced),
        )

    def release(self) -> None:
        if self.settings.pe_endpoint is not None:  # what the PE server listed is asked again after a release
            from ..text.remote_enhancer import forget_listed_model

            forget_listed_model(self.settings.pe_endpoint)
        self._close_connections()
        self._fleet = None
        self._built.clear()


def _close_soon(built: list[Fleet]) -> None:
    """A dropped pipe's connections, closed on the private loop without waiting (a finalizer may run anywhere)."""
    for fleet in built:
        run_soon(fleet.close())
    built.clear()


def _notice_other_variant(request: GenerationRequest, model: ServerModel, host: Host) -> None:
    """Settings given for the other variant than the batch's model: a notice before anything is sent, naming the
    server and its model, and the two ways out: the model's own settings, or servers of the other model."""
    clause = other_settings(model.variant, request.settings_for, int(request.steps), float(request.cfg))
    if clause is None:
        return
    host.log(naming_line(f"{model.server} serves {model.id}, {model.variant_choice.text()}, but {clause}, or point "
                         f"{URLS_SETTING} at a server of {variant_words(request.settings_for)}",
                         own_settings(model.variant), URLS_SETTING))


def _estimate_text(seconds: float, measured: bool) -> str:
    if not measured:
        return "time known after the first image"
    return f"about {seconds:.1f} s" if seconds < 10 else f"about {seconds:.0f} s"


def _pe_note(request: GenerationRequest, revised: Optional["RevisedPrompts"]) -> str:
    if revised is not None:
        return "run on the PE chat endpoint; the DiT server got the revised prompt with its PE off"
    return "run on the server; its rewritten prompt is not returned" if request.use_pe else "off"


def _waiting(events: "queue.SimpleQueue[tuple[str, Any]]") -> Callable[[str, float, float], None]:
    """The fleet's waiting state, for the host: shown where the run is shown (a node's text)."""
    def on_wait(line: str, waited_s: float, wait_s: float) -> None:
        events.put(("wait", (line, waited_s, wait_s)))
    return on_wait


def _drain(events: "queue.SimpleQueue[tuple[str, Any]]", host: Host) -> int:
    images = 0
    while True:
        try:
            kind, value = events.get_nowait()
        except queue.Empty:
            return images
        if kind == "log":
            host.log(value)
        elif kind == "status":
            show_status(host, value)
        elif kind == "wait":  # the progress bar stays in the batch's steps; the node's text says what it waits for
            show_status(host, value[0])
        elif kind == "image":
            images += 1
