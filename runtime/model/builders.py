"""Where a model's parts are, and turning those files into runtime modules.

Parsing weight files (layouts, key names, detection, errors) lives in `formats/`; this module composes the
parts: it builds the DiT, text tower and VAE on the meta device and fills them straight from the file
mappings, so no random init is ever materialised and host RAM stays near one copy of the weights.
"""
from __future__ import annotations

import inspect
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Optional

import torch

from ..core.errors import ModelFileError
from ..core.variant import Variant, checked_variant_option
from ..formats.config_json import config_named

if TYPE_CHECKING:
    from .dit import DiTConfig

CONFIG_ROOT = Path(__file__).parent.parent / "configs"
# What a component is called where a message asks for its file, and the setting that takes that file.
_FILE_WORDS = {"transformer": ("DiT", "dit"), "text_encoder": ("text encoder", "text_encoder"), "vae": ("VAE", "vae"),
               "pe": ("prompt enhancer", "pe")}


@dataclass
class ModelSources:
    """Any mix of a diffusers folder and single files; a single file overrides the folder's component."""

    model_dir: Optional[Path] = None
    dit: Optional[Path] = None
    text_encoder: Optional[Path] = None
    vae: Optional[Path] = None
    pe: Optional[Path] = None
    tokenizer: Optional[Path] = None  # a tokenizer folder or tokenizer.json; else found next to the weights
    variant: Optional[Variant] = None  # None or "auto": decided from the files (runtime/core/variant.py)

    def __post_init__(self) -> None:
        for name in ("model_dir", "dit", "text_encoder", "vae", "pe", "tokenizer"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, Path(value))
        self.variant = checked_variant_option(self.variant)

    def component(self, name: str) -> Path:
        """The file or folder holding one component ("transformer", "text_encoder", "vae", "pe")."""
        explicit = {"transformer": self.dit, "text_encoder": self.text_encoder, "vae": self.vae, "pe": self.pe}[name]
        if explicit is not None:
            if not explicit.exists():
                raise ModelFileError(f"{name} file {explicit} does not exist: check the path")
            return explicit
        part, setting = _FILE_WORDS[name]
        if self.model_dir is None:
            raise ModelFileError(f"no {part} given: pass a diffusers folder (model_dir) or the {part} file ({setting})"
                                 ).naming("model_dir", setting)
        if not self.model_dir.is_dir():
            what = "is a file, not a folder" if self.model_dir.exists() else "does not exist"
            hint = ("give the diffusers ERNIE-Image folder, or the file as the component it holds" if
                    self.model_dir.exists() else "check the path")
            raise ModelFileError(f"model folder {self.model_dir} {what}: {hint}")
        folder = self.model_dir / name
        if not folder.is_dir():
            raise ModelFileError(
                f"{self.model_dir} has no {name}/ folder: point model_dir at a diffusers ERNIE-Image folder "
                f"(model_index.json, transformer/, text_encoder/, tokenizer/, vae/) or give the {part} file ({setting})"
            ).naming("model_dir", setting)
        return folder

    def has_pe(self) -> bool:
        return self.pe is not None or (self.model_dir is not None and (self.model_dir / "pe").is_dir())


def load_config(variant: Variant, component: str) -> dict:
    folder = "ERNIE-Image-Turbo" if variant == "turbo" else "ERNIE-Image"
    return json.loads((CONFIG_ROOT / folder / component / "config.json").read_text())


def fill_from_file(module: torch.nn.Module, component, device: torch.device, dtype: torch.dtype, quant: str = "none",
                   quant_device: Optional[torch.device] = None, keep_fp32: tuple[str, ...] = ()) -> torch.nn.Module:
    """Fill a meta-device module from `component` (packed Linears when the file is quantised or `quant` asks),
    then check that nothing is left on the meta device."""
    if component.quantized or quant in QUANT_ON_LOAD_FORMATS:
        module = _build_quantized(module, component, device, dtype, quant, quant_device or device)
    else:
        module = _fill_module(module, component, device, dtype, keep_fp32)
    for name, tensor in list(module.named_parameters()) + list(module.named_buffers()):
        if tensor.is_meta:
            raise ModelFileError(f"{component.path}: {name} was not filled from the file: report this as a bug")
    return module


