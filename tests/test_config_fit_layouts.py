"""A config that does not fit the weights beside it is refused when the files are read, in every layout users have.

Each structural field of the VAE's and the DiT's config (a switch that keeps or leaves out layers, a list whose length
is a block count, a channel count or width) is changed in turn, in a config.json beside the weights or in a config
embedded in a single file's metadata, beside bf16 safetensors, GGUF, FP8 and NVFP4 DiT files. Each change is refused
in one line that names the config, the field (or the tensors that differ and the field most likely responsible) and
the fix; the CLI exits 2 with no traceback, before the DiT runs a step, and writes nothing. A config that only adds
fields no part is built from still loads, to the same picture; a config and file that agree on a structure other than
the released one (a VAE without quant convs or mid-block attention) load and decode.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ernie_image.runtime.cli.commands import main
from ernie_image.runtime.core.errors import ModelFileError
from ernie_image.runtime.demo.tiny import build_tiny_model
from ernie_image.runtime.model.tensor_fit import PRESENCE_FIELDS

REPO_ROOT = Path(__file__).resolve().parent.parent
UP, DOWN = "UpDecoderBlock2D", "DownEncoderBlock2D"


@dataclass(frozen=True)
class ConfigAt:
    """Where one part's config lives: a config.json, or the `config` in a safetensors file's metadata."""

    path: Path
    embedded: bool = False

    def read(self) -> dict[str, Any]:
        if not self.embedded:
            return json.loads(self.path.read_text())
        with safe_open(str(self.path), "pt") as handle:
            return json.loads(handle.metadata()["config"])

    def write(self, config: dict[str, Any]) -> None:
        if not self.embedded:
            self.path.write_text(json.dumps(config))
            return
        with safe_open(str(self.path), "pt") as handle:
            tensors, metadata = {key: handle.get_tensor(key) for key in handle.keys()}, handle.metadata()
        save_file(tensors, str(self.path), metadata={**metadata, "config": json.dumps(config)})

    def change(self, field: str, value: Any) -> None:
        config = self.read()
        config[field] = value
        self.write(config)

    def named(self) -> str:
        """The config's name, and the fix, as a refusal words them (formats/config_json.origin_of)."""
        return (f"the config in {self.path.name}'s metadata" if self.embedded else str(self.path))

    def fix(self) -> str:
        return "re-export or re-download the file" if self.embedded else "fix it or re-download it"


@dataclass(frozen=True)
class Model:
    argv: tuple[str, ...]  # the CLI's arguments naming the model's files
    configs: dict[str, ConfigAt]  # "dit", "vae": where each part's config is


def _diffusers_folder(sources: dict[str, Path], root: Path) -> Model:
    model = Path(shutil.copytree(sources["diffusers"], root / "model"))
    return Model(("--model-dir", str(model)), {"dit": ConfigAt(model / "transformer" / "config.json"),
                                              "vae": ConfigAt(model / "vae" / "config.json")})


def _comfy_single_files(sources: dict[str, Path], root: Path) -> Model:
    """Comfy-Org's files: the VAE in BFL names with its config embedded; the DiT (prefixed names, no config of its
    own) inside a transformer/ folder beside the released layout's config.json, which then is its config."""
    files = Path(shutil.copytree(sources["comfy"], root / "comfy"))
    dit = files / "transformer" / "ernie-image-turbo-tiny.safetensors"
    dit.parent.mkdir()
    shutil.move(files / "diffusion_models" / dit.name, dit)
    shutil.copyfile(sources["diffusers"] / "transformer" / "config.json", dit.parent / "config.json")
    vae = files / "vae" / "flux2-vae-tiny.safetensors"
    return Model(("--dit", str(dit), "--text-encoder", str(files / "text_encoders" / "ministral-3-3b-tiny.safetensors"),
                  "--vae", str(vae)), {"dit": ConfigAt(dit.parent / "config.json"), "vae": ConfigAt(vae, True)})


def _quantized_dit(fmt: str) -> Callable[[dict[str, Path], Path], Model]:
    """The diffusers folder with its DiT given as a quantised file (GGUF, FP8, NVFP4) beside the DiT's config.json."""
    def build(sources: dict[str, Path], root: Path) -> Model:
        folder = _diffusers_folder(sources, root)
        dit = root / "quantized" / sources[fmt].name
        dit.parent.mkdir()
        shutil.copyfile(sources[fmt], dit)
        shutil.copyfile(sources["diffusers"] / "transformer" / "config.json", dit.parent / "config.json")
        return Model((*folder.argv, "--dit", str(dit)), {"dit": ConfigAt(dit.parent / "config.json"),
                                                         "vae": folder.configs["vae"]})
    return build


