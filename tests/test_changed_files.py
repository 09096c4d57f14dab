"""A model file replaced, rewritten, cut or deleted on disk while a loaded pipe holds it (its weights are read
through memory maps, and again after each release) is refused before the next run or phase reads it: one line naming
the file, what changed and the fix in the words of the surface the user is on, and the pipe lets go of what it
holds. Never a picture from the new bytes, a NaN blamed on the wrong part, or a SIGBUS from a mapped page past a
cut file's end."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Callable

import pytest
import torch

from ernie_image.runtime.cli.names import cli_message
from ernie_image.runtime.core.errors import ModelFileError
from ernie_image.runtime.core.host import NullHost
from ernie_image.runtime.core.request import GenerationRequest
from ernie_image.runtime.demo.tiny import build_tiny_model
from ernie_image.runtime.formats.sources import ModelSources
from ernie_image.runtime.local.options import LoadOptions
from ernie_image.runtime.local.pipe import LocalPipe

pytestmark = pytest.mark.usefixtures("one_thread")

REPO_ROOT = Path(__file__).resolve().parent.parent

REQUEST = GenerationRequest(prompt="a red fox", width=256, height=256, steps=1, seed=5)
LIBRARY_FIX = ": load the model again (LocalPipe.load)"


# ------------------------------------------------------------------------------------------- how files change
def replaced(path: Path) -> str:
    """Other bytes renamed over the file (a new inode), as a download or a copy does."""
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    fresh = path.with_name(path.name + ".part")
    fresh.write_bytes(bytes(data))
    os.replace(fresh, path)
    return "replaced by another file"


MODIFIED = "its modification time changed (same size): it may have been rewritten"


def flip_last_byte(path: Path) -> None:
    with open(path, "r+b") as handle:
        handle.seek(-1, os.SEEK_END)
        last = handle.read(1)
        handle.seek(-1, os.SEEK_END)
        handle.write(bytes([last[0] ^ 0xFF]))


def rewritten(path: Path) -> str:
    """The same size, other bytes, written into the same inode."""
    before = path.stat()
    flip_last_byte(path)
    # A rewrite moves the modified time; set it past the old one whatever the file system clock's resolution.
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns + 1_000_000_000))
    return MODIFIED


def touched(path: Path) -> str:
    """Only the modification time moved (`touch`): the bytes may be the same, so it is said as what is known."""
    before = path.stat()
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns + 1_000_000_000))
    return MODIFIED


def copied_over(path: Path) -> str:
    """Other bytes of the same size copied into the same inode keeping its times (`touch -r turbo base; cp -p base
    turbo`): only the status-change time, which no user tool sets, moves."""
    before = path.stat()
    flip_last_byte(path)
    # Wait for the status-change time to move past the one recorded at load, whatever the clock's granularity.
    while True:
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
        if path.stat().st_ctime_ns != before.st_ctime_ns:
            return "its status time changed (same size and modification time): it may have been rewritten"


def truncated(path: Path) -> str:
    size = path.stat().st_size
    os.truncate(path, size // 2)
    return f"size {size} -> {size // 2} bytes"


def deleted(path: Path) -> str:
    path.unlink()
    return "deleted or moved"


CHANGES: list[Callable[[Path], str]] = [replaced, rewritten, touched, copied_over, truncated, deleted]


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> ModelSources:
    return build_tiny_model(tmp_path_factory.mktemp("built"), layout="comfy", variant="turbo")


@pytest.fixture
def sources(tmp_path, built) -> ModelSources:
    """A copy of the tiny model's single files this test may change."""
    folder = tmp_path / "models"
    folder.mkdir()
    return ModelSources(**{part: Path(shutil.copy(getattr(built, part), folder)) for part in ("dit", "text_encoder",
                                                                                              "vae")})


def changed_line(path: Path, what: str) -> str:
    return f"{path} changed on disk since the model was loaded ({what}){LIBRARY_FIX}"


