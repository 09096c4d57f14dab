"""Tiny random ERNIE-Image models with the real classes and shape relations, for tests and the no-weights demo.

Everything is built in code: nothing is downloaded. The DiT keeps the released structure (shared AdaLN,
3-axis RoPE whose axes sum to the head dim, gated-GELU MLP, text_in_dim == text-encoder width, 128 latent
channels == 4 x the VAE's 32) at a few hundred kilobytes.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from ..core.variant import Variant
from ..files.output_files import give_usual_mode, safetensors_under
from ..formats.config_json import released_config_folder
from ..formats.sources import ModelSources
from ..text.pe_prompt import ERNIE_PE_CHAT_TEMPLATE
from .tiny_vocab import BOS_ID, EOS_ID, PAD_ID, SPECIAL_TOKENS

__all__ = ["BOS_ID", "EOS_ID", "PAD_ID", "SPECIAL_TOKENS", "TinySizes", "build_tiny_model"]

Layout = Literal["diffusers", "comfy"]



@dataclass(frozen=True)
class TinySizes:
    dit_hidden: int = 64
    dit_heads: int = 2
    dit_layers: int = 2
    dit_ffn: int = 128
    rope_axes: tuple[int, int, int] = (8, 12, 12)
    text_hidden: int = 48
    text_layers: int = 4
    text_heads: int = 4
    text_kv_heads: int = 2
    text_ffn: int = 96
    vae_channels: tuple[int, ...] = (8, 16, 16, 32)


def build_tokenizer():
    """Byte-level BPE over the 256 byte symbols after the special tokens; BOS added like Tekken does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS)}
    for symbol in sorted(alphabet):
        vocab[symbol] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", BOS_ID)]
    )
    return tokenizer


def save_tokenizer(folder: Path, chat_template: str | None = None, max_length: int = 2048) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    build_tokenizer().save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "TokenizersBackend",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": "<pad>",
        "model_max_length": max_length,
        "add_bos_token": True,
        "add_eos_token": False,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (folder / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"})
    )
    if chat_template is not None:
        (folder / "chat_template.jinja").write_text(chat_template)


def _text_config(sizes: TinySizes) -> dict:
    head_dim = sizes.text_hidden // sizes.text_heads
    return {
        "model_type": "mistral",
        "hidden_size": sizes.text_hidden,
        "intermediate_size": sizes.text_ffn,
        "num_hidden_layers": sizes.text_layers,
        "num_attention_heads": sizes.text_heads,
        "num_key_value_heads": sizes.text_kv_heads,
        "head_dim": head_dim,
        "vocab_size": len(SPECIAL_TOKENS) + 256,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "hidden_act": "silu",
        "tie_word_embeddings": True,
        "rope_parameters": {
            "rope_type": "yarn", "type": "yarn", "rope_theta": 1000000.0, "factor": 16.0,
            "original_max_position_embeddings": 256, "beta_fast": 32.0, "beta_slow": 1.0,
            "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.1,
        },
    }


def build_text_encoder(sizes: TinySizes, seed: int):
    from ..model.libraries import Mistral3Config, Mistral3Model

    config = Mistral3Config(
        text_config=_text_config(sizes),
        vision_config={
            "model_type": "pixtral", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
            "num_attention_heads": 2, "head_dim": 16, "image_size": 28, "patch_size": 14,
        },
        image_token_index=10,
        spatial_merge_size=2,
        multimodal_projector_bias=False,
    )
    torch.manual_seed(seed)
    return Mistral3Model(config).eval()


def build_prompt_enhancer(sizes: TinySizes, seed: int):
    from ..model.libraries import Ministral3Config, Ministral3ForCausalLM

    raw = _text_config(sizes)
    raw.pop("model_type")
    raw["pad_token_id"] = PAD_ID
    torch.manual_seed(seed)
    return Ministral3ForCausalLM(Ministral3Config(**raw)).eval()


def build_dit(sizes: TinySizes, seed: int):
    from ..model.libraries import ErnieImageTransformer2DModel

    torch.manual_seed(seed)
    model = ErnieImageTransformer2DModel(
        hidden_size=sizes.dit_hidden,
        num_attention_heads=sizes.dit_heads,
        num_layers=sizes.dit_layers,
        ffn_hidden_size=sizes.dit_ffn,
        in_channels=128,
        out_channels=128,
        patch_size=1,
        text_in_dim=sizes.text_hidden,
        rope_theta=256,
        rope_axes_dim=sizes.rope_axes,
    )
    # diffusers zero-initialises the modulation and the output layer; random weights there make the test meaningful.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm_q.weight") or name.endswith("norm_k.weight") or name.endswith("_ln.weight"):
                param.uniform_(0.8, 1.2)
            else:
                param.normal_(0.0, 0.5 / param.shape[-1] ** 0.5 if param.ndim > 1 else 0.02)
    return model.eval()


