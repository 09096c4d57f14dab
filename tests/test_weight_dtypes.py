"""Weights in a type a model's weights never have are refused in one line when the files are read, in every layout.

Each part (the DiT, the VAE, the text encoder, the prompt enhancer) in each layout the tiny model is written in (the
diffusers folder, Comfy-Org's single files, and for the DiT a GGUF, an FP8 and an NVFP4 file) is saved again with
floating-point tensors in integer or bool types: the whole file, as `.to(torch.int16)` makes it, or one norm, bias,
scale or packed weight. Every case is refused in one line naming the file, the type, the tensors as the file names
them and the fix; the CLI exits 2 with no traceback, before the DiT runs a step, and writes nothing. What the layouts
legitimately hold in byte types (GGUF blocks, FP8 data, NVFP4 pairs and block scales, the text encoder's embedded
tokenizer, BatchNorm's step counter) still loads. Float64 weights load as diffusers loads them: cast to the run's
dtype, to the same picture as the float32 file.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ernie_image.runtime.cli.commands import main
from ernie_image.runtime.demo.tiny import build_tiny_model

REPO_ROOT = Path(__file__).resolve().parent.parent
FIX = "the file is damaged or not this model's; re-download it"
INTEGERS = (torch.int8, torch.int16, torch.int32, torch.uint8, torch.bool)
GGUF_INTEGERS = (torch.int8, torch.int16, torch.int32)  # GGUF has no uint8 or bool tensor type
HAS_GGUF = importlib.util.find_spec("gguf") is not None

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    """The tiny Turbo model with a prompt enhancer, in each layout, shared read-only: each test changes a copy."""
    from ernie_image.runtime import quant

    root = tmp_path_factory.mktemp("dtypes")
    folder = build_tiny_model(root / "diffusers", layout="diffusers", variant="turbo", with_pe=True).model_dir
    build_tiny_model(root / "comfy", layout="comfy", variant="turbo", with_pe=True)
    found = {"diffusers": folder, "comfy": root / "comfy"}
    state = load_file(str(folder / "transformer" / "diffusion_pytorch_model.safetensors"))
    (root / "quantized").mkdir()
    for fmt, name in (("fp8", "ernie-image-turbo-fp8.safetensors"), ("nvfp4", "ernie-image-turbo-nvfp4.safetensors"),
                      ("q8_0", "ernie-image-turbo-Q8_0.gguf")):
        if fmt != "q8_0" or HAS_GGUF:
            found[fmt] = quant.write_quantized_file(dict(state), fmt, root / "quantized" / name, variant="turbo")
    return found


@dataclass(frozen=True)
class Model:
    argv: tuple[str, ...]  # the CLI's arguments naming the model's files
    damaged: Path  # the file of the part under test


def _diffusers(part: str, weights: str) -> Callable[[dict[str, Path], Path], Model]:
    def build(sources: dict[str, Path], root: Path) -> Model:
        model = Path(shutil.copytree(sources["diffusers"], root / "model"))
        return Model(("--model-dir", str(model)), model / part / weights)
    return build


COMFY_FILES = {"dit": "diffusion_models/ernie-image-turbo-tiny.safetensors",
               "text_encoder": "text_encoders/ministral-3-3b-tiny.safetensors", "vae": "vae/flux2-vae-tiny.safetensors",
               "pe": "text_encoders/ernie-image-prompt-enhancer-tiny.safetensors"}


def _comfy(part: str) -> Callable[[dict[str, Path], Path], Model]:
    def build(sources: dict[str, Path], root: Path) -> Model:
        files = Path(shutil.copytree(sources["comfy"], root / "comfy"))
        argv = ("--dit", str(files / COMFY_FILES["dit"]), "--text-encoder", str(files / COMFY_FILES["text_encoder"]),
                "--vae", str(files / COMFY_FILES["vae"]))
        if part == "pe":  # the CLI takes a prompt enhancer only to run it
            argv += ("--pe", str(files / COMFY_FILES["pe"]), "--use-pe")
        return Model(argv, files / COMFY_FILES[part])
    return build


def _quantized_dit(fmt: str) -> Callable[[dict[str, Path], Path], Model]:
    """The diffusers folder with its DiT given as a quantised file (GGUF, FP8, NVFP4)."""
    def build(sources: dict[str, Path], root: Path) -> Model:
        if fmt not in sources:
            pytest.skip("the gguf package is not installed")
        folder = _diffusers("transformer", "diffusion_pytorch_model.safetensors")(sources, root)
        dit = root / sources[fmt].name
        shutil.copyfile(sources[fmt], dit)
        return Model((*folder.argv, "--dit", str(dit)), dit)
    return build


LAYOUTS: dict[tuple[str, str], Callable[[dict[str, Path], Path], Model]] = {
    ("dit", "diffusers folder"): _diffusers("transformer", "diffusion_pytorch_model.safetensors"),
    ("dit", "comfy single file"): _comfy("dit"),
    ("dit", "GGUF"): _quantized_dit("q8_0"),
    ("dit", "FP8"): _quantized_dit("fp8"),
    ("dit", "NVFP4"): _quantized_dit("nvfp4"),
    ("vae", "diffusers folder"): _diffusers("vae", "diffusion_pytorch_model.safetensors"),
    ("vae", "comfy single file"): _comfy("vae"),
    ("text_encoder", "diffusers folder"): _diffusers("text_encoder", "model.safetensors"),
    ("text_encoder", "comfy single file"): _comfy("text_encoder"),
    ("pe", "diffusers folder"): _diffusers("pe", "model.safetensors"),
    ("pe", "comfy single file"): _comfy("pe"),
}

# Per part and layout: the tensors (a pattern on the file's own names) given another type, and where the refusal says
# they belong. "" is the whole file; a norm and a bias each part reads; a quantised file's packed weights and scales.
FLOATING = "weights are floating point"
WHOLE_FILE = ("", FLOATING)
COMFY_QUANT = "comfy_quant entries are uint8 (JSON text)"
FP8_WEIGHTS = "FP8 weights are float8_e4m3fn or float8_e5m2"
SCALES = "scales are floating point"
NVFP4_WEIGHTS = "NVFP4 weights are uint8 (packed pairs)"
NVFP4_BLOCK_SCALES = "NVFP4 block scales are float8_e4m3fn"
UINT8_HOLDS = (NVFP4_WEIGHTS, NVFP4_BLOCK_SCALES)  # what uint8 is legitimately (block scales: the e4m3 bytes)
# A whole comfy_quant file in uint8 keeps its comfy_quant entries (and NVFP4's packed weights and block scales) in
# their own type: the refusal then names the first tensors in another, (where, where in uint8).
WHOLE_FP8 = ("", (COMFY_QUANT, FP8_WEIGHTS))
WHOLE_NVFP4 = ("", (COMFY_QUANT, SCALES))
DAMAGES: dict[tuple[str, str], tuple[tuple[str, str | tuple[str, str]], ...]] = {
    ("dit", "diffusers folder"): (WHOLE_FILE, (r"^layers\.0\.self_attention\.norm_q\.weight$", FLOATING),
                                  (r"^x_embedder\.proj\.bias$", FLOATING)),
    ("dit", "comfy single file"): (WHOLE_FILE, (r"^model\.diffusion_model\.layers\.0\.adaLN_sa_ln\.weight$", FLOATING),
                                   (r"^model\.diffusion_model\.time_embedding\.linear_1\.bias$", FLOATING)),
    ("dit", "GGUF"): ((r"^layers\.0\.self_attention\.norm_k\.weight$", FLOATING), (r"^final_linear\.bias$", FLOATING),
                      (r"\.(weight|bias)$", FLOATING)),  # every tensor but the packed Q8_0 blocks
    ("dit", "FP8"): (WHOLE_FP8,
                     (r"^layers\.0\.self_attention\.norm_q\.weight$", FLOATING),
                     (r"^layers\.0\.mlp\.up_proj\.weight$", FP8_WEIGHTS),
                     (r"^layers\.1\.self_attention\.to_k\.weight_scale$", SCALES)),
    ("dit", "NVFP4"): (WHOLE_NVFP4, (r"^final_linear\.bias$", FLOATING),
                       (r"^layers\.0\.self_attention\.to_q\.weight$", NVFP4_WEIGHTS),
                       (r"^layers\.0\.mlp\.gate_proj\.weight_scale$", NVFP4_BLOCK_SCALES),
                       (r"\.weight_scale_2$", SCALES)),
    ("vae", "diffusers folder"): (WHOLE_FILE, (r"^decoder\.conv_norm_out\.weight$", FLOATING),
                                  (r"^bn\.running_var$", FLOATING)),
    ("vae", "comfy single file"): (WHOLE_FILE, (r"^decoder\.norm_out\.bias$", FLOATING),
                                   (r"^decoder\.up\.0\.block\.0\.conv1\.weight$", FLOATING)),
    ("text_encoder", "diffusers folder"): (WHOLE_FILE, (r"layers\.0\.input_layernorm\.weight$", FLOATING)),
    ("text_encoder", "comfy single file"): (WHOLE_FILE, (r"^model\.embed_tokens\.weight$", FLOATING),
                                            (r"^model\.layers\.0\.post_attention_layernorm\.weight$", FLOATING)),
    ("pe", "diffusers folder"): (WHOLE_FILE, (r"^model\.layers\.1\.post_attention_layernorm\.weight$", FLOATING)),
    ("pe", "comfy single file"): (WHOLE_FILE, (r"^model\.layers\.0\.self_attn\.k_proj\.weight$", FLOATING)),
}


def _retyped(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (tensor.float() if tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else tensor).to(dtype)


def _retype_safetensors(path: Path, pattern: str, dtype: torch.dtype) -> list[str]:
    """`path` saved again with the tensors whose names match `pattern` in `dtype` (its metadata kept): their names."""
    with safe_open(str(path), "pt") as handle:
        tensors, metadata = {key: handle.get_tensor(key) for key in handle.keys()}, handle.metadata()
    changed = [key for key in tensors if re.search(pattern, key)]
    save_file({key: _retyped(value, dtype) if key in changed else value for key, value in tensors.items()},
              str(path), metadata=metadata)
    return changed


def _retype_gguf(path: Path, pattern: str, dtype: torch.dtype) -> list[str]:
    """`path` written again with its plain (unpacked) tensors whose names match `pattern` in `dtype` (I8, I16, I32 or
    F64 in GGUF's types), its packed blocks and this pack's header fields kept: their names."""
    import gguf
    from ernie_image.runtime.quant.gguf_files import _tensor_entry, pack_fields

    reader = gguf.GGUFReader(str(path))
    writer = gguf.GGUFWriter(str(path) + ".new", arch="wan")
    for key, value in pack_fields(path).items():
        writer.add_string(key, value)
    changed = []
    for tensor in reader.tensors:
        entry = _tensor_entry(tensor, tensor.name)
        if isinstance(entry, torch.Tensor) and re.search(pattern, tensor.name):
            changed.append(tensor.name)
            writer.add_tensor(tensor.name, entry.float().to(dtype).numpy())
        else:
            writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    del reader
    os.replace(str(path) + ".new", path)
    return changed


def _retype(path: Path, pattern: str, dtype: torch.dtype) -> list[str]:
    changed = (_retype_gguf if path.suffix == ".gguf" else _retype_safetensors)(path, pattern, dtype)
    assert changed, f"no tensor of {path.name} matches {pattern!r}"
    return changed


def _generate(model: Model, out: Path) -> list[str]:
    return ["generate", *model.argv, "--prompt", "a fox", "--width", "256", "--height", "256", "--steps", "1",
            "--device", "cpu", "--out", str(out)]


def _refused(capsys, argv: list[str]) -> str:
    """The CLI's one line for a refusal: exit code 2, nothing else on stderr (no traceback, no step, no notice)."""
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


CASES = [pytest.param(part, layout, pattern, where, dtype,
                      id=f"{part} {layout} {pattern.strip('^$') or 'whole file'} {_name(dtype)}")
         for (part, layout), damages in DAMAGES.items() for pattern, where in damages
         for dtype in (GGUF_INTEGERS if layout == "GGUF" else INTEGERS)
         if not (dtype == torch.uint8 and where in UINT8_HOLDS)]


class TestWeightsInIntegerOrBoolTypes:
    @pytest.mark.parametrize("part, layout, pattern, where, dtype", CASES)
    def test_are_refused_in_one_line_naming_the_file_and_tensors_before_any_step_and_leave_nothing(
            self, capsys, tmp_path, sources, dit_steps, part, layout, pattern, where, dtype):
        model = LAYOUTS[part, layout](sources, tmp_path)
        changed = _retype(model.damaged, pattern, dtype)
        if isinstance(where, tuple):
            where = where[dtype == torch.uint8]
        out = tmp_path / "out" / "x.png"
        out.parent.mkdir()
        line = _refused(capsys, _generate(model, out))
        assert line.startswith(f"error: {model.damaged} holds {_name(dtype)} tensors (") and "Traceback" not in line
        assert line.endswith(f") where {where}: {FIX}"), line
        listed = line[line.index(" tensors (") + len(" tensors ("):line.rindex(f") where {where}")]
        assert listed.split(" (")[0].split(", ")[0] in changed, line  # as the file names them
        if len(changed) == 1:
            assert listed == changed[0], line
        assert dit_steps == [] and list(out.parent.iterdir()) == []


# ------------------------------------------------------------------------------------------- what still loads
def _pixels(path: Path) -> bytes:
    from PIL import Image

    with Image.open(path) as image:
        return image.tobytes()


FLOAT64_LAYOUTS = [("dit", "diffusers folder", ""), ("dit", "comfy single file", ""),
                   ("dit", "FP8", r"(norm_[qk]|_ln)\.weight$|\.bias$|\.weight_scale$"),
                   ("dit", "NVFP4", r"(norm_[qk]|_ln)\.weight$|\.bias$|\.weight_scale_2$"),
                   ("dit", "GGUF", r"\.(weight|bias)$"), ("vae", "diffusers folder", ""),
                   ("vae", "comfy single file", ""), ("text_encoder", "diffusers folder", ""),
                   ("text_encoder", "comfy single file", r"^model\.")]


@pytest.mark.parametrize("part, layout, pattern", FLOAT64_LAYOUTS,
                         ids=[f"{part} {layout}" for part, layout, _ in FLOAT64_LAYOUTS])
def test_float64_weights_are_cast_as_diffusers_casts_them_to_the_same_picture(tmp_path, sources, monkeypatch, part,
                                                                              layout, pattern):
    """diffusers' from_pretrained casts float64 weights to the dtype asked for (float32 when none is); so does the
    pack, to the run's dtype: the tiny model's float32 weights stored as float64 load as the very same tensors and
    make the same picture. On the CPU the float32 file's weights are used where the file maps them, the cast ones
    from fresh memory, and the CPU's matrix kernels round by the weights' address: a pixel may differ by one level."""
    from ernie_image.runtime.local import parts

    built = []
    for name in ("build_dit", "build_vae", "build_text_tower"):
        monkeypatch.setattr(parts, name, _kept(name, getattr(parts, name), built))
    plain = LAYOUTS[part, layout](sources, tmp_path / "plain")
    assert main(_generate(plain, tmp_path / "plain.png")) == 0
    wide = LAYOUTS[part, layout](sources, tmp_path / "wide")
    _retype(wide.damaged, pattern, torch.float64)
    assert main(_generate(wide, tmp_path / "wide.png")) == 0
    half = len(built) // 2
    assert [name for name, _ in built[:half]] == [name for name, _ in built[half:]]
    for (name, plain_part), (_, wide_part) in zip(built[:half], built[half:]):
        plain_state, wide_state = plain_part.state_dict(), wide_part.state_dict()
        differ = [key for key, value in wide_state.items() if plain_state[key].is_floating_point()
                  and (plain_state[key].dtype != value.dtype or not torch.equal(plain_state[key], value))]
        assert differ == [], f"{name} loads {differ} otherwise than from the float32 file"
    assert _largest_pixel_difference(tmp_path / "wide.png", tmp_path / "plain.png") <= 1


def _kept(name: str, build: Callable, built: list) -> Callable:
    def build_and_keep(*args, **kwargs):
        built.append((name, build(*args, **kwargs)))
        return built[-1][1]
    return build_and_keep


def _largest_pixel_difference(a: Path, b: Path) -> int:
    return max(abs(x - y) for x, y in zip(_pixels(a), _pixels(b)))


def test_float64_weights_are_what_diffusers_loads_too(tmp_path, sources):
    """The reference's own behaviour: AutoencoderKLFlux2.from_pretrained on float64 weights gives the float32 model."""
    from diffusers import AutoencoderKLFlux2

    model = _diffusers("vae", "diffusion_pytorch_model.safetensors")(sources, tmp_path)
    _retype(model.damaged, "", torch.float64)
    vae = AutoencoderKLFlux2.from_pretrained(str(model.damaged.parent))
    reference = AutoencoderKLFlux2.from_pretrained(str(sources["diffusers"] / "vae"))
    assert {parameter.dtype for parameter in vae.parameters()} == {torch.float32}
    assert all(torch.equal(a, b) for a, b in zip(vae.state_dict().values(), reference.state_dict().values()))


@pytest.mark.parametrize("layout", ["FP8", "NVFP4", "GGUF", "comfy single file"])
def test_what_a_layout_holds_in_byte_types_still_loads(tmp_path, sources, dit_steps, layout):
    """Packed FP8 data, NVFP4 pairs and block scales, GGUF blocks, comfy_quant entries, the text encoder's embedded
    tokenizer (uint8) and BatchNorm's step counter (int64) are what those files hold: they load and run."""
    model = LAYOUTS["dit", layout](sources, tmp_path)
    out = tmp_path / "x.png"
    assert main(_generate(model, out)) == 0
    assert out.is_file() and dit_steps


def test_nvfp4_block_scales_stored_as_their_bytes_load_to_the_same_picture(tmp_path, sources):
    """ModelOpt-style writers store NVFP4's e4m3 block scales as uint8: the same bytes, read as e4m3."""
    plain = LAYOUTS["dit", "NVFP4"](sources, tmp_path / "plain")
    assert main(_generate(plain, tmp_path / "plain.png")) == 0
    as_bytes = LAYOUTS["dit", "NVFP4"](sources, tmp_path / "bytes")
    with safe_open(str(as_bytes.damaged), "pt") as handle:
        tensors, metadata = {key: handle.get_tensor(key) for key in handle.keys()}, handle.metadata()
    save_file({key: value.view(torch.uint8) if key.endswith(".weight_scale") else value
               for key, value in tensors.items()}, str(as_bytes.damaged), metadata=metadata)
    assert main(_generate(as_bytes, tmp_path / "bytes.png")) == 0
    assert _pixels(tmp_path / "bytes.png") == _pixels(tmp_path / "plain.png")


def test_a_text_encoder_gguf_holding_integers_is_refused_naming_it(tmp_path):
    """A Ministral text-encoder GGUF (llama.cpp names) whose norm is an integer tensor: refused when the part is
    checked, naming the .gguf file and the tensor as the part names it."""
    if not HAS_GGUF:
        pytest.skip("the gguf package is not installed")
    import gguf
    import numpy as np
    from ernie_image.runtime.core.errors import ModelFileError
    from ernie_image.runtime.formats import open_component
    from ernie_image.runtime.model.dtype_fit import check_built_dtypes

    path = tmp_path / "ministral-3-3b-Q8_0.gguf"
    writer = gguf.GGUFWriter(str(path), arch="mistral3")
    writer.add_uint32("mistral3.attention.head_count", 4)
    writer.add_uint32("mistral3.attention.head_count_kv", 2)
    writer.add_tensor("token_embd.weight", np.zeros((8, 48), dtype=np.float32))
    writer.add_tensor("blk.0.attn_q.weight", np.zeros((48, 48), dtype=np.float32))
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(48, dtype=np.int16))
    writer.add_tensor("output.weight", np.zeros((8, 48), dtype=np.float32))  # a head of its own: not the PE's layout
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    component = open_component(path, "text_encoder")
    with pytest.raises(ModelFileError) as refused:
        check_built_dtypes(component, {"embed_tokens.weight", "layers.0.input_layernorm.weight"})
    assert str(refused.value) == (f"{path} holds int16 tensors (layers.0.input_layernorm.weight) where weights are "
                                  f"floating point: {FIX}")