def refused_run(pipe: LocalPipe, host=None) -> str:
    with pytest.raises(ModelFileError) as refused:
        pipe.generate(REQUEST, host or NullHost())
    return str(refused.value)


# Weights kept loaded on the CPU in float32 are views of the mapped file: a cut there is a SIGBUS in this process,
# which test_a_file_cut_under_weights_the_pipe_maps_is_refused_not_a_crash runs in a process of its own.
CASES = [(part, change, keep) for part in ("dit", "text_encoder", "vae") for change in CHANGES for keep in (True, False)
         if not (change is truncated and keep)]


CASE_IDS = [f"{part}-{change.__name__}-{'kept' if keep else 'freed'}" for part, change, keep in CASES]


@pytest.mark.parametrize("part, change, keep_loaded", CASES, ids=CASE_IDS)
def test_a_file_changed_under_a_loaded_pipe_is_refused_naming_it_and_the_pipe_lets_go(sources, part, change,
                                                                                       keep_loaded):
    pipe = LocalPipe.load(sources, LoadOptions(device="cpu", keep_loaded=keep_loaded))
    pipe.generate(REQUEST, NullHost())
    path = getattr(sources, part)
    what = change(path)
    assert refused_run(pipe) == changed_line(path, what)
    assert not pipe.is_loaded()
    assert refused_run(pipe) == changed_line(path, what)  # refused until the model is loaded again


def other_decoder(path: Path) -> None:
    """Other bytes renamed over the VAE file, differing in a weight the decoder uses."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), "pt") as handle:
        tensors, metadata = {key: handle.get_tensor(key) for key in handle.keys()}, handle.metadata()
    tensors["decoder.conv_out.bias"] = tensors["decoder.conv_out.bias"] + 0.25
    fresh = path.with_name(path.name + ".part")
    save_file(tensors, str(fresh), metadata=metadata)
    os.replace(fresh, path)


def test_a_model_loaded_again_runs_with_the_new_file(sources):
    pipe = LocalPipe.load(sources, LoadOptions(device="cpu"))
    first = pipe.generate(REQUEST, NullHost()).images
    other_decoder(sources.vae)
    refused_run(pipe)
    again = LocalPipe.load(sources, LoadOptions(device="cpu")).generate(REQUEST, NullHost()).images
    assert again.shape == first.shape and not torch.equal(again, first)


def test_a_config_changed_under_a_pipe_of_a_diffusers_folder_is_named(tmp_path, tiny_turbo_folder):
    model = Path(shutil.copytree(tiny_turbo_folder, tmp_path / "model"))
    pipe = LocalPipe.load(ModelSources(model_dir=model), LoadOptions(device="cpu"))
    pipe.generate(REQUEST, NullHost())
    config = model / "transformer" / "config.json"
    what = rewritten(config)
    assert refused_run(pipe) == changed_line(config, what)


class ReplacingVae(NullHost):
    """Replaces the VAE file while the DiT samples: between the run's first check and the VAE phase."""

    def __init__(self, vae: Path) -> None:
        super().__init__()
        self.vae = vae
        self.change = ""

    def progress(self, value: int, total: int, preview=None) -> None:
        super().progress(value, total, preview)
        if not self.change:
            self.change = replaced(self.vae)


def test_a_file_changed_during_a_run_is_refused_before_the_phase_that_reads_it(sources, monkeypatch):
    from ernie_image.runtime.local import pipe as pipe_module

    pipe = LocalPipe.load(sources, LoadOptions(device="cpu", keep_loaded=True))
    pipe.generate(REQUEST, NullHost())
    decodes: list[int] = []
    decode = pipe_module.decode_images
    monkeypatch.setattr(pipe_module, "decode_images",
                        lambda *args, **kwargs: decodes.append(1) or decode(*args, **kwargs))
    host = ReplacingVae(sources.vae)  # replaces the VAE file while the DiT samples
    assert refused_run(pipe, host) == changed_line(sources.vae, host.change)
    assert host.progress_calls and not pipe.is_loaded() and decodes == []  # the decode never ran


