"""Tiny ERNIE-Image models with their diffusers references, for the tests that compare the two.

Whole pipelines: a tiny model in diffusers' folder layout, loaded by diffusers (the numerical reference) and by
the runtime (fp32 on the CPU); the fixtures are module-scoped, so a test module that imports them gets its own
folder and models. The DiT alone: a small ErnieDiT with random weights (`random_dit`) and diffusers'
ErnieImageTransformer2DModel holding the same weights (`diffusers_dit`).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ernie_image.runtime.demo.tiny import build_tiny_model
from ernie_image.runtime.formats.sources import ModelSources
from ernie_image.runtime.local.options import LoadOptions
from ernie_image.runtime.local.pipe import LocalPipe
from ernie_image.runtime.model.dit import DiTConfig, ErnieDiT

DIT_CONFIG = DiTConfig(hidden_size=256, num_attention_heads=2, num_layers=3, ffn_hidden_size=512, text_in_dim=96,
                       rope_axes_dim=(32, 48, 48))


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny base-variant model in diffusers' folder layout (baidu/ERNIE-Image)."""
    folder = tmp_path_factory.mktemp("tiny") / "ERNIE-Image-tiny"
    build_tiny_model(folder, layout="diffusers", variant="base")
    return folder


@pytest.fixture(scope="module")
def reference(tiny_folder: Path):
    """diffusers' ErnieImagePipeline on that folder, fp32."""
    from diffusers import ErnieImagePipeline

    return ErnieImagePipeline.from_pretrained(str(tiny_folder), torch_dtype=torch.float32)


@pytest.fixture(scope="module")
def pipe(tiny_folder: Path) -> LocalPipe:
    """The runtime's pipe on the same folder, fp32 on the CPU."""
    return LocalPipe.load(ModelSources(model_dir=tiny_folder), LoadOptions(device="cpu", dtype="fp32"))


def random_dit(device: str, dtype: torch.dtype) -> ErnieDiT:
    """An ErnieDiT of DIT_CONFIG, seeded: weights scaled to keep activations O(1), norm gains around 1."""
    torch.manual_seed(0)
    model = ErnieDiT(DIT_CONFIG)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(0.0, 0.5 / param.shape[-1] ** 0.5 if param.ndim > 1 else 0.05)
            if name.endswith("_ln.weight") or "norm_" in name:
                param.add_(1.0)
    return model.to(device, dtype).eval().requires_grad_(False)


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    """The relative L2 distance of `ours` from `reference`, in float32."""
    return ((ours.float() - reference.float()).norm() / reference.float().norm()).item()


def diffusers_dit(ours: ErnieDiT):
    """diffusers' ErnieImageTransformer2DModel of DIT_CONFIG holding `ours`'s weights, on its device and dtype."""
    from diffusers import ErnieImageTransformer2DModel

    config = DIT_CONFIG
    reference = ErnieImageTransformer2DModel(
        hidden_size=config.hidden_size, num_attention_heads=config.num_attention_heads, num_layers=config.num_layers,
        ffn_hidden_size=config.ffn_hidden_size, in_channels=config.in_channels, out_channels=config.out_channels,
        text_in_dim=config.text_in_dim, rope_axes_dim=config.rope_axes_dim)
    reference.load_state_dict({k: v.detach().clone() for k, v in ours.state_dict().items()})
    return reference.to(ours.final_linear.weight.device, ours.dtype).eval().requires_grad_(False)
