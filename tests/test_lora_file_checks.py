"""What a LoRA file alone shows to be wrong is refused in one line naming the file, the cause and the fix, with
the other content checks: by the CLI before the demo model's notice, by the Python API before any model file is
opened. That is: a lora_alpha in diffusers' `lora_adapter_metadata` that is not a finite number, metadata that is
not valid JSON, an `.alpha` that is not one number, weights that are not floating point (complex included) or are
empty (rank 0), lora_A and lora_B (or
down and up) of different ranks, a lora_A without its lora_B, DoRA, and a pickle renamed `.safetensors`. A
negative alpha (a sign flip some tools write) is accepted."""
from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import lora_files as lf
from ernie_image.runtime.cli.commands import main as cli_main
from ernie_image.runtime.core.errors import ModelFileError
from ernie_image.runtime.core.host import NullHost
from ernie_image.runtime.core.request import GenerationRequest
from ernie_image.runtime.demo import cached_model as demo_module
from ernie_image.runtime.formats.sources import ModelSources
from ernie_image.runtime.local.options import LoadOptions
from ernie_image.runtime.local.pipe import LocalPipe
from ernie_image.runtime.lora.parsed import check_lora_file

pytestmark = pytest.mark.usefixtures("one_thread")

LAYER = "diffusion_model.layers.0.mlp.linear_fc2"  # [64, 128] in the tiny DiT


class _Marker:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


def _with_metadata(path: Path, shapes: dict, lora_adapter_metadata: str) -> Path:
    state = lf.peft_keys(lf.random_lora(shapes, 2, seed=7), "transformer.")
    save_file(state, str(path), metadata={"lora_adapter_metadata": lora_adapter_metadata})
    return path


def _layer(path: Path, **parts: torch.Tensor) -> Path:
    save_file({f"{LAYER}.{part.replace('__', '.')}": tensor for part, tensor in parts.items()}, str(path))
    return path


