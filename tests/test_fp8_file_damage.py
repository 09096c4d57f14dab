"""A quantised DiT file (FP8 or NVFP4, as `ernie-image quantize` writes it) whose scales are damaged is refused when
it is read, in one line naming the file, the tensor, what is wrong and the fix, before the DiT runs a step.

Each class of damage, on any packed layer: a scale in another shape than its weight needs (which otherwise failed
inside the first matmul, a traceback in the middle of sampling), a scale missing, a scale whose values quantising a
weight never makes (0, non-finite, negative: otherwise a picture of noise, black or NaN without a word), and an FP8
weight in the other float8 type than the file's metadata says. Scales a quantiser does make (per-row FP8 scales,
single scales stored as [1], NVFP4 blocks of zeros) still load and run.
"""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ernie_image.runtime.cli.commands import main

FIX = "the file is damaged: quantise it again, or download it again"
VALUES = "which quantising a weight never makes (scales are finite, never negative, never all 0)"
UP = "layers.0.mlp.up_proj"  # [128, 64] in the tiny DiT
TO_Q = "layers.1.self_attention.to_q"  # [64, 64]
FC2 = "layers.1.mlp.linear_fc2"  # [64, 128]: NVFP4 block scales padded to [128, 8]
ADALN = "adaLN_modulation.1"  # [384, 64], outside the blocks

pytestmark = pytest.mark.usefixtures("one_thread")

Tensors = dict[str, torch.Tensor]


@pytest.fixture(scope="module")
def quantised(tmp_path_factory, tiny_turbo_folder) -> dict[str, Path]:
    """The tiny Turbo DiT written as FP8 and as NVFP4 by the pack's own writer, shared read-only."""
    from ernie_image.runtime import quant

    root = tmp_path_factory.mktemp("quantised")
    state = load_file(str(tiny_turbo_folder / "transformer" / "diffusion_pytorch_model.safetensors"))
    return {fmt: quant.write_quantized_file(dict(state), fmt, root / f"ernie-image-turbo-{fmt}.safetensors",
                                            variant="turbo") for fmt in ("fp8", "nvfp4")}


def _damaged(source: Path, folder: Path, damage: Callable[[Tensors], None]) -> Path:
    """A copy of `source` in `folder`, `damage` done to its tensors (its metadata kept)."""
    with safe_open(str(source), "pt") as handle:
        tensors, metadata = {key: handle.get_tensor(key) for key in handle.keys()}, handle.metadata()
    damage(tensors)
    path = folder / source.name
    save_file(tensors, str(path), metadata=metadata)
    return path


def _generate(model: Path, dit: Path, out: Path) -> list[str]:
    return ["generate", "--model-dir", str(model), "--dit", str(dit), "--prompt", "a fox", "--width", "256",
            "--height", "256", "--steps", "1", "--device", "cpu", "--out", str(out)]


def _refused(capsys, argv: list[str]) -> str:
    """The CLI's one line for a refusal: exit code 2, nothing else on stderr (no traceback, no step, no notice)."""
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0].removeprefix("error: ")


# ------------------------------------------------------------------------------------------------- damages
def _set(key: str, value: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[Tensors], None]:
    def damage(tensors: Tensors) -> None:
        tensors[key] = value(tensors[key])
    return damage


def _drop(key: str) -> Callable[[Tensors], None]:
    def damage(tensors: Tensors) -> None:
        del tensors[key]
    return damage


def _add(key: str, value: torch.Tensor) -> Callable[[Tensors], None]:
    def damage(tensors: Tensors) -> None:
        tensors[key] = value
    return damage


def _filled(value: float, shape: tuple[int, ...] | None = None) -> Callable[[torch.Tensor], torch.Tensor]:
    """A float scale with every value `value` (in its own shape, or `shape`), in its own dtype."""
    return lambda scale: torch.full(shape if shape is not None else scale.shape, value, dtype=scale.dtype)


