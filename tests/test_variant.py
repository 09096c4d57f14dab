"""Base or Turbo is read from what the DiT says before what it is called, and every line that names the variant says
how it was decided.

The two releases share every key and shape, so the weights cannot tell them apart. First to last: the variant the
user sets (ModelSources.variant, the Loader's variant widget, --variant), `ernie_image.variant` in the metadata
every DiT file this pack writes records, the transformer config (the Turbo release's carries use_lora/lora_rank),
the file or folder name, else the base model with a line saying nothing told.
"""
from __future__ import annotations

import dataclasses
import shutil
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from comfy_folders import fake_folder_paths
from ernie_image.nodes.loader import ErnieImageLoader
from ernie_image.runtime.cli.commands import main
from ernie_image.runtime.core.errors import InvalidInputError, ModelFileError
from ernie_image.runtime.demo.tiny import build_tiny_model
from ernie_image.runtime.formats.sources import ModelSources
from ernie_image.runtime.local.options import LoadOptions
from ernie_image.runtime.core.request import GenerationRequest
from ernie_image.runtime.local.pipe import LocalPipe
from conftest import LoggingHost

CPU = LoadOptions(device="cpu")

pytestmark = pytest.mark.usefixtures("one_thread", "no_comfy_modules_left_behind")  # tiny models: one thread


@pytest.fixture(scope="module")
def turbo(tmp_path_factory) -> ModelSources:
    """A tiny Turbo model in ComfyUI's single-file layout (its DiT file records its variant, as the pack writes it)."""
    return build_tiny_model(tmp_path_factory.mktemp("turbo"), layout="comfy", variant="turbo")


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> ModelSources:
    return build_tiny_model(tmp_path_factory.mktemp("base"), layout="comfy", variant="base")


def copied(source: Path, target: Path) -> Path:
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, target)
    return target


def without_metadata(source: Path, target: Path) -> Path:
    """The DiT as a file that records nothing but its tensors, as the released single files are."""
    target.parent.mkdir(parents=True, exist_ok=True)
    save_file(load_file(str(source)), str(target))
    return target


def first_line(sources: ModelSources) -> str:
    return LocalPipe.load(sources, CPU).describe().splitlines()[0]


# ------------------------------------------------------------------------------------------- what decides
def test_a_turbo_dit_renamed_without_turbo_is_turbo_by_its_metadata(turbo, tmp_path):
    renamed = dataclasses.replace(turbo, dit=copied(turbo.dit, tmp_path / "my-model.safetensors"))
    pipe = LocalPipe.load(renamed, CPU)
    assert pipe.variant == "turbo" and pipe.defaults == {"steps": 8, "cfg": 1.0}
    assert pipe.describe().startswith("ERNIE-Image Turbo, from the file's metadata; on cpu")


def test_the_metadata_wins_over_a_name_that_says_otherwise(base, tmp_path):
    misnamed = dataclasses.replace(base, dit=copied(base.dit, tmp_path / "ernie-image-turbo.safetensors"))
    assert first_line(misnamed).startswith("ERNIE-Image Base, from the file's metadata;")


@pytest.mark.parametrize("variant, folder_name, expected", [
    ("turbo", "my-copy", "ERNIE-Image Turbo, from the transformer config;"),
    ("base", "ERNIE-Image-Turbo", "ERNIE-Image Base, from the transformer config;"),
])
def test_a_diffusers_folder_is_told_by_its_transformer_config_whatever_its_name(tmp_path, variant, folder_name,
                                                                                expected):
    folder = build_tiny_model(tmp_path / folder_name, layout="diffusers", variant=variant).model_dir
    assert first_line(ModelSources(model_dir=folder)).startswith(expected)


