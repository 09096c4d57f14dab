"""FLUX.2 VAE key names: Black Forest Labs' original layout (what `vae/flux2-vae.safetensors` holds and ComfyUI
reads) <-> diffusers' AutoencoderKLFlux2, in both directions.

BFL names blocks `encoder.down.I.block.J`, `decoder.up.I.block.J` (up blocks numbered from the lowest resolution
the other way round: BFL `up.I` is diffusers `up_blocks.N-1-I`), `mid.block_1/2`, `mid.attn_1.{norm,q,k,v,proj_out}`
with 1x1-conv attention weights [C, C, 1, 1], `norm_out`, `nin_shortcut`, and keeps `quant_conv` inside the encoder
and `post_quant_conv` inside the decoder. `bn.*` (the latent BatchNorm statistics) is named the same in both.
"""
from __future__ import annotations

import re
from typing import Callable, Optional

import torch

Reshape = Optional[Callable[[torch.Tensor], torch.Tensor]]

_ATTN_TO_BFL = {"group_norm": "norm", "to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "proj_out"}
_ATTN_TO_DIFFUSERS = {v: k for k, v in _ATTN_TO_BFL.items()}
_TOP_TO_BFL = {"quant_conv.": "encoder.quant_conv.", "post_quant_conv.": "decoder.post_quant_conv."}


def is_bfl_vae(keys) -> bool:
    return any(k.startswith(("decoder.up.", "decoder.mid.block_1.", "encoder.down.")) for k in keys)


def num_up_blocks_bfl(keys) -> int:
    indices = {int(m.group(1)) for k in keys if (m := re.match(r"decoder\.up\.(\d+)\.", k))}
    return max(indices) + 1 if indices else 0


def _squeeze_1x1(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(tensor.shape[0], tensor.shape[1]) if tensor.ndim == 4 else tensor


def _unsqueeze_1x1(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(*tensor.shape, 1, 1) if tensor.ndim == 2 else tensor


def _resnet_to_diffusers(rest: str) -> str:
    return rest.replace("nin_shortcut.", "conv_shortcut.")


def _resnet_to_bfl(rest: str) -> str:
    return rest.replace("conv_shortcut.", "nin_shortcut.")


def bfl_to_diffusers(key: str, num_up_blocks: int) -> tuple[Optional[str], Reshape]:
    """A BFL key -> (diffusers key, reshape for the tensor) or (None, None) for a key diffusers has no place for."""
    for top, bfl in _TOP_TO_BFL.items():
        if key.startswith(bfl):
            return top + key[len(bfl):], None
    if key.startswith(("quant_conv.", "post_quant_conv.", "bn.")):  # ComfyUI's own saves keep these top-level
        return key, None
    side, _, rest = key.partition(".")
    if side not in ("encoder", "decoder"):
        return None, None
    if m := re.match(r"down\.(\d+)\.block\.(\d+)\.(.+)", rest):
        return f"{side}.down_blocks.{m[1]}.resnets.{m[2]}.{_resnet_to_diffusers(m[3])}", None
    if m := re.match(r"down\.(\d+)\.downsample\.(.+)", rest):
        return f"{side}.down_blocks.{m[1]}.downsamplers.0.{m[2]}", None
    if m := re.match(r"up\.(\d+)\.block\.(\d+)\.(.+)", rest):
        return f"{side}.up_blocks.{num_up_blocks - 1 - int(m[1])}.resnets.{m[2]}.{_resnet_to_diffusers(m[3])}", None
    if m := re.match(r"up\.(\d+)\.upsample\.(.+)", rest):
        return f"{side}.up_blocks.{num_up_blocks - 1 - int(m[1])}.upsamplers.0.{m[2]}", None
    if m := re.match(r"mid\.block_(\d)\.(.+)", rest):
        return f"{side}.mid_block.resnets.{int(m[1]) - 1}.{_resnet_to_diffusers(m[2])}", None
    if m := re.match(r"mid\.attn_1\.(norm|q|k|v|proj_out)\.(weight|bias)", rest):
        reshape = _squeeze_1x1 if m[1] != "norm" and m[2] == "weight" else None
        return f"{side}.mid_block.attentions.0.{_ATTN_TO_DIFFUSERS[m[1]]}.{m[2]}", reshape
    if rest.startswith("norm_out."):
        return f"{side}.conv_norm_out.{rest[len('norm_out.'):]}", None
    if rest.startswith(("conv_in.", "conv_out.")):
        return key, None
    return None, None


def diffusers_to_bfl(key: str, num_up_blocks: int) -> tuple[str, Reshape]:
    """A diffusers AutoencoderKLFlux2 key -> (BFL key, reshape for the tensor)."""
    for top, bfl in _TOP_TO_BFL.items():
        if key.startswith(top):
            return bfl + key[len(top):], None
    side, _, rest = key.partition(".")
    if side not in ("encoder", "decoder"):
        return key, None
    if m := re.match(r"down_blocks\.(\d+)\.resnets\.(\d+)\.(.+)", rest):
        return f"{side}.down.{m[1]}.block.{m[2]}.{_resnet_to_bfl(m[3])}", None
    if m := re.match(r"down_blocks\.(\d+)\.downsamplers\.0\.(.+)", rest):
        return f"{side}.down.{m[1]}.downsample.{m[2]}", None
    if m := re.match(r"up_blocks\.(\d+)\.resnets\.(\d+)\.(.+)", rest):
        return f"{side}.up.{num_up_blocks - 1 - int(m[1])}.block.{m[2]}.{_resnet_to_bfl(m[3])}", None
    if m := re.match(r"up_blocks\.(\d+)\.upsamplers\.0\.(.+)", rest):
        return f"{side}.up.{num_up_blocks - 1 - int(m[1])}.upsample.{m[2]}", None
    if m := re.match(r"mid_block\.resnets\.(\d+)\.(.+)", rest):
        return f"{side}.mid.block_{int(m[1]) + 1}.{_resnet_to_bfl(m[2])}", None
    if m := re.match(r"mid_block\.attentions\.0\.(group_norm|to_q|to_k|to_v|to_out\.0)\.(weight|bias)", rest):
        reshape = _unsqueeze_1x1 if m[1] != "group_norm" and m[2] == "weight" else None
        return f"{side}.mid.attn_1.{_ATTN_TO_BFL[m[1]]}.{m[2]}", reshape
    if rest.startswith("conv_norm_out."):
        return f"{side}.norm_out.{rest[len('conv_norm_out.'):]}", None
    return key, None


def to_bfl_state_dict(state: dict[str, torch.Tensor], num_up_blocks: int) -> dict[str, torch.Tensor]:
    converted = {}
    for key, tensor in state.items():
        new_key, reshape = diffusers_to_bfl(key, num_up_blocks)
        converted[new_key] = reshape(tensor) if reshape else tensor
    return converted


def config_from_shapes(shapes: dict[str, tuple[int, ...]], released: dict) -> dict:
    """An AutoencoderKLFlux2 config for a diffusers-named VAE whose file carries none: the released one, with the
    sizes the tensors show. GroupNorm's group count cannot be seen in shapes; the released 32 is kept."""
    config = dict(released)
    ups = sorted({int(m[1]) for k in shapes if (m := re.match(r"decoder\.up_blocks\.(\d+)\.", k))})
    if not ups or "decoder.conv_in.weight" not in shapes:
        return config
    # Decoder up block i outputs block_out_channels reversed[i].
    outs = [shapes[f"decoder.up_blocks.{i}.resnets.0.conv1.weight"][0] for i in ups]
    config["block_out_channels"] = list(reversed(outs))
    resnets = {int(m[1]) for k in shapes if (m := re.match(r"decoder\.up_blocks\.0\.resnets\.(\d+)\.", k))}
    config["layers_per_block"] = max(resnets)  # the decoder has one resnet more per block than the encoder
    config["latent_channels"] = shapes["decoder.conv_in.weight"][1]
    config["down_block_types"] = ["DownEncoderBlock2D"] * len(ups)
    config["up_block_types"] = ["UpDecoderBlock2D"] * len(ups)
    return config
