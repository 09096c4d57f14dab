"""The in-process backend: text encoder, DiT and VAE as phases on one device.

Weights load lazily, phase by phase, straight from the (memory-mapped) files. After a run, or after an error
or a cancel, device memory is released according to `keep_loaded`; nothing stays half-loaded.
"""
from __future__ import annotations

import functools
import gc
import math
import os
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from .acceleration import compile_available, compile_blocks, fuse_projections
from .decode import decode_images
from .encode import encode_images
from .errors import ErnieImageError, InvalidInputError, MemoryBudgetError, ModelFileError
from .formats import open_component
from .image_in import composite, init_latents, needs_encoding, start_state
from .host import Host, NullHost
from .lora.pipe_loras import PipeLoras
from .lora.stack import LoraStack
from .model_files import (QUANT_ON_LOAD_FORMATS, ModelSources, Variant, build_dit, build_text_tower, build_vae,
                          check_config_builds, require_vae_encoder)
from .non_finite import refuse_non_finite
from .offload.device_memory import JobMemoryMeter
from .offload.planner import budget_bytes
from .offload.reserve import device_bytes_held, device_bytes_needed, phase_needs
from .offload.session import PipeMemory, plans_pe
from .out_of_memory import out_of_host_memory_message, out_of_memory_message, without_tracebacks
from .pipe import check_generate_call, short_repr
from .preview import latent_preview
from .request import VARIANT_DEFAULTS, GenerationRequest, GenerationResult, validate_size
from .sampling import initial_noise, length_grouped_denoiser, sample_euler
from .text.encoder import encode_prompts
from .variant import VariantChoice, decide_variant, set_by_user, settings_notice

# LoadOptions.quant: a bf16 DiT is quantised on load to the format named; a quantised DiT file runs in its own
# format (with 'none', 'auto' or that format; another is refused).
QUANT_CHOICES = ("none", "auto", "bf16", *QUANT_ON_LOAD_FORMATS)
DTYPE_CHOICES = ("auto", "bf16", "fp16", "fp32")  # auto: bf16 on a GPU, fp32 on the CPU


@dataclass
class LoadOptions:
    device: str = "auto"  # "auto", "cpu", "cuda", "cuda:1"...
    dtype: str = "auto"  # "auto" (bf16 on GPU, fp32 on CPU), "bf16", "fp16", "fp32"
    vram_budget_gb: Optional[float] = None  # None: free VRAM minus a reserve
    keep_loaded: bool = True  # keep weights (in host RAM when they do not fit) between runs
    quant: str = "none"  # "none", "auto", "fp8", "q8_0", "nvfp4", or a quantised file given as the DiT
    previews: bool = True
    compile: bool = True  # regional torch.compile of the DiT and the PE's decode step, on CUDA when Triton is installed
    # Uncompiled DiT resident on a CUDA device (compile off or no Triton): replay its forward as CUDA graphs
    # (dit_graphs.py; bit-identical output). Streamed blocks always run eagerly.
    cuda_graphs: bool = True
    pe_quant: str = "none"  # "none" or "fp8": the local prompt enhancer's layer weights packed on load (text/pe_quant.py)
    # Prompt enhancer on an OpenAI-compatible chat server (text.remote_enhancer.ChatEndpoint; holds no secret).
    # When set, requests with use_pe are revised there instead of by a local PE.
    pe_endpoint: Optional[Any] = None
    # How LoRAs that name no mode of their own are applied: "merge" (added into the resident weights in place, no
    # cost per step, originals kept in host memory) or "branch" (beside the weights). See lora/merge.py.
    lora_mode: str = "merge"

    def validate(self) -> None:
        """Refuse a device name or quantisation the pipe cannot use, before any file is read or model built."""
        kind, _, index = self.device.partition(":")
        if self.device not in ("auto", "cpu") and not (kind == "cuda" and (not index or index.isdigit())):
            raise InvalidInputError(f"device {self.device!r} is not supported: use auto, cpu, cuda or cuda:N"
                                    ).naming("device")
        from .text.pe_quant import PE_QUANT_FORMATS

        if self.pe_quant not in ("none", *PE_QUANT_FORMATS):
            raise InvalidInputError(f"pe_quant {self.pe_quant!r} is not supported: use none or "
                                    f"{', '.join(PE_QUANT_FORMATS)}")
        from .lora.stack import check_mode

        check_mode(self.lora_mode)
        if self.dtype not in DTYPE_CHOICES:
            raise InvalidInputError(f"dtype {self.dtype!r} is not supported: use {', '.join(DTYPE_CHOICES)}"
                                    ).naming("dtype")
        if self.quant not in QUANT_CHOICES:
            raise InvalidInputError(f"quant {self.quant!r} is not supported: use one of {', '.join(QUANT_CHOICES)}, "
                                    "or give a quantised DiT file").naming("quant")
        budget = self.vram_budget_gb
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, (int, float))
                                   or not math.isfinite(budget) or budget <= 0):
            raise InvalidInputError(f"VRAM budget {budget!r} GB is not a positive number: give the GB the pipe may "
                                    f"use, or None for free VRAM minus a reserve")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InvalidInputError(f"device {name} was asked for but PyTorch sees no CUDA GPU: choose cpu"
                                ).naming("device")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        count = torch.cuda.device_count()
        raise InvalidInputError(f"device {name} was asked for but PyTorch sees {count} CUDA GPU(s): choose "
                                f"{' or '.join(f'cuda:{index}' for index in range(min(count, 4)))}"
                                f"{' or another' if count > 4 else ''}").naming("device")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    table = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in table:
        raise InvalidInputError(f"dtype {name!r} is not supported: use {', '.join(DTYPE_CHOICES)}").naming("dtype")
    return table[name]