@pytest.mark.parametrize("name, expected", [
    ("ernie-image-turbo.safetensors", "ERNIE-Image Turbo, from the file name;"),
    ("ernie-image.safetensors", "ERNIE-Image Base, from the file name;"),
])
def test_a_file_that_records_nothing_is_told_by_its_name_and_says_so(turbo, tmp_path, name, expected):
    release_like = dataclasses.replace(turbo, dit=without_metadata(turbo.dit, tmp_path / name))
    assert first_line(release_like).startswith(expected)


@pytest.mark.parametrize("name, expected", [
    ("ernie-image-turbo.safetensors", "turbo"),
    ("ERNIE-Image-Turbo", "turbo"),
    ("ErnieImageTurbo-q8_0.gguf", "turbo"),  # camelCase words
    ("turbo.safetensors", "turbo"),
    ("ernie-image.safetensors", "base"),
    ("ernie_base.gguf", "base"),
    ("base_not_turbo.safetensors", "base"),  # a negated word is the other variant's
    ("ernie-non-turbo.safetensors", "base"),
    ("not-base.safetensors", "turbo"),
    ("turbo_without_base.gguf", "turbo"),
    ("ernie-base-turbo-merge.safetensors", None),  # both: the name does not decide
    ("model.safetensors", None),  # neither
    ("turbocharged-ernie.safetensors", "base"),  # "turbo" inside a word is no word: ernie alone is the base model
    ("database.safetensors", None),
])
def test_a_name_is_read_word_by_word(name, expected):
    from ernie_image.runtime.core.variant import name_variant

    assert name_variant(name) == expected


@pytest.mark.parametrize("name, expected", [
    ("base_not_turbo.safetensors", "ERNIE-Image Base, from the file name;"),
    ("ernie-base-turbo-merge.safetensors", "ERNIE-Image Base, by default: nothing in the files says which (set "
                                           "variant if it is Turbo);"),
])
def test_a_name_that_negates_turbo_or_says_both_is_never_taken_as_turbo(turbo, tmp_path, name, expected):
    (tmp_path / "models").mkdir()  # a folder whose name says nothing either (this test's own folder says "turbo")
    named = dataclasses.replace(turbo, dit=without_metadata(turbo.dit, tmp_path / "models" / name))
    assert first_line(named).startswith(expected)


@pytest.mark.parametrize("folder, expected", [
    ("ERNIE-Image-Turbo", "ERNIE-Image Turbo, from the folder name;"),
    ("ernie-image", "ERNIE-Image Base, from the folder name;"),
    ("diffusion_models", "ERNIE-Image Base, by default: nothing in the files says which"),
])
def test_a_file_whose_name_says_nothing_is_told_by_its_folders_name(turbo, tmp_path, folder, expected):
    (tmp_path / folder).mkdir()
    inside = dataclasses.replace(turbo, dit=without_metadata(turbo.dit, tmp_path / folder / "model.safetensors"))
    assert first_line(inside).startswith(expected)


def test_a_file_whose_name_says_nothing_runs_as_base_saying_nothing_told(turbo, tmp_path):
    anonymous = dataclasses.replace(turbo, dit=without_metadata(turbo.dit, tmp_path / "model.safetensors"))
    pipe = LocalPipe.load(anonymous, CPU)
    assert pipe.variant == "base"
    assert pipe.describe().startswith("ERNIE-Image Base, by default: nothing in the files says which (set variant "
                                      "if it is Turbo); on cpu")


def test_the_variant_option_overrides_what_the_file_says(turbo):
    assert first_line(dataclasses.replace(turbo, variant="base")).startswith("ERNIE-Image Base, set by variant;")
    assert first_line(dataclasses.replace(turbo, variant="auto")).startswith("ERNIE-Image Turbo, from the file's "
                                                                            "metadata;")


@pytest.mark.parametrize("value", ["Turbo", "sdxl", 1])
def test_a_variant_option_that_is_not_base_turbo_or_auto_is_refused_in_one_line(value):
    with pytest.raises(InvalidInputError) as refused:
        ModelSources(model_dir="/models/ERNIE-Image", variant=value)
    assert str(refused.value) == (f"variant {value!r} is not allowed: give 'base', 'turbo' or 'auto' (decided from "
                                  "the files)")