LAYOUTS: dict[str, Callable[[dict[str, Path], Path], Model]] = {
    "diffusers folder": _diffusers_folder,
    "comfy single files": _comfy_single_files,
    "GGUF q8_0 DiT": _quantized_dit("q8_0"),
    "FP8 DiT": _quantized_dit("fp8"),
    "NVFP4 DiT": _quantized_dit("nvfp4"),
}
VAE_LAYOUTS = ("diffusers folder", "comfy single files")  # the VAE is never quantised


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    """The tiny Turbo model in each layout, shared read-only: each test changes a copy."""
    from ernie_image.runtime import quant

    root = tmp_path_factory.mktemp("layouts")
    folder = build_tiny_model(root / "diffusers", layout="diffusers", variant="turbo").model_dir
    build_tiny_model(root / "comfy", layout="comfy", variant="turbo")
    found = {"diffusers": folder, "comfy": root / "comfy"}
    state = load_file(str(folder / "transformer" / "diffusion_pytorch_model.safetensors"))
    (root / "quantized").mkdir()
    for fmt, name in (("fp8", "ernie-image-turbo-fp8.safetensors"), ("nvfp4", "ernie-image-turbo-nvfp4.safetensors"),
                      ("q8_0", "ernie-image-turbo-Q8_0.gguf")):
        if fmt == "q8_0" and importlib.util.find_spec("gguf") is None:
            continue
        found[fmt] = quant.write_quantized_file(dict(state), fmt, root / "quantized" / name, variant="turbo")
    return found


def _model(sources: dict[str, Path], layout: str, root: Path) -> Model:
    if layout == "GGUF q8_0 DiT" and "q8_0" not in sources:
        pytest.skip("the gguf package is not installed")
    return LAYOUTS[layout](sources, root)


def _generate(model: Model, out: Path, *more: str) -> list[str]:
    return ["generate", *model.argv, "--prompt", "a fox", "--width", "256", "--height", "256", "--steps", "1",
            "--device", "cpu", "--out", str(out), *more]


def _refused(capsys, argv: list[str]) -> str:
    """The CLI's one line for a refusal: exit code 2, nothing else on stderr (no traceback, no step, no notice)."""
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


# The tiny model: VAE channels [8, 16, 16, 32] in 4 down and 4 up blocks, one resnet a block (two in the decoder's),
# 32 latent channels, 2x2 patches, quant_conv, post_quant_conv and mid-block attention; DiT 2 layers of width 64
# (2 heads of 32, q/k norms), MLP 128, 128 latent channels in and out, text coming in at 48.
VAE_MISFITS = [
    ("use_quant_conv", False, "says use_quant_conv false but the weights hold quant_conv.weight [64, 64, 1, 1]"),
    ("use_post_quant_conv", False, "says use_post_quant_conv false but the weights hold post_quant_conv.weight "
                                   "[32, 32, 1, 1]"),
    ("mid_block_add_attention", False, "says mid_block_add_attention false but the weights hold "
                                       "decoder.mid_block.attentions.0.to_q.weight [32, 32]"),
    ("down_block_types", [DOWN] * 3, "(3 blocks) but the weights hold 4 down blocks (encoder.down_blocks.0 to 3)"),
    ("down_block_types", [DOWN] * 5, "(5 blocks) but the weights hold 4 down blocks (encoder.down_blocks.0 to 3)"),
    ("up_block_types", [UP] * 3, "(3 blocks) but the weights hold 4 up blocks (decoder.up_blocks.0 to 3)"),
    ("up_block_types", [UP] * 5, "(5 blocks) but the weights hold 4 up blocks (decoder.up_blocks.0 to 3)"),
    ("up_block_types", [UP, UP, UP, "AttnUpDecoderBlock2D"], "does not fit the weights: it makes "
                                                             "decoder.up_blocks.3.attentions.0."),
    ("block_out_channels", [8, 16, 32], "says block_out_channels [8, 16, 32] but the weights hold [8, 16, 16, 32]"),
    ("block_out_channels", [8, 16, 16, 64], "says block_out_channels [8, 16, 16, 64] but the weights hold "
                                            "[8, 16, 16, 32]"),
    ("decoder_block_out_channels", [8, 16, 16, 16], "says decoder_block_out_channels [8, 16, 16, 16] but the weights "
                                                    "hold [8, 16, 16, 32] (the decoder's tensors)"),
    ("layers_per_block", 2, "says layers_per_block 2 but the weights hold 1"),
    ("latent_channels", 16, "says latent_channels 16 but the weights hold 32"),
    ("in_channels", 4, "says in_channels 4 but the weights hold 3 (encoder.conv_in.weight is [8, 3, 3, 3])"),
    ("out_channels", 1, "says out_channels 1 but the weights hold 3 (decoder.conv_out.weight is [3, 8, 3, 3])"),
    ("patch_size", [1, 1], "does not fit the weights: it makes bn.running_mean [32] but the weights hold [128] (its "
                           "patch_size [1, 1] is the likely cause)"),
]
DIT_MISFITS = [
    ("qk_layernorm", False, "says qk_layernorm false but the weights hold the q/k norms "
                            "(layers.0.self_attention.norm_q.weight is [32])"),
    ("num_layers", 1, "says num_layers 1 but the weights hold 2 layers"),
    ("num_layers", 3, "says num_layers 3 but the weights hold 2 layers"),
    ("hidden_size", 128, "says hidden_size 128 but the weights hold 64 (x_embedder.proj.weight is [64, 128, 1, 1])"),
    ("num_attention_heads", 4, "says num_attention_heads 4 but the weights hold 2 heads of 32"),
    ("ffn_hidden_size", 64, "says ffn_hidden_size 64 but the weights hold 128"),
    ("in_channels", 64, "says in_channels 64 but the weights hold 128"),
    ("out_channels", 64, "says out_channels 64 but the weights hold 128 (final_linear.weight is [128, 64])"),
    ("text_in_dim", 64, "says text_in_dim 64 but the weights hold 48 (text_proj.weight is [64, 48])"),
    ("patch_size", 2, "does not describe an ERNIE-Image DiT (ValueError: patch_size 2 is not supported"),
]
CASES = ([pytest.param(layout, "vae", *misfit, id=f"{layout}: VAE {misfit[0]} {json.dumps(misfit[1])}")
          for layout in VAE_LAYOUTS for misfit in VAE_MISFITS]
         + [pytest.param(layout, "dit", *misfit, id=f"{layout}: DiT {misfit[0]} {json.dumps(misfit[1])}")
            for layout in LAYOUTS for misfit in DIT_MISFITS])