def _block_byte(byte: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """NVFP4 block scales with their first block's e4m3 byte set to `byte`."""
    def change(scales: torch.Tensor) -> torch.Tensor:
        data = scales.view(torch.uint8).clone()
        data[0, 0] = byte
        return data.view(torch.float8_e4m3fn)
    return change


def _e4m3(shape: tuple[int, ...]) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda scales: torch.ones(shape).to(torch.float8_e4m3fn)


FP8_SHAPE = "{file}: {layer}.weight_scale has shape {shape}, but the float8_e4m3fn layer {layer} (weight {weight}) " \
            "takes one scale ([]) or one per output row ([{rows}]): " + FIX
NVFP4_LAYER = "the NVFP4 layer {layer} (weight {weight}, {width} values a row)"

# (format, case id, damage, the line that refuses it without "error: ", {file} for the damaged file)
DAMAGES: list[tuple[str, str, Callable[[Tensors], None], str]] = [
    # a scale in another shape than its weight needs
    ("fp8", "weight scale [7]", _set(f"{UP}.weight_scale", _filled(0.01, (7,))),
     FP8_SHAPE.format(file="{file}", layer=UP, shape=[7], weight=[128, 64], rows=128)),
    ("fp8", "weight scale per row of another layer", _set(f"{TO_Q}.weight_scale", _filled(0.01, (128,))),
     FP8_SHAPE.format(file="{file}", layer=TO_Q, shape=[128], weight=[64, 64], rows=64)),
    ("fp8", "weight scale the weight's shape", _set(f"{ADALN}.weight_scale", _filled(0.01, (384, 64))),
     FP8_SHAPE.format(file="{file}", layer=ADALN, shape=[384, 64], weight=[384, 64], rows=384)),
    ("fp8", "activation scale [64]", _add(f"{UP}.input_scale", torch.ones(64)),
     f"{{file}}: {UP}.input_scale has shape [64], but the float8_e4m3fn layer {UP} (weight [128, 64]) takes one "
     f"activation scale ([]): {FIX}"),
    ("nvfp4", "block scales of twice the blocks", _set(f"{UP}.weight_scale", _e4m3((128, 8))),
     f"{{file}}: {UP}.weight_scale has shape [128, 8], but "
     + NVFP4_LAYER.format(layer=UP, weight=[128, 32], width=64) + f" takes block scales of shape [128, 4]: {FIX}"),
    ("nvfp4", "block scales unpadded", _set(f"{FC2}.weight_scale", _e4m3((64, 8))),
     f"{{file}}: {FC2}.weight_scale has shape [64, 8], but "
     + NVFP4_LAYER.format(layer=FC2, weight=[64, 64], width=128) + f" takes block scales of shape [128, 8]: {FIX}"),
    ("nvfp4", "per-tensor scale [3]", _set(f"{UP}.weight_scale_2", _filled(0.01, (3,))),
     f"{{file}}: {UP}.weight_scale_2 has shape [3], but "
     + NVFP4_LAYER.format(layer=UP, weight=[128, 32], width=64) + f" takes one scale ([]): {FIX}"),
    # a scale missing
    ("fp8", "weight scale missing", _drop(f"{UP}.weight_scale"),
     f"{{file}} lacks {UP}.weight_scale, the weight scale of its float8_e4m3fn layer {UP}: {FIX}"),
    ("fp8", "weight scale missing outside the blocks", _drop(f"{ADALN}.weight_scale"),
     f"{{file}} lacks {ADALN}.weight_scale, the weight scale of its float8_e4m3fn layer {ADALN}: {FIX}"),
    ("nvfp4", "block scales missing", _drop(f"{TO_Q}.weight_scale"),
     f"{{file}} lacks {TO_Q}.weight_scale, the block scales of its NVFP4 layer {TO_Q}: {FIX}"),
    ("nvfp4", "per-tensor scale missing", _drop(f"{UP}.weight_scale_2"),
     f"{{file}} lacks {UP}.weight_scale_2, the per-tensor scale of its NVFP4 layer {UP}: {FIX}"),
    # values no quantiser makes
    ("fp8", "weight scale 0", _set(f"{UP}.weight_scale", _filled(0.0)),
     f"{{file}}: {UP}.weight_scale is 0, {VALUES}: {FIX}"),
    ("fp8", "weight scale nan", _set(f"{TO_Q}.weight_scale", _filled(float("nan"))),
     f"{{file}}: {TO_Q}.weight_scale holds nan, {VALUES}: {FIX}"),
    ("fp8", "weight scale inf", _set(f"{UP}.weight_scale", _filled(float("inf"))),
     f"{{file}}: {UP}.weight_scale holds inf, {VALUES}: {FIX}"),
    ("fp8", "weight scale negative", _set(f"{UP}.weight_scale", _filled(-0.25)),
     f"{{file}}: {UP}.weight_scale holds -0.25, {VALUES}: {FIX}"),
    ("fp8", "activation scale 0", _add(f"{UP}.input_scale", torch.tensor(0.0)),
     f"{{file}}: {UP}.input_scale is 0, {VALUES}: {FIX}"),
    ("nvfp4", "block scales all 0", _set(f"{UP}.weight_scale", lambda s: torch.zeros_like(s)),
     f"{{file}}: {UP}.weight_scale is 0 throughout, {VALUES}: {FIX}"),
    ("nvfp4", "a block scale nan", _set(f"{UP}.weight_scale", _block_byte(0x7F)),
     f"{{file}}: {UP}.weight_scale holds nan, {VALUES}: {FIX}"),
    ("nvfp4", "a block scale negative", _set(f"{UP}.weight_scale", _block_byte(0xB8)),  # e4m3 -1.0
     f"{{file}}: {UP}.weight_scale holds -1, {VALUES}: {FIX}"),
    ("nvfp4", "per-tensor scale 0", _set(f"{FC2}.weight_scale_2", _filled(0.0)),
     f"{{file}}: {FC2}.weight_scale_2 is 0, {VALUES}: {FIX}"),
    ("nvfp4", "per-tensor scale -inf", _set(f"{FC2}.weight_scale_2", _filled(float("-inf"))),
     f"{{file}}: {FC2}.weight_scale_2 holds -inf, {VALUES}: {FIX}"),
    # a weight in another type than the file says
    ("fp8", "weight float8_e5m2 where the metadata says float8_e4m3fn",
     _set(f"{UP}.weight", lambda weight: weight.float().to(torch.float8_e5m2)),
     f"{{file}} holds float8_e5m2 tensors ({UP}.weight) where the file's comfy_quant metadata says float8_e4m3fn: "
     "the file is damaged or not this model's; re-download it"),
]


class TestDamagedScalesOfAQuantisedDiT:
    @pytest.mark.parametrize("fmt, damage, says", [pytest.param(fmt, damage, says, id=f"{fmt} {case}")
                                                   for fmt, case, damage, says in DAMAGES])
    def test_are_refused_in_one_line_naming_the_file_and_tensor_before_any_step_and_leave_nothing(
            self, capsys, tmp_path, tiny_turbo_folder, quantised, dit_steps, fmt, damage, says):
        dit = _damaged(quantised[fmt], tmp_path, damage)
        out = tmp_path / "out" / "x.png"
        out.parent.mkdir()
        line = _refused(capsys, _generate(tiny_turbo_folder, dit, out))
        assert line == says.format(file=dit)
        assert dit_steps == [] and list(out.parent.iterdir()) == []


# ------------------------------------------------------------------------------------------- what still loads
def _per_row_fp8(source: Path) -> Callable[[Tensors], None]:
    """Every FP8 layer quantised again with one scale per output row ([out]), as ModelOpt-style writers do."""
    from ernie_image.runtime.quant.fp8 import quantize_fp8

    plain = load_file(str(source / "transformer" / "diffusion_pytorch_model.safetensors"))

    def requantise(tensors: Tensors) -> None:
        for key in [key for key in tensors if key.endswith(".weight_scale")]:
            weight = key.removesuffix("_scale")
            tensors[weight], tensors[key] = quantize_fp8(plain[weight], per_row=True)
    return requantise


def _single_scales_as_one_element(tensors: Tensors) -> None:
    for key in [key for key in tensors if key.endswith(".weight_scale")]:
        tensors[key] = tensors[key].reshape(1)


def _nvfp4_row_of_zeros(source: Path) -> Callable[[Tensors], None]:
    """up_proj quantised again from a weight whose first row is 0: its blocks' scales are 0, the rest are not."""
    from ernie_image.runtime.quant.nvfp4 import quantize_nvfp4

    plain = load_file(str(source / "transformer" / "diffusion_pytorch_model.safetensors"))

    def requantise(tensors: Tensors) -> None:
        weight = plain[f"{UP}.weight"].clone()
        weight[0] = 0
        data, blocked, tensor_scale = quantize_nvfp4(weight)
        assert not blocked[0].float().any()
        tensors[f"{UP}.weight"], tensors[f"{UP}.weight_scale"], tensors[f"{UP}.weight_scale_2"] = \
            data, blocked, tensor_scale
    return requantise


@pytest.mark.parametrize("fmt, change", [("fp8", _per_row_fp8), ("fp8", lambda source: _single_scales_as_one_element),
                                         ("nvfp4", _nvfp4_row_of_zeros)],
                         ids=["fp8 per-row scales", "fp8 single scales stored as [1]", "nvfp4 a row of zeros"])
def test_scales_a_quantiser_makes_still_load_and_run(tmp_path, tiny_turbo_folder, quantised, dit_steps, fmt, change):
    dit = _damaged(quantised[fmt], tmp_path, change(tiny_turbo_folder))
    out = tmp_path / "x.png"
    assert main(_generate(tiny_turbo_folder, dit, out)) == 0
    assert out.is_file() and dit_steps