# ------------------------------------------------------------------------------------------- other front ends
def test_the_loader_node_says_it_in_one_line(tmp_path, sources, monkeypatch, no_comfy_modules_left_behind):
    """In ComfyUI the Loader refuses the files in the same line, before the Sampler runs anything."""
    from comfy_folders import fake_folder_paths
    from ernie_image.nodes.loader import ErnieImageLoader
    from ernie_image.runtime.core.errors import ModelFileError

    models = tmp_path / "models"
    for folder, file in (("diffusion_models", "dit"), ("text_encoders", "text_encoder"), ("vae", "vae")):
        (models / folder).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(sources["comfy"] / COMFY_FILES[file], models / folder / Path(COMFY_FILES[file]).name)
    vae = models / "vae" / "flux2-vae-tiny.safetensors"
    _retype(vae, "", torch.int16)
    monkeypatch.setitem(sys.modules, "folder_paths", fake_folder_paths(models))
    with pytest.raises(ModelFileError) as refused:
        ErnieImageLoader().load(diffusers_folder="(none)", diffusion_model="ernie-image-turbo-tiny.safetensors",
                                text_encoder="ministral-3-3b-tiny.safetensors", vae="flux2-vae-tiny.safetensors",
                                prompt_enhancer="(none)", variant="auto", vram_budget_gb=0.0, keep_loaded=False)
    message = str(refused.value)
    assert "\n" not in message and message.startswith(f"{vae} holds int16 tensors (") and message.endswith(FIX)