def test_each_surface_says_its_own_way_to_load_the_model_again(sources):
    from ernie_image.nodes.comfy_names import in_comfy_words

    pipe = LocalPipe.load(sources, LoadOptions(device="cpu"))
    what = replaced(sources.dit)
    with pytest.raises(ModelFileError) as refused:
        pipe.generate(REQUEST, NullHost())
    assert cli_message(refused.value) == (f"{sources.dit} changed on disk since the model was loaded ({what}): load "
                                          "the model again (run the command again)")
    with pytest.raises(ModelFileError) as refused, in_comfy_words():
        pipe.generate(REQUEST, NullHost())
    assert str(refused.value) == (f"{sources.dit} changed on disk since the model was loaded ({what}): load the model "
                                  "again (queue the prompt again: the Loader reloads changed files)")


def test_a_prompt_enhancer_file_changed_under_the_pipe_is_refused_by_the_enhancer_node_in_its_words(
        tmp_path, tiny_turbo_with_pe):
    from ernie_image.nodes.enhancer import ErnieImagePromptEnhancer

    model = Path(shutil.copytree(tiny_turbo_with_pe, tmp_path / "model"))
    pipe = LocalPipe.load(ModelSources(model_dir=model), LoadOptions(device="cpu", keep_loaded=True))
    inputs = dict(prompt="a lighthouse", resolution="custom", width=256, height=256, seed=21, temperature=0.6,
                  top_p=0.95, max_new_tokens=4, pipe=pipe)
    ErnieImagePromptEnhancer().enhance(**inputs)
    weights = next((model / "pe").glob("*.safetensors"))
    what = replaced(weights)
    with pytest.raises(ModelFileError) as refused:
        ErnieImagePromptEnhancer().enhance(**inputs)
    assert str(refused.value) == (f"{weights} changed on disk since the model was loaded ({what}): load the model "
                                  "again (queue the prompt again: the Loader reloads changed files)")
    assert not pipe.is_loaded()


def test_a_file_cut_under_weights_the_pipe_maps_is_refused_not_a_crash(sources):
    script = textwrap.dedent(f"""
        import importlib.util, os, sys
        spec = importlib.util.spec_from_file_location("ernie_image", {str(REPO_ROOT / "__init__.py")!r},
                                                      submodule_search_locations=[{str(REPO_ROOT)!r}])
        sys.modules["ernie_image"] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        import torch
        from ernie_image.runtime.core.errors import ModelFileError
        from ernie_image.runtime.core.host import NullHost
        from ernie_image.runtime.core.request import GenerationRequest
        from ernie_image.runtime.formats.sources import ModelSources
        from ernie_image.runtime.local.options import LoadOptions
        from ernie_image.runtime.local.pipe import LocalPipe
        torch.set_num_threads(1)
        dit = {str(sources.dit)!r}
        request = GenerationRequest(prompt="a red fox", width=256, height=256, steps=1, seed=5)
        pipe = LocalPipe.load(ModelSources(dit=dit, text_encoder={str(sources.text_encoder)!r},
                                           vae={str(sources.vae)!r}), LoadOptions(device="cpu", keep_loaded=True))
        pipe.generate(request, NullHost())
        os.truncate(dit, os.path.getsize(dit) // 2)
        try:
            pipe.generate(request, NullHost())
        except ModelFileError as error:
            print(error)
    """)
    size = sources.dit.stat().st_size
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert done.stdout.strip() == changed_line(sources.dit, f"size {size} -> {size // 2} bytes")


