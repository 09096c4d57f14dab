"""The models local pipes built, held weakly in runtime/core (core/built_models.py): every part a pipe builds is
counted while it lives and no longer once it is gone, from any thread; and the ComfyUI pack's memory route reads the
count without importing model code where no model was built."""
from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
from pathlib import Path

from ernie_image.runtime.core.built_models import built_models_alive, register_built_model
from ernie_image.runtime.core.host import NullHost
from ernie_image.runtime.core.request import GenerationRequest
from ernie_image.runtime.formats.sources import ModelSources
from ernie_image.runtime.local.options import LoadOptions
from ernie_image.runtime.local.pipe import LocalPipe

REPO_ROOT = Path(__file__).resolve().parent.parent


class Model:
    """Anything registered: the registry holds it weakly and knows nothing of torch."""


def counted(models: list[object]) -> int:
    alive = {id(model) for model in built_models_alive()}
    return sum(id(model) in alive for model in models)


def test_a_registered_model_is_counted_while_it_lives_and_not_after():
    models = [register_built_model(Model()) for _ in range(3)]
    assert counted(models) == 3
    gone = models.pop(1)
    ident = id(gone)
    del gone  # freed by its reference count: no collection needed
    assert ident not in {id(model) for model in built_models_alive()} and counted(models) == 2


def test_models_registered_on_several_threads_while_others_read_are_all_counted():
    """Prompts build models on their threads while a route reads the registry on another: no reader fails (a bare
    WeakSet raises "Set changed size during iteration") and every model registered is counted."""
    kept: list[list[Model]] = [[] for _ in range(4)]
    failures: list[BaseException] = []
    building = threading.Event()

    def build(into: list[Model]) -> None:
        building.wait()
        for _ in range(2000):
            into.append(register_built_model(Model()))

    def read() -> None:
        building.wait()
        try:
            for _ in range(300):
                built_models_alive()
        except BaseException as error:  # noqa: BLE001 - the failure is what the test reports
            failures.append(error)

    threads = [threading.Thread(target=build, args=(into,)) for into in kept]
    threads += [threading.Thread(target=read) for _ in range(2)]
    for thread in threads:
        thread.start()
    building.set()
    for thread in threads:
        thread.join(60)
    assert not any(thread.is_alive() for thread in threads), "a thread did not finish"
    assert failures == []
    assert counted([model for into in kept for model in into]) == 4 * 2000


def test_every_part_a_local_pipe_builds_is_counted_until_the_pipe_is_gone(tiny_turbo_folder):
    """Gone with the pipe's last reference, not at some later collection: a part kept in a reference cycle would
    hold its memory until the garbage collector ran."""
    pipe = LocalPipe.load(ModelSources(model_dir=tiny_turbo_folder), LoadOptions(device="cpu", keep_loaded=True))
    pipe.generate(GenerationRequest(prompt="a fox", width=256, height=256, steps=1), NullHost())
    parts = [pipe.parts.text_tower, pipe.parts.dit, pipe.parts.vae]
    assert all(part is not None for part in parts) and counted(parts) == 3
    idents = {id(part) for part in parts}
    gc.collect()  # whatever earlier tests left in cycles
    gc.disable()
    try:
        del pipe, parts
        assert not idents & {id(model) for model in built_models_alive()}
    finally:
        gc.enable()


def test_the_memory_routes_summary_imports_no_model_code_where_no_model_was_built(tmp_path):
    (tmp_path / "ernie_image").symlink_to(REPO_ROOT, target_is_directory=True)
    code = ("import sys; from ernie_image.nodes import live_pipes; report = live_pipes.summary(holders=True); "
            "loaded = [m for m in sys.modules if m.startswith(('ernie_image.runtime.model', "
            "'ernie_image.runtime.offload', 'ernie_image.runtime.local.parts', 'ernie_image.runtime.local.pipe'))]; "
            "print(report['orphaned_models'], report['orphaned_weights_held_by'], loaded)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(tmp_path)}, cwd=tmp_path)
    assert done.stdout.strip() == "0 [] []", done.stderr