def test_enhance_refuses_an_integer_prompt_enhancer_in_one_line(capsys, tmp_path, sources):
    """`ernie-image enhance` builds the prompt enhancer without a pipe: the same line, not PyTorch's per tensor."""
    model = _diffusers("pe", "model.safetensors")(sources, tmp_path)
    _retype(model.damaged, r"norm", torch.int32)
    line = _refused(capsys, ["enhance", "--model-dir", str(model.argv[1]), "--prompt", "a fox", "--device", "cpu"])
    assert line.startswith(f"error: {model.damaged} holds int32 tensors (") and line.endswith(FIX)


@pytest.mark.parametrize("quant", ["fp8", "q8_0"])
def test_a_format_to_quantise_on_load_asked_of_an_integer_dit_names_the_integers_not_the_format(
        capsys, tmp_path, sources, quant):
    """Integers pack in no format: the refusal names the weights' type, not a format that cannot pack them."""
    model = _diffusers("transformer", "diffusion_pytorch_model.safetensors")(sources, tmp_path)
    _retype(model.damaged, "", torch.int16)
    line = _refused(capsys, [*_generate(model, tmp_path / "x.png"), "--quant", quant])
    assert line.startswith(f"error: {model.damaged} holds int16 tensors (") and line.endswith(FIX), line


