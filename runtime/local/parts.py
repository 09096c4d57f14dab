"""The parts a LocalPipe holds: tokenizer, text tower, DiT (and the forward the sampler calls), the VAE's halves and
the prompt enhancer. Each is built from its file on first use, placed by the memory plan, and dropped on release;
what they hold on the device and in host memory is counted here."""
from __future__ import annotations

import functools
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

import torch

from ..core.built_models import register_built_model
from ..core.errors import ModelFileError
from ..core.host import Host
from ..core.variant import Variant
from ..formats.sources import ModelSources
from ..model.background_compile import BlockCompile, CompilingForward
from ..model.builders import build_dit, build_text_tower, build_vae, dit_config_for
from ..model.compile import compile_available, compile_blocks, fuse_projections
from ..model.compile_marks import caches_hold, mark_compiled
from ..model.fill import QUANT_ON_LOAD_FORMATS
from ..offload.reserve import device_bytes_held
from ..quant import fp8_kernel_warmup
from ..quant.fp8 import native_fp8_supported
from .checks import dit_weight_format, file_weight_format, open_part
from .compile_policy import CompilePolicy, DitWork
from .loaded_files import LoadedFiles
from .loras import PipeLoras
from .memory import PipeMemory
from .options import LoadOptions


def built_outside_inference_mode(build: Callable[..., Any]) -> Callable[..., Any]:
    """Models and their placements (streaming rings, host copies) are made as normal tensors, even when the
    caller runs in inference mode (ComfyUI runs every node so); the phases then use them inside inference mode.
    Tensors made in one mode and used in the other fail later ("Inference tensors do not track version counter")."""
    @functools.wraps(build)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with torch.inference_mode(False):
            return build(*args, **kwargs)

    return wrapper


def choose_auto_quant(options: LoadOptions, device: torch.device) -> Optional[tuple[str, str]]:
    """quant 'auto' on this device under this budget, decided once: (format, reason); None for any other quant."""
    if options.quant != "auto":
        return None
    from ..quant.gpu_support import choose_auto, detect_device

    budget = None if options.vram_budget_gb is None else int(options.vram_budget_gb * 1024**3)
    return choose_auto(detect_device(device), budget)


def _built(module: Any) -> Any:
    """`module` as built, counted among the models alive (core.built_models) when it is a model."""
    if isinstance(module, torch.nn.Module):
        register_built_model(module)
    return module