def _built_outside_inference_mode(build: Callable[..., Any]) -> Callable[..., Any]:
    """Models and their placements (streaming rings, host copies) are made as normal tensors, even when the
    caller runs in inference mode (ComfyUI runs every node so); the phases then use them inside inference mode.
    Tensors made in one mode and used in the other fail later ("Inference tensors do not track version counter")."""
    @functools.wraps(build)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with torch.inference_mode(False):
            return build(*args, **kwargs)

    return wrapper


@dataclass
class _Loaded:
    tokenizer: Any = None
    text_tower: Any = None
    dit: Any = None
    dit_forward: Any = None  # what the sampler calls: the DiT, or dit_graphs.DiTGraphs around it
    vae: Any = None
    vae_encoder: Any = None  # built only for jobs with an image in
    enhancer: Any = None


def check_quant_packs(quant: str, dit_weights: dict[str, torch.Tensor]) -> None:
    """A quantise-on-load format that none of a bf16 DiT's weights can be packed in is refused as `ernie-image
    quantize` refuses it, not run in bf16 without a word. Only shapes and dtypes are looked at (views of a mapped
    file, or meta tensors): no weight is read."""
    if quant not in QUANT_ON_LOAD_FORMATS:
        return
    from .quant.writer import quantized_layer_counts, refuse_unpackable

    refuse_unpackable(quantized_layer_counts(dit_weights, quant), quant, "quant")


def refuse_quant_for_quantized_dit(quant: str, dit) -> None:
    """A format asked for beside a DiT file that is already quantised (GGUF, FP8, NVFP4) cannot be had: the file runs
    in its own format, so asking for another is refused rather than ignored ('auto', 'none' and the file's own
    format take the file as it is)."""
    if quant not in ("bf16", *QUANT_ON_LOAD_FORMATS):
        return
    from .quant.qweight import QuantizedWeight, block_format

    entries = [entry for entry in (dit.tensor(key) for key in dit.keys) if isinstance(entry, QuantizedWeight)]
    if {block_format(entry.format, entry.qtype) for entry in entries} == {quant}:
        return  # the format the file already has
    raise InvalidInputError(f"quant {quant} does not apply to {dit.path.name}, a DiT file already quantised "
                            f"({file_weight_format(dit) or 'packed'}): drop that option to run the file as it is, or "
                            "give the bf16 DiT to quantise it on load").naming("quant")


def file_weight_format(dit) -> str:
    """The packed weight formats of a quantised DiT file, most used first ("GGUF Q8_0", "FP8", ...), from its
    entries (no weight is read); "" when nothing in it is packed."""
    from collections import Counter

    from .quant.qweight import QuantizedWeight, format_label

    packed = Counter(format_label(entry.format, entry.qtype) for entry in (dit.tensor(key) for key in dit.keys)
                     if isinstance(entry, QuantizedWeight))
    return "/".join(name for name, _ in packed.most_common())


