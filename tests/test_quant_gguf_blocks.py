"""GGUF block dequantisation in torch is bit-exact against gguf-py's numpy reference, type by type."""
from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as T  # noqa: E402

from ernie_image.runtime.core.errors import ModelFileError  # noqa: E402
from ernie_image.runtime.quant.gguf_blocks import BLOCK_GEOMETRY, FP16_SCALE_OFFSETS, KERNELS  # noqa: E402
from ernie_image.runtime.quant.gguf_quantize import quantize_q4_k, quantize_q8_0  # noqa: E402
from ernie_image.runtime.quant.qweight import dequantize_gguf  # noqa: E402

# Types gguf-py can quantise itself: the test blocks come from its own quantiser.
QUANTISABLE = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
# The others: random bytes, with each fp16 scale field overwritten by a sane positive value.
ROWS, COLS = 8, 512


def _random_blocks(qtype: str, rng: np.random.Generator) -> np.ndarray:
    block_size, type_size = BLOCK_GEOMETRY[qtype]
    if qtype in QUANTISABLE:
        values = rng.standard_normal((ROWS, COLS), dtype=np.float32)
        return gguf.quants.quantize(values, T[qtype])
    raw = rng.integers(0, 256, size=(ROWS * COLS // block_size, type_size), dtype=np.uint8)
    for offset in FP16_SCALE_OFFSETS[qtype]:
        scales = rng.uniform(1e-3, 0.1, size=raw.shape[0]).astype(np.float16)
        raw[:, offset:offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    return raw.reshape(ROWS, COLS // block_size * type_size)


@pytest.mark.parametrize("qtype", sorted(KERNELS))
def test_dequantisation_is_bit_exact_against_gguf_reference(qtype: str) -> None:
    assert gguf.GGML_QUANT_SIZES[T[qtype]] == BLOCK_GEOMETRY[qtype]
    packed = _random_blocks(qtype, np.random.default_rng(sum(qtype.encode())))
    reference = gguf.quants.dequantize(packed, T[qtype])
    ours = dequantize_gguf(torch.from_numpy(packed), qtype, (ROWS, COLS), torch.float32)
    assert ours.shape == (ROWS, COLS)
    assert np.isfinite(reference).all()
    assert np.array_equal(ours.numpy().view(np.uint32), reference.view(np.uint32))


def test_float_types_pass_through() -> None:
    weight = torch.randn(4, 32, dtype=torch.bfloat16)
    assert torch.equal(dequantize_gguf(weight, "BF16", (4, 32), torch.bfloat16), weight)
    assert dequantize_gguf(weight.float(), "F32", (4, 32), torch.float16).dtype == torch.float16


def test_unsupported_type_names_type_and_tensor() -> None:
    with pytest.raises(ModelFileError, match=r"'layers\.3\.mlp\.up_proj\.weight'.*IQ2_XXS"):
        dequantize_gguf(torch.zeros(66, dtype=torch.uint8), "IQ2_XXS", (1, 256), torch.float32,
                        name="layers.3.mlp.up_proj.weight")


def test_q8_0_quantiser_is_byte_identical_to_gguf() -> None:
    weight = torch.randn(16, 256)
    assert np.array_equal(quantize_q8_0(weight).numpy(), gguf.quants.quantize(weight.numpy(), T.Q8_0))


def test_q8_0_error_bound() -> None:
    # |x - q*d| <= d/2 (rounding) + 127*|d - fp16(d)| (the stored scale), d = amax/127, fp16 rel. error 2^-11:
    # per block |err| <= amax/254 + amax*2^-11.
    weight = torch.randn(64, 1024) * 0.05
    packed = quantize_q8_0(weight)
    restored = dequantize_gguf(packed, "Q8_0", tuple(weight.shape), torch.float32)
    amax = weight.reshape(-1, 32).abs().amax(dim=1, keepdim=True)
    err = (restored - weight).reshape(-1, 32).abs()
    assert (err <= amax / 254 + amax * 2**-11 + 1e-12).all()


def test_q4_k_quantiser_round_trips_through_gguf_reference() -> None:
    # Min/max Q4_K: step s = range/15 per 32 values; the 6-bit scale and min codes each move the grid by at
    # most half a code (<= range/126 and |min|/126 for the largest sub-block), so |err| stays below 0.6 s.
    weight = torch.randn(32, 512)
    packed = quantize_q4_k(weight)
    ours = dequantize_gguf(packed, "Q4_K", (32, 512), torch.float32)
    reference = gguf.quants.dequantize(packed.numpy(), T.Q4_K)
    assert np.array_equal(ours.numpy(), reference)
    blocks = weight.reshape(-1, 32)
    step = (blocks.amax(1) - blocks.amin(1).clamp(max=0)) / 15
    assert ((ours - weight).reshape(-1, 32).abs().amax(1) <= 0.6 * step).all()
