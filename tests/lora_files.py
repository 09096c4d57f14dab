"""LoRA files in the layouts trainers write, for a tiny ERNIE-Image DiT, and hand merges from their definitions.

Random adapter weights are drawn here in diffusers module names; each writer below stores them the way its
trainer does (diffusers' own `save_lora_weights`, PEFT's `save_pretrained`, plain safetensors for the others).
`merged_dit` writes W + strength * delta into a copy of the DiT's weights, delta computed from the format's
definition (not from the runtime's code), for the formats diffusers cannot load.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, save_file

BLOCK_LINEARS = ("self_attention.to_q", "self_attention.to_k", "self_attention.to_v", "self_attention.to_out.0",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.linear_fc2")
STEM_LINEARS = ("text_proj", "time_embedding.linear_1", "time_embedding.linear_2", "adaLN_modulation.1",
                "final_norm.linear", "final_linear")


def dit_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(Path(model_dir) / "transformer" / "diffusion_pytorch_model.safetensors"))


def linear_shapes(weights: dict[str, torch.Tensor], modules: tuple[str, ...] | None = None) -> dict[str, tuple[int, int]]:
    layers = sorted({int(k.split(".")[1]) for k in weights if k.startswith("layers.")})
    names = [f"layers.{i}.{n}" for i in layers for n in BLOCK_LINEARS] + list(STEM_LINEARS)
    if modules is not None:
        names = [n for n in names if any(n.endswith(m) or n == m for m in modules)]
    return {n: tuple(weights[f"{n}.weight"].shape) for n in names if f"{n}.weight" in weights}


def random_lora(shapes: dict[str, tuple[int, int]], rank: int, seed: int, std: float = 0.25
                ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{module: (down [rank, in], up [out, rank])}: a delta of about `std` relative to a unit weight."""
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for name, (rows, cols) in shapes.items():
        down = torch.randn((rank, cols), generator=generator) / cols ** 0.5
        up = torch.randn((rows, rank), generator=generator) * std / rank ** 0.5 / cols ** 0.25
        out[name] = (down, up)
    return out


def peft_keys(lora: dict, prefix: str) -> dict[str, torch.Tensor]:
    state = {}
    for name, (down, up) in lora.items():
        state[f"{prefix}{name}.lora_A.weight"] = down.contiguous()
        state[f"{prefix}{name}.lora_B.weight"] = up.contiguous()
    return state


def write_diffusers(folder: Path, lora: dict, rank: int, alpha: float) -> Path:
    """diffusers' own writer: `transformer.*` keys and the LoraConfig (lora_alpha) in the safetensors metadata."""
    from diffusers import ErnieImagePipeline
    from peft import LoraConfig

    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=sorted(lora)).to_dict()
    ErnieImagePipeline.save_lora_weights(folder, transformer_lora_layers=peft_keys(lora, ""),
                                         transformer_lora_adapter_metadata=config, weight_name="diffusers.safetensors")
    return folder / "diffusers.safetensors"


def write_peft(folder: Path, model_dir: Path, lora: dict, rank: int) -> Path:
    """PEFT's own writer: `base_model.model.*` keys (lora_alpha only in adapter_config.json, which is left there)."""
    from diffusers import ErnieImageTransformer2DModel
    from peft import LoraConfig, get_peft_model

    model = ErnieImageTransformer2DModel.from_pretrained(str(Path(model_dir) / "transformer"))
    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=rank, target_modules=sorted(lora)))
    with torch.no_grad():
        for name, (down, up) in lora.items():
            layer = peft_model.base_model.model.get_submodule(name)
            layer.lora_A["default"].weight.copy_(down)
            layer.lora_B["default"].weight.copy_(up)
    peft_model.save_pretrained(str(folder / "peft"))
    return folder / "peft" / "adapter_model.safetensors"


def write_ai_toolkit(path: Path, lora: dict) -> Path:
    save_file(peft_keys(lora, "diffusion_model."), str(path), metadata={"format": "pt", "software": "ai-toolkit"})
    return path


def kohya_name(module: str) -> str:
    return "lora_unet_" + module.replace(".", "_")


def write_down_up(path: Path, lora: dict, alpha: float, name: Callable[[str], str]) -> Path:
    """kohya / sd-scripts (lora_unet_* names) and OneTrainer (transformer.* names): lora_down, lora_up, alpha."""
    state = {}
    for module, (down, up) in lora.items():
        key = name(module)
        state[f"{key}.lora_down.weight"] = down.contiguous()
        state[f"{key}.lora_up.weight"] = up.contiguous()
        state[f"{key}.alpha"] = torch.tensor(float(alpha))
    save_file(state, str(path), metadata={"ss_network_dim": str(next(iter(lora.values()))[0].shape[0]),
                                          "ss_network_alpha": str(alpha)})
    return path


def lora_delta(down: torch.Tensor, up: torch.Tensor, alpha: float | None) -> torch.Tensor:
    scale = 1.0 if alpha is None else alpha / down.shape[0]
    return scale * (up.double() @ down.double())


# LyCORIS: factors drawn for each module, deltas written out from their definitions.

def _factor_pair(n: int) -> tuple[int, int]:
    a = int(n ** 0.5)
    while n % a:
        a -= 1
    return a, n // a