def dit_weight_format(dit: torch.nn.Module) -> str:
    """The block Linears' weight formats, most used first ("FP8", "GGUF Q8_0/Q4_K", ...), or the weights' dtype
    when none is packed."""
    from collections import Counter

    from .quant.linear import QuantLinear
    from .quant.qweight import format_label

    packed = Counter(format_label(module.format, module.qtype) for module in dit.modules()
                     if isinstance(module, QuantLinear))
    if packed:
        return "/".join(name for name, _ in packed.most_common())
    weight = next((p for p in dit.parameters() if p.is_floating_point()), None)
    return str(weight.dtype).replace("torch.", "") if weight is not None else ""


def notice_empty_prompts(prompts: list[str], host: Host) -> None:
    """An empty prompt is allowed (the DiT then follows no text), but never silently."""
    empty = sum(1 for prompt in prompts if not prompt.strip())
    if empty:
        which = "the prompt is" if len(prompts) == 1 else f"{empty} of {len(prompts)} prompts are"
        host.log(f"{which} empty: the image follows no text (write a prompt to describe the picture)")


def check_finite_latents(latents: torch.Tensor, sources: ModelSources, loras: LoraStack = LoraStack()) -> None:
    """NaN or inf out of the DiT would decode to a black or noise image: stop with the likely cause instead. With
    LoRAs applied (`loras`: the job's stack) they are named as the likely cause, not the DiT's weights."""
    finite = torch.isfinite(latents)
    if bool(finite.all()):
        return
    bad = int((~finite).sum())
    if loras:
        applied = ", ".join(f"{entry.name} (strength {entry.strength:g})" for entry in loras.entries)
        raise ModelFileError(f"the DiT produced {bad} non-finite latent values (NaN/inf) of {latents.numel()} with "
                             f"LoRA(s) {applied} applied: the LoRA is the likely cause: lower its strength or leave "
                             "it out")
    dit = sources.dit or (sources.model_dir / "transformer" if sources.model_dir is not None else "the DiT")
    refuse_non_finite(latents, "DiT", dit, "latent values")


