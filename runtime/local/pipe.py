"""The in-process backend: text encoder, DiT and VAE as phases on one device.

Weights load lazily, phase by phase, straight from the (memory-mapped) files (parts.py). After a run, or after an
error or a cancel, device memory is released according to `keep_loaded`; nothing stays half-loaded.
"""
from __future__ import annotations

import gc
import threading
import time
import weakref
from typing import Any, Callable, Optional

import torch

from ..core.errors import ModelFileError, NamedLine
from ..core.host import Host, NullHost, held_unless_cancelled, wants_previews
from ..core.non_finite import refuse_non_finite
from ..core.pipe import check_generate_call
from ..core.request import VARIANT_DEFAULTS, GenerationRequest, GenerationResult, validate_size
from ..core.variant import Variant, VariantChoice, decide_variant, files_notices, set_by_user, settings_notice
from ..formats import open_component
from ..formats.scheduler_config import scheduler_notices
from ..formats.sources import ModelSources
from ..lora.stack import LoraStack
from ..model.builders import require_vae_encoder
from ..model.cancel_points import cancellable
from ..model.vae_decode import decode_images
from ..model.vae_encode import encode_images
from ..offload.device_memory import JobMemoryMeter
from ..offload.planner import budget_bytes
from ..offload.reserve import device_bytes_needed, phase_needs
from ..sampling.euler import initial_noise, length_grouped_denoiser, sample_euler
from ..sampling.image_in import (composite, init_latents, needs_encoding, pixel_mask,
                                  refuse_masks_repainting_nothing, start_state)
from ..sampling.preview_stream import PreviewStream
from ..text.encoder import encode_prompts
from .checks import (check_configs_build, check_finite_latents, check_pe_file, checked_load_arguments,
                     notice_empty_prompts, open_checked_parts)
from .description import describe_pipe
from .loaded_files import LoadedFiles
from .loras import PipeLoras
from .memory import PipeMemory, plans_pe
from .options import LoadOptions, resolve_device, resolve_dtype
from .out_of_memory import memory_refusal
from .compile_policy import DitWork
from .parts import PipeParts, choose_auto_quant
from .prompt_phase import revised_by_local_pe, revised_without_local_pe


