"""Make the repository importable as the package `ernie_image`, whatever the checkout folder is called."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def _register_package() -> None:
    if "ernie_image" in sys.modules:
        return
    spec = importlib.util.spec_from_file_location(
        "ernie_image", REPO_ROOT / "__init__.py", submodule_search_locations=[str(REPO_ROOT)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["ernie_image"] = module
    spec.loader.exec_module(module)


_register_package()


import pytest  # noqa: E402
import torch  # noqa: E402

from ernie_image.runtime.core.errors import Cancelled  # noqa: E402
from ernie_image.runtime.core.host import NullHost  # noqa: E402


class LoggingHost(NullHost):
    """A host that keeps every console line the pipe logs, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def log(self, message: str) -> None:
        self.messages.append(message)


class CancelAfter(NullHost):
    """A host whose check_cancel lets `checks` calls pass and raises Cancelled at the next; `calls` counts them."""

    def __init__(self, checks: int) -> None:
        super().__init__()
        self.checks = checks
        self.calls = 0
        self.calls_at_last_step = 0  # `calls` when the last step's progress came (the VAE's checks follow)

    def check_cancel(self) -> None:
        self.calls += 1
        if self.calls > self.checks:
            raise Cancelled("cancelled by the test")

    def progress(self, value: int, total: int, preview=None) -> None:
        super().progress(value, total, preview)
        self.calls_at_last_step = self.calls


@pytest.fixture
def cancel_after() -> type[CancelAfter]:
    """`cancel_after(n)`: a CancelAfter host (a fixture, as test modules do not import conftest)."""
    return CancelAfter


@pytest.fixture(autouse=True)
def no_model_list_from_another_test():
    """The remote PE's listed-model cache is per process, by URL; a loopback port an earlier test's server used
    must not hand a later test that server's model."""
    from ernie_image.runtime.text.remote_enhancer import _listed_models

    _listed_models.clear()
    yield
    _listed_models.clear()


@pytest.fixture(autouse=True)
def keys_file_of_this_test(tmp_path_factory, monkeypatch) -> Path:
    """No test reads the keys file of whoever runs the suite: each gets an empty config home of its own, and
    `keys_file(...)` (below) writes the keys file there."""
    home = tmp_path_factory.mktemp("config-home")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(home))
    monkeypatch.delenv("ERNIE_IMAGE_KEYS_FILE", raising=False)
    return home / "ernie-image" / "keys.json"


@pytest.fixture
def keys_file(keys_file_of_this_test: Path):
    """`keys_file({"label": ..., "origin": ..., "env"|"file"|"key": ...}, ...)` writes the user's keys file (mode
    0600) where the pack looks for it, and returns its path."""
    import json
    import os

    def write(*entries: dict) -> Path:
        keys_file_of_this_test.parent.mkdir(parents=True, exist_ok=True)
        keys_file_of_this_test.write_text(json.dumps({"credentials": list(entries)}))
        os.chmod(keys_file_of_this_test, 0o600)
        return keys_file_of_this_test

    return write


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread: tiny models only lose to threading overhead on a 2-core runner."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_turbo_folder(tmp_path_factory) -> Path:
    """A tiny Turbo model as a diffusers folder, shared read-only by the tests that only run it."""
    from ernie_image.runtime.demo.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-turbo"), layout="diffusers", variant="turbo").model_dir


@pytest.fixture(scope="session")
def tiny_turbo_with_pe(tmp_path_factory) -> Path:
    """A tiny Turbo diffusers folder with a prompt enhancer in Baidu's layout (pe/, pe_tokenizer/)."""
    from ernie_image.runtime.demo.tiny import build_tiny_model
    from ernie_image.runtime.demo.tiny_pe import build_tiny_pe_folder

    folder = tmp_path_factory.mktemp("tiny-with-pe")
    build_tiny_model(folder, layout="diffusers", variant="turbo")
    return build_tiny_pe_folder(folder, seed=6)


@pytest.fixture
def no_comfy_modules_left_behind():
    """The Sampler node probes for ComfyUI's own modules (comfy.*); where a folder named `comfy` happens to be on
    sys.path that probe imports part of it. Drop what the test imported, so later tests see no ComfyUI."""
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        if name.split(".")[0] in ("comfy", "comfy_execution"):
            del sys.modules[name]


@pytest.fixture
def dit_steps(monkeypatch) -> list[int]:
    """Every DiT forward the run makes, counted (there must be none before a refusal)."""
    from ernie_image.runtime.model.dit import ErnieDiT

    steps: list[int] = []
    forward = ErnieDiT.forward

    def counted(self, *args, **kwargs):
        steps.append(1)
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(ErnieDiT, "forward", counted)
    return steps
