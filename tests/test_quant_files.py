"""Real quantised files, built in code, load into diffusers DiT keys with their weights kept packed."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as T  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from ernie_image.runtime.core.errors import ModelFileError  # noqa: E402
from ernie_image.runtime.formats.quantized_file import load_quantized_state_dict  # noqa: E402
from ernie_image.runtime.quant import QuantizedWeight, load_text_encoder_gguf  # noqa: E402
from ernie_image.runtime.quant.gguf_files import llama_permute, llama_unpermute  # noqa: E402
from ernie_image.runtime.quant.nvfp4 import block_scales_plain, quantize_nvfp4, to_modelopt  # noqa: E402

HIDDEN = 256
NORM_K = "layers.0.self_attention.norm_k.weight"
TO_Q = "layers.0.self_attention.to_q.weight"
UP = "layers.0.mlp.up_proj.weight"


def _unsloth_gguf(path: Path, prefix: str = "", extra: dict[str, tuple[np.ndarray, T]] | None = None) -> dict:
    """A DiT GGUF as unsloth writes them: diffusers names, header `wan`, 1-D tensors F32, mixed block types."""
    rng = np.random.default_rng(0)
    floats = {TO_Q: rng.standard_normal((HIDDEN, HIDDEN), dtype=np.float32),
              UP: rng.standard_normal((2 * HIDDEN, HIDDEN), dtype=np.float32),
              "final_linear.weight": rng.standard_normal((16, HIDDEN), dtype=np.float32)}
    writer = gguf.GGUFWriter(str(path), arch="wan")
    writer.add_tensor(prefix + NORM_K, np.ones(128, dtype=np.float32))
    writer.add_tensor(prefix + TO_Q, gguf.quants.quantize(floats[TO_Q], T.Q8_0), raw_dtype=T.Q8_0)
    writer.add_tensor(prefix + UP, gguf.quants.quantize(floats[UP], T.Q5_1), raw_dtype=T.Q5_1)
    bf16 = torch.from_numpy(floats["final_linear.weight"]).bfloat16()
    writer.add_tensor(prefix + "final_linear.weight", bf16.view(torch.uint8).numpy(), raw_dtype=T.BF16)
    for name, (array, qtype) in (extra or {}).items():
        writer.add_tensor(prefix + name, array, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return floats


@pytest.mark.parametrize("prefix", ["", "model.diffusion_model."])
def test_unsloth_dit_gguf_loads_packed_with_diffusers_keys(tmp_path: Path, prefix: str) -> None:
    path = tmp_path / "ernie-image-UD-Q8_0.gguf"
    floats = _unsloth_gguf(path, prefix)
    state = load_quantized_state_dict(path)
    assert set(state) == {NORM_K, TO_Q, UP, "final_linear.weight"}
    q = state[TO_Q]
    assert isinstance(q, QuantizedWeight) and (q.format, q.qtype, q.shape) == ("gguf", "Q8_0", (HIDDEN, HIDDEN))
    assert q.data.dtype == torch.uint8 and q.data.shape == (HIDDEN, HIDDEN // 32 * 34)
    for name, qtype in ((TO_Q, T.Q8_0), (UP, T.Q5_1)):
        reference = gguf.quants.dequantize(gguf.quants.quantize(floats[name], qtype), qtype)
        assert np.array_equal(state[name].dequantize(torch.float32).numpy(), reference)
    assert state["final_linear.weight"].dtype == torch.bfloat16
    assert torch.equal(state["final_linear.weight"], torch.from_numpy(floats["final_linear.weight"]).bfloat16())
    assert state[NORM_K].shape == (128,)


def test_gguf_that_is_not_ernie_is_refused_with_what_was_found(tmp_path: Path) -> None:
    path = tmp_path / "wan2.1.gguf"
    writer = gguf.GGUFWriter(str(path), arch="wan")
    writer.add_tensor("model.diffusion_model.blocks.0.self_attn.q.weight", np.zeros((4, 32), dtype=np.float32))
    writer.write_header_to_file(); writer.write_kv_data_to_file(); writer.write_tensors_to_file(); writer.close()
    with pytest.raises(ModelFileError, match=r"not an ERNIE-Image DiT GGUF.*'wan'.*\['blocks\.0\.self_attn"):
        load_quantized_state_dict(path)
    # component="any" skips the ERNIE check; the DiT prefix is still stripped.
    assert set(load_quantized_state_dict(path, "any")) == {"blocks.0.self_attn.q.weight"}


def test_gguf_with_unsupported_block_type_names_it(tmp_path: Path) -> None:
    path = tmp_path / "iq2.gguf"
    junk = np.zeros((HIDDEN, HIDDEN // 256 * 66), dtype=np.uint8)
    _unsloth_gguf(path, extra={"layers.0.mlp.gate_proj.weight": (junk, T.IQ2_XXS)})
    with pytest.raises(ModelFileError, match=r"'layers\.0\.mlp\.gate_proj\.weight'.*IQ2_XXS"):
        load_quantized_state_dict(path)


def test_corrupt_file_is_a_model_file_error(tmp_path: Path) -> None:
    path = tmp_path / "broken.safetensors"
    path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")
    with pytest.raises(ModelFileError, match="broken.safetensors is not a readable safetensors file .*re-download"):
        load_quantized_state_dict(path)


# ---- text encoder GGUF ---------------------------------------------------------------------------

def test_llama_permutation_round_trip_matches_rotate_half_pairing() -> None:
    n_head, head_dim = 2, 8
    weight = torch.arange(n_head * head_dim, dtype=torch.float32).unsqueeze(1).repeat(1, 3)
    permuted = llama_permute(weight, n_head)
    # llama.cpp's interleaved order: rows (0, 4, 1, 5, 2, 6, 3, 7) of each head's split halves.
    assert permuted[:8, 0].tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
    assert torch.equal(llama_unpermute(permuted, n_head), weight)


def test_text_encoder_gguf_maps_names_and_undoes_qk_permutation(tmp_path: Path) -> None:
    n_head, n_kv, head_dim, hidden = 4, 2, 16, 64
    rng = np.random.default_rng(1)
    hf = {"q": rng.standard_normal((n_head * head_dim, hidden), dtype=np.float32),
          "k": rng.standard_normal((n_kv * head_dim, hidden), dtype=np.float32),
          "v": rng.standard_normal((n_kv * head_dim, hidden), dtype=np.float32)}
    path = tmp_path / "ministral-3-3b-Q8_0.gguf"
    writer = gguf.GGUFWriter(str(path), arch="mistral3")
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv)
    # What convert_hf_to_gguf.py writes: q/k rows permuted (LlamaModel.permute), then quantised.
    q_file = llama_permute(torch.from_numpy(hf["q"]), n_head).numpy()
    k_file = llama_permute(torch.from_numpy(hf["k"]), n_kv).numpy()
    writer.add_tensor("token_embd.weight", rng.standard_normal((10, hidden), dtype=np.float32))
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(hidden, dtype=np.float32))
    writer.add_tensor("blk.0.attn_q.weight", gguf.quants.quantize(q_file, T.Q8_0), raw_dtype=T.Q8_0)
    writer.add_tensor("blk.0.attn_k.weight", k_file)
    writer.add_tensor("blk.0.attn_v.weight", hf["v"])
    writer.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    writer.add_tensor("rope_freqs.weight", np.ones(8, dtype=np.float32))
    writer.write_header_to_file(); writer.write_kv_data_to_file(); writer.write_tensors_to_file(); writer.close()

    state = load_text_encoder_gguf(path)
    assert set(state) == {"model.embed_tokens.weight", "model.layers.0.input_layernorm.weight",
                          "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
                          "model.layers.0.self_attn.v_proj.weight", "model.norm.weight"}
    assert torch.equal(state["model.layers.0.self_attn.k_proj.weight"], torch.from_numpy(hf["k"]))
    assert torch.equal(state["model.layers.0.self_attn.v_proj.weight"], torch.from_numpy(hf["v"]))
    q = state["model.layers.0.self_attn.q_proj.weight"]
    assert isinstance(q, QuantizedWeight)  # un-permuted while still packed: whole rows move
    expected_q = gguf.quants.dequantize(gguf.quants.quantize(hf["q"], T.Q8_0), T.Q8_0)
    assert np.array_equal(q.dequantize(torch.float32).numpy(), expected_q)


# ---- safetensors layouts -------------------------------------------------------------------------

def _plain_layers() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {NORM_K: torch.ones(128), "final_linear.weight": torch.randn(16, HIDDEN).bfloat16(),
            TO_Q: torch.randn(HIDDEN, HIDDEN), UP: torch.randn(2 * HIDDEN, HIDDEN)}


def _comfy_json(fmt: str) -> torch.Tensor:
    return torch.tensor(list(json.dumps({"format": fmt}).encode()), dtype=torch.uint8)


def test_comfy_quant_fp8_per_layer_tensors(tmp_path: Path) -> None:
    layers = _plain_layers()
    scale = layers[TO_Q].abs().amax() / 448
    fp8 = (layers[TO_Q] / scale).to(torch.float8_e4m3fn)
    tensors = {NORM_K: layers[NORM_K], "final_linear.weight": layers["final_linear.weight"],
               TO_Q: fp8, "layers.0.self_attention.to_q.weight_scale": scale.reshape(()),
               "layers.0.self_attention.to_q.input_scale": torch.tensor(1.0),
               "layers.0.self_attention.to_q.comfy_quant": _comfy_json("float8_e4m3fn"),
               UP: layers[UP].bfloat16()}
    tensors = {f"model.diffusion_model.{k}": v for k, v in tensors.items()}
    save_file(tensors, str(tmp_path / "ernie-fp8.safetensors"))
    state = load_quantized_state_dict(tmp_path / "ernie-fp8.safetensors")
    assert set(state) == {NORM_K, "final_linear.weight", TO_Q, UP}
    q = state[TO_Q]
    assert q.format == "fp8" and q.data.dtype == torch.float8_e4m3fn and q.input_scale is not None
    assert torch.equal(q.dequantize(torch.float32), fp8.float() * scale)
    assert isinstance(state[UP], torch.Tensor) and state[UP].dtype == torch.bfloat16


def test_comfy_quant_nvfp4_from_file_metadata(tmp_path: Path) -> None:
    layers = _plain_layers()
    data, blocked, tensor_scale = quantize_nvfp4(layers[UP])
    tensors = {NORM_K: layers[NORM_K], "final_linear.weight": layers["final_linear.weight"], TO_Q: layers[TO_Q],
               UP: data, "layers.0.mlp.up_proj.weight_scale": blocked,
               "layers.0.mlp.up_proj.weight_scale_2": tensor_scale}
    meta = {"_quantization_metadata": json.dumps({"format_version": "1.0",
                                                  "layers": {"layers.0.mlp.up_proj": {"format": "nvfp4"}}})}
    save_file(tensors, str(tmp_path / "ernie-nvfp4.safetensors"), metadata=meta)
    up = load_quantized_state_dict(tmp_path / "ernie-nvfp4.safetensors")[UP]
    assert (up.format, up.shape) == ("nvfp4", (2 * HIDDEN, HIDDEN))
    assert torch.equal(up.data, data) and torch.equal(up.scale.view(torch.uint8), blocked.view(torch.uint8))


def test_legacy_scaled_fp8(tmp_path: Path) -> None:
    layers = _plain_layers()
    scale = torch.tensor(0.01)
    fp8 = (layers[TO_Q] / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    tensors = {"scaled_fp8": torch.zeros(0, dtype=torch.float8_e4m3fn), NORM_K: layers[NORM_K],
               "final_linear.weight": layers["final_linear.weight"], TO_Q: fp8,
               "layers.0.self_attention.to_q.scale_weight": scale, "layers.0.self_attention.to_q.scale_input": scale.clone()}
    save_file(tensors, str(tmp_path / "ernie_fp8_scaled.safetensors"))
    state = load_quantized_state_dict(tmp_path / "ernie_fp8_scaled.safetensors")
    assert "scaled_fp8" not in state
    assert torch.equal(state[TO_Q].dequantize(torch.float32), fp8.float() * scale)


def test_modelopt_nvfp4_converts_to_the_comfy_layout(tmp_path: Path) -> None:
    layers = _plain_layers()
    data, blocked, tensor_scale = quantize_nvfp4(layers[UP])
    mo_weight, mo_scale = to_modelopt(data, blocked, (2 * HIDDEN, HIDDEN))
    assert mo_scale.shape == (2 * HIDDEN, HIDDEN // 16)  # ModelOpt: plain [N, K/16] scales
    tensors = {NORM_K: layers[NORM_K], "final_linear.weight": layers["final_linear.weight"], TO_Q: layers[TO_Q],
               UP: mo_weight, "layers.0.mlp.up_proj.weight_scale": mo_scale,
               "layers.0.mlp.up_proj.weight_scale_2": tensor_scale, "layers.0.mlp.up_proj.input_scale": tensor_scale.clone()}
    save_file(tensors, str(tmp_path / "modelopt.safetensors"))
    up = load_quantized_state_dict(tmp_path / "modelopt.safetensors")[UP]
    assert torch.equal(up.data, data)
    assert torch.equal(block_scales_plain(up.scale, up.shape).view(torch.uint8), mo_scale.view(torch.uint8))
    # The diffusers/ModelOpt reference decoding of the same bytes gives the same weight.
    from diffusers.quantizers.bfl.utils import dequantize_nvfp4 as bfl_dequantize
    expected = bfl_dequantize(mo_weight, mo_scale, tensor_scale)
    assert torch.equal(up.dequantize(torch.float32), expected.float())


def test_unknown_comfy_quant_format_is_named(tmp_path: Path) -> None:
    layers = _plain_layers()
    tensors = {NORM_K: layers[NORM_K], "final_linear.weight": layers["final_linear.weight"],
               TO_Q: layers[TO_Q].to(torch.int8), "layers.0.self_attention.to_q.comfy_quant": _comfy_json("int8_tensorwise")}
    save_file(tensors, str(tmp_path / "int8.safetensors"))
    with pytest.raises(ModelFileError, match=r"to_q uses comfy_quant format 'int8_tensorwise'"):
        load_quantized_state_dict(tmp_path / "int8.safetensors")


# ---- packed layers' scales, in the layouts not written by `ernie-image quantize` ---------------------------------
# (tests/test_fp8_file_damage.py holds the comfy_quant files the pack writes to every class of damage, through the CLI)
DAMAGED = "the file is damaged: quantise it again, or download it again"
NEVER_MADE = "which quantising a weight never makes (scales are finite, never negative, never all 0)"


def _legacy_scaled_fp8(drop: str = "") -> dict[str, torch.Tensor]:
    """A legacy scaled-fp8 file's tensors (two FP8 layers with `scale_weight`), `drop` left out."""
    layers = _plain_layers()
    tensors = {"scaled_fp8": torch.zeros(0, dtype=torch.float8_e4m3fn), NORM_K: layers[NORM_K],
               "final_linear.weight": layers["final_linear.weight"]}
    for name, weight in ((TO_Q, layers[TO_Q]), (UP, layers[UP])):
        tensors[name] = (weight / 0.01).clamp(-448, 448).to(torch.float8_e4m3fn)
        tensors[name.replace(".weight", ".scale_weight")] = torch.tensor(0.01)
    tensors.pop(drop, None)
    return tensors