def _fill_module(module: torch.nn.Module, component, device: torch.device, dtype: torch.dtype,
                 keep_fp32: tuple[str, ...] = ()) -> torch.nn.Module:
    """Load every parameter and buffer of a meta-device module from `component`, one tensor at a time."""
    expected = dict(module.state_dict(keep_vars=True))
    missing = [key for key in expected if key not in component.keys]
    if missing:
        raise ModelFileError(
            f"{component.path} is missing {len(missing)} {component.kind} tensors (e.g. {missing[0]}): "
            f"the file is incomplete or not an ERNIE-Image {component.kind}"
        )
    loaded: dict[str, torch.Tensor] = {}
    for key, target in expected.items():
        tensor = component.tensor(key)
        if tuple(tensor.shape) != tuple(target.shape):
            raise ModelFileError(
                f"{component.path}: tensor {key} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}: "
                f"the file does not match the ERNIE-Image {component.kind} configuration"
            )
        if not tensor.is_floating_point():
            want = tensor.dtype
        else:
            want = torch.float32 if any(key.endswith(k) for k in keep_fp32) else dtype
        loaded[key] = tensor.to(device=device, dtype=want)
        if loaded[key].data_ptr() != tensor.data_ptr() and hasattr(component, "release"):
            component.release(key)  # a converted copy exists: the mapped file pages need not stay in RAM
    module.load_state_dict(loaded, strict=True, assign=True)
    return module.eval().requires_grad_(False)


