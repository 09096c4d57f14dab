"""A model folder's scheduler/scheduler_config.json (runtime/formats/scheduler_config.py): the pack samples as the
released scheduler does, with the request's shift; where the folder's config says otherwise, or cannot be read, the
job says so in a notice (diffusers would sample as the folder says) and still runs."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from conftest import LoggingHost

from ernie_image.runtime.core.request import GenerationRequest
from ernie_image.runtime.formats.scheduler_config import LABEL, scheduler_notices
from ernie_image.runtime.formats.sources import ModelSources
from ernie_image.runtime.local.options import LoadOptions
from ernie_image.runtime.local.pipe import LocalPipe

pytestmark = pytest.mark.usefixtures("one_thread")


def folder_with(tmp_path: Path, text: str | None) -> Path:
    (tmp_path / "scheduler").mkdir(parents=True)
    if text is not None:
        (tmp_path / "scheduler" / "scheduler_config.json").write_text(text)
    return tmp_path


RELEASED = json.loads((Path(__file__).resolve().parent.parent / "runtime" / "formats" / "configs" / "ERNIE-Image"
                       / "scheduler" / "config.json").read_text())


@pytest.mark.parametrize("case", ["no folder given", "no scheduler folder", "no config file", "the released config",
                                  "a config without shift"])
def test_nothing_is_said_where_the_folder_agrees_or_says_nothing(tmp_path, case):
    model_dir = {"no folder given": lambda: None, "no scheduler folder": lambda: tmp_path,
                 "no config file": lambda: folder_with(tmp_path, None),
                 "the released config": lambda: folder_with(tmp_path, json.dumps(RELEASED)),
                 "a config without shift": lambda: folder_with(tmp_path, json.dumps({"num_train_timesteps": 1000})),
                 }[case]()
    assert scheduler_notices(model_dir, 4.0) == []


@pytest.mark.parametrize("config, shift, said", [
    ({"shift": 1.0}, 4.0, f"give shift 1 to sample as {LABEL} says (this run uses 4)"),
    ({"shift": 4.0}, 3.0, f"give shift 4 to sample as {LABEL} says (this run uses 3)"),
    ({"shift": "4"}, 4.0, f"this run uses shift 4: {LABEL} gives '4' for it, not a positive number"),
    ({"shift": -1}, 4.0, f"this run uses shift 4: {LABEL} gives -1 for it, not a positive number"),
])
def test_another_shift_is_named_with_the_setting_that_follows_it(tmp_path, config, shift, said):
    notices = scheduler_notices(folder_with(tmp_path, json.dumps({**RELEASED, **config})), shift)
    assert notices == [said] and notices[0].settings == ("shift",)


@pytest.mark.parametrize("key, value", [("use_dynamic_shifting", True), ("use_karras_sigmas", True),
                                        ("use_beta_sigmas", True), ("invert_sigmas", True), ("shift_terminal", 0.1),
                                        ("stochastic_sampling", True), ("num_train_timesteps", 500)])
def test_a_sampler_option_the_pack_does_not_run_is_named(tmp_path, key, value):
    notices = scheduler_notices(folder_with(tmp_path, json.dumps({**RELEASED, key: value})), 4.0)
    assert notices == [f"{LABEL} sets {key} {value!r}; this pack samples as ERNIE-Image's released scheduler (a static "
                       "shift, Euler steps), without them"]


@pytest.mark.parametrize("text", ["", '{"shift": 4.0, "base_sh', "[1, 2]", "\xff\xfe"])
def test_a_config_that_cannot_be_read_is_a_notice_not_a_failure(tmp_path, text):
    notices = scheduler_notices(folder_with(tmp_path, text), 4.0)
    assert notices == [f"{LABEL} cannot be read (not a readable JSON object); this pack samples as ERNIE-Image's "
                       "released scheduler (a static shift, Euler steps), shift 4"]
    assert str(tmp_path) not in notices[0]


def _scheduler_folder_linked_to_nothing(path: Path) -> None:
    path.parent.rmdir()
    path.parent.symlink_to(path.parent.parent / "gone")


@pytest.mark.parametrize("kind, why", [("a folder", "not a file"), ("a FIFO", "not a file"),
                                       ("a link to nothing", "a link to nothing"),
                                       ("a folder linked to nothing", "its scheduler/ folder is a link to nothing"),
                                       ("a key twice", "it holds a key twice, so which value is meant is not known")])
def test_something_other_than_a_file_is_said_and_never_read(tmp_path, kind, why):
    """A FIFO is never opened: a read would wait for a writer for ever."""
    folder = folder_with(tmp_path, None)
    path = folder / "scheduler" / "scheduler_config.json"
    {"a folder": path.mkdir, "a FIFO": lambda: os.mkfifo(path),
     "a link to nothing": lambda: path.symlink_to(tmp_path / "gone"),
     "a folder linked to nothing": lambda: _scheduler_folder_linked_to_nothing(path),
     "a key twice": lambda: path.write_text('{"shift": 4.0, "shift": 1.0}')}[kind]()
    assert scheduler_notices(folder, 4.0) == [f"{LABEL} cannot be read ({why}); this pack samples as ERNIE-Image's "
                                              "released scheduler (a static shift, Euler steps), shift 4"]


def test_a_folder_that_cannot_be_listed_is_a_notice_too(tmp_path, monkeypatch):
    folder = folder_with(tmp_path, json.dumps(RELEASED))

    def denied(self):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "stat", denied)
    assert scheduler_notices(folder, 4.0)[0].startswith(f"{LABEL} cannot be read (Permission denied)")


def test_a_pipe_says_it_once_and_runs(tiny_turbo_folder, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(tiny_turbo_folder, folder)
    (folder / "scheduler" / "scheduler_config.json").write_text(json.dumps({**RELEASED, "shift": 1.0}))
    pipe = LocalPipe.load(ModelSources(model_dir=folder), LoadOptions(device="cpu"))
    host = LoggingHost()
    for _ in range(2):
        result = pipe.generate(GenerationRequest(prompt="a fox", width=256, height=256, steps=1), host)
        assert result.images.shape[0] == 1
    said = f"give shift 1 to sample as {LABEL} says (this run uses 4)"
    assert host.messages.count(said) == 1


@pytest.mark.parametrize("said, notice", [
    (1.0, f"give --shift 1 to sample as {LABEL} says (this run uses 4)"),
    ("nan", f"this run uses --shift 4: {LABEL} gives 'nan' for it, not a positive number")])
def test_the_cli_names_its_flag_where_the_notice_names_the_runs_shift_not_the_files_field(capsys, tiny_turbo_folder,
                                                                                          tmp_path, said, notice):
    from ernie_image.runtime.cli.commands import main

    folder = Path(shutil.copytree(tiny_turbo_folder, tmp_path / "model"))
    (folder / "scheduler" / "scheduler_config.json").write_text(json.dumps({**RELEASED, "shift": said}))
    assert main(["generate", "--model-dir", str(folder), "--width", "256", "--height", "256", "--steps", "1",
                 "--out", str(tmp_path / "x.png")]) == 0
    assert notice in capsys.readouterr().err.splitlines()