def test_quantize_refuses_an_integer_dit_in_one_line_and_writes_nothing(capsys, tmp_path, sources):
    model = _diffusers("transformer", "diffusion_pytorch_model.safetensors")(sources, tmp_path)
    _retype(model.damaged, r"^layers\.0\.", torch.int16)
    out = tmp_path / "q.gguf"
    line = _refused(capsys, ["quantize", "--dit", str(model.damaged.parent), "--format", "q8_0", "--out", str(out)])
    assert line.startswith(f"error: {model.damaged} holds int16 tensors (layers.0.") and line.endswith(FIX), line
    assert not out.exists()


def test_the_cli_process_exits_2_with_one_line_and_no_image(tmp_path, sources):
    """The reported run: `python -m ernie_image generate` on the demo-sized folder whose VAE was saved as int16."""
    model = _diffusers("vae", "diffusion_pytorch_model.safetensors")(sources, tmp_path)
    _retype(model.damaged, "", torch.int16)
    site = tmp_path / "site"
    site.mkdir()
    (site / "ernie_image").symlink_to(REPO_ROOT, target_is_directory=True)  # this checkout, as `ernie_image`
    out = tmp_path / "o.png"
    done = subprocess.run([sys.executable, "-m", "ernie_image", *_generate(model, out)], capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(site), "OMP_NUM_THREADS": "1"}, timeout=300)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert lines[0] == (f"error: {model.damaged} holds int16 tensors (bn.running_mean, bn.running_var, "
                        f"decoder.conv_in.bias (186 tensors in all)) where weights are floating point: {FIX}")
    assert not out.exists()