def dit_config_for(component) -> "DiTConfig":
    from .dit import DiTConfig

    if component.config is not None:
        with config_named(component, "DiT"):
            return DiTConfig.from_dict(component.config)
    shape = {key: tuple(component.tensor(key).shape) for key in
             ("x_embedder.proj.weight", "layers.0.self_attention.norm_q.weight", "layers.0.mlp.gate_proj.weight")}
    hidden, in_channels = shape["x_embedder.proj.weight"][:2]
    head_dim = shape["layers.0.self_attention.norm_q.weight"][0]
    num_layers = 1 + max(int(key.split(".")[1]) for key in component.keys if key.startswith("layers."))
    text_in = tuple(component.tensor("text_proj.weight").shape)[1] if "text_proj.weight" in component.keys else hidden
    released = DiTConfig()  # the rope axes scale with the head dim
    axes = tuple(a * head_dim // released.head_dim for a in released.rope_axes_dim)
    return DiTConfig.from_dict({
        "hidden_size": hidden, "num_attention_heads": hidden // head_dim, "num_layers": num_layers,
        "ffn_hidden_size": shape["layers.0.mlp.gate_proj.weight"][0], "in_channels": in_channels,
        "out_channels": tuple(component.tensor("final_linear.weight").shape)[0], "text_in_dim": text_in,
        "rope_axes_dim": axes,
    })


QUANT_ON_LOAD_FORMATS = ("fp8", "q8_0", "q4_k", "nvfp4")


def _build_quantized(module: torch.nn.Module, component, device: torch.device, dtype: torch.dtype,
                     quant: str, quant_device: torch.device) -> torch.nn.Module:
    """Fill a meta module whose Linears take packed weights: from a quantised file (GGUF, comfy_quant FP8/NVFP4)
    and/or by quantising bf16 weights on load (`quant` in QUANT_ON_LOAD_FORMATS), one tensor at a time."""
    from ..quant.linear import quantize_linears
    from ..quant.qweight import QuantizedWeight
    from ..quant.writer import quantize_weight, should_quantize

    linear_weights = {f"{name}.weight" for name, child in module.named_modules() if isinstance(child, torch.nn.Linear)}
    state: dict[str, object] = {}
    for key in module.state_dict(keep_vars=True):
        if key not in component.keys:
            raise ModelFileError(f"{component.path} has no tensor {key!r}: the file is not a complete ERNIE-Image "
                                 f"{component.kind}")
        value = component.tensor(key)
        if isinstance(value, QuantizedWeight) and key not in linear_weights:
            value = value.dequantize(dtype, key)  # e.g. a quantised embedding table: used by lookup, not matmul
        elif (quant in QUANT_ON_LOAD_FORMATS and key in linear_weights and isinstance(value, torch.Tensor)
              and should_quantize(key, value, quant)):
            packed = quantize_weight(value.to(quant_device, dtype), quant)
            value = _moved(packed, device)
        state[key] = value
    replaced = quantize_linears(module, state, dtype)
    for name in replaced:
        module.get_submodule(name).to(device)
    plain = {}
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            raise ModelFileError(f"{component.path}: {key} is quantised but is not a Linear weight here")
        plain[key] = value.to(device=device, dtype=dtype if value.is_floating_point() else value.dtype)
    module.load_state_dict(plain, strict=False, assign=True)
    return module.eval().requires_grad_(False)


def _moved(packed, device: torch.device):
    import dataclasses

    fields = ("data", "scale", "scale_2", "input_scale")
    return dataclasses.replace(packed, **{name: getattr(packed, name).to(device) for name in fields
                                          if getattr(packed, name) is not None})


def build_dit(component, device: torch.device, dtype: torch.dtype, quant: str = "none",
              quant_device: Optional[torch.device] = None):
    """The DiT on `device`; `quant` quantises bf16 Linear weights on load (on `quant_device`, default `device`)."""
    return fill_from_file(dit_on_meta(component), component, device, dtype, quant, quant_device)


def dit_on_meta(component) -> torch.nn.Module:
    """The DiT its config describes, on the meta device (no memory): a config that does not build it is named."""
    from .dit import ErnieDiT

    with config_named(component, "DiT"), torch.device("meta"):
        return ErnieDiT(dit_config_for(component))


def text_config_for(component, variant: Variant = "base") -> dict:
    """The text tower's config: the folder's, one embedded in the file, or the released Ministral-3B one."""
    config = component.config
    if config is not None:
        return dict(config.get("text_config", config))
    released = load_config(variant, "text_encoder")["text_config"]
    width = tuple(component.tensor("embed_tokens.weight").shape)[1]
    if width != released["hidden_size"]:
        raise ModelFileError(
            f"{component.path}: text encoder width {width} is not Ministral-3B's {released['hidden_size']}: "
            f"ERNIE-Image needs the ministral-3-3b text encoder"
        )
    return dict(released)


def rebuild_rotary_tables(model: torch.nn.Module, config, device: torch.device) -> None:
    """A meta-built Mistral-family model's rotary tables are non-persistent buffers, in no file: compute them."""
    with torch.device("cpu"):
        model.rotary_emb = type(model.rotary_emb)(config).to(device)


def build_text_tower(component, device: torch.device, dtype: torch.dtype, variant: Variant = "base"):
    """Mistral text tower cut at the layer whose output is hidden_states[-2]: later layers and norm never load."""
    tower = text_tower_on_meta(component, variant)
    rebuild_rotary_tables(tower, tower.config, device)
    return fill_from_file(tower, component, device, dtype)


def text_tower_on_meta(component, variant: Variant = "base") -> torch.nn.Module:
    """The text tower its config describes, on the meta device: a config that does not build it is named."""
    from transformers import MistralConfig, MistralModel

    with config_named(component, "text encoder"):
        raw = text_config_for(component, variant)
        total_layers = int(raw["num_hidden_layers"])
        raw = {k: v for k, v in raw.items() if k not in ("model_type", "architectures", "dtype", "transformers_version")}
        # Only Ministral3 (the PE) reads llama_4_scaling_beta; the reference text tower is a plain MistralModel.
        raw["rope_parameters"] = {k: v for k, v in raw.get("rope_parameters", {}).items()
                                  if k != "llama_4_scaling_beta"}
        raw["num_hidden_layers"] = total_layers - 1
        config = MistralConfig(**raw)
        config._attn_implementation = "sdpa"
        with torch.device("meta"):
            tower = MistralModel(config)
    tower.norm = torch.nn.Identity()
    return tower


VaePart = Literal["decoder", "encoder"]


def require_vae_encoder(component) -> None:
    """Image inputs need the VAE's encoder: a decoder-only file is named before any work starts."""
    if not any(key.startswith("encoder.") for key in component.keys):
        raise ModelFileError(f"{component.path.name} holds only the VAE decoder: image inputs need the encoder too: "
                             "pick the full vae/flux2-vae.safetensors (or a diffusers ERNIE-Image folder's vae/)")


def build_vae(component, device: torch.device, dtype: torch.dtype, part: VaePart = "decoder"):
    """One half of the FLUX.2 VAE with the latent BatchNorm statistics: the decoder (text-to-image never encodes)
    or the encoder (image inputs). The other half is dropped before anything is materialised."""
    if part == "encoder":
        require_vae_encoder(component)
    vae = vae_on_meta(component)
    if part == "encoder":
        vae.decoder = None
        vae.post_quant_conv = None
    else:
        vae.encoder = None
        vae.quant_conv = None
    return fill_from_file(vae, component, device, dtype, keep_fp32=("bn.running_mean", "bn.running_var"))


def vae_on_meta(component) -> torch.nn.Module:
    """The whole VAE its config describes, on the meta device: a config that does not build it is named."""
    from diffusers import AutoencoderKLFlux2

    with config_named(component, "VAE"):
        config = component.config or load_config("base", "vae")
        # Keys the class does not take (force_upcast: a pipeline's setting) would print a warning at every build.
        accepted = inspect.signature(AutoencoderKLFlux2.__init__).parameters
        config = {k: v for k, v in config.items() if k in accepted}
        with torch.device("meta"):
            return AutoencoderKLFlux2.from_config(config)


def check_config_builds(component, kind: str, variant: Variant = "base") -> None:
    """Build the part `component`'s config describes on the meta device and drop it: a config that does not build
    its part (wrong types, values out of range) fails at load in one line, before any work."""
    {"dit": dit_on_meta, "text_encoder": lambda c: text_tower_on_meta(c, variant), "vae": vae_on_meta}[kind](component)