class TestAConfigThatDoesNotFitItsWeights:
    @pytest.mark.parametrize("layout, part, field, value, says", CASES)
    def test_is_refused_in_one_line_naming_the_field_before_any_step_and_leaves_nothing(
            self, capsys, tmp_path, sources, dit_steps, layout, part, field, value, says):
        model = _model(sources, layout, tmp_path)
        config = model.configs[part]
        config.change(field, value)
        out = tmp_path / "out" / "x.png"
        out.parent.mkdir()
        line = _refused(capsys, _generate(model, out))
        assert line.startswith(f"error: {config.named()} ") and says in line, line
        assert field in line and line.endswith(f": {config.fix()}"), line
        assert dit_steps == [] and list(out.parent.iterdir()) == []

    @pytest.mark.parametrize("layout", list(LAYOUTS))
    def test_fields_no_part_is_built_from_still_load_to_the_same_picture(self, tmp_path, sources, layout):
        model = _model(sources, layout, tmp_path)
        plain, noted = tmp_path / "plain.png", tmp_path / "noted.png"
        assert main(_generate(model, plain)) == 0
        notes = {"_comment": "converted by hand", "trained_with": {"steps": 1000}, "torch_dtype": "bfloat16",
                 "force_upcast": True}
        for config in model.configs.values():
            config.write({**config.read(), **notes})
        assert main(_generate(model, noted)) == 0
        assert _pixels(noted) == _pixels(plain)


def _pixels(path: Path) -> bytes:
    from PIL import Image

    with Image.open(path) as image:
        return image.tobytes()


# --------------------------------------------------------------- config and file agreeing on another structure
def _vae_without(root: Path, **switches: bool) -> Model:
    """The diffusers folder whose VAE (config and file) is built with `switches` (AutoencoderKLFlux2's)."""
    from diffusers import AutoencoderKLFlux2

    model = _diffusers_folder({"diffusers": root / "source"}, root)
    vae_folder = model.configs["vae"].path.parent
    config = {k: v for k, v in model.configs["vae"].read().items() if not k.startswith("_")}
    torch.manual_seed(0)
    vae = AutoencoderKLFlux2(**{**config, **switches}).eval()
    shutil.rmtree(vae_folder)
    vae.save_pretrained(vae_folder)
    return model


SWITCHES = {"use_quant_conv": "quant_conv.*", "use_post_quant_conv": "post_quant_conv.*",
            "mid_block_add_attention": "decoder.mid_block.attentions.* (the mid block's attention)"}


class TestAConfigAndFileThatAgree:
    @pytest.fixture
    def switched_off(self, tmp_path, sources) -> Model:
        shutil.copytree(sources["diffusers"], tmp_path / "source")
        return _vae_without(tmp_path, **dict.fromkeys(SWITCHES, False))

    def test_on_a_vae_without_quant_convs_or_mid_attention_load_and_decode(self, tmp_path, switched_off, dit_steps):
        out = tmp_path / "x.png"
        assert main(_generate(switched_off, out)) == 0
        assert out.is_file() and dit_steps

    @pytest.mark.parametrize("field, layer", SWITCHES.items(), ids=list(SWITCHES))
    def test_then_a_switch_turned_back_on_is_refused_naming_what_the_weights_lack(
            self, capsys, tmp_path, switched_off, dit_steps, field, layer):
        config = switched_off.configs["vae"]
        config.change(field, True)
        line = _refused(capsys, _generate(switched_off, tmp_path / "x.png"))
        assert line == f"error: {config.named()} says {field} true but the weights hold no {layer}: {config.fix()}"
        assert dit_steps == [] and not (tmp_path / "x.png").exists()