class LocalPipe:
    kind = "local"

    def __init__(self, sources: ModelSources, options: LoadOptions, variant: Variant | VariantChoice,
                 loras=None) -> None:
        """`variant`: how LocalPipe.load decided it (VariantChoice), or a variant the caller sets."""
        options.validate()
        self.loras = LoraStack.of(loras)  # the pipe's own LoRA stack (empty: the base model); see with_loras
        self._lora = PipeLoras(self.loras, options.lora_mode)
        self.sources = sources
        self.options = options
        self.variant_choice = variant if isinstance(variant, VariantChoice) else set_by_user(variant)
        self.variant: Variant = self.variant_choice.variant
        self.device = resolve_device(options.device)
        self.dtype = resolve_dtype(options.dtype, self.device)
        # quant 'auto' decided once for this device and budget: the DiT is sized (the host's ask, the plan) in the
        # format it will be built in, not as bf16 until it is built.
        auto_quant = choose_auto_quant(options, self.device)
        planned_quant = auto_quant[0] if auto_quant is not None else options.quant
        self.memory = PipeMemory(self.device, self.dtype, options.vram_budget_gb, planned_quant)
        self.files = LoadedFiles()  # the files the parts are read from, as first opened (loaded_files.py)
        self.parts = PipeParts(sources, options, self.variant, self.device, self.dtype, self.memory, self._lora,
                               auto_quant, self.files)
        # Through a weak reference: a pipe dropped by its last owner (ComfyUI evicting its node cache) must be freed
        # at once by reference counting, with its pinned slabs, not at some later garbage collection.
        this = weakref.ref(self)
        self.memory.held_bytes = lambda: sum(pipe.device_bytes_held().values()) if (pipe := this()) else 0
        self._phase = "setup"  # the phase running now ("pe", "text", "dit", "vae"): named when memory runs out
        self.last_run: dict[str, Any] = {}  # the info of the last finished job (timings, device-memory peak)
        self.last_step_cache = None  # step_cache.session.StepCacheReport of the last sampling run, if it had one
        self._running = threading.RLock()
        self._said: set[str] = set()  # notices given once a pipe (its views share it)
        self.file_notices: tuple[str, ...] = ()  # what reading the parts' files decided (a file left unread)

    @classmethod
    def load(cls, sources: ModelSources, options: Optional[LoadOptions] = None, loras=None) -> "LocalPipe":
        """Check the files and prepare; weights are read on first use, one phase at a time.

        Every part's header is read here, so a missing, damaged or wrong file fails now, not after the text
        encoder and the whole sampling loop have run. `loras`: LoRA files (paths, (path, strength) pairs or
        lora.LoraEntry) every run of this pipe applies; they are read and checked here too. `sources` may be the
        model folder's path (ModelSources(model_dir=it))."""
        sources, options = checked_load_arguments(sources, options)
        from ..lora.parsed import check_lora_files

        check_lora_files(LoraStack.of(loras))  # a bad LoRA file fails first, before any model file is opened
        options.validate()
        opened = open_checked_parts(sources, options)
        pipe = cls(sources, options, decide_variant(opened["dit"], sources.variant), loras)
        check_configs_build(opened, pipe.variant, options.quant)  # on the meta device: a bad config.json fails now
        pipe.parts.note_dit_file(opened["dit"])  # what 'auto' runs is said before the DiT is built
        pipe._lora.resolve(pipe.loras, sources)
        pe = check_pe_file(sources, pipe.variant)
        # The files the variant, the configs and the checks were read from: the ones every run must read.
        for kind, component in opened.items():
            pipe.files.opened(kind, component.files)
        if pe is not None:
            pipe.files.opened("pe", pe.files)
        pipe.file_notices = tuple(line for component in (*opened.values(), pe) if component is not None
                                  for line in component.notices)
        return pipe

    def with_loras(self, loras, mode: Optional[str] = None):
        """A view of this pipe (same loaded model, no second copy) that runs with this pipe's LoRAs followed by
        `loras`; switching between views re-applies only the LoRA deltas, never reads the base weights again.
        `mode`: "merge" or "branch" for the entries that name none (None: LoadOptions.lora_mode)."""
        from .lora_view import LoraPipe

        return LoraPipe(self, self.loras).with_loras(loras, mode)

    def with_step_cache(self, step_cache):
        """A view of this pipe (same loaded model) that runs every job with `step_cache`: a StepCacheConfig, a spec
        such as 'dbcache:threshold=0.08', or None (this pipe itself). See docs/step-cache.md."""
        from ..step_cache.view import with_step_cache

        return with_step_cache(self, step_cache)

    @property
    def defaults(self) -> dict[str, float]:
        return VARIANT_DEFAULTS[self.variant]

    @property
    def compiles_dit(self) -> bool:
        """Whether the DiT's blocks are (or, once loaded, will be) compiled: asked for and possible here."""
        return self.parts.compiles_dit

    @property
    def dit_weights(self) -> str:
        """The DiT's weight format ("bf16", "FP8", "GGUF Q8_0", ...), once known."""
        return self.parts.dit_weights

    @property
    def quant_reason(self) -> str:
        """What quant 'auto' runs, and why ("" for any other quant)."""
        return self.parts.quant_reason

    def describe(self, request: Optional[GenerationRequest] = None) -> NamedLine:
        """The variant, device, formats and the VRAM plan (of the last job, else of `request` or a default 1024x1024
        job), recording the settings it names (errors.naming_line)."""
        return describe_pipe(self, request)

    def is_loaded(self) -> bool:
        """Whether any weights (text encoder, DiT, VAE, prompt enhancer) are held by this pipe."""
        return self.parts.any_loaded()

    # -- phases ---------------------------------------------------------------------------------------

    def encode_image(self, request: GenerationRequest, check_cancel: Callable[[], None]) -> Optional[torch.Tensor]:
        """The image-in phase: the original's normalised latents (a LATENT input as given, an IMAGE through the VAE
        encoder), or None when the job starts from pure noise. The encoder leaves the device after its phase
        unless the plan keeps everything resident. `check_cancel` runs between the encoder's layers."""
        given = init_latents(request)
        if given is not None or not needs_encoding(request):
            return given
        self._phase = "encode"
        tile = self.memory.plan.encode.tile if self.memory.plan is not None and self.memory.plan.encode else None
        encoder = self.parts.load_vae_encoder()
        with torch.inference_mode(), cancellable(encoder, check_cancel):
            latents = encode_images(request.init_image, encoder, tile)
        if not self.memory.encoder_is_persistent():
            self.parts.vae_encoder = None
            self.memory.after_encode()
        refuse_non_finite(latents, "VAE encoder", lambda: self.parts.weights_of("vae"), "latent values")
        return latents

    def encode(self, prompts: list[str], host: Optional[Host] = None) -> list[torch.Tensor]:
        """Text embeddings per prompt; `host` is told of a prompt cut at the text encoder's token limit."""
        self._phase = "text"
        unique = list(dict.fromkeys(prompts))
        log = host.log if host is not None else None
        tower = self.parts.load_text_tower()
        with torch.inference_mode():
            encoded = dict(zip(unique, encode_prompts(self.parts.load_tokenizer(), tower, unique, log)))
        self.memory.after_text()
        refuse_non_finite(encoded.values(), "text encoder", lambda: self.parts.weights_of("text_encoder"),
                          "embedding values")
        return [encoded[p] for p in prompts]

    def sample(self, request: GenerationRequest, text: list[torch.Tensor], negative: Optional[list[torch.Tensor]],
               host: Host, original: Optional[torch.Tensor] = None,
               repaint: Optional[torch.Tensor] = None) -> torch.Tensor:
        """`original`: the image's normalised latents (encode_image) the job starts from; None: pure noise.
        `repaint`: the job's repaint mask (pixel_mask's), None without one."""
        self._phase = "dit"
        self.memory.set_host(host)
        work = DitWork.of(request, negative is not None)
        dit = self.parts.load_dit()  # with the job's LoRAs: the compile decided below is for this structure
        self.parts.compile_if_it_pays(work, host, background=request.step_cache is None)
        rows = (negative + text) if negative is not None else text
        forward = self.parts.load_dit_forward(dit)
        self.last_step_cache = None
        cache = None
        noise = initial_noise(request.seed, request.batch, request.width, request.height).to(self.device)
        start = start_state(request, original, self.device, repaint)
        # Previews only for a host that shows them: otherwise a step does no preview work at all.
        previews = PreviewStream(self.device) if self.options.previews and wants_previews(host) else None
        try:
            with torch.inference_mode(), self.parts.timed_if_uncompiled(work):  # the run's text projected once here
                if request.step_cache is not None:  # the denoiser of step_cache/ instead (same groups, same seams)
                    from ..step_cache.session import open_run

                    cache = open_run(request.step_cache, dit, forward, rows, self.device, self.dtype, request.steps,
                                     host)
                denoise = cache if cache is not None else length_grouped_denoiser(forward, rows, self.device,
                                                                                  self.dtype, dit.project_text)
                cfg = request.cfg if negative is not None else 1.0
                return sample_euler(denoise, noise, request.steps, request.shift, cfg, self.dtype, host, previews,
                                    start)
        finally:
            if cache is not None:
                self.last_step_cache = cache.close(release_graphs=self.memory.plan is not None)
            if self.memory.plan is not None:
                self.parts.release_graphs()  # the plan gives the DiT's activation memory to the VAE phase next

    def decode(self, latents: torch.Tensor, check_cancel: Callable[[], None]) -> torch.Tensor:
        """Images from the sampled latents; `check_cancel` runs between the decoder's layers."""
        self._phase = "vae"
        tile = self.memory.plan.vae.tile if self.memory.plan is not None else None
        vae = self.parts.load_vae()
        with torch.inference_mode(), cancellable(vae, check_cancel):
            images = decode_images(latents, vae, tile)
        if not self.memory.vae_is_persistent():
            self.parts.vae = None
        refuse_non_finite(images, "VAE decoder", lambda: self.parts.weights_of("vae"), "pixel values")
        return images

    # -- the whole job ------------------------------------------------------------------------------

    def generate(self, request: GenerationRequest, host: Host, loras: Optional[LoraStack] = None) -> GenerationResult:
        """Run the job. Any failure or cancel releases the pipe's device memory; running out of it is a
        MemoryBudgetError naming the phase and the fix. `loras`: the stack to run with (None: the pipe's own);
        a bad LoRA file is refused here, before anything runs, and leaves the loaded model as it was."""
        check_generate_call(request, host)
        request = request.with_defaults(self.variant)
        request.validate()
        # one job at a time on the loaded model (its views share it, with their own LoRAs)
        with held_unless_cancelled(self._running, host):
            # A file the model was loaded from that changed on disk is refused before the job reads anything
            # (loaded_files.py), and the pipe lets go of all it holds: its weights may be views of that file.
            self._releasing_on_error(request, self.files.check)
            self._lora.prepare(loras, self.sources, host, self.memory)
            return self._releasing_on_error(request, lambda: self._generate(request, host))

    def check_request(self, request: GenerationRequest) -> None:
        """Refuse `request` as generate() would before it reads a weight, reading file headers only: its settings
        with this model's defaults (a step-cache schedule against the steps), and a VRAM budget below what it
        needs. generate() checks again, with the LoRAs it runs."""
        request = request.with_defaults(self.variant)
        request.validate()
        self.memory.check_request(request, self.sources, self.variant, self._local_pe())

    def _releasing_on_error(self, request: GenerationRequest, job):
        try:
            return job()
        except BaseException as error:
            refusal = memory_refusal(error, self._phase, request, self.device, self.options.vram_budget_gb)
            if refusal is None:
                self.release()
                raise
        # Out of memory: past the except block the failed phase's frames, and the tensors they held, are gone, so
        # releasing now gives their memory back too.
        self.release()
        raise refusal

    def _generate(self, request: GenerationRequest, host: Host) -> GenerationResult:
        self._phase = "setup"
        for notice in (*files_notices(self.variant_choice),
                       settings_notice(self.variant_choice, request.settings_for, request.steps, request.cfg)):
            if notice:
                host.log(notice)
        for notice in (*self.file_notices, *scheduler_notices(self.sources.model_dir, request.shift)):
            if notice not in self._said:  # once a pipe: its files do not change between jobs
                self._said.add(notice)
                host.log(notice)
        repaint = pixel_mask(request, host.check_cancel)  # grown and feathered once a job: a wide feather costs seconds
        refuse_masks_repainting_nothing(repaint, request)
        if needs_encoding(request):
            require_vae_encoder(open_component(self.sources.component("vae"), "vae"))
        room = self.device_bytes_needed(request)
        if room:
            host.make_room(room, self.device)  # ComfyUI unloads its own models; the CLI has nothing to unload
        meter = JobMemoryMeter(self.device)
        meter.start(sum(self.device_bytes_held().values()))
        self._plan(request, host)  # MemoryBudgetError before any allocation
        self.parts.check_tokenizer()
        started_encode = self._clock()
        original = self.encode_image(request, host.check_cancel)
        encoded_image = self._clock()
        host.check_cancel()
        revised = self._enhance(request, host)
        prompts = revised.prompts
        notice_empty_prompts(prompts, host)
        if request.unused_negative_notice():
            host.log(request.unused_negative_notice())
        host.check_cancel()
        started = self._clock()
        negatives = [request.negative_prompt] * request.batch if request.uses_cfg else []
        encoded_rows = self.encode(prompts + negatives, host)  # one text phase for prompts and negatives
        text, negative = encoded_rows[: len(prompts)], (encoded_rows[len(prompts):] or None)
        encoded = self._clock()
        host.check_cancel()
        latents = self.sample(request, text, negative, host, original, repaint)
        if self.last_step_cache is not None:
            host.log(self.last_step_cache.line())
        check_finite_latents(latents, self.sources, self._lora.wanted_stack)
        sampled = self._clock()
        host.check_cancel()
        images = composite(self.decode(latents, host.check_cancel), request, repaint)
        decoded = self._clock()
        if not self.options.keep_loaded:
            self.release()
        info: dict[str, Any] = {
            "backend": "local",
            "variant": self.variant,
            "device": str(self.device),
            "text_s": round(encoded - started, 3),
            "sampling_s": round(sampled - encoded, 3),
            "decode_s": round(decoded - sampled, 3),
            "steps": request.steps,
            **({"image_encode_s": round(encoded_image - started_encode, 3)} if request.has_image_input else {}),
            **revised.info(),
            **self._lora.info(),
            **(self.last_step_cache.info() if self.last_step_cache is not None else {}),
            **meter.finish(),
        }
        self.last_run = info
        return GenerationResult(images=images, latents=latents.cpu(), prompts_used=prompts, info=info,
                                request=request.as_enhanced(revised.enhanced))

    # -- device memory ------------------------------------------------------------------------------

    def device_bytes_needed(self, request: GenerationRequest, phases: Optional[tuple[str, ...]] = None
                            ) -> Optional[int]:
        """Free device memory to ask the host for before `request` (offload.reserve): None off the GPU or with the
        memory manager switched off (bench/e2e.py injects its weights); with a VRAM budget, the budget less what
        this pipe holds on the device; else the largest phase's weights not yet on the device plus that phase's
        activation peak for this size, batch and CFG.

        `phases`: only these of "pe", "text", "dit", "vae" (the enhancer node runs ("pe",)); None: the whole job.
        """
        if self.device.type != "cuda" or not self.memory.active:  # inactive: weights given, not read from files
            return None
        held = self.device_bytes_held()
        spec = self.options.vram_budget_gb
        if spec is not None and spec != "auto":
            return device_bytes_needed(self.device.type, budget_bytes(spec), {}, held)
        use_pe = plans_pe(request, self.sources, self._local_pe())
        sizes = self.memory.planning_sizes(self.sources, self.variant, use_pe)
        needs = phase_needs(sizes, PipeMemory.job_for(request, use_pe), self.device.type, phases)
        return device_bytes_needed(self.device.type, None, needs, held)

    def device_bytes_held(self) -> dict[str, int]:
        """Bytes of weights (and streaming buffers) this pipe holds on its device now, by phase."""
        return self.parts.device_bytes_held()

    def _plan(self, request: GenerationRequest, host: Host) -> None:
        """Plan the job; drop the parts the new plan released (they are rebuilt on use)."""
        self.memory.plan_job(request, self.sources, self.variant, self._local_pe())
        self.parts.drop_unplanned()
        self.memory.set_host(host)

    def _local_pe(self) -> bool:
        """Whether prompts asking for the PE are revised here (no PE chat endpoint set)."""
        return self.options.pe_endpoint is None

    def _clock(self) -> float:
        """Wall time at a phase boundary; waits for queued GPU work so each phase is charged its own time."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def has_enhancer(self) -> bool:
        """Whether `enhance` can run: a PE in the model files or a PE chat endpoint in the options."""
        return self.options.pe_endpoint is not None or self.sources.has_pe()

    def enhance(self, prompt: str, width: int, height: int, seed: int, temperature: float = 0.6, top_p: float = 0.95,
                max_new_tokens: int = 512, host: Optional[Host] = None):
        """The PE phase on its own (the standalone enhancer node): text.enhancer.RevisedPrompts for one prompt.

        The same revision `generate` gives the DiT for this prompt, size and seed. A failure or a cancel releases
        the pipe's memory, as `generate` does.
        """
        from ..text.enhancer import validate_sampling

        if not self.has_enhancer():
            raise ModelFileError("this model has no prompt enhancer: give one (pe, or pe/ in model_dir), or a PE chat "
                                 "endpoint (pe_endpoint)").naming("pe", "model_dir", "pe_endpoint")
        validate_size(width, height)
        validate_sampling(temperature, top_p, max_new_tokens)
        host = host or NullHost()
        request = GenerationRequest(prompt=prompt, width=width, height=height, seed=seed, use_pe=True,
                                    pe_temperature=temperature, pe_top_p=top_p, pe_max_new_tokens=max_new_tokens)
        request = request.with_defaults(self.variant)  # the plan counts the CFG batch
        return self._releasing_on_error(request, lambda: self._enhance_alone(request, host))

    def _enhance_alone(self, request: GenerationRequest, host: Host):
        self._phase = "setup"
        self.files.check()  # a changed file refused before anything is read (the caller releases the pipe)
        room = self.device_bytes_needed(request, phases=("pe",))
        if room:
            host.make_room(room, self.device)
        self._plan(request, host)
        return self._enhance(request, host)

    def _enhance(self, request: GenerationRequest, host: Host):
        """The prompt-enhancer phase, before text encoding: text.enhancer.RevisedPrompts (prompt_phase.py)."""
        revised = revised_without_local_pe(request, host, self.options, self.sources)
        if revised is not None:
            return revised
        self._phase = "pe"
        return revised_by_local_pe(request, host, self.options, self.parts, self.memory)

    def host_bytes(self) -> dict[str, int]:
        """Host memory this pipe holds now: all of it (`host_tensors`, each storage once) and the page-locked part."""
        return self.parts.host_bytes()

    def host_tensors(self) -> list[torch.Tensor]:
        """Every host tensor this pipe holds now: streaming slabs (page-locked on CUDA) and weights kept in host
        memory (a parked prompt enhancer, a CPU device's models). Read-only; loads nothing."""
        return self.parts.host_tensors()

    # ComfyUI's node cache (comfy_execution/caching.py RAMPressureCache) sizes a cached output by the CPU tensors
    # this returns, so under RAM pressure it can weigh and evict the Loader's pipe; see __del__.
    _comfy_cache_tensors = host_tensors

    def __del__(self) -> None:
        # The last reference is gone (an evicted cache entry, "Free model and node cache"): hand back the pinned
        # slabs, device buffers and graph memory now. Only what release() frees without collecting garbage or
        # touching the CUDA cache, as this can run on any thread or at interpreter exit.
        for holder, release in (("memory", "release"), ("parts", "release_graphs")):  # each whatever the other does
            try:
                getattr(getattr(self, holder), release)()
            except Exception:  # noqa: BLE001 - a finaliser must not raise (nor one of a pipe whose making failed)
                pass

    def release(self) -> None:
        self.memory.release()
        self.parts.drop()
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