def test_a_recorded_variant_that_is_neither_is_refused_naming_the_file(turbo, tmp_path):
    odd = tmp_path / "odd.safetensors"
    save_file(load_file(str(turbo.dit)), str(odd), metadata={"ernie_image.variant": "lightning"})
    with pytest.raises(ModelFileError) as refused:
        LocalPipe.load(dataclasses.replace(turbo, dit=odd), CPU)
    assert str(refused.value) == ("odd.safetensors records ernie_image.variant 'lightning' in its metadata, which is "
                                  "neither 'base' nor 'turbo': set variant to the right one, or write the file again")


# ------------------------------------------------------------------------------------------- quantize records it
def _quantize(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["quantize", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("fmt, name", [("q8_0", "renamed.gguf"), ("fp8", "renamed.safetensors")])
def test_quantize_records_the_variant_so_a_renamed_output_still_loads_as_turbo(capsys, tmp_path, tiny_turbo_folder,
                                                                              fmt, name):
    out = tmp_path / name
    code, printed, _ = _quantize(capsys, "--dit", str(tiny_turbo_folder / "transformer"), "--format", fmt,
                                 "--out", str(out))
    assert code == 0 and printed.rstrip().endswith("; recorded as Turbo, from the transformer config"), printed
    quantised = ModelSources(model_dir=tiny_turbo_folder, dit=out)
    assert first_line(quantised).startswith("ERNIE-Image Turbo, from the file's metadata;")


def test_quantize_refuses_a_source_that_does_not_say_its_variant_until_variant_is_given(capsys, tmp_path, turbo):
    source = without_metadata(turbo.dit, tmp_path / "weights.safetensors")
    out = tmp_path / "q.gguf"
    code, _, err = _quantize(capsys, "--dit", str(source), "--format", "q8_0", "--out", str(out))
    assert code == 2 and err.strip() == (
        "error: --dit weights.safetensors does not say whether it is ERNIE-Image or ERNIE-Image-Turbo (its metadata "
        "records neither, it has no transformer config, and its name has no word 'ernie', 'base' or 'turbo', or has "
        "both variants'): set --variant to base or turbo, which the written file records")
    assert not out.exists()
    code, printed, _ = _quantize(capsys, "--dit", str(source), "--format", "q8_0", "--out", str(out),
                                 "--variant", "turbo")
    assert code == 0 and printed.rstrip().endswith("; recorded as Turbo, set by --variant"), printed
    assert first_line(dataclasses.replace(turbo, dit=out)).startswith("ERNIE-Image Turbo, from the file's metadata;")


# ------------------------------------------------------------------------------------------- the run line says it
def _generate(capsys, sources: ModelSources, out: Path, *extra: str) -> str:
    """The CLI's run line ("1 image 256x256, 1 step, ...; ERNIE-Image ...") for a one-step 256x256 run of `sources`."""
    code = main(["generate", "--dit", str(sources.dit), "--text-encoder", str(sources.text_encoder), "--vae",
                 str(sources.vae), "--prompt", "a fox", "--width", "256", "--height", "256", "--steps", "1",
                 "--device", "cpu", "--out", str(out), *extra])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 0, err
    return next(line for line in err if line.startswith("1 image 256x256, 1 step, "))


def test_the_cli_run_line_says_the_variant_and_how_it_was_decided(capsys, tmp_path, turbo):
    renamed = dataclasses.replace(turbo, dit=copied(turbo.dit, tmp_path / "my-model.safetensors"))
    assert "; ERNIE-Image Turbo, from the file's metadata; on cpu" in _generate(capsys, renamed, tmp_path / "a.png")
    assert "; ERNIE-Image Turbo, from the file's metadata; on cpu" in _generate(capsys, renamed, tmp_path / "b.png",
                                                                              "--variant", "auto")
    assert "; ERNIE-Image Base, set by --variant; on cpu" in _generate(capsys, renamed, tmp_path / "c.png",
                                                                      "--variant", "base")


# ------------------------------------------------------------------------------------------- an override is told
OVERRIDE = ("{setting} set to base overrides what the files say (Turbo, from the file's metadata): the model is taken "
            "as Base")


def test_quantize_with_a_variant_against_the_file_s_metadata_says_the_flag_overrides_it(capsys, tmp_path, turbo):
    code, _, err = _quantize(capsys, "--dit", str(turbo.dit), "--format", "q8_0", "--out", str(tmp_path / "q.gguf"),
                             "--variant", "base")
    assert code == 0 and err.splitlines().count(OVERRIDE.format(setting="--variant")) == 1, err
    code, _, err = _quantize(capsys, "--dit", str(turbo.dit), "--format", "q8_0", "--out", str(tmp_path / "t.gguf"),
                             "--variant", "turbo")
    assert code == 0 and "overrides" not in err  # the flag agrees with the file


def test_generate_with_a_variant_against_the_file_s_metadata_says_the_flag_overrides_it(capsys, tmp_path, turbo):
    code = main(["generate", "--dit", str(turbo.dit), "--text-encoder", str(turbo.text_encoder), "--vae",
                 str(turbo.vae), "--prompt", "a fox", "--width", "256", "--height", "256", "--steps", "1", "--device",
                 "cpu", "--out", str(tmp_path / "b.png"), "--variant", "base"])
    err = capsys.readouterr().err.splitlines()
    assert code == 0 and err.count(OVERRIDE.format(setting="--variant")) == 1, err


def test_the_library_and_the_loader_say_a_variant_set_against_the_file_overrides_it(turbo, comfy_models):
    host = LoggingHost()
    LocalPipe.load(dataclasses.replace(turbo, variant="base"), CPU).generate(
        GenerationRequest(prompt="a fox", width=256, height=256, steps=1), host)
    assert OVERRIDE.format(setting="variant") in host.messages
    plan = load_with_loader("base")["result"][1]
    assert OVERRIDE.format(setting="the Loader's variant widget") in plan.splitlines()
    assert "overrides" not in load_with_loader("turbo")["result"][1]


# ------------------------------------------------------------------------------------------- the Loader says it
@pytest.fixture
def comfy_models(tmp_path, turbo, monkeypatch) -> Path:
    """ComfyUI's model folders holding the tiny Turbo model, its DiT under a name that says nothing of Turbo."""
    models = tmp_path / "models"
    copied(turbo.dit, models / "diffusion_models" / "my-model.safetensors")
    copied(turbo.text_encoder, models / "text_encoders" / "ministral-3-3b.safetensors")
    copied(turbo.vae, models / "vae" / "flux2-vae.safetensors")
    monkeypatch.setitem(sys.modules, "folder_paths", fake_folder_paths(models))
    return models


def load_with_loader(variant: str, **changes) -> dict:
    inputs = dict(diffusers_folder="(none)", diffusion_model="my-model.safetensors",
                  text_encoder="ministral-3-3b.safetensors", vae="flux2-vae.safetensors", prompt_enhancer="(none)",
                  variant=variant, vram_budget_gb=0.0, keep_loaded=False)
    return ErnieImageLoader().load(**{**inputs, **changes})


@pytest.mark.parametrize("variant, expected", [
    ("auto", "ERNIE-Image Turbo, from the file's metadata;"),
    ("base", "ERNIE-Image Base, set by the Loader's variant widget;"),
])
def test_the_loader_text_says_the_variant_and_how_it_was_decided(comfy_models, variant, expected):
    shown = load_with_loader(variant)
    pipe, plan = shown["result"]
    assert plan.startswith(expected) and shown["ui"]["text"] == [plan]
    assert pipe.variant == ("base" if variant == "base" else "turbo")


def test_the_variant_widget_keeps_its_place_in_saved_workflows():
    """UI workflows save widget values by position: the variant widget stays between prompt_enhancer and the budget."""
    names = list(ErnieImageLoader.INPUT_TYPES()["required"])
    assert names.index("variant") == names.index("prompt_enhancer") + 1 == names.index("vram_budget_gb") - 1


# ------------------------------------------------------------------------------------------- a file in its folder
def folder_files(folder: Path) -> ModelSources:
    """Each part of a diffusers folder given as the single file inside its component folder (--dit
    /m/transformer/diffusion_pytorch_model.safetensors, ...), the folder itself not given."""
    return ModelSources(dit=folder / "transformer" / "diffusion_pytorch_model.safetensors",
                        text_encoder=folder / "text_encoder" / "model.safetensors",
                        vae=folder / "vae" / "diffusion_pytorch_model.safetensors", tokenizer=folder / "tokenizer")


@pytest.mark.parametrize("variant", ["turbo", "base"])
def test_a_dit_file_inside_a_diffusers_folder_is_told_by_the_config_beside_it(tmp_path, variant):
    folder = build_tiny_model(tmp_path / "m", layout="diffusers", variant=variant).model_dir
    label = "Turbo" if variant == "turbo" else "Base"
    assert first_line(folder_files(folder)).startswith(f"ERNIE-Image {label}, from the transformer config;")
    alone = ModelSources(model_dir=folder, dit=folder / "transformer" / "diffusion_pytorch_model.safetensors")
    assert first_line(alone).startswith(f"ERNIE-Image {label}, from the transformer config;")
    defaults = "defaults 8 steps, CFG 1;" if variant == "turbo" else "defaults 50 steps, CFG 4;"
    assert defaults in first_line(alone)  # as the run line and the options write them


def test_quantize_reads_the_config_beside_a_dit_file_inside_a_diffusers_folder(capsys, tmp_path, tiny_turbo_folder):
    out = tmp_path / "q.gguf"
    code, printed, err = _quantize(capsys, "--dit", str(tiny_turbo_folder / "transformer" /
                                                         "diffusion_pytorch_model.safetensors"),
                                   "--format", "q8_0", "--out", str(out))
    assert code == 0 and printed.rstrip().endswith("; recorded as Turbo, from the transformer config"), err


@pytest.mark.parametrize("other", ["text_encoder", "vae"])
def test_a_config_beside_a_dit_file_that_is_another_parts_is_not_read_as_its_config(tmp_path, tiny_turbo_folder, other):
    dit = without_metadata(tiny_turbo_folder / "transformer" / "diffusion_pytorch_model.safetensors",
                           tmp_path / "models" / "weights.safetensors")
    shutil.copyfile(tiny_turbo_folder / other / "config.json", dit.parent / "config.json")
    sources = ModelSources(model_dir=tiny_turbo_folder, dit=dit)
    assert first_line(sources).startswith("ERNIE-Image Base, by default: nothing in the files says which")


# ------------------------------------------------------------------------------------------- a name that says otherwise
NAME_NOTICE = ("the {what} name {name} says {named}, but {decider} says {label} ({evidence}): it runs as {label}; set "
               "{setting} to turbo or base to choose")
NO_LORA_FIELDS = "it has no use_lora or lora_rank, which Turbo's carries"


@pytest.fixture(scope="module")
def misnamed_folders(tmp_path_factory) -> dict[str, Path]:
    """Diffusers folders whose name says the other variant than their transformer config: 'ERNIE-Image-Turbo' holding
    the base release's config (no use_lora/lora_rank), 'ERNIE-Image-Base' holding Turbo's."""
    root = tmp_path_factory.mktemp("named")
    return {name: build_tiny_model(root / name, layout="diffusers", variant=variant).model_dir
            for name, variant in (("ERNIE-Image-Turbo", "base"), ("ERNIE-Image-Base", "turbo"))}


MISNAMED = {  # folder -> what the notice says, and what the run is
    "ERNIE-Image-Turbo": (dict(named="Turbo", label="Base", evidence=NO_LORA_FIELDS), "base"),
    "ERNIE-Image-Base": (dict(named="Base", label="Turbo", evidence="it has use_lora and lora_rank"), "turbo"),
}


def _name_notice(folder: str, setting: str) -> str:
    said, _ = MISNAMED[folder]
    return NAME_NOTICE.format(what="folder", name=folder, decider="the transformer config", setting=setting, **said)


def _run_folder(capsys, folder: Path, out: Path, *extra: str) -> list[str]:
    code = main(["generate", "--model-dir", str(folder), "--prompt", "a fox", "--width", "256", "--height", "256",
                 "--steps", "1", "--device", "cpu", "--out", str(out), *extra])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 0, err
    return err


@pytest.mark.parametrize("folder", list(MISNAMED))
def test_a_folder_named_one_variant_whose_config_says_the_other_runs_as_the_config_says_with_a_notice(
        capsys, tmp_path, misnamed_folders, folder):
    err = _run_folder(capsys, misnamed_folders[folder], tmp_path / "x.png")
    assert err.count(_name_notice(folder, "--variant")) == 1, err
    _, variant = MISNAMED[folder]
    label = "Turbo" if variant == "turbo" else "Base"
    run_line = next(line for line in err if line.startswith("1 image 256x256, "))
    assert f"; ERNIE-Image {label}, from the transformer config; on cpu" in run_line
    assert ("CFG 1," if variant == "turbo" else "CFG 4,") in run_line  # the config's variant's defaults


@pytest.mark.parametrize("folder", list(MISNAMED))
@pytest.mark.parametrize("chosen", ["turbo", "base"])
def test_a_variant_set_chooses_and_the_name_notice_goes(capsys, tmp_path, misnamed_folders, folder, chosen):
    err = _run_folder(capsys, misnamed_folders[folder], tmp_path / "x.png", "--variant", chosen)
    assert not any(" name " in line and " says " in line for line in err), err
    label = "Turbo" if chosen == "turbo" else "Base"
    assert any(f"; ERNIE-Image {label}, set by --variant; on cpu" in line for line in err), err


def test_a_folder_whose_name_agrees_or_says_nothing_gets_no_notice(capsys, tmp_path, tiny_turbo_folder):
    for name in ("ERNIE-Image-Turbo", "my-model"):
        folder = Path(shutil.copytree(tiny_turbo_folder, tmp_path / name))
        err = _run_folder(capsys, folder, tmp_path / f"{name}.png")
        assert not any(" name " in line and " says " in line for line in err), err


def test_a_file_whose_metadata_says_base_but_whose_name_says_turbo_gets_the_notice(capsys, tmp_path, base):
    misnamed = copied(base.dit, tmp_path / "models" / "ernie-image-turbo.safetensors")
    host = LoggingHost()
    LocalPipe.load(dataclasses.replace(base, dit=misnamed), CPU).generate(
        GenerationRequest(prompt="a fox", width=256, height=256, steps=1), host)
    assert NAME_NOTICE.format(what="file", name=misnamed.name, named="Turbo", decider="the file's metadata",
                              label="Base", evidence="ernie_image.variant base", setting="variant") in host.messages


def test_the_loader_text_says_it(misnamed_folders, tmp_path, monkeypatch, no_comfy_modules_left_behind):
    models = tmp_path / "models"
    shutil.copytree(misnamed_folders["ERNIE-Image-Turbo"], models / "diffusers" / "ERNIE-Image-Turbo")
    monkeypatch.setitem(sys.modules, "folder_paths", fake_folder_paths(models))
    pipe, plan = load_with_loader("auto", diffusers_folder="ERNIE-Image-Turbo", diffusion_model="(none)",
                                  text_encoder="(none)", vae="(none)")["result"]
    assert pipe.variant == "base" and plan.startswith("ERNIE-Image Base, from the transformer config;")
    assert _name_notice("ERNIE-Image-Turbo", "the Loader's variant widget") in plan.splitlines()
    _, plan = load_with_loader("turbo", diffusers_folder="ERNIE-Image-Turbo", diffusion_model="(none)",
                               text_encoder="(none)", vae="(none)")["result"]
    assert "ERNIE-Image-Turbo says" not in plan  # the widget chose: what the files say is the override's notice


def test_quantize_says_it_before_recording_the_config_s_variant(capsys, tmp_path, misnamed_folders):
    out = tmp_path / "q.gguf"
    code, printed, err = _quantize(capsys, "--dit", str(misnamed_folders["ERNIE-Image-Turbo"] / "transformer"),
                                   "--format", "q8_0", "--out", str(out))
    assert code == 0 and err.splitlines() == [_name_notice("ERNIE-Image-Turbo", "--variant")], err
    assert printed.rstrip().endswith("; recorded as Base, from the transformer config")


# ------------------------------------------------------------------------------------------- files that disagree
CONFIG_NOTICE = ("the transformer config says {config} ({evidence}), but the file's metadata says {label} "
                 "(ernie_image.variant {recorded}): it runs as {label}; set {setting} to turbo or base to choose")


@pytest.mark.parametrize("variant, recorded", [("turbo", "base"), ("base", "turbo")])
def test_metadata_and_a_config_that_disagree_run_as_the_metadata_says_with_a_notice(capsys, tmp_path, variant,
                                                                                     recorded):
    """The metadata decides (a quantised file records what it was made from); the config beside it saying the
    other variant is told, in every front end's words, never passed over."""
    from safetensors.torch import load_file, save_file

    folder = build_tiny_model(tmp_path / "m", layout="diffusers", variant=variant).model_dir
    weights = folder / "transformer" / "diffusion_pytorch_model.safetensors"
    save_file(load_file(str(weights)), str(weights), metadata={"ernie_image.variant": recorded})
    err = _run_folder(capsys, folder, tmp_path / "x.png")
    evidence = "it has use_lora and lora_rank" if variant == "turbo" else NO_LORA_FIELDS
    label = "Turbo" if recorded == "turbo" else "Base"
    notice = CONFIG_NOTICE.format(config="Turbo" if variant == "turbo" else "Base", evidence=evidence, label=label,
                                  recorded=recorded, setting="--variant")
    assert err.count(notice) == 1, err
    assert any(f"; ERNIE-Image {label}, from the file's metadata; on cpu" in line for line in err), err
    assert not any("the transformer config says" in line for line in _run_folder(
        capsys, folder, tmp_path / "y.png", "--variant", recorded))  # the flag chose: no notice


def test_a_folder_whose_files_record_two_variants_is_refused_naming_both(capsys, tmp_path, tiny_turbo_folder):
    """Shards of a Base and of a Turbo download in one folder: the file read last decided, without a word."""
    from safetensors.torch import load_file, save_file

    folder = Path(shutil.copytree(tiny_turbo_folder, tmp_path / "m"))
    part = folder / "transformer"
    tensors = load_file(str(part / "diffusion_pytorch_model.safetensors"))
    (part / "diffusion_pytorch_model.safetensors").unlink()
    keys = sorted(tensors)
    save_file({key: tensors[key] for key in keys[::2]}, str(part / "a.safetensors"),
              metadata={"ernie_image.variant": "base"})
    save_file({key: tensors[key] for key in keys[1::2]}, str(part / "b.safetensors"),
              metadata={"ernie_image.variant": "turbo"})
    assert main(["generate", "--model-dir", str(folder), "--steps", "1", "--device", "cpu", "--out",
                 str(tmp_path / "x.png")]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: transformer/ mixes two models' files: a.safetensors records ernie_image.variant base and "
        "b.safetensors turbo: download the folder again")
    assert not (tmp_path / "x.png").exists()