def _dit_without_qk_norms(sources: dict[str, Path], root: Path) -> Model:
    model = _diffusers_folder(sources, root)
    weights = model.configs["dit"].path.parent / "diffusion_pytorch_model.safetensors"
    state = load_file(str(weights))
    save_file({k: v for k, v in state.items() if ".norm_q." not in k and ".norm_k." not in k}, str(weights))
    return model


@pytest.mark.parametrize("qk_layernorm, says", [
    (True, "does not fit the weights: it makes layers.0.self_attention.norm_k.weight, "
           "layers.0.self_attention.norm_q.weight, layers.1.self_attention.norm_k.weight (4 tensors in all), which the "
           "weights lack (its qk_layernorm true is the likely cause)"),
    (False, "does not describe an ERNIE-Image DiT (ValueError: qk_layernorm false is not supported: ERNIE-Image's "
            "transformer normalises q and k (qk_layernorm true))"),
])
def test_a_dit_file_without_q_k_norms_is_refused_whatever_its_config_says(capsys, tmp_path, sources, dit_steps,
                                                                          qk_layernorm, says):
    model = _dit_without_qk_norms(sources, tmp_path)
    config = model.configs["dit"]
    config.change("qk_layernorm", qk_layernorm)
    line = _refused(capsys, _generate(model, tmp_path / "x.png"))
    assert line == f"error: {config.named()} {says}: fix it or re-download it"
    assert dit_steps == []


# ------------------------------------------------------------------------------- text encoder and prompt enhancer
TEXT_MISFITS = [
    ("text_encoder", "num_attention_heads", 2, "it makes layers.0.self_attn.q_proj.weight [24, 48] but the weights "
                                               "hold [48, 48] (its text_config.num_attention_heads 2 or "
                                               "text_config.head_dim 12 is the likely cause)"),
    ("text_encoder", "head_dim", 8, "it makes layers.0.self_attn.q_proj.weight [32, 48] but the weights hold "
                                    "[48, 48] (its text_config.num_attention_heads 4 or text_config.head_dim 8 is "
                                    "the likely cause)"),
    ("text_encoder", "num_key_value_heads", 4, "it makes layers.0.self_attn.k_proj.weight [48, 48] but the weights "
                                               "hold [24, 48] (its text_config.num_key_value_heads 4 or "
                                               "text_config.head_dim 12 is the likely cause)"),
    ("pe", "num_key_value_heads", 1, "it makes layers.0.self_attn.k_proj.weight [12, 48] but the weights hold "
                                     "[24, 48] (its num_key_value_heads 1 or head_dim 12 is the likely cause)"),
    ("pe", "tie_word_embeddings", False, "it makes lm_head.weight, which the weights lack (its tie_word_embeddings "
                                         "false is the likely cause)"),
]


@pytest.mark.parametrize("part, field, value, says", TEXT_MISFITS,
                         ids=[f"{part} {field} {json.dumps(value)}" for part, field, value, _ in TEXT_MISFITS])
def test_a_text_model_config_that_does_not_fit_is_refused_in_one_line_before_any_step(
        capsys, tmp_path, tiny_turbo_with_pe, dit_steps, part, field, value, says):
    model = Path(shutil.copytree(tiny_turbo_with_pe, tmp_path / "model"))
    config = model / part / "config.json"
    values = json.loads(config.read_text())
    values.get("text_config", values)[field] = value
    config.write_text(json.dumps(values))
    line = _refused(capsys, _generate(Model(("--model-dir", str(model)), {}), tmp_path / "x.png"))
    assert line == f"error: {config} does not fit the weights: {says}: fix it or re-download it"
    assert dit_steps == [] and not (tmp_path / "x.png").exists()


def _pe_with_head(tiny_turbo_with_pe: Path, root: Path, head: Callable[[torch.Tensor], torch.Tensor]) -> Path:
    """A copy of the tiny model whose PE file (tied config) also holds lm_head.weight = head(embed_tokens)."""
    model = Path(shutil.copytree(tiny_turbo_with_pe, root / "model"))
    weights = next((model / "pe").glob("*.safetensors"))
    state = load_file(str(weights))
    state["lm_head.weight"] = head(state["model.embed_tokens.weight"]).clone(memory_format=torch.contiguous_format)
    save_file(state, str(weights))
    return model


@pytest.mark.parametrize("head", [lambda embed: embed, torch.zeros_like],
                         ids=["the embeddings' copy", "zeros in the embeddings' shape"])
