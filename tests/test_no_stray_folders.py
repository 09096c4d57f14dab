"""A run that compiles nothing leaves nothing in the temporary folder.

torch makes inductor's cache folder (`$TMPDIR/torchinductor_<user>`) when torch._dynamo is first imported, which
diffusers' and transformers' model classes do; the pack imports it first and takes back what that import alone made
(runtime/model/dynamo_import.py). Asking where the cache folder is makes nothing either (model/compile_marks.py).
"""
from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

CHECKOUT = Path(__file__).resolve().parent.parent


def _python(tmp_path: Path, temporary: Path, *argv: str, code: str = "") -> subprocess.CompletedProcess:
    """`python -m ernie_image ARGV` (or `python -c CODE`) with this checkout as the package, TMPDIR `temporary` and
    no inductor cache folder named by the environment (the test process may hold one torch set)."""
    site = tmp_path / "site"
    if not site.exists():
        site.mkdir()
        (site / "ernie_image").symlink_to(CHECKOUT, target_is_directory=True)
    env = {**os.environ, "PYTHONPATH": str(site), "TMPDIR": str(temporary),
           "ERNIE_IMAGE_CACHE": str(tmp_path / "cache")}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    command = [sys.executable, "-c", code] if code else [sys.executable, "-m", "ernie_image", *argv]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)


def _printed(tmp_path: Path, temporary: Path, lines: list[str]) -> list[str]:
    """What a fresh Python prints running `lines` (as _python runs it), split into words; it must exit 0."""
    done = _python(tmp_path, temporary, code="".join(f"{line}\n" for line in lines))
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


@pytest.fixture
def temporary(tmp_path) -> Path:
    folder = tmp_path / "temporary"
    folder.mkdir()
    return folder


class TestEagerCpuRuns:
    """Each way a CPU run reaches model code, compile off (the CPU never compiles): exit 0, an empty TMPDIR."""

    CASES = {
        "the demo model, built by the run": lambda out, models: ["generate", "--steps", "1", "--out", str(out)],
        "a model folder with its prompt enhancer": lambda out, models: [
            "generate", "--model-dir", str(models["with_pe"]), "--use-pe", "--device", "cpu", "--steps", "1",
            "--width", "256", "--height", "256", "--out", str(out)],
        "the prompt enhancer alone": lambda out, models: [
            "enhance", "--model-dir", str(models["with_pe"]), "--device", "cpu", "--prompt", "a fox",
            "--max-new-tokens", "4", "--quiet"],
    }

    @pytest.mark.parametrize("case", CASES)
    def test_leaves_the_temporary_folder_empty(self, tmp_path, temporary, tiny_turbo_with_pe, case):
        argv = self.CASES[case](tmp_path / "out.png", {"with_pe": tiny_turbo_with_pe})
        done = _python(tmp_path, temporary, *argv)
        assert done.returncode == 0, done.stderr
        assert sorted(path.name for path in temporary.iterdir()) == []


def test_asking_where_the_cache_folder_is_makes_nothing_and_agrees_with_torch(tmp_path, temporary):
    assert _printed(tmp_path, temporary, [
        "import sys",
        "from ernie_image.runtime.model.compile_marks import inductor_cache_folder",
        "folder = inductor_cache_folder()",
        "print(folder.exists(), 'torch._dynamo' in sys.modules)",
        "from torch._inductor.runtime.cache_dir_utils import default_cache_dir",
        "print(str(folder) == default_cache_dir())",
    ]) == ["False", "False", "True"]


