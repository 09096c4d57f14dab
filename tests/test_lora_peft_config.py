"""A PEFT LoRA saved with its adapter_config.json beside it and no alpha in the file: diffusers and ComfyUI read
alphas from the file only, so the LoRA runs at alpha = rank, as both run it; where the config's lora_alpha differs
from its r (what PEFT itself would run), a notice says so and which strength runs it as PEFT does."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import save_file

import lora_files as lf
from ernie_image.runtime.lora import parsed
from ernie_image.runtime.lora.keys import dit_linear_shapes
from ernie_image.runtime.model.dit import DiTConfig

CONFIG = DiTConfig(hidden_size=256, num_attention_heads=2, num_layers=2, ffn_hidden_size=512, text_in_dim=96,
                   rope_axes_dim=(32, 48, 48))


def _peft_lora(folder: Path, config: str | None) -> Path:
    folder.mkdir()
    shapes = {"layers.0.self_attention.to_q": dit_linear_shapes(CONFIG)["layers.0.self_attention.to_q"]}
    path = folder / "adapter_model.safetensors"
    save_file(lf.peft_keys(lf.random_lora(shapes, 4, seed=0), "base_model.model."), str(path))
    if config is not None:
        (folder / "adapter_config.json").write_text(config)
    return path


@pytest.mark.parametrize("config, said", [
    ('{"r": 4, "lora_alpha": 16}', "it says lora_alpha 16, r 4: strength 4 runs the LoRA as PEFT does"),
    ('{"r": 4, "lora_alpha": 8, "use_rslora": true}',
     "it says lora_alpha 8, r 4, rsLoRA: strength 4 runs the LoRA as PEFT does"),
    ('{"r": 4, "lora_alpha": 4, "alpha_pattern": {"layers.0.self_attention.to_q": 16}}',
     "it says lora_alpha 4, r 4: strength 1 runs the LoRA as PEFT does, but for the layers its alpha_pattern or "
     "rank_pattern sets otherwise"),
    ('{"r": 4, "lora_alpha": 16, "lora_alpha": 4}',
     "it cannot be read: the key 'lora_alpha' appears twice in one object, so which value is meant is not known"),
    ('{"r": 4, "lora_alpha": 16', "it cannot be read: line 1, column 26: Expecting ',' delimiter"),
    ('[4, 16]', "it cannot be read: not a JSON object"),
    ('{"r": 0, "lora_alpha": "loud"}', "its lora_alpha or r is unusable"),
], ids=["alpha 16, rank 4", "rsLoRA", "an alpha pattern", "a key twice", "cut short", "a list", "unusable values"])
def test_an_adapter_config_that_would_change_the_strength_is_told_as_not_read(tmp_path, config, said):
    path = _peft_lora(tmp_path / "lora", config)
    assert parsed.load_lora(path, CONFIG).notices == [
        f"LoRA {path.name}: the adapter_config.json beside it is not read, as diffusers and ComfyUI do not read it: "
        f"the file holds no alpha, so the LoRA runs at alpha = rank ({said})"]


@pytest.mark.parametrize("config", [None, '{"r": 4, "lora_alpha": 4}'], ids=["no config", "alpha equal to rank"])
def test_nothing_is_said_where_the_config_would_change_nothing(tmp_path, config):
    assert parsed.load_lora(_peft_lora(tmp_path / "lora", config), CONFIG).notices == []