def test_a_tied_prompt_enhancer_file_holding_a_head_in_the_embeddings_shape_loads_and_the_copy_is_unused(
        capsys, tmp_path, tiny_turbo_with_pe, head):
    """As transformers does: with tie_word_embeddings true the head is the embeddings, whatever lm_head.weight holds."""
    images = []
    for name, model in (("without", tiny_turbo_with_pe),
                        ("with", _pe_with_head(tiny_turbo_with_pe, tmp_path, head))):
        out = tmp_path / f"{name}.png"
        assert main(_generate(Model(("--model-dir", str(model)), {}), out, "--use-pe", "--seed", "5")) == 0, \
            capsys.readouterr().err
        images.append(out.read_bytes())
    assert images[0] == images[1]


@pytest.mark.parametrize("head", [lambda embed: embed[:-1], lambda embed: embed[:, :-1], lambda embed: embed.t()],
                         ids=["a row fewer", "a column fewer", "transposed"])
def test_a_tied_prompt_enhancer_file_holding_a_head_in_another_shape_is_refused(
        capsys, tmp_path, tiny_turbo_with_pe, dit_steps, head):
    model = _pe_with_head(tiny_turbo_with_pe, tmp_path, head)
    line = _refused(capsys, _generate(Model(("--model-dir", str(model)), {}), tmp_path / "x.png"))
    assert line == (f"error: {model / 'pe' / 'config.json'} does not fit the weights: the weights hold lm_head.weight, "
                    "for which it makes no place (its tie_word_embeddings true is the likely cause): fix it or "
                    "re-download it")
    assert dit_steps == [] and not (tmp_path / "x.png").exists()


# -------------------------------------------------------------------------- quantize holds its source to the same fit
def _comfy_dit_without_config(sources: dict[str, Path], root: Path) -> Model:
    """Comfy-Org's files as downloaded: the DiT alone in diffusion_models/, its config inferred from its shapes."""
    files = Path(shutil.copytree(sources["comfy"], root / "comfy"))
    vae = files / "vae" / "flux2-vae-tiny.safetensors"
    dit = files / "diffusion_models" / "ernie-image-turbo-tiny.safetensors"
    text_encoder = files / "text_encoders" / "ministral-3-3b-tiny.safetensors"
    return Model(("--dit", str(dit), "--text-encoder", str(text_encoder), "--vae", str(vae)),
                 {"vae": ConfigAt(vae, True)})


BF16_LAYOUTS: dict[str, Callable[[dict[str, Path], Path], Model]] = {
    "diffusers folder": _diffusers_folder,
    "comfy single file beside a config.json": _comfy_single_files,
    "comfy single file without a config": _comfy_dit_without_config,
}


def _bf16_dit(model: Model) -> Path:
    """What `quantize --dit` is given for the model's DiT: the --dit file, else the model's transformer folder."""
    argv = list(model.argv)
    return Path(argv[argv.index("--dit") + 1]) if "--dit" in argv else model.configs["dit"].path.parent


Change = Callable[[dict[str, torch.Tensor], str], None]


def _damaged(model: Model, change: Change) -> Model:
    """The model with its DiT file saved again after `change(tensors, prefix)`, `prefix` the file's own key prefix
    (Comfy-Org's files name every tensor under one), its metadata kept."""
    dit = _bf16_dit(model)
    weights = dit / "diffusion_pytorch_model.safetensors" if dit.is_dir() else dit
    with safe_open(str(weights), "pt") as handle:
        tensors, metadata = {key: handle.get_tensor(key) for key in handle.keys()}, handle.metadata()
    embedder = next(key for key in tensors if key.endswith("x_embedder.proj.weight"))
    change(tensors, embedder.removesuffix("x_embedder.proj.weight"))
    save_file(tensors, str(weights), metadata=metadata)
    return model


UP_PROJ = "layers.0.mlp.up_proj.weight"  # [128, 64] in the tiny DiT
EXTRA = "layers.0.mlp.extra.weight"  # no ERNIE-Image DiT has it


def _one_row_cut(tensors: dict[str, torch.Tensor], prefix: str) -> None:
    tensors[prefix + UP_PROJ] = tensors[prefix + UP_PROJ][:-1]


def _left_out(tensors: dict[str, torch.Tensor], prefix: str) -> None:
    del tensors[prefix + UP_PROJ]


def _one_added(tensors: dict[str, torch.Tensor], prefix: str) -> None:
    tensors[prefix + EXTRA] = torch.zeros(4)