@pytest.mark.parametrize("before", ["absent", "empty", "holding a file"])
def test_import_dynamo_takes_back_only_what_its_import_made(tmp_path, temporary, before):
    """A cache folder that was there before (empty or not) stays; one the import made is removed, and the variable
    torch set with it is unset again."""
    code = (
        "import os, sys\n"
        "from ernie_image.runtime.model.compile_marks import inductor_cache_folder\n"
        "from ernie_image.runtime.model.dynamo_import import import_dynamo\n"
        "folder = inductor_cache_folder()\n"
        f"if {before!r} != 'absent':\n"
        "    folder.mkdir()\n"
        f"if {before!r} == 'holding a file':\n"
        "    (folder / 'kernel.py').write_text('')\n"
        "import_dynamo()\n"
        "print('torch._dynamo' in sys.modules, folder.exists(), 'TORCHINDUCTOR_CACHE_DIR' in os.environ)\n"
    )
    done = _python(tmp_path, temporary, code=code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", str(before != "absent"), "False"]


# ------------------------------------------------------------------------------------------- one place of import
LIBRARIES_MODULE = CHECKOUT / "runtime" / "model" / "libraries.py"
MODEL_MODULES = re.compile(r"^(diffusers\.(models|pipelines)|transformers\.models)(\.|$)")  # they import torch._dynamo


def _imports_of_model_classes(path: Path) -> list[str]:
    """`module: name` for each model class (runtime/model/libraries.py lists them) or model module that the file
    imports from diffusers or transformers itself."""
    from ernie_image.runtime.model.libraries import LIBRARY_OF

    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            library = node.module.split(".")[0]
            if library not in ("diffusers", "transformers"):
                continue
            for alias in node.names:
                if alias.name in LIBRARY_OF or MODEL_MODULES.search(f"{node.module}.{alias.name}"):
                    found.append(f"{node.module}: {alias.name}")
        elif isinstance(node, ast.Import):
            found += [alias.name for alias in node.names if MODEL_MODULES.search(alias.name)]
    return found


def test_only_the_libraries_module_imports_the_model_classes():
    """Each model class comes through runtime/model/libraries.py, which imports torch._dynamo first: a module that
    imported one from diffusers or transformers itself would leave the cache folder behind again."""
    elsewhere = {str(path.relative_to(CHECKOUT)): found for path in sorted((CHECKOUT / "runtime").rglob("*.py"))
                 if path != LIBRARIES_MODULE and (found := _imports_of_model_classes(path))}
    assert elsewhere == {}


@pytest.mark.parametrize("source, caught", [
    ("from diffusers import AutoencoderKLFlux2", ["diffusers: AutoencoderKLFlux2"]),
    ("def build():\n    from transformers import MistralModel as Model", ["transformers: MistralModel"]),
    ("from transformers.models.ministral3 import modeling_ministral3",
     ["transformers.models.ministral3: modeling_ministral3"]),
    ("import transformers.models.mistral.modeling_mistral", ["transformers.models.mistral.modeling_mistral"]),
    ("from diffusers.models.autoencoders import AutoencoderKL", ["diffusers.models.autoencoders: AutoencoderKL"]),
    ("from transformers import AutoTokenizer, DynamicCache", []),
    ("from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS", []),
    ("from ..model.libraries import MistralModel", []),
], ids=["diffusers class", "inside a function, renamed", "a model module", "a model module imported whole",
        "a class from diffusers.models", "tokenizers and caches", "a helper module", "through libraries.py"])
def test_the_structural_check_catches_each_form_of_import(tmp_path, source, caught):
    module = tmp_path / "module.py"
    module.write_text(source + "\n")
    assert _imports_of_model_classes(module) == caught


def test_the_libraries_module_imports_dynamo_before_a_model_class(tmp_path, temporary):
    assert _printed(tmp_path, temporary, [
        "import sys",
        "from ernie_image.runtime.model import libraries",
        "print('torch._dynamo' in sys.modules, 'diffusers' in sys.modules)",
        "from ernie_image.runtime.model.libraries import AutoencoderKLFlux2",
        "print('torch._dynamo' in sys.modules, AutoencoderKLFlux2.__module__.split('.')[0])",
    ]) == ["False", "False", "True", "diffusers"]
    assert sorted(path.name for path in temporary.iterdir()) == []
