"""A key given twice in one JSON object, in any JSON a run reads, is refused naming the file and the key, not read
as its last copy (json.loads' and the tokenizer library's choice, without a word). config.json and the safetensors
index: tests/test_config_files.py, tests/test_folder_weight_files.py; a LoRA's metadata: test_lora_file_checks.py;
the scheduler config (a notice: the pack never reads it for sampling): test_scheduler_config.py."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ernie_image.runtime.cli.commands import main


def _refused(capsys, *argv: str) -> str:
    assert main(list(argv)) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines and lines[-1].startswith("error: "), lines
    return lines[-1]


def _generate(model: Path, out: Path, *more: str) -> list[str]:
    return ["generate", "--model-dir", str(model), "--steps", "1", "--device", "cpu", "--prompt", "a fox",
            "--out", str(out), *more]


@pytest.mark.parametrize("name, key", [("tokenizer_config.json", "model_max_length"),
                                       ("special_tokens_map.json", "bos_token"),
                                       ("tokenizer.json", "truncation")])
def test_a_tokenizer_file_holding_a_key_twice_is_refused_before_the_library_reads_it(capsys, tmp_path,
                                                                                  tiny_turbo_folder, name, key):
    model = Path(shutil.copytree(tiny_turbo_folder, tmp_path / "model"))
    path = model / "tokenizer" / name
    rest = {k: v for k, v in (json.loads(path.read_text()) if path.exists() else {}).items() if k != key}
    path.write_text("{" + f'"{key}": 1, "{key}": 2' + (", " + json.dumps(rest)[1:] if rest else "}"))
    out = tmp_path / "x.png"
    line = _refused(capsys, *_generate(model, out))
    assert line == (f"error: the tokenizer in {model / 'tokenizer'} cannot be read (its {name} is damaged: the key "
                    f"'{key}' appears twice in one object, so which value is meant is not known): download the "
                    "model's tokenizer/ folder again"), line
    assert not out.exists()


def test_an_fp8_files_quantisation_metadata_naming_a_layer_twice_is_refused(capsys, tmp_path, tiny_turbo_folder):
    fp8 = tmp_path / "ernie-image-turbo-fp8.safetensors"
    assert main(["quantize", "--dit", str(tiny_turbo_folder / "transformer"), "--format", "fp8", "--out",
                 str(fp8)]) == 0
    with safe_open(str(fp8), "pt") as opened:
        metadata = opened.metadata()
    layers = json.loads(metadata["_quantization_metadata"])["layers"]
    first = sorted(layers)[0]
    listed = ", ".join(f"{json.dumps(name)}: {json.dumps(conf)}" for name, conf in layers.items())
    metadata["_quantization_metadata"] = ('{"format_version": "1.0", "layers": {' + f"{json.dumps(first)}: "
                                          + '{"format": "nvfp4"}, ' + listed + "}}")
    save_file(load_file(str(fp8)), str(fp8), metadata=metadata)
    line = _refused(capsys, *_generate(tiny_turbo_folder, tmp_path / "x.png", "--dit", str(fp8)))
    assert line == (f"error: {fp8.name}: unreadable _quantization_metadata (the key '{first}' appears twice in one "
                    "object, so which value is meant is not known); re-export the file"), line