TENSOR_DAMAGE: dict[str, tuple[Change, str]] = {  # (the change, what the refusal says)
    "a tensor in another shape": (_one_row_cut, f" does not fit the weights: it makes {UP_PROJ} [128, 64] but the "
                                                f"weights hold [127, 64]"),
    # The other layer holds its up_proj: the file lost the tensor, the config is not to blame.
    "a tensor missing": (_left_out, f" lacks {UP_PROJ}, which the config makes and the weights' other layers hold: "
                                    f"the file is damaged or was not fully downloaded: download it again"),
    "an unknown tensor": (_one_added, f" holds {EXTRA}, which no ERNIE-Image transformer has: save the weights "
                                      "without them, or re-download them"),
}
# A file without a config is held to the config its shapes show, which makes no claim on tensors beyond it: generate
# loads such a file, so quantize writes it.
TENSOR_CASES = [pytest.param(layout, damage, id=f"{layout}: {damage}") for layout in BF16_LAYOUTS
                for damage in TENSOR_DAMAGE
                if (layout, damage) != ("comfy single file without a config", "an unknown tensor")]


def _quantize_refused(capsys, tmp_path: Path, model: Model) -> str:
    """quantize's one line for `model`'s DiT, checking that it left nothing where it was asked to write."""
    out = tmp_path / "quantized-out"
    out.mkdir()
    line = _refused(capsys, ["quantize", "--dit", str(_bf16_dit(model)), "--format", "fp8",
                             "--out", str(out / "ernie-image-fp8.safetensors")])
    assert list(out.iterdir()) == []  # no output, no partial file
    return line


class TestQuantizeRefusesWhatGenerateRefusesOfABf16Dit:
    """In generate's words and before writing anything, rather than writing a quantised file generate refuses."""

    @pytest.mark.parametrize("layout, damage", TENSOR_CASES)
    def test_a_tensor_the_config_does_not_make_as_the_file_holds_it(self, capsys, tmp_path, sources, dit_steps,
                                                                     layout, damage):
        change, says = TENSOR_DAMAGE[damage]
        model = _damaged(BF16_LAYOUTS[layout](sources, tmp_path), change)
        line = _refused(capsys, _generate(model, tmp_path / "x.png"))
        assert says in line, line
        assert _quantize_refused(capsys, tmp_path, model) == line
        assert dit_steps == []

    @pytest.mark.parametrize("layout", ["diffusers folder", "comfy single file beside a config.json"])
    @pytest.mark.parametrize("field, value, says", DIT_MISFITS,
                             ids=[f"{field} {json.dumps(value)}" for field, value, _ in DIT_MISFITS])
    def test_a_config_that_does_not_fit_the_weights(self, capsys, tmp_path, sources, layout, field, value, says):
        model = BF16_LAYOUTS[layout](sources, tmp_path)
        model.configs["dit"].change(field, value)
        line = _refused(capsys, _generate(model, tmp_path / "x.png"))
        assert says in line, line
        assert _quantize_refused(capsys, tmp_path, model) == line

    def test_an_unknown_tensor_beside_no_config_is_told_not_read_and_not_written(self, capsys, tmp_path, sources):
        """A file without a config is held to the released config, which makes no claim on tensors beyond the DiT:
        such a tensor is not read, with a line saying so, and the quantised file leaves it out."""
        change, _ = TENSOR_DAMAGE["an unknown tensor"]
        model = _damaged(_comfy_dit_without_config(sources, tmp_path), change)
        told = f"{_bf16_dit(model).name} holds 1 tensor no ERNIE-Image transformer has ({EXTRA}): they are not read"
        assert main(_generate(model, tmp_path / "y.png")) == 0
        assert told in capsys.readouterr().err.splitlines()
        out = tmp_path / "ernie-image-turbo-fp8.safetensors"
        assert main(["quantize", "--dit", str(_bf16_dit(model)), "--format", "fp8", "--out", str(out)]) == 0
        assert told in capsys.readouterr().err.splitlines()
        assert EXTRA not in load_file(str(out))
        argv = list(model.argv)
        argv[argv.index("--dit") + 1] = str(out)
        assert main(_generate(Model(tuple(argv), model.configs), tmp_path / "x.png")) == 0


@pytest.mark.parametrize("layout", BF16_LAYOUTS)
def test_a_tensor_in_another_shape_is_not_blamed_on_a_field_that_decides_which_tensors_exist(capsys, tmp_path, sources,
                                                                                            layout):
    """A layer's tensor cut by a row: the layer count (num_layers) makes layers, not their shapes."""
    model = _damaged(BF16_LAYOUTS[layout](sources, tmp_path), _one_row_cut)
    line = _refused(capsys, _generate(model, tmp_path / "x.png"))
    assert "[127, 64]" in line and not any(field in line for field in PRESENCE_FIELDS), line


# ------------------------------------------------------------------------------- a layer's tensor the weights lost
LOST_FROM_A_LAYER = {  # (the part, the tensors the weights lost): in each, another layer still holds them
    "one DiT tensor": ("dit", ("layers.1.self_attention.to_v.weight",)),
    "two DiT tensors of two layers": ("dit", ("layers.0.mlp.up_proj.weight", "layers.1.self_attention.to_k.weight")),
    "one text encoder tensor": ("text_encoder", ("layers.1.mlp.up_proj.weight",)),
    "a text encoder attention tensor": ("text_encoder", ("layers.1.self_attn.q_proj.weight",)),
}
PREFIXED_BY = {"dit": "x_embedder.proj.weight", "text_encoder": "embed_tokens.weight"}  # a tensor every file holds