# ------------------------------------------------------------------------------------------- the Loader in ComfyUI
@pytest.fixture
def comfy_models(tmp_path, built, monkeypatch) -> Path:
    """ComfyUI's model folders holding the tiny model's single files, and a diffusers folder of it."""
    from comfy_folders import fake_folder_paths

    models = tmp_path / "models"
    for folder, path in (("diffusion_models", built.dit), ("text_encoders", built.text_encoder), ("vae", built.vae)):
        (models / folder).mkdir(parents=True)
        shutil.copy(path, models / folder)
    monkeypatch.setitem(sys.modules, "folder_paths", fake_folder_paths(models))
    return models


def loader_inputs(built: ModelSources, **changes) -> dict:
    """The Loader's widget values, as ComfyUI hands them to IS_CHANGED (a linked quant_config is not among them)."""
    return {"diffusers_folder": "(none)", "diffusion_model": built.dit.name, "text_encoder": built.text_encoder.name,
            "vae": built.vae.name, "prompt_enhancer": "(none)", "variant": "auto", "vram_budget_gb": 0.0,
            "keep_loaded": True, **changes}


@pytest.mark.parametrize("folder", ["diffusion_models", "text_encoders", "vae"])
@pytest.mark.parametrize("change", CHANGES, ids=[change.__name__ for change in CHANGES])
def test_the_loaders_fingerprint_changes_with_any_file_it_reads_so_a_requeued_prompt_reloads(
        comfy_models, built, folder, change):
    from ernie_image.nodes.loader import ErnieImageLoader

    inputs = loader_inputs(built)
    before = ErnieImageLoader.IS_CHANGED(**inputs)
    assert ErnieImageLoader.IS_CHANGED(**inputs) == before  # the same files: ComfyUI keeps the cached pipe
    change(next((comfy_models / folder).iterdir()))
    assert ErnieImageLoader.IS_CHANGED(**inputs) != before


def test_the_loaders_fingerprint_follows_every_file_of_a_diffusers_folder(comfy_models, built, tiny_turbo_folder):
    from ernie_image.nodes.loader import ErnieImageLoader

    folder = Path(shutil.copytree(tiny_turbo_folder, comfy_models / "diffusers" / "ERNIE-Image-Turbo"))
    inputs = loader_inputs(built, diffusers_folder=folder.name, diffusion_model="(none)", text_encoder="(none)",
                           vae="(none)")
    before = ErnieImageLoader.IS_CHANGED(**inputs)
    rewritten(folder / "transformer" / "config.json")
    assert ErnieImageLoader.IS_CHANGED(**inputs) != before


def test_the_loaders_fingerprint_of_a_missing_file_leaves_the_refusal_to_the_load(comfy_models, built):
    from ernie_image.nodes.loader import ErnieImageLoader

    inputs = loader_inputs(built, vae="gone.safetensors")
    assert ErnieImageLoader.IS_CHANGED(**inputs) == ErnieImageLoader.IS_CHANGED(**inputs)
    with pytest.raises(ModelFileError, match="VAE file 'gone.safetensors' was not found"):
        ErnieImageLoader().load(**inputs)


def test_a_loader_run_again_after_a_change_says_what_the_new_file_is(comfy_models, built, tmp_path):
    """The Loader's text is the new file's: a Turbo DiT replaced by the base one reads Base when the prompt runs
    again (ComfyUI runs the Loader again because its fingerprint changed)."""
    from ernie_image.nodes.loader import ErnieImageLoader

    inputs = loader_inputs(built)
    before = ErnieImageLoader.IS_CHANGED(**inputs)
    assert ErnieImageLoader().load(**inputs)["ui"]["text"][0].startswith("ERNIE-Image Turbo, from the file's metadata")
    base = build_tiny_model(tmp_path / "base", layout="comfy", variant="base")
    os.replace(shutil.copy(base.dit, tmp_path / "new.safetensors"), comfy_models / "diffusion_models" / built.dit.name)
    assert ErnieImageLoader.IS_CHANGED(**inputs) != before
    assert ErnieImageLoader().load(**inputs)["ui"]["text"][0].startswith("ERNIE-Image Base, from the file's metadata")