def random_lokr(shapes: dict[str, tuple[int, int]], rank: int, seed: int, factored_w1: bool = False
                ) -> dict[str, dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for name, (rows, cols) in shapes.items():
        (o1, o2), (i1, i2) = _factor_pair(rows), _factor_pair(cols)
        parts = {}
        if factored_w1:
            parts["lokr_w1_a"] = torch.randn((o1, 1), generator=generator) * 0.5
            parts["lokr_w1_b"] = torch.randn((1, i1), generator=generator) * 0.5
        else:
            parts["lokr_w1"] = torch.randn((o1, i1), generator=generator) * 0.5
        parts["lokr_w2_a"] = torch.randn((o2, rank), generator=generator) * 0.3 / rank ** 0.5
        parts["lokr_w2_b"] = torch.randn((rank, i2), generator=generator) / i2 ** 0.5
        out[name] = parts
    return out


def lokr_delta(parts: dict[str, torch.Tensor], alpha: float | None) -> torch.Tensor:
    w1 = parts["lokr_w1"].double() if "lokr_w1" in parts else parts["lokr_w1_a"].double() @ parts["lokr_w1_b"].double()
    w2 = parts["lokr_w2_a"].double() @ parts["lokr_w2_b"].double()
    scale = 1.0 if alpha is None else alpha / parts["lokr_w2_b"].shape[0]  # w2's rank (it is factored)
    return scale * torch.kron(w1, w2)


def random_loha(shapes: dict[str, tuple[int, int]], rank: int, seed: int) -> dict[str, dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for name, (rows, cols) in shapes.items():
        out[name] = {
            "hada_w1_a": torch.randn((rows, rank), generator=generator) * 0.7 / rank ** 0.5,
            "hada_w1_b": torch.randn((rank, cols), generator=generator) / cols ** 0.5,
            "hada_w2_a": torch.randn((rows, rank), generator=generator) * 0.7 / rank ** 0.5,
            "hada_w2_b": torch.randn((rank, cols), generator=generator),
        }
    return out


def loha_delta(parts: dict[str, torch.Tensor], alpha: float | None) -> torch.Tensor:
    p = {k: v.double() for k, v in parts.items()}
    scale = 1.0 if alpha is None else alpha / parts["hada_w1_b"].shape[0]
    return scale * (p["hada_w1_a"] @ p["hada_w1_b"]) * (p["hada_w2_a"] @ p["hada_w2_b"])


def write_lycoris(path: Path, adapters: dict[str, dict[str, torch.Tensor]], alpha: float | None,
                  name: Callable[[str], str] = kohya_name) -> Path:
    state = {}
    for module, parts in adapters.items():
        for part, tensor in parts.items():
            state[f"{name(module)}.{part}"] = tensor.contiguous()
        if alpha is not None:
            state[f"{name(module)}.alpha"] = torch.tensor(float(alpha))
    save_file(state, str(path))
    return path


def merged_dit(path: Path, weights: dict[str, torch.Tensor], deltas: list[tuple[dict[str, torch.Tensor], float]]
               ) -> Path:
    """The DiT's weights with every (module -> delta, strength) added, written as one diffusers-keyed file."""
    merged = {k: v.clone() for k, v in weights.items()}
    for delta_by_module, strength in deltas:
        for module, delta in delta_by_module.items():
            key = f"{module}.weight"
            merged[key] = (merged[key].double() + strength * delta).to(merged[key].dtype)
    save_file(merged, str(path))
    return path


def read_metadata(path: Path) -> dict:
    with open(path, "rb") as handle:
        size = int.from_bytes(handle.read(8), "little")
        return json.loads(handle.read(size)).get("__metadata__", {})


def load_keys(path: Path) -> list[str]:
    return list(load_file(str(path)))


EXAMPLE_LORAS = {"ernie-image-style-lora.safetensors": 31, "ernie-image-detail-lora.safetensors": 32}


def write_example_loras(folder: Path, dit_file: Path) -> dict[str, Path]:
    """The LoRA files the example workflows name, for the DiT in `dit_file` (any layout the runtime reads)."""
    from ernie_image.runtime.formats import open_component
    from ernie_image.runtime.lora.keys import dit_linear_shapes
    from ernie_image.runtime.model.builders import dit_config_for

    shapes = dit_linear_shapes(dit_config_for(open_component(Path(dit_file), "dit")))
    folder.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, seed in EXAMPLE_LORAS.items():
        paths[name] = write_down_up(folder / name, random_lora(shapes, 4, seed=seed), 4.0, kohya_name)
    return paths


def two_dit_loras(folder: Path, shapes: dict[str, tuple[int, int]], kohya_rank: int) -> dict[str, Path]:
    """Two LoRAs on every Linear of `shapes`: "a" in ai-toolkit's layout at rank 8, "b" in kohya's at `kohya_rank`
    (alpha 8)."""
    return {"a": write_ai_toolkit(folder / "a.safetensors", random_lora(shapes, 8, seed=1)),
            "b": write_down_up(folder / "b.safetensors", random_lora(shapes, kohya_rank, seed=2), 8.0, kohya_name)}


def tiny_model_loras(tiny_folder: Path, folder: Path) -> dict[str, Path]:
    """The LoRA files the pipe tests use on the tiny Turbo model: rank-4 kohya and ai-toolkit LoRAs on every DiT
    Linear, a rank-2 one on the attention only, and LoKr and LoHa of rank 2."""
    weights = dit_weights(tiny_folder)
    shapes = linear_shapes(weights)
    attention = linear_shapes(weights, ("to_q", "to_k", "to_v"))
    return {
        "kohya": write_down_up(folder / "kohya.safetensors", random_lora(shapes, 4, seed=1), 2.0, kohya_name),
        "toolkit": write_ai_toolkit(folder / "toolkit.safetensors", random_lora(shapes, 4, seed=2)),
        "attention": write_ai_toolkit(folder / "attention.safetensors", random_lora(attention, 2, seed=3)),
        "lokr": write_lycoris(folder / "lokr.safetensors", random_lokr(shapes, 2, seed=4), alpha=1.0),
        "loha": write_lycoris(folder / "loha.safetensors", random_loha(shapes, 2, seed=5), alpha=2.0),
    }