def _part_weights(model: Model, part: str) -> Path:
    """The weight file of `part` ("dit" or "text_encoder") the model's arguments give."""
    argv = list(model.argv)
    if part == "dit":
        dit = _bf16_dit(model)
        return dit / "diffusion_pytorch_model.safetensors" if dit.is_dir() else dit
    if "--text-encoder" in argv:
        return Path(argv[argv.index("--text-encoder") + 1])
    return Path(argv[argv.index("--model-dir") + 1]) / "text_encoder" / "model.safetensors"


def _without(weights: Path, part: str, lost: tuple[str, ...]) -> None:
    """`weights` saved again without the tensors `lost` (canonical names: under the file's own prefix)."""
    with safe_open(str(weights), "pt") as handle:
        tensors, metadata = {key: handle.get_tensor(key) for key in handle.keys()}, handle.metadata()
    prefix = next(key for key in tensors if key.endswith(PREFIXED_BY[part])).removesuffix(PREFIXED_BY[part])
    save_file({key: tensor for key, tensor in tensors.items() if key.removeprefix(prefix) not in lost}, str(weights),
              metadata=metadata)


@pytest.mark.parametrize("layout", ["diffusers folder", "comfy single files"])
@pytest.mark.parametrize("lost", LOST_FROM_A_LAYER)
def test_a_tensor_lost_from_a_layer_the_weights_hold_is_the_files_damage_not_the_layer_counts(
        capsys, tmp_path, sources, dit_steps, layout, lost):
    """The layer count makes whole layers: neither it nor any other field is named for a tensor missing from a layer
    the weights hold, and the file is named, not the config."""
    part, keys = LOST_FROM_A_LAYER[lost]
    model = LAYOUTS[layout](sources, tmp_path)
    weights = _part_weights(model, part)
    _without(weights, part, keys)
    line = _refused(capsys, _generate(model, tmp_path / "x.png"))
    assert line == (f"error: {weights} lacks {', '.join(keys)}, which the config makes and the weights' other layers "
                    f"hold: the file is damaged or was not fully downloaded: download it again")
    assert dit_steps == [] and not (tmp_path / "x.png").exists()


# ---------------------------------------------------------------- stray tensors of a layer the weights hardly hold
STRAY = {  # (tensors copied from layer 1 to another layer, the layer they land in): each layer of the tiny DiT has 11
    "one tensor of the next layer": (("self_attention.norm_q.weight",), 2),
    "one tensor far beyond the last layer": (("adaLN_sa_ln.weight",), 5),
    "three tensors of the next layer": (("mlp.up_proj.weight", "self_attention.norm_k.weight", "adaLN_mlp_ln.weight"), 2),
}


def _stray_copies(kinds: tuple[str, ...], layer: int) -> Change:
    def change(tensors: dict[str, torch.Tensor], prefix: str) -> None:
        for kind in kinds:
            tensors[f"{prefix}layers.{layer}.{kind}"] = tensors[f"{prefix}layers.1.{kind}"].clone()
    return change


@pytest.mark.parametrize("layout", BF16_LAYOUTS)
@pytest.mark.parametrize("stray", STRAY)
def test_stray_tensors_of_a_layer_are_the_files_damage_not_the_configs_layer_count(capsys, tmp_path, sources,
                                                                                    dit_steps, layout, stray):
    """A layer holding fewer than half of a layer's tensors would count as a layer: the config (given or inferred)
    would be blamed for the file's strays. The file and the layer are named, before any work."""
    kinds, layer = STRAY[stray]
    model = _damaged(BF16_LAYOUTS[layout](sources, tmp_path), _stray_copies(kinds, layer))
    weights = _part_weights(model, "dit")
    held = ", ".join(sorted(f"layers.{layer}.{kind}" for kind in kinds))
    line = _refused(capsys, _generate(model, tmp_path / "x.png"))
    assert line == (f"error: {weights} holds {held} of a layer {layer} that lacks {11 - len(kinds)} of the 11 tensors "
                    "its fullest layer holds: stray tensors, or the file is damaged: download it again, or save the "
                    "weights without them")
    assert _quantize_refused(capsys, tmp_path, model) == line
    assert dit_steps == [] and not (tmp_path / "x.png").exists()


def test_two_layers_of_strays_are_both_named(capsys, tmp_path, sources):
    model = _damaged(_comfy_dit_without_config(sources, tmp_path), _stray_copies(("adaLN_sa_ln.weight",), 3))
    model = _damaged(model, _stray_copies(("adaLN_sa_ln.weight",), 2))
    line = _refused(capsys, _generate(model, tmp_path / "x.png"))
    assert "holds layers.2.adaLN_sa_ln.weight of a layer 2 that lacks 10 of the 11 tensors its fullest layer holds " \
           "(so does layer 3): stray tensors" in line, line