def _as_sources(sources: Any) -> ModelSources:
    """ModelSources as given; a str or path as the model folder; anything else refused in one line."""
    if isinstance(sources, ModelSources):
        return sources
    if isinstance(sources, (str, os.PathLike)):
        return ModelSources(model_dir=Path(sources))
    raise InvalidInputError(f"sources {short_repr(sources)} is not a ModelSources: give "
                            "ernie_image.ModelSources(model_dir=...) or the model folder's path")


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
        self._loaded = _Loaded()
        self.quant_reason = ""
        self.dit_weights = ""  # the loaded DiT's weight format ("bf16", "FP8", "GGUF Q8_0", ...), once built
        # quant 'auto' decided once for this device and budget: the DiT is sized (the host's ask, the plan) in the
        # format it will be built in, not as bf16 until it is built.
        self._auto_quant = self._choose_auto_quant() if options.quant == "auto" else None
        planned_quant = self._auto_quant[0] if self._auto_quant is not None else options.quant
        self.memory = PipeMemory(self.device, self.dtype, options.vram_budget_gb, planned_quant)
        # Through a weak reference: a pipe dropped by its last owner (ComfyUI evicting its node cache) must be freed
        # at once by reference counting, with its pinned slabs, not at some later garbage collection.
        this = weakref.ref(self)
        self.memory.held_bytes = lambda: sum(pipe.device_bytes_held().values()) if (pipe := this()) else 0
        self._phase = "setup"  # the phase running now ("pe", "text", "dit", "vae"): named when memory runs out
        self.last_run: dict[str, Any] = {}  # the info of the last finished job (timings, device-memory peak)
        self.last_step_cache = None  # step_cache.session.StepCacheReport of the last sampling run, if it had one
        self._running = threading.RLock()

    @classmethod
    def load(cls, sources: ModelSources, options: Optional[LoadOptions] = None, loras=None) -> "LocalPipe":
        """Check the files and prepare; weights are read on first use, one phase at a time.

        Every part's header is read here, so a missing, damaged or wrong file fails now, not after the text
        encoder and the whole sampling loop have run. `loras`: LoRA files (paths, (path, strength) pairs or
        lora.LoraEntry) every run of this pipe applies; they are read and checked here too. `sources` may be the
        model folder's path (ModelSources(model_dir=it))."""
        sources = _as_sources(sources)
        options = LoadOptions() if options is None else options
        if not isinstance(options, LoadOptions):
            raise InvalidInputError(f"options {short_repr(options)} is not a LoadOptions: give "
                                    "ernie_image.LoadOptions(...) or None for the defaults")
        from .lora.parsed import check_lora_files

        check_lora_files(LoraStack.of(loras))  # a bad LoRA file fails first, before any model file is opened
        options.validate()
        opened = {kind: open_component(sources.component(component), kind)
                  for component, kind in (("transformer", "dit"), ("text_encoder", "text_encoder"), ("vae", "vae"))}
        dit = opened["dit"]
        if dit.quantized:
            refuse_quant_for_quantized_dit(options.quant, dit)
        else:
            check_quant_packs(options.quant, {key: dit.tensor(key) for key in dit.keys})  # mapped views
        pipe = cls(sources, options, decide_variant(dit, sources.variant), loras)
        for kind, component in opened.items():
            check_config_builds(component, kind, pipe.variant)  # on the meta device: a bad config.json fails now
        if dit.quantized:
            pipe.dit_weights = file_weight_format(dit)
        if pipe._auto_quant is not None:  # what 'auto' runs, said before the DiT is built
            pipe.quant_reason = (f"auto -> {pipe.dit_weights}, the DiT file's own format ({dit.path.name} is already "
                                 "quantised; auto picks a format for a bf16 DiT only)" if dit.quantized
                                 else pipe._auto_quant[1])
        pipe._lora.resolve(pipe.loras, sources)
        if sources.has_pe():  # a text encoder given as the PE is refused now, not when the PE first runs
            from .text.pe_model import locate_pe, open_pe_component

            open_pe_component(locate_pe(sources))
        return pipe

    def with_loras(self, loras, mode: Optional[str] = None):
        """A view of this pipe (same loaded model, no second copy) that runs with this pipe's LoRAs followed by
        `loras`; switching between views re-applies only the LoRA deltas, never reads the base weights again.
        `mode`: "merge" or "branch" for the entries that name none (None: LoadOptions.lora_mode)."""
        from .lora.view import LoraPipe

        return LoraPipe(self, self.loras).with_loras(loras, mode)

    def with_step_cache(self, step_cache):
        """A view of this pipe (same loaded model) that runs every job with `step_cache`: a StepCacheConfig, a spec
        such as 'dbcache:threshold=0.08', or None (this pipe itself). See docs/step-cache.md."""
        from .step_cache.view import with_step_cache

        return with_step_cache(self, step_cache)

    @property
    def defaults(self) -> dict[str, float]:
        return VARIANT_DEFAULTS[self.variant]

    @property
    def compiles_dit(self) -> bool:
        """Whether the DiT's blocks are (or, once loaded, will be) compiled: asked for and possible here."""
        return self.options.compile and compile_available(self.device)

    def _dit_mode(self) -> str:
        if self.compiles_dit:
            return "compiled"
        if self.options.cuda_graphs and self.device.type == "cuda":
            return "eager, replayed as CUDA graphs when resident"
        return "eager"

    def describe(self, request: Optional[GenerationRequest] = None) -> str:
        """The variant, device, formats and the VRAM plan (of the last job, else of a default 1024x1024 job)."""
        lines = [
            f"ERNIE-Image {self.variant_choice.text()}; on {self.device} in "
            f"{str(self.dtype).replace('torch.', '')}; defaults {int(self.defaults['steps'])} steps, "
            f"CFG {self.defaults['cfg']}; DiT {self.dit_weights + ', ' if self.dit_weights else ''}{self._dit_mode()}"
        ]
        if self.quant_reason:
            lines.append(self.quant_reason)
        if self.loras:
            from .lora.view import describe_stack

            lines.append(describe_stack(self.loras))
        merged = self._lora.describe(self._loaded.dit)
        if merged:
            lines.append(merged)
        if self.memory.plan is not None and request is None:
            lines.append(self.memory.describe())
        else:
            job = (request or GenerationRequest(prompt="")).with_defaults(self.variant)
            try:
                lines.append(self.memory.preview(job, self.sources, self.variant, self._local_pe()))
            except ErnieImageError as error:
                lines.append(f"VRAM plan unavailable: {error}")
        return "\n".join(lines)

    def is_loaded(self) -> bool:
        """Whether any weights (text encoder, DiT, VAE, prompt enhancer) are held by this pipe."""
        loaded = self._loaded
        return any(part is not None for part in (loaded.text_tower, loaded.dit, loaded.vae, loaded.vae_encoder,
                                                 loaded.enhancer))

    # -- phases ---------------------------------------------------------------------------------------

    def _tokenizer(self):
        if self._loaded.tokenizer is None:
            from .formats.tokenizer import load_tokenizer

            self._loaded.tokenizer = load_tokenizer(self.sources)
        return self._loaded.tokenizer

    @_built_outside_inference_mode
    def _text_tower(self):
        if self._loaded.text_tower is None:
            component = open_component(self.sources.component("text_encoder"), "text_encoder")
            tower = build_text_tower(component, self.memory.build_device(), self.dtype, self.variant)
            self._loaded.text_tower = self.memory.place_text(tower)
        return self._loaded.text_tower

    @_built_outside_inference_mode
    def _dit(self):
        if self._loaded.dit is None:
            component = open_component(self.sources.component("transformer"), "dit")
            dit = build_dit(component, self.memory.build_device(), self.dtype, quant=self._quant_on_load(component),
                            quant_device=self.device)
            if self.device.type == "cuda":
                fuse_projections(dit)
            dit = self.memory.place_dit(dit)
            if self.compiles_dit:
                compile_blocks(dit)
            self._loaded.dit = dit
            self.dit_weights = dit_weight_format(dit)
        # After placement: branches stay resident, never streamed; merge-mode LoRAs merge into the resident blocks.
        streamed = self.memory.dit.plan.streamed if self.memory.dit is not None else ()
        self._lora.sync(self._loaded.dit, streamed, self.memory.host)
        return self._loaded.dit

    def _dit_forward(self, dit):
        """The DiT's forward as the sampler calls it: replayed as CUDA graphs where dit_graphs can (kept, with their
        graphs, for as long as this DiT is the loaded one), else the module itself."""
        from .dit_graphs import graphed_dit

        forward = self._loaded.dit_forward
        if forward is None or getattr(forward, "dit", forward) is not dit:
            forward = graphed_dit(dit, self.options.cuda_graphs and not self.compiles_dit, self.device)
            self._loaded.dit_forward = forward
        return forward

    def _quant_on_load(self, component) -> str:
        """The format to quantise a bf16 DiT into while loading ("none" keeps the file's weights as they are)."""
        choice = self.options.quant
        if component.quantized or choice in ("none", "bf16"):
            return "none"
        if choice == "auto":
            choice, self.quant_reason = self._auto_quant
        return choice if choice in QUANT_ON_LOAD_FORMATS else "none"

    def _choose_auto_quant(self) -> tuple[str, str]:
        """quant 'auto' on this device under this budget: (format, reason)."""
        from .quant.gpu_support import choose_auto, detect_device

        budget = None if self.options.vram_budget_gb is None else int(self.options.vram_budget_gb * 1024**3)
        return choose_auto(detect_device(self.device), budget)

    @_built_outside_inference_mode
    def _vae(self):
        if self._loaded.vae is None:
            component = open_component(self.sources.component("vae"), "vae")
            self._loaded.vae = build_vae(component, self.device, torch.float32 if self.device.type == "cpu" else self.dtype)
        return self._loaded.vae

    @_built_outside_inference_mode
    def _vae_encoder(self):
        if self._loaded.vae_encoder is None:
            component = open_component(self.sources.component("vae"), "vae")
            dtype = torch.float32 if self.device.type == "cpu" else self.dtype
            self._loaded.vae_encoder = build_vae(component, self.device, dtype, part="encoder")
        return self._loaded.vae_encoder

    def _weights_of(self, component: str) -> object:
        """Where a part's weights are, for a message: its file or folder, or the part's name where none was given
        (weights handed over already built)."""
        try:
            return self.sources.component(component)
        except ModelFileError:
            return f"the {component} given"

    def encode_image(self, request: GenerationRequest) -> Optional[torch.Tensor]:
        """The image-in phase: the original's normalised latents (a LATENT input as given, an IMAGE through the VAE
        encoder), or None when the job starts from pure noise. The encoder leaves the device after its phase
        unless the plan keeps everything resident."""
        given = init_latents(request)
        if given is not None or not needs_encoding(request):
            return given
        self._phase = "encode"
        tile = self.memory.plan.encode.tile if self.memory.plan is not None and self.memory.plan.encode else None
        with torch.inference_mode():
            latents = encode_images(request.init_image, self._vae_encoder(), tile)
        if not self.memory.encoder_is_persistent():
            self._loaded.vae_encoder = None
            self.memory.after_encode()
        refuse_non_finite(latents, "VAE encoder", lambda: self._weights_of("vae"), "latent values")
        return latents

    def encode(self, prompts: list[str], host: Optional[Host] = None) -> list[torch.Tensor]:
        """Text embeddings per prompt; `host` is told of a prompt cut at the text encoder's token limit."""
        self._phase = "text"
        unique = list(dict.fromkeys(prompts))
        log = host.log if host is not None else None
        tower = self._text_tower()
        with torch.inference_mode():
            encoded = dict(zip(unique, encode_prompts(self._tokenizer(), tower, unique, log)))
        self.memory.after_text()
        refuse_non_finite(encoded.values(), "text encoder", lambda: self._weights_of("text_encoder"),
                          "embedding values")
        return [encoded[p] for p in prompts]

    def sample(self, request: GenerationRequest, text: list[torch.Tensor], negative: Optional[list[torch.Tensor]],
               host: Host, original: Optional[torch.Tensor] = None) -> torch.Tensor:
        """`original`: the image's normalised latents (encode_image) the job starts from; None: pure noise."""
        self._phase = "dit"
        self.memory.set_host(host)
        dit = self._dit()
        rows = (negative + text) if negative is not None else text
        forward = self._dit_forward(dit)
        self.last_step_cache = None
        cache = None
        if request.step_cache is not None:  # the denoiser of step_cache/ instead (same groups, same seams)
            from .step_cache.session import open_run

            cache = open_run(request.step_cache, dit, forward, rows, self.device, self.dtype, request.steps, host)
        denoise = cache if cache is not None else length_grouped_denoiser(forward, rows, self.device, self.dtype)
        noise = initial_noise(request.seed, request.batch, request.width, request.height).to(self.device)
        start = start_state(request, original, self.device)

        preview = latent_preview if self.options.previews else None
        try:
            with torch.inference_mode():
                cfg = request.cfg if negative is not None else 1.0
                return sample_euler(denoise, noise, request.steps, request.shift, cfg, self.dtype, host, preview,
                                    start)
        finally:
            if cache is not None:
                self.last_step_cache = cache.close(release_graphs=self.memory.plan is not None)
            release_graphs = getattr(self._loaded.dit_forward, "release_graphs", None)
            if release_graphs is not None and self.memory.plan is not None:
                release_graphs()  # the plan gives the DiT's activation memory to the VAE phase next

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        self._phase = "vae"
        tile = self.memory.plan.vae.tile if self.memory.plan is not None else None
        with torch.inference_mode():
            images = decode_images(latents, self._vae(), tile)
        if not self.memory.vae_is_persistent():
            self._loaded.vae = None
        refuse_non_finite(images, "VAE decoder", lambda: self._weights_of("vae"), "pixel values")
        return images

    # -- the whole job ------------------------------------------------------------------------------

    def generate(self, request: GenerationRequest, host: Host, loras: Optional[LoraStack] = None) -> GenerationResult:
        """Run the job. Any failure or cancel releases the pipe's device memory; running out of it is a
        MemoryBudgetError naming the phase and the fix. `loras`: the stack to run with (None: the pipe's own);
        a bad LoRA file is refused here, before anything runs, and leaves the loaded model as it was."""
        check_generate_call(request, host)
        request = request.with_defaults(self.variant)
        request.validate()
        with self._running:  # one job at a time on the loaded model (its views share it, with their own LoRAs)
            self._lora.prepare(loras, self.sources, host, self.memory)
            return self._releasing_on_error(request, lambda: self._generate(request, host))

    def _releasing_on_error(self, request: GenerationRequest, job):
        try:
            return job()
        except BaseException as error:
            message = out_of_memory_message(error, self._phase, request, self.device, self.options.vram_budget_gb)
            names: tuple[str, ...] = ()
            if message is None:  # host RAM rather than the device's: its fix names the device setting
                message, names = out_of_host_memory_message(error, self._phase, request, self.device), ("device",)
            if message is None:
                self.release()
                raise
            cause = without_tracebacks(error)
        # Out of memory: past the except block the failed phase's frames, and the tensors they held, are gone, so
        # releasing now gives their memory back too.
        self.release()
        raise MemoryBudgetError(message).naming(*names) from cause

    def _generate(self, request: GenerationRequest, host: Host) -> GenerationResult:
        self._phase = "setup"
        mismatch = settings_notice(self.variant_choice, request.settings_for, request.steps, request.cfg)
        if mismatch:
            host.log(mismatch)
        if needs_encoding(request):
            require_vae_encoder(open_component(self.sources.component("vae"), "vae"))
        room = self.device_bytes_needed(request)
        if room:
            host.make_room(room, self.device)  # ComfyUI unloads its own models; the CLI has nothing to unload
        meter = JobMemoryMeter(self.device)
        meter.start(sum(self.device_bytes_held().values()))
        self._plan(request, host)  # MemoryBudgetError before any allocation
        started_encode = self._clock()
        original = self.encode_image(request)
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
        latents = self.sample(request, text, negative, host, original)
        if self.last_step_cache is not None:
            host.log(self.last_step_cache.line())
        check_finite_latents(latents, self.sources, self._lora.wanted_stack)
        sampled = self._clock()
        host.check_cancel()
        images = composite(self.decode(latents), request)
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
        loaded = self._loaded
        enhancer = loaded.enhancer.model if loaded.enhancer is not None else None
        parts = {"pe": enhancer, "text": loaded.text_tower, "dit": loaded.dit, "vae": loaded.vae}
        if loaded.vae_encoder is not None:  # built only for jobs with an image in
            parts["encode"] = loaded.vae_encoder
        return {phase: device_bytes_held(module, self.device) for phase, module in parts.items()}

    def _plan(self, request: GenerationRequest, host: Host) -> None:
        """Plan the job; drop the parts the new plan released (they are rebuilt on use)."""
        self.memory.plan_job(request, self.sources, self.variant, self._local_pe())
        if self.memory.active:
            if self.memory.dit is None:
                self._loaded.dit = self._loaded.dit_forward = None
            if self.memory.text is None:
                self._loaded.text_tower = None
            if self.memory.pe is None:
                self._loaded.enhancer = None
            if not self.memory.encoder_is_persistent():
                self._loaded.vae_encoder = None  # kept from an earlier job whose plan had room for it
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
        from .text.enhancer import validate_sampling

        if not self.has_enhancer():
            raise ModelFileError("this model has no prompt enhancer: pick one on the Loader (prompt_enhancer, or "
                                 "a diffusers folder with pe/), or give a PE chat endpoint URL")
        validate_size(width, height)
        validate_sampling(temperature, top_p, max_new_tokens)
        host = host or NullHost()
        request = GenerationRequest(prompt=prompt, width=width, height=height, seed=seed, use_pe=True,
                                    pe_temperature=temperature, pe_top_p=top_p, pe_max_new_tokens=max_new_tokens)
        request = request.with_defaults(self.variant)  # the plan counts the CFG batch
        return self._releasing_on_error(request, lambda: self._enhance_alone(request, host))

    def _enhance_alone(self, request: GenerationRequest, host: Host):
        self._phase = "setup"
        room = self.device_bytes_needed(request, phases=("pe",))
        if room:
            host.make_room(room, self.device)
        self._plan(request, host)
        return self._enhance(request, host)

    def _enhance(self, request: GenerationRequest, host: Host):
        """The prompt-enhancer phase, before text encoding: returns text.enhancer.RevisedPrompts.

        Local PE: loaded (or brought back from host RAM), run, then moved to host RAM (keep_loaded) or dropped, so
        the device is free for the text encoder. With a VRAM plan the PE is built on the host and placed by the
        plan's PE mode (loaded for the phase, or its layers streamed); see PipeMemory.place_pe. Remote PE: nothing
        local is loaded.
        """
        from .text.enhancer import LocalEnhancer, RevisedPrompts, revise_prompts, validate_sampling

        prompts = request.prompt_list()
        if not request.use_pe:
            return RevisedPrompts(prompts)
        validate_sampling(request.pe_temperature, request.pe_top_p, request.pe_max_new_tokens)
        if self.options.pe_endpoint is not None:
            from .text.remote_enhancer import revise_prompts_remote

            return revise_prompts_remote(self.options.pe_endpoint, prompts, request.width, request.height,
                                         request.seed, request.pe_temperature, request.pe_top_p,
                                         request.pe_max_new_tokens, host)
        if not self.sources.has_pe():
            host.log("prompt enhancer is on but this model has none (no pe/ folder, PE file or PE server): "
                     "the prompt is used as written")
            return RevisedPrompts(prompts)
        self._phase = "pe"
        placed = self.memory.places_pe()
        enhancer = self._loaded.enhancer or _built_outside_inference_mode(LocalEnhancer.load)(
            self.sources, self.device, self.dtype, self.variant, host,
            build_device=self.memory.build_device() if placed else None, quant=self.options.pe_quant)
        self._loaded.enhancer = enhancer
        enhancer.compiled_decode = self.compiles_dit  # compile asked for and Triton present: the PE's step too
        try:
            if placed:
                self.memory.place_pe(enhancer.model)
                enhancer.placed = True
            settings = enhancer.settings(request.pe_temperature, request.pe_top_p, request.pe_max_new_tokens)
            return revise_prompts(enhancer, prompts, request.width, request.height, request.seed, settings, host)
        finally:
            if placed:
                self.memory.after_pe(self.options.keep_loaded)
            if self.options.keep_loaded:
                enhancer.offload()
            else:
                enhancer.release()
                self._loaded.enhancer = None

    def host_bytes(self) -> dict[str, int]:
        """Host memory this pipe holds now: all of it (`host_tensors`, each storage once) and the page-locked part."""
        storages = {(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in self.host_tensors()}
        return {"host": sum(n for _, n in storages),
                "pinned": self.memory.pinned_bytes() + self._lora.pinned_bytes(self._loaded.dit)}

    def host_tensors(self) -> list[torch.Tensor]:
        """Every host tensor this pipe holds now: streaming slabs (page-locked on CUDA) and weights kept in host
        memory (a parked prompt enhancer, a CPU device's models). Read-only; loads nothing."""
        loaded = self._loaded
        enhancer = loaded.enhancer.model if loaded.enhancer is not None else None
        tensors: list[torch.Tensor] = list(self.memory.host_slabs())
        for module in (loaded.text_tower, loaded.dit, loaded.vae, enhancer):
            if module is None:
                continue
            tensors += [t for t in (*module.parameters(), *module.buffers()) if t.device.type == "cpu"]
        tensors += self._lora.host_tensors(loaded.dit)  # a merged LoRA's copy of the original weights
        return tensors

    # ComfyUI's node cache (comfy_execution/caching.py RAMPressureCache) sizes a cached output by the CPU tensors
    # this returns, so under RAM pressure it can weigh and evict the Loader's pipe; see __del__.
    _comfy_cache_tensors = host_tensors

    def __del__(self) -> None:
        # The last reference is gone (an evicted cache entry, "Free model and node cache"): hand back the pinned
        # slabs and device buffers now. Only what release() frees without collecting garbage or touching the CUDA
        # cache, as this can run on any thread or at interpreter exit.
        try:
            self.memory.release()
        except Exception:  # noqa: BLE001 - a finaliser must not raise; the memory goes with the objects anyway
            pass

    def release(self) -> None:
        self.memory.release()
        self._loaded = _Loaded(tokenizer=self._loaded.tokenizer)
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