@pytest.fixture(scope="module")
def files(tiny_turbo_folder, tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("file-checks")
    shapes = lf.linear_shapes(lf.dit_weights(tiny_turbo_folder))
    down, up = torch.zeros(2, 128), torch.zeros(64, 2)
    pickle_path = folder / "renamed.safetensors"
    pickle_path.write_bytes(pickle.dumps({"lora": _Marker(str(folder / "unpickled"))}, protocol=4))
    return {
        "alpha-nan-string": _with_metadata(folder / "alpha-nan-string.safetensors", shapes, '{"lora_alpha": "nan"}'),
        "alpha-nan": _with_metadata(folder / "alpha-nan.safetensors", shapes, '{"lora_alpha": NaN, "r": 2}'),
        "alpha-inf": _with_metadata(folder / "alpha-inf.safetensors", shapes, '{"lora_alpha": Infinity}'),
        "alpha-word": _with_metadata(folder / "alpha-word.safetensors", shapes, '{"lora_alpha": "loud"}'),
        "alpha-pattern-nan": _with_metadata(folder / "alpha-pattern-nan.safetensors", shapes,
                                            '{"lora_alpha": 2, "alpha_pattern": {"to_q": NaN}}'),
        "bad-json": _with_metadata(folder / "bad-json.safetensors", shapes, '{"lora_alpha": 8,'),
        "alpha-twice": _with_metadata(folder / "alpha-twice.safetensors", shapes,
                                      '{"r": 4, "lora_alpha": 16, "lora_alpha": 4}'),
        "alpha-two": _layer(folder / "alpha-two.safetensors", lora_down__weight=down, lora_up__weight=up,
                            alpha=torch.tensor([2.0, 2.0])),
        "int32": _layer(folder / "int32.safetensors", lora_A__weight=down.to(torch.int32),
                        lora_B__weight=up.to(torch.int32)),
        "rank": _layer(folder / "rank.safetensors", lora_A__weight=torch.zeros(4, 128), lora_B__weight=torch.zeros(64, 3)),
        "rank-down-up": _layer(folder / "rank-down-up.safetensors", lora_down__weight=torch.zeros(4, 128),
                               lora_up__weight=torch.zeros(64, 3)),
        "rank-zero": _layer(folder / "rank-zero.safetensors", lora_A__weight=torch.zeros(0, 128),
                            lora_B__weight=torch.zeros(64, 0)),
        "loha-rank-zero": _layer(folder / "loha-rank-zero.safetensors", hada_w1_a=torch.zeros(64, 0),
                                 hada_w1_b=torch.zeros(0, 128), hada_w2_a=torch.zeros(64, 2),
                                 hada_w2_b=torch.zeros(2, 128), alpha=torch.tensor(1.0)),
        "complex": _layer(folder / "complex.safetensors", lora_A__weight=down.to(torch.complex64),
                          lora_B__weight=up.to(torch.complex64)),
        "incomplete": _layer(folder / "incomplete.safetensors", lora_A__weight=down),
        "dora": _layer(folder / "dora.safetensors", lora_A__weight=down, lora_B__weight=up,
                       lora_magnitude_vector=torch.ones(64)),
        "dora-weight": _layer(folder / "dora-weight.safetensors", lora_A__weight=down, lora_B__weight=up,
                              lora_magnitude_vector__weight=torch.ones(64)),
        "dora-scale": _layer(folder / "dora-scale.safetensors", lora_down__weight=down, lora_up__weight=up,
                             dora_scale=torch.ones(1, 128)),
        "pickle": pickle_path,
        "negative-metadata": _with_metadata(folder / "negative-metadata.safetensors", shapes,
                                            json.dumps({"lora_alpha": -2, "r": 2})),
        "negative-alpha": _layer(folder / "negative-alpha.safetensors", lora_down__weight=down, lora_up__weight=up,
                                 alpha=torch.tensor(-2.0)),
        "int-alpha": _layer(folder / "int-alpha.safetensors", lora_down__weight=down, lora_up__weight=up,
                            alpha=torch.tensor(2)),
    }


REFUSALS = [
    ("alpha-nan-string", "LoRA alpha-nan-string.safetensors: lora_alpha 'nan' in its metadata key "
                         "lora_adapter_metadata is not a finite number: the file is damaged; export the LoRA again"),
    ("alpha-nan", "lora_alpha nan in its metadata key lora_adapter_metadata is not a finite number"),
    ("alpha-inf", "lora_alpha inf in its metadata key lora_adapter_metadata is not a finite number"),
    ("alpha-word", "lora_alpha 'loud' in its metadata key lora_adapter_metadata is not a finite number"),
    ("alpha-pattern-nan", "alpha_pattern['to_q'] nan in its metadata key lora_adapter_metadata is not a finite"),
    ("bad-json", "LoRA bad-json.safetensors: its metadata key lora_adapter_metadata is not valid JSON"),
    ("alpha-twice", "LoRA alpha-twice.safetensors: its metadata key lora_adapter_metadata holds the key 'lora_alpha' "
                    "twice in one object, so which value is meant is not known: the file is damaged; export the LoRA "
                    "again"),
    ("alpha-two", f"LoRA alpha-two.safetensors: layers.0.mlp.linear_fc2.alpha is a torch.float32 tensor of shape "
                  f"(2,), not one number: the file is damaged; export it again"),
    ("int32", "LoRA int32.safetensors: layers.0.mlp.linear_fc2.lora_A.weight holds torch.int32 values, not floating "
              "point: the file is damaged or not a LoRA; export it again"),
    ("rank", "LoRA rank.safetensors: layers.0.mlp.linear_fc2 has rank 4 in lora_A.weight but 3 in lora_B.weight: "
             "the file is damaged or mixes two LoRAs; export it again"),
    ("rank-down-up", "has rank 4 in lora_down.weight but 3 in lora_up.weight"),
    ("rank-zero", "LoRA rank-zero.safetensors: layers.0.mlp.linear_fc2.lora_A.weight is empty (shape (0, 128), "
                  "rank 0): the file is damaged; export the LoRA again"),
    ("loha-rank-zero", "layers.0.mlp.linear_fc2.hada_w1_a is empty (shape (64, 0), rank 0)"),
    ("complex", "complex.safetensors: tensor 'diffusion_model.layers.0.mlp.linear_fc2.lora_A.weight' holds complex "
                "numbers (C64), which no model or LoRA weights are: the file is not a weights file or is damaged"),
    ("incomplete", "LoRA incomplete.safetensors: layers.0.mlp.linear_fc2 has lora_A.weight but no lora_B.weight: "
                   "the file is incomplete; export the LoRA again"),
    ("dora", "LoRA dora.safetensors is a DoRA (lora_magnitude_vector): DoRA needs the base weight's norms and is "
             "not supported; use a plain LoRA export of it (at layers.0.mlp.linear_fc2)"),
    ("dora-weight", "LoRA dora-weight.safetensors is a DoRA (lora_magnitude_vector)"),
    ("dora-scale", "LoRA dora-scale.safetensors is a DoRA (dora_scale)"),
    ("pickle", "LoRA renamed.safetensors is a PyTorch pickle, whatever its name says, which is never loaded (pickles "
               "can run code): convert the LoRA to .safetensors or get its .safetensors release"),
]


@pytest.mark.parametrize("name, message", REFUSALS, ids=[name for name, _ in REFUSALS])
def test_the_cli_refuses_it_before_the_demo_model_and_its_notice(files, tmp_path, capsys, monkeypatch, name, message):
    monkeypatch.setattr(demo_module, "load_demo_pipe", lambda *a, **k: pytest.fail("the demo model was built"))
    code = cli_main(["generate", "--prompt", "a fox", "--device", "cpu", "--lora", str(files[name]),
                     "--out", str(tmp_path / "x.png")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
    assert not (tmp_path / "x.png").exists()
    assert not (files["pickle"].parent / "unpickled").exists()


@pytest.mark.parametrize("name, message", REFUSALS, ids=[name for name, _ in REFUSALS])
def test_the_python_api_refuses_it_before_opening_any_model_file(files, tmp_path, name, message):
    missing_model = ModelSources(model_dir=tmp_path / "no-model-here")
    with pytest.raises(ModelFileError) as caught:  # the LoRA's error, not the missing model's
        LocalPipe.load(missing_model, LoadOptions(device="cpu"), loras=[files[name]])
    assert message in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize("name", ["negative-metadata", "negative-alpha", "int-alpha"])
def test_a_negative_or_integer_alpha_is_accepted(files, tiny_turbo_folder, name):
    check_lora_file(files[name])
    pipe = LocalPipe.load(ModelSources(model_dir=tiny_turbo_folder), LoadOptions(device="cpu", dtype="fp32"),
                          loras=[files[name]])
    request = GenerationRequest(prompt="a fox", width=256, height=256, steps=1, cfg=1.0, seed=2)
    assert pipe.generate(request, NullHost()).images.isfinite().all()