@pytest.mark.parametrize("layout", BF16_LAYOUTS)
def test_a_top_layer_that_lost_its_q_k_norm_is_the_files_damage_not_qk_layernorm(capsys, tmp_path, sources, layout):
    """Tensors missing from a layer the weights hold, of kinds their other layers hold: every layer makes the same
    tensors, so no config field (qk_layernorm here) leaves them out, given or inferred."""
    lost = ("layers.1.self_attention.norm_k.weight", "layers.1.self_attention.norm_q.weight")

    def change(tensors: dict[str, torch.Tensor], prefix: str) -> None:
        for key in lost:
            del tensors[prefix + key]
    model = _damaged(BF16_LAYOUTS[layout](sources, tmp_path), change)
    line = _refused(capsys, _generate(model, tmp_path / "x.png"))
    assert line == (f"error: {_part_weights(model, 'dit')} lacks {', '.join(lost)}, which the config makes and the "
                    "weights' other layers hold: the file is damaged or was not fully downloaded: download it again")


def test_stray_tensors_in_the_text_encoder_are_named_too(capsys, tmp_path, sources):
    model = _comfy_single_files(sources, tmp_path)
    weights = _part_weights(model, "text_encoder")
    with safe_open(str(weights), "pt") as handle:
        tensors, metadata = {key: handle.get_tensor(key) for key in handle.keys()}, handle.metadata()
    source = next(key for key in tensors if key.endswith("layers.0.mlp.up_proj.weight"))
    tensors[source.replace("layers.0.", "layers.7.")] = tensors[source].clone()
    save_file(tensors, str(weights), metadata=metadata)
    line = _refused(capsys, _generate(model, tmp_path / "x.png"))
    assert line.startswith(f"error: {weights} holds layers.7.mlp.up_proj.weight of a layer 7 that lacks "), line


def _dit_held_against(sources: dict[str, Path], root: Path, num_layers: int) -> tuple[Any, dict]:
    """The tiny DiT folder (2 layers) and what a config of `num_layers` makes, held against each other directly:
    loading, config_fit refuses the count first, in its own words."""
    from ernie_image.runtime.formats import open_component
    from ernie_image.runtime.model.builders import dit_on_meta
    from ernie_image.runtime.model.tensor_fit import shapes_of

    model = _diffusers_folder(sources, root)
    model.configs["dit"].change("num_layers", num_layers)
    component = open_component(model.configs["dit"].path.parent, "dit")
    return component, shapes_of(dit_on_meta(component))


@pytest.mark.parametrize("num_layers, says", [
    (3, "it makes layers.2.adaLN_mlp_ln.weight, layers.2.adaLN_sa_ln.weight, layers.2.mlp.gate_proj.weight "
        "(11 tensors in all), which the weights lack (its num_layers 3 is the likely cause)"),
    (1, "the weights hold layers.1.adaLN_mlp_ln.weight, layers.1.adaLN_sa_ln.weight, layers.1.mlp.gate_proj.weight "
        "(11 tensors in all), for which it makes no place (its num_layers 1 is the likely cause)"),
], ids=["a layer more than the weights hold", "a layer fewer"])
def test_whole_layers_the_config_counts_otherwise_are_blamed_on_its_layer_count(tmp_path, sources, num_layers, says):
    from ernie_image.runtime.model.tensor_fit import check_built_tensors

    component, made = _dit_held_against(sources, tmp_path, num_layers)
    with pytest.raises(ModelFileError) as refused:
        check_built_tensors(component, "dit", made)
    assert str(refused.value) == f"{component.config_file} does not fit the weights: {says}: fix it or re-download it"


# ------------------------------------------------------------------------------------------- as a separate process
def test_the_cli_process_exits_2_with_one_line_and_no_image(tmp_path, sources):
    """`python -m ernie_image generate` on a folder whose VAE config leaves out post_quant_conv: refused at load, not
    a traceback at VAE decode after the whole sampling run."""
    model = _diffusers_folder(sources, tmp_path)
    model.configs["vae"].change("use_post_quant_conv", False)
    site = tmp_path / "site"
    site.mkdir()
    (site / "ernie_image").symlink_to(REPO_ROOT, target_is_directory=True)  # this checkout, as `ernie_image`
    out = tmp_path / "x.png"
    done = subprocess.run([sys.executable, "-m", "ernie_image", *_generate(model, out)], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(site), "OMP_NUM_THREADS": "1"}, timeout=300)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert lines[0] == (f"error: {model.configs['vae'].path} says use_post_quant_conv false but the weights hold "
                        "post_quant_conv.weight [32, 32, 1, 1]: fix it or re-download it")
    assert "sampling" not in done.stdout + done.stderr and not out.exists()
