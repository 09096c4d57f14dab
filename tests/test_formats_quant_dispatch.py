"""open_component recognises quantised files by their bytes and keys (GGUF magic; comfy_quant / fp8 tensors) and
hands them to runtime/quant, returning the same canonical DiT keys with packed weights."""
from __future__ import annotations

import pytest
import torch

from ernie_image.runtime.core.errors import ModelFileError
from ernie_image.runtime.demo.tiny import TinySizes, build_dit, build_tiny_model
from ernie_image.runtime.formats import open_component

quant = pytest.importorskip("ernie_image.runtime.quant")


@pytest.fixture(scope="module")
def dit_state():
    return {k: v.detach().clone() for k, v in build_dit(TinySizes(), 0).state_dict().items()}


def test_comfy_quant_fp8_file_is_dispatched_to_the_quant_loader(dit_state, tmp_path):
    path = quant.write_quantized_file(dict(dit_state), "fp8", tmp_path / "ernie-image-fp8.safetensors")
    component = open_component(path, "dit")
    assert component.quantized and component.layout == "quantized-safetensors"
    assert set(component.keys) == set(dit_state)
    packed = [k for k in component.keys if isinstance(component.tensor(k), quant.QuantizedWeight)]
    assert "layers.0.mlp.gate_proj.weight" in packed


def test_gguf_dit_is_recognised_by_its_magic_bytes_not_its_name(dit_state, tmp_path):
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "renamed.safetensors"  # a GGUF under a misleading name
    writer = gguf.GGUFWriter(str(path), arch="wan")  # unsloth's files say "wan" too
    for key, tensor in dit_state.items():
        writer.add_tensor(key, tensor.float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    component = open_component(path, "dit")
    assert component.quantized and component.layout == "gguf"
    assert set(component.keys) == set(dit_state)
    assert torch.equal(component.tensor("final_linear.weight").float(), dit_state["final_linear.weight"])


def test_quantised_vae_is_refused(dit_state, tmp_path):
    path = quant.write_quantized_file(dict(dit_state), "fp8", tmp_path / "vae-fp8.safetensors")
    with pytest.raises(ModelFileError, match="VAE is only read in bf16/fp32"):
        open_component(path, "vae")


def test_quantised_text_encoder_file_where_a_dit_is_expected(tmp_path):
    sources = build_tiny_model(tmp_path / "comfy", layout="comfy")
    from safetensors import safe_open

    with safe_open(str(sources.text_encoder), "pt") as handle:
        state = {k: handle.get_tensor(k) for k in handle.keys() if k != "tekken_model"}
    path = quant.write_quantized_file(state, "fp8", tmp_path / "te-fp8.safetensors")
    with pytest.raises(ModelFileError, match="not an ERNIE-Image DiT|not an ERNIE-Image transformer"):
        open_component(path, "dit")