def model_shapes(sizes: TinySizes = TinySizes()) -> tuple[dict, dict, dict, dict[str, torch.Tensor]]:
    """The DiT, text-tower and VAE configs of the model build_tiny_model writes, and its DiT's weights as meta
    tensors (shapes and dtypes, no data): what checks that read a model's file headers need, with nothing built
    or written."""
    # Imported outside the meta device: diffusers makes module-level tensors on import (quantizer tables), which
    # would otherwise live on the meta device for the rest of the process.
    from ..model.libraries import AutoencoderKLFlux2, ErnieImageTransformer2DModel  # noqa: F401

    with torch.device("meta"):
        dit, vae = build_dit(sizes, 0), build_vae(sizes, 0)
    return dict(dit.config), _text_config(sizes), dict(vae.config), dit.state_dict()


def build_vae(sizes: TinySizes, seed: int):
    from ..model.libraries import AutoencoderKLFlux2

    torch.manual_seed(seed)
    vae = AutoencoderKLFlux2(
        in_channels=3,
        out_channels=3,
        block_out_channels=sizes.vae_channels,
        layers_per_block=1,
        latent_channels=32,
        norm_num_groups=8,
        sample_size=256,
    )
    with torch.no_grad():
        vae.bn.running_mean.normal_(0.0, 0.3)
        vae.bn.running_var.uniform_(0.5, 2.0)
    return vae.eval()


def lively_prompt_enhancer(sizes: TinySizes = TinySizes(), seed: int = 0):
    model = build_prompt_enhancer(sizes, seed)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("embed_tokens.weight"):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
            elif param.ndim == 2:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    return model


def write_pe_tokenizer(folder: Path, chat_template: str = ERNIE_PE_CHAT_TEMPLATE, adds_bos: bool = False,
                       max_length: int = 2048) -> None:
    save_tokenizer(folder, chat_template=chat_template, max_length=max_length)
    if not adds_bos:
        spec = json.loads((folder / "tokenizer.json").read_text())
        spec["post_processor"] = None
        (folder / "tokenizer.json").write_text(json.dumps(spec))
        config = json.loads((folder / "tokenizer_config.json").read_text())
        config["add_bos_token"] = False
        (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def _write_scheduler(folder: Path, config_root: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(config_root / "scheduler" / "config.json", folder / "scheduler_config.json")  # the umask's mode


def build_tiny_model(
    dest: Path,
    layout: Layout = "diffusers",
    variant: Variant = "turbo",
    with_pe: bool = False,
    seed: int = 0,
    sizes: TinySizes = TinySizes(),
) -> ModelSources:
    """Write a tiny random ERNIE-Image model under `dest` and return where its parts are.

    layout "diffusers": Baidu's folder (model_index.json, transformer/, text_encoder/, tokenizer/, vae/,
    scheduler/, optional pe/ + pe_tokenizer/). layout "comfy": ComfyUI's single files under
    diffusion_models/, text_encoders/ (tokenizer embedded as `tekken_model`) and vae/ (BFL key layout).
    """
    dest = Path(dest)
    config_root = released_config_folder(variant)
    dit, text_encoder, vae = build_dit(sizes, seed), build_text_encoder(sizes, seed + 1), build_vae(sizes, seed + 2)
    pe = None
    if with_pe:
        pe = lively_prompt_enhancer(sizes, seed + 3)
    if layout == "diffusers":
        return save_diffusers_layout(dest, config_root, dit, text_encoder, vae, pe)
    from .comfy_files import save_comfy_layout

    return save_comfy_layout(dest, variant, dit, text_encoder, vae, pe)


def save_diffusers_layout(dest: Path, config_root: Path, dit, text_encoder, vae, pe) -> ModelSources:
    dest.mkdir(parents=True, exist_ok=True)
    index = json.loads((config_root / "model_index" / "config.json").read_text())
    if pe is None:
        index.pop("pe", None)
        index.pop("pe_tokenizer", None)
    (dest / "model_index.json").write_text(json.dumps(index, indent=2))
    dit.save_pretrained(dest / "transformer")
    if config_root.name.endswith("Turbo"):
        # The released Turbo transformer config carries LoRA fields (unused at inference); keep that trait.
        config_path = dest / "transformer" / "config.json"
        config = json.loads(config_path.read_text())
        config.update({"use_lora": False, "lora_rank": 4})
        config_path.write_text(json.dumps(config, indent=2))
    text_encoder.save_pretrained(dest / "text_encoder")
    vae.save_pretrained(dest / "vae")
    save_tokenizer(dest / "tokenizer")
    _write_scheduler(dest / "scheduler", config_root)
    if pe is not None:
        pe.save_pretrained(dest / "pe")
        write_pe_tokenizer(dest / "pe_tokenizer")  # Baidu's layout: the chat template writes BOS
    give_usual_mode(safetensors_under(dest))
    return ModelSources(model_dir=dest)