class PipeParts:
    def __init__(self, sources: ModelSources, options: LoadOptions, variant: Variant, device: torch.device,
                 dtype: torch.dtype, memory: PipeMemory, lora: PipeLoras,
                 auto_quant: Optional[tuple[str, str]], files: LoadedFiles) -> None:
        self.sources = sources
        self.files = files  # each part's files as first opened: checked before a phase reads them again
        self.options = options
        self.variant = variant
        self.device = device
        self.dtype = dtype
        self.memory = memory
        self.lora = lora
        self.auto_quant = auto_quant  # choose_auto_quant's (format, reason) for quant 'auto'
        self.quant_reason = ""  # what quant 'auto' runs, and why
        self.dit_weights = ""  # the DiT's weight format ("bf16", "FP8", "GGUF Q8_0", ...), once known
        self.tokenizer: Any = None
        self.tokenizer_checked: Any = None  # the tokenizer check_tokenizer last found fitting its text encoder
        self.text_tower: Any = None
        self.dit: Any = None
        self.dit_forward: Any = None  # what the sampler calls: the DiT, or dit_graphs.DiTGraphs around it
        self.vae: Any = None
        self.vae_encoder: Any = None  # built only for jobs with an image in
        self.enhancer: Any = None
        self.compile_policy = CompilePolicy(options.compile)
        self.compile_policy_decided = False  # "auto" decided to compile: this DiT and any rebuilt one are compiled
        self.compile_wanted_in_background = False  # "auto" decided to compile beside the next run's calls
        self.compiling: Optional[CompilingForward] = None  # the DiT forward while its blocks compile beside it
        self.compile_let_go: Optional[BlockCompile] = None  # a background compile let go: its thread ends on its own
        self.compile_marked = False  # compile_marks.py knows this process compiled its blocks

    @property
    def compiles_dit(self) -> bool:
        """Whether the DiT's blocks are (or, once loaded, will be) compiled: asked for, or decided by the "auto"
        policy, and possible here."""
        return (self.options.compile is True or self.compile_policy_decided) and compile_available(self.device)

    @property
    def stacks_fp8(self) -> bool:
        """Whether loading stacks the DiT's FP8 q/k/v and gate/up (fuse_projections): where the device multiplies
        FP8 natively in bf16."""
        return native_fp8_supported(self.device) and self.dtype == torch.bfloat16

    def planned_dit_format(self) -> str:
        """The DiT's weight format as the compile policy prices it: what the loaded DiT holds, else what loading it
        will make (a quantised file's own format, or the format a bf16 DiT is quantised into on load); FP8 as
        "fp8" where its projections are stacked, "fp8 apart" where not."""
        if self.dit_weights:
            fp8 = self.dit_weights.startswith("FP8")
        else:
            choice = self.options.quant
            if choice == "auto" and self.auto_quant is not None:
                choice = self.auto_quant[0]
            fp8 = choice == "fp8"
        if self.dit is not None:
            stacked = getattr(self.dit.layers[0].self_attention, "to_qkv", None) is not None
        else:
            stacked = self.stacks_fp8
        return "bf16" if not fp8 else "fp8" if stacked else "fp8 apart"

    @contextmanager
    def timed_if_uncompiled(self, work: DitWork) -> Iterator[None]:
        """Around a job's DiT calls: uncompiled ones are timed (the device drained at both ends) for the policy."""
        if self.compiles_dit:
            yield
            self._mark_compiled()
            return
        synchronize = torch.cuda.synchronize if self.device.type == "cuda" else (lambda device: None)
        synchronize(self.device)
        beside_a_compile = self.compile_thread_running()
        started = time.perf_counter()
        yield
        synchronize(self.device)
        self.compile_policy.ran_uncompiled(work, time.perf_counter() - started,
                                           learn=not (beside_a_compile or self.compile_thread_running()))

    def compile_thread_running(self) -> bool:
        """Whether a background compile (this DiT's, or one let go that has not ended) may be running: calls beside
        it are slower than this device's own speed."""
        return self.compiling is not None or (self.compile_let_go is not None and not self.compile_let_go.join(0))

    def _mark_compiled(self) -> None:
        if not self.compile_marked and self.device.type == "cuda":
            mark_compiled(self.planned_dit_format(), self.device)  # a restart prices a warm-cache compile
            self.compile_marked = True

    def compile_fits_beside_the_run(self) -> bool:
        """Whether the blocks can compile on a thread beside this job's DiT calls (model/background_compile.py): a
        CUDA DiT with every block resident, room in the plan for a second call's activations beside the run, and
        the calls replayed as CUDA graphs (an eager call launches its kernels from Python, which the compile's
        thread holds), and no LoRA on them (a compile made for the blocks one LoRA wraps would meet the others' when
        they switch, and compile again there). Memory is judged from the plan as the job starts, not again during
        the compile."""
        plan = self.memory.plan
        if self.device.type != "cuda" or plan is None or plan.dit.streamed or not self.options.cuda_graphs:
            return False
        if getattr(self.dit, "lora_signature", ()):
            return False
        if getattr(self.dit_forward, "disabled_reason", None):
            return False
        return plan.budget - plan.phase_peaks.get("dit", plan.peak) >= plan.dit.workspace

    def compile_if_it_pays(self, work: DitWork, host: Host, background: bool = True) -> None:
        """Before a job's DiT phase: compile the blocks where the compile policy says it pays from here on, beside
        the run's calls where they can (`background`: the run calls the DiT forward, as a step-cache run does not),
        else now (the loaded DiT's captured graphs are dropped; its blocks compile on their next call). A run that
        cannot switch to compiled blocks between its calls first lets a compile in flight end."""
        self.compile_wanted_in_background = False
        if self.compiling is not None and self.compiling.outdated():
            host.log("the DiT's LoRAs changed while its blocks compiled in the background: that compile is let go")
            self._stop_compiling()
        if self.compiling is not None:
            if not background:
                host.log("waiting for the DiT's blocks to finish compiling in the background: a step-cache run "
                         "cannot switch to them between its calls")
                self.compiling.wait_and_switch(host.check_cancel)
            return
        if self.compiles_dit or not compile_available(self.device):
            return
        if self.compile_let_go is not None and not self.compile_let_go.join(0):
            return  # its trace holds dynamo's lock: a compile now would wait for it; decided at the next job
        fmt = self.planned_dit_format()
        self.compile_policy.set_format(fmt)
        self.compile_policy.caches_warm = caches_hold(fmt, self.device)
        policy = self.compile_policy
        placement = policy.placement(work, background and self.compile_fits_beside_the_run())
        if placement is None:
            return
        if placement == "beside":
            self.compile_wanted_in_background = True
            host.log(f"compiling the DiT's blocks in the background: uncompiled runs have cost {policy.spent_s:.1f} s "
                     "more than compiled ones would, and this job's would pay for compiling beside them "
                     "(LoadOptions.compile='auto'); calls run uncompiled until it is done")
            return
        self.compile_policy_decided = True
        host.log(f"compiling the DiT's blocks: uncompiled runs have cost {policy.spent_s:.1f} s more "
                 "than compiled ones would, about what compiling costs (LoadOptions.compile='auto')")
        if self.dit is not None:
            self.release_graphs()
            self.dit_forward = None
            compile_blocks(self.dit)
            self._sync_loras()

    def release_graphs(self) -> None:
        """Give the DiT forward's CUDA graphs and their memory back (dit_graphs.DiTGraphs; nothing for a plain DiT)."""
        release = getattr(self.dit_forward, "release_graphs", None)
        if release is not None:
            release()

    def note_dit_file(self, dit) -> None:
        """What the opened DiT file says before it is built: a quantised file's formats, and what 'auto' runs."""
        if dit.quantized:
            self.dit_weights = file_weight_format(dit)
        if self.auto_quant is not None:
            self.quant_reason = (f"auto -> {self.dit_weights}, the DiT file's own format ({dit.path.name} is already "
                                 "quantised; auto picks a format for a bf16 DiT only)" if dit.quantized
                                 else self.auto_quant[1])

    # -- built on first use --------------------------------------------------------------------------

    def load_tokenizer(self):
        if self.tokenizer is None:
            from ..formats.tokenizer import load_tokenizer

            self.tokenizer = load_tokenizer(self.sources)
        return self.tokenizer

    def check_tokenizer(self) -> None:
        """The tokenizer read, and held against the text encoder's embedding from its file's shapes (no weight is
        read): one that cannot be read or gives ids past the embedding is refused before any phase runs."""
        from ..formats.tokenizer_fit import refuse_unfit

        tokenizer = self.load_tokenizer()
        if self.text_tower is not None or self.tokenizer_checked is tokenizer:  # built: encode_prompts holds it
            return                                                             # against the tower; or done before
        component = self._open("text_encoder")
        refuse_unfit(tokenizer, int(component.tensor("embed_tokens.weight").shape[0]), "text encoder", component.path)
        self.tokenizer_checked = tokenizer

    def _open(self, kind: str):
        """The part's file opened again, refused where it is not the file the pipe first opened (loaded_files.py)."""
        component = open_part(self.sources, kind)
        self.files.opened(kind, component.files)
        return component

    @built_outside_inference_mode
    def load_text_tower(self):
        self.files.check(("text_encoder",))
        if self.text_tower is None:
            component = self._open("text_encoder")
            tower = build_text_tower(component, self.memory.build_device(), self.dtype, self.variant)
            self.text_tower = self.memory.place_text(_built(tower))
        return self.text_tower

    @built_outside_inference_mode
    def load_dit(self):
        """The DiT, placed by the plan and carrying the job's LoRAs."""
        self.files.check(("dit",))
        if self.dit is None:
            component = self._open("dit")
            quant = self._quant_on_load(component)
            kernels_compiling = self._compile_fp8_kernels_ahead(component)
            dit = build_dit(component, self.memory.build_device(), self.dtype, quant=quant, quant_device=self.device,
                            arithmetic=self.options.arithmetic)
            if self.device.type == "cuda":
                fuse_projections(dit, stack_packed=self.stacks_fp8)
            dit = self.memory.place_dit(_built(dit))
            if self.compiles_dit:
                compile_blocks(dit)
            self.dit = dit
            self.dit_weights = dit_weight_format(dit)
            if kernels_compiling is not None:
                kernels_compiling.join()  # before the first call: its launches (and captures) find them compiled
        self._sync_loras()
        return self.dit

    def _compile_fp8_kernels_ahead(self, component) -> Optional[threading.Thread]:
        """For a DiT that will multiply FP8 natively: its activation kernels compiling on a thread beside its load
        (quant/fp8_kernel_warmup.py), else None."""
        if not (self.stacks_fp8 and self.planned_dit_format() == "fp8"):
            return None
        config = dit_config_for(component)
        return fp8_kernel_warmup.start(self.device, config.hidden_size, config.ffn_hidden_size)

    def _sync_loras(self) -> None:
        """The job's LoRAs on the DiT. After placement: branches stay resident, never streamed; merge-mode LoRAs
        merge into the resident blocks; compiled blocks take them in one structure."""
        streamed = self.memory.dit.plan.streamed if self.memory.dit is not None else ()
        self.lora.sync(self.dit, streamed, self.memory.host)

    def load_dit_forward(self, dit):
        """The DiT's forward as the sampler calls it: replayed as CUDA graphs where dit_graphs can (kept, with their
        graphs, for as long as this DiT is the loaded one), else the module itself."""
        from ..model.dit_graphs import graphed_dit

        forward = self.dit_forward
        if forward is None or getattr(forward, "dit", forward) is not dit:
            self._stop_compiling()
            forward = graphed_dit(dit, self.options.cuda_graphs and not self.compiles_dit, self.device)
            self.dit_forward = forward
        if self.compile_wanted_in_background and not self.compiles_dit:
            self.compile_wanted_in_background = False
            forward = self.compiling = CompilingForward(dit, forward, self._say, self._compiled_in_background)
            self.dit_forward = forward
        return forward

    def _say(self, message: str) -> None:
        if self.memory.host is not None:
            self.memory.host.log(message)

    def _compiled_in_background(self, seconds: Optional[float]) -> None:
        """The background compile's switch: the blocks are compiled in place (after a failed compile, they compile on
        their next call), and this DiT and any rebuilt one stay compiled: its forward is the DiT itself, as at a load
        with compile=True (a step cache then runs the compiled blocks, no graphs)."""
        self.dit_forward = self.compiling.dit
        self.compiling = None
        self.compile_policy_decided = True
        if seconds is not None:
            self._say(f"the DiT's blocks compiled in the background ({seconds:.1f} s on its thread): calls run "
                      "compiled from here on")
            self._mark_compiled()

    def _stop_compiling(self) -> None:
        """The DiT the background compile serves is dropped or replaced: no switch, its thread ends on its own."""
        if self.compiling is not None:
            self.compiling.abandon()
            self.compile_let_go = self.compiling.block_compile
            self.dit_forward = self.compiling.uncompiled
            self.compiling = None

    def _quant_on_load(self, component) -> str:
        """The format to quantise a bf16 DiT into while loading ("none" keeps the file's weights as they are)."""
        choice = self.options.quant
        if component.quantized or choice in ("none", "bf16"):
            return "none"
        if choice == "auto":
            choice, self.quant_reason = self.auto_quant
        return choice if choice in QUANT_ON_LOAD_FORMATS else "none"

    def _vae_dtype(self) -> torch.dtype:
        return torch.float32 if self.device.type == "cpu" else self.dtype

    @built_outside_inference_mode
    def load_vae(self):
        self.files.check(("vae",))
        if self.vae is None:
            component = self._open("vae")
            self.vae = _built(build_vae(component, self.device, self._vae_dtype()))
        return self.vae

    @built_outside_inference_mode
    def load_vae_encoder(self):
        self.files.check(("vae",))
        if self.vae_encoder is None:
            component = self._open("vae")
            self.vae_encoder = _built(build_vae(component, self.device, self._vae_dtype(), part="encoder"))
        return self.vae_encoder

    def load_enhancer(self, host: Host, placed: bool):
        """The local prompt enhancer; `placed`: built on the host for the memory plan to place (PipeMemory.place_pe)."""
        self.files.check(("pe",))
        if self.enhancer is None:
            from ..text.enhancer import LocalEnhancer

            self.enhancer = built_outside_inference_mode(LocalEnhancer.load)(
                self.sources, self.device, self.dtype, self.variant, host,
                build_device=self.memory.build_device() if placed else None, quant=self.options.pe_quant)
            _built(self.enhancer.model)
        self.enhancer.compiled_decode = self.options.pe_compile and compile_available(self.device)
        return self.enhancer

    def weights_of(self, component: str) -> object:
        """Where a part's weights are, for a message: its file or folder, or the part's name where none was given
        (weights handed over already built)."""
        try:
            return self.sources.component(component)
        except ModelFileError:
            return f"the {component} given"

    # -- what they hold ------------------------------------------------------------------------------

    def _modules(self) -> dict[str, Optional[torch.nn.Module]]:
        enhancer = self.enhancer.model if self.enhancer is not None else None
        return {"pe": enhancer, "text": self.text_tower, "dit": self.dit, "vae": self.vae}

    def any_loaded(self) -> bool:
        """Whether any weights (text encoder, DiT, VAE, prompt enhancer) are held."""
        return any(part is not None for part in (self.text_tower, self.dit, self.vae, self.vae_encoder, self.enhancer))

    def device_bytes_held(self) -> dict[str, int]:
        """Bytes of weights (and streaming buffers) held on the device now, by phase."""
        parts = self._modules()
        if self.vae_encoder is not None:  # built only for jobs with an image in
            parts["encode"] = self.vae_encoder
        return {phase: device_bytes_held(module, self.device) for phase, module in parts.items()}

    def host_tensors(self) -> list[torch.Tensor]:
        """Every host tensor held now: streaming slabs (page-locked on CUDA) and weights kept in host memory (a
        parked prompt enhancer, a CPU device's models). Read-only; loads nothing."""
        modules = self._modules()
        tensors: list[torch.Tensor] = list(self.memory.host_slabs())
        for module in (modules["text"], modules["dit"], modules["vae"], modules["pe"]):
            if module is None:
                continue
            tensors += [t for t in (*module.parameters(), *module.buffers()) if t.device.type == "cpu"]
        tensors += self.lora.host_tensors(self.dit)  # a merged LoRA's copy of the original weights
        return tensors

    def host_bytes(self) -> dict[str, int]:
        """Host memory held now: all of it (`host_tensors`, each storage once) and the page-locked part."""
        storages = {(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in self.host_tensors()}
        return {"host": sum(n for _, n in storages),
                "pinned": self.memory.pinned_bytes() + self.lora.pinned_bytes(self.dit)}

    def drop_unplanned(self) -> None:
        """Let go of the parts the memory plan just released (they are rebuilt on use)."""
        if not self.memory.active:
            return
        if self.memory.dit is None:
            self.release_graphs()
            self._stop_compiling()
            self.dit = self.dit_forward = None
        if self.memory.text is None:
            self.text_tower = None
        if self.memory.pe is None:
            self.enhancer = None
        if not self.memory.encoder_is_persistent():
            self.vae_encoder = None  # kept from an earlier job whose plan had room for it

    def drop(self) -> None:
        """Let go of every part but the tokenizer (no device memory, quick to keep)."""
        self.release_graphs()
        self._stop_compiling()
        self.compile_wanted_in_background = False
        self.text_tower = self.dit = self.dit_forward = self.vae = self.vae_encoder = self.enhancer = None