def _modelopt_nvfp4(**changed: torch.Tensor) -> dict[str, torch.Tensor]:
    """A ModelOpt NVFP4 file's tensors (up_proj packed, plain [N, K/16] block scales), `changed` by suffix."""
    layers = _plain_layers()
    data, blocked, tensor_scale = quantize_nvfp4(layers[UP])
    weight, scales = to_modelopt(data, blocked, (2 * HIDDEN, HIDDEN))
    tensors = {NORM_K: layers[NORM_K], "final_linear.weight": layers["final_linear.weight"], TO_Q: layers[TO_Q],
               UP: weight, "layers.0.mlp.up_proj.weight_scale": scales,
               "layers.0.mlp.up_proj.weight_scale_2": tensor_scale}
    tensors.update({f"layers.0.mlp.up_proj.{suffix}": value for suffix, value in changed.items()})
    return tensors


SCALE_DAMAGES = [
    pytest.param(_legacy_scaled_fp8(drop="layers.0.mlp.up_proj.scale_weight"),
                 "{file} lacks layers.0.mlp.up_proj.scale_weight, the weight scale of its FP8 layer "
                 f"layers.0.mlp.up_proj (the file's other FP8 layers have theirs): {DAMAGED}",
                 id="legacy fp8 one layer's scale missing"),
    pytest.param({**_legacy_scaled_fp8(), "layers.0.self_attention.to_q.scale_weight": torch.full((2,), 0.01)},
                 "{file}: layers.0.self_attention.to_q.scale_weight has shape [2], but the FP8 layer "
                 f"layers.0.self_attention.to_q (weight [{HIDDEN}, {HIDDEN}]) takes one scale ([]) or one per output "
                 f"row ([{HIDDEN}]): {DAMAGED}", id="legacy fp8 scale in another shape"),
    pytest.param({**_legacy_scaled_fp8(), "layers.0.mlp.up_proj.scale_input": torch.tensor(float("nan"))},
                 f"{{file}}: layers.0.mlp.up_proj.scale_input holds nan, {NEVER_MADE}: {DAMAGED}",
                 id="legacy fp8 activation scale nan"),
    pytest.param(_modelopt_nvfp4(weight_scale=torch.ones(2 * HIDDEN, HIDDEN // 8).to(torch.float8_e4m3fn)),
                 f"{{file}}: layers.0.mlp.up_proj.weight_scale has shape [{2 * HIDDEN}, {HIDDEN // 8}], but the "
                 f"NVFP4 layer layers.0.mlp.up_proj (weight [{2 * HIDDEN}, {HIDDEN // 2}], {HIDDEN} values a row) "
                 f"takes block scales of shape [{2 * HIDDEN}, {HIDDEN // 16}]: {DAMAGED}",
                 id="modelopt nvfp4 block scales"),
    pytest.param(_modelopt_nvfp4(weight_scale_2=torch.tensor(-1.0)),
                 f"{{file}}: layers.0.mlp.up_proj.weight_scale_2 holds -1, {NEVER_MADE}: {DAMAGED}",
                 id="modelopt nvfp4 per-tensor scale negative"),
    pytest.param(_modelopt_nvfp4(input_scale=torch.ones(HIDDEN)),
                 "{file}: layers.0.mlp.up_proj.input_scale has shape [256], but the NVFP4 layer layers.0.mlp.up_proj "
                 f"(weight [{2 * HIDDEN}, {HIDDEN // 2}], {HIDDEN} values a row) takes one activation scale ([]): "
                 f"{DAMAGED}", id="modelopt nvfp4 activation scale"),
]


@pytest.mark.parametrize("tensors, says", SCALE_DAMAGES)
def test_damaged_scales_of_legacy_and_modelopt_files_are_refused_in_one_line_when_read(tmp_path: Path, tensors,
                                                                                       says: str) -> None:
    path = tmp_path / "ernie-image-packed.safetensors"
    save_file(tensors, str(path))
    with pytest.raises(ModelFileError) as refused:
        load_quantized_state_dict(path)
    assert str(refused.value) == says.format(file=path)


def test_fp8_weights_without_any_scale_still_load_as_unscaled(tmp_path: Path) -> None:
    """ComfyUI's unscaled fp8 files hold no scale at all: not damage, a scale of 1."""
    layers = _plain_layers()
    fp8 = layers[TO_Q].to(torch.float8_e4m3fn)
    save_file({NORM_K: layers[NORM_K], "final_linear.weight": layers["final_linear.weight"], TO_Q: fp8,
               UP: layers[UP].to(torch.float8_e4m3fn)}, str(tmp_path / "ernie-fp8-unscaled.safetensors"))
    q = load_quantized_state_dict(tmp_path / "ernie-fp8-unscaled.safetensors")[TO_Q]
    assert q.format == "fp8" and q.scale is None and torch.equal(q.dequantize(torch.float32), fp8.float())
