"""A tokenizer that is damaged, or that belongs to another model, is refused in one line naming it and the fix,
never a traceback: by generate for the text encoder's tokenizer, by enhance for the prompt enhancer's.

- Every JSON file transformers reads from a tokenizer folder (tokenizer.json, tokenizer_config.json,
  special_tokens_map.json, added_tokens.json) that does not parse (nested too deep, cut short, not UTF-8), is empty
  or holds no JSON object names the folder and the file: "download the model's tokenizer/ folder again" (its
  pe_tokenizer/ for the prompt enhancer). So does a Tekken tokenizer embedded in a single file that cannot be read.
- A tokenizer with a token id past the rows of the embedding it feeds (another model's tokenizer) is refused when
  it first meets that embedding, whatever the prompt: naming the tokenizer, the model, the tokenizer's largest id
  and the embedding's rows, and "give the tokenizer released with this text encoder". An embedding with rows no
  token uses (a padded vocabulary) is fine.
- A prompt enhancer's chat template that does not render is refused before the enhancer is built.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors.torch import load_file, save_file

from ernie_image.runtime.cli.commands import main
from ernie_image.runtime.core.errors import ModelFileError
from ernie_image.runtime.demo.comfy_files import tiny_tekken_bytes
from ernie_image.runtime.formats.tekken import tokenizer_from_text_encoder_file
from ernie_image.runtime.text.encoder import encode_prompts

pytestmark = pytest.mark.usefixtures("one_thread")

FOLDER_FIX = "download the model's tokenizer/ folder again"
PE_FIX = "download the model's pe_tokenizer/ folder again"
EXTRA_ID = 9999  # a token id far past the tiny text encoder's 270 embedding rows


def _refused(capsys, argv: list[str]) -> str:
    """The CLI's one line for a refusal: exit code 2, nothing else on stderr."""
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0].removeprefix("error: ")


def _generate(model: Path, out: Path, prompt: str = "a fox", *more: str) -> list[str]:
    return ["generate", "--device", "cpu", "--width", "256", "--height", "256", "--steps", "1", "--prompt", prompt,
            "--model-dir", str(model), "--out", str(out), *more]


def _enhance(model: Path) -> list[str]:
    return ["enhance", "--device", "cpu", "--prompt", "a fox", "--max-new-tokens", "4", "--model-dir", str(model)]


@pytest.fixture
def model(tmp_path, tiny_turbo_folder) -> Path:
    """A copy of the tiny Turbo diffusers folder, to damage."""
    return Path(shutil.copytree(tiny_turbo_folder, tmp_path / "model"))


@pytest.fixture
def model_with_pe(tmp_path, tiny_turbo_with_pe) -> Path:
    """A copy of the tiny Turbo folder with a prompt enhancer (pe/, pe_tokenizer/), to damage."""
    return Path(shutil.copytree(tiny_turbo_with_pe, tmp_path / "model"))


# What a damaged JSON file holds, and the words for it after "its <file> ".
DAMAGE: dict[str, tuple[Callable[[bytes], bytes], str]] = {
    "arrays nested 100000 deep": (lambda _: b"[" * 100000 + b"]" * 100000,
                                  "is damaged: not valid JSON (nested deeper than JSON is read)"),
    "objects nested 100000 deep": (lambda _: b'{"a":' * 100000 + b"1" + b"}" * 100000,
                                   "is damaged: not valid JSON (nested deeper than JSON is read)"),
    "cut short": (lambda data: data[: len(data) // 2], "is damaged: not valid JSON ("),
    "a 5000-digit number": (lambda _: b'{"a": ' + b"9" * 5000 + b"}",
                            "is damaged: not valid JSON (a number of more digits than can be read)"),
    "empty": (lambda _: b"", "is empty (0 bytes)"),
    "a JSON array": (lambda _: b"[1, 2]", "is damaged: it holds an array, not a JSON object"),
    "JSON null": (lambda _: b"null", "is damaged: it holds null, not a JSON object"),
    "not UTF-8": (lambda _: b'\xff\xfe{"a": 1}', "is damaged: not valid JSON (not UTF-8 text at byte 0)"),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json")


def _damage(folder: Path, name: str, damage: str) -> None:
    path = folder / name
    data = path.read_bytes() if path.exists() else json.dumps({"<extra>": 270}).encode()
    path.write_bytes(DAMAGE[damage][0](data))


def _expected(folder: Path, name: str, damage: str) -> str:
    """How the refusal of `damage` to `name` in `folder` starts (a JSON parser's own words may follow)."""
    return f"the tokenizer in {folder} cannot be read (its {name} {DAMAGE[damage][1]}"


@pytest.mark.parametrize("damage", DAMAGE)
@pytest.mark.parametrize("name", TOKENIZER_FILES)
def test_a_damaged_tokenizer_file_is_named_by_generate_in_one_line(model, tmp_path, capsys, name, damage):
    folder = model / "tokenizer"
    _damage(folder, name, damage)
    message = _refused(capsys, _generate(model, tmp_path / "x.png"))
    assert message.startswith(_expected(folder, name, damage)) and message.endswith(f"): {FOLDER_FIX}")
    assert not (tmp_path / "x.png").exists()


def test_a_tokenizer_given_explicitly_that_is_damaged_is_named_as_well(model, tmp_path, capsys):
    given = Path(shutil.copytree(model / "tokenizer", tmp_path / "mine"))
    _damage(given, "tokenizer.json", "arrays nested 100000 deep")
    assert _refused(capsys, _generate(model, tmp_path / "x.png", "a fox", "--tokenizer", str(given))) == (
        f"the tokenizer in {given} cannot be read (its tokenizer.json is damaged: not valid JSON (nested deeper "
        f"than JSON is read)): {FOLDER_FIX}")


@pytest.mark.parametrize("damage", ["arrays nested 100000 deep", "cut short", "a JSON array"])
@pytest.mark.parametrize("name", TOKENIZER_FILES[:3])
def test_a_damaged_pe_tokenizer_file_is_named_by_enhance_in_one_line(model_with_pe, capsys, name, damage):
    folder = model_with_pe / "pe_tokenizer"
    _damage(folder, name, damage)
    message = _refused(capsys, _enhance(model_with_pe))
    assert message.startswith(_expected(folder, name, damage)) and message.endswith(f"): {PE_FIX}")


def test_a_tokenizer_json_the_tokenizer_library_refuses_is_named_in_its_words(model, tmp_path, capsys):
    """Valid JSON of the wrong shape: the library's reason is quoted, never an exception's class name."""
    (model / "tokenizer" / "tokenizer.json").write_text('{"model": 5, "added_tokens": 3}')
    message = _refused(capsys, _generate(model, tmp_path / "x.png"))
    assert message.startswith(f"the tokenizer in {model / 'tokenizer'} cannot be read (the tokenizer library "
                              "refused its files: ") and message.endswith(f"): {FOLDER_FIX}")
    assert "Error" not in message


# ------------------------------------------------------------------ the Tekken tokenizer a single file embeds

def _tekken(**config) -> bytes:
    spec = json.loads(tiny_tekken_bytes())
    spec["config"].update(config)
    return json.dumps(spec).encode()


@pytest.mark.parametrize("tekken, why", [
    (b"[" * 100000 + b"]" * 100000, "its JSON is nested too deep to read"),
    (b"[1]", "it holds a JSON list, not the object of a tekken.json"),
    (json.dumps({"config": {}}).encode(), "it has no 'vocab' entry"),
    (_tekken(default_num_special_tokens=10**12), "default_num_special_tokens 1000000000000 is not a count of "
                                                 "special tokens"),
    (_tekken(pattern="(("), "Oniguruma error: end pattern with unmatched parenthesis"),
    (torch.zeros(4), "its tekken_model tensor holds float32 values, not the bytes of a tekken.json"),
], ids=["nested 100000 deep", "a JSON array", "no vocab", "a trillion special tokens", "a broken split pattern",
        "float values"])
def test_an_embedded_tekken_tokenizer_that_cannot_be_read_names_the_file(tmp_path, tekken, why):
    path = tmp_path / "te.safetensors"
    stored = tekken if isinstance(tekken, torch.Tensor) else torch.frombuffer(bytearray(tekken), dtype=torch.uint8)
    save_file({"model.embed_tokens.weight": torch.zeros(4, 4), "tekken_model": stored}, str(path))
    with pytest.raises(ModelFileError) as refused:
        tokenizer_from_text_encoder_file(path)
    assert str(refused.value) == (f"the Tekken tokenizer embedded in {path} is unreadable ({why}): the file is "
                                  f"damaged: download it again")


# ------------------------------------------------------------------ a tokenizer of another model

def _add_token(folder: Path, content: str = "<zz>", token_id: int = EXTRA_ID) -> None:
    """`content` as a token of id `token_id` in the folder's tokenizer.json (vocabulary and added tokens)."""
    path = folder / "tokenizer.json"
    spec = json.loads(path.read_text())
    spec["added_tokens"].append({"id": token_id, "content": content, "single_word": False, "lstrip": False,
                                 "rstrip": False, "normalized": False, "special": False})
    spec["model"]["vocab"][content] = token_id
    path.write_text(json.dumps(spec))


def _unfit(tokenizer: str, model: str, part: str, fix: str) -> str:
    return (f"{tokenizer} does not fit the {part} {model}: the tokenizer has token ids up to {EXTRA_ID} but the "
            f"{part}'s embedding has 270 rows (ids 0 to 269): give the tokenizer released with this {part}{fix}")


@pytest.mark.parametrize("prompt", ["a <zz> fox", "a fox"], ids=["a prompt with the extra token", "one without"])
def test_a_tokenizer_with_ids_past_the_text_encoders_embedding_is_refused_for_every_prompt(model, tmp_path, capsys,
                                                                                          prompt):
    _add_token(model / "tokenizer")
    assert _refused(capsys, _generate(model, tmp_path / "x.png", prompt)) == _unfit(
        f"the tokenizer in {model / 'tokenizer'}", str(model / "text_encoder"), "text encoder", f": {FOLDER_FIX}")
    assert not (tmp_path / "x.png").exists()


def test_the_text_encoders_tokenizer_is_judged_before_any_part_is_built(model, tmp_path, capsys, monkeypatch):
    """Read and held against the text encoder's embedding from its file's shapes at the run's start: neither the
    text encoder nor the DiT is built first."""
    from ernie_image.runtime.local import parts

    monkeypatch.setattr(parts, "build_text_tower", lambda *a, **k: pytest.fail("the text encoder was built"))
    monkeypatch.setattr(parts, "build_dit", lambda *a, **k: pytest.fail("the DiT was built"))
    _add_token(model / "tokenizer")
    assert _refused(capsys, _generate(model, tmp_path / "x.png")).startswith(f"the tokenizer in {model / 'tokenizer'}")


def test_another_models_tokenizer_given_explicitly_is_refused_naming_the_option(model, tmp_path, capsys):
    given = Path(shutil.copytree(model / "tokenizer", tmp_path / "other-tokenizer"))
    _add_token(given)
    assert _refused(capsys, _generate(model, tmp_path / "x.png", "a fox", "--tokenizer", str(given))) == _unfit(
        f"--tokenizer {given}", str(model / "text_encoder"), "text encoder",
        " (the tokenizer/ folder of its diffusers download), or leave the tokenizer out")


def test_a_pe_tokenizer_with_ids_past_the_enhancers_embedding_is_refused_before_it_is_built(model_with_pe, capsys,
                                                                                           monkeypatch):
    from ernie_image.runtime.text import enhancer

    monkeypatch.setattr(enhancer, "build_pe_model", lambda *a, **k: pytest.fail("the enhancer was built"))
    _add_token(model_with_pe / "pe_tokenizer")
    assert _refused(capsys, _enhance(model_with_pe)) == _unfit(
        f"the tokenizer in {model_with_pe / 'pe_tokenizer'}", str(model_with_pe / "pe"), "prompt enhancer",
        f": {PE_FIX}")


def test_an_embedding_with_rows_no_token_uses_is_fine(model, tmp_path):
    """Released text encoders pad their vocabulary: a tokenizer smaller than the embedding fits it."""
    weights = model / "text_encoder" / "model.safetensors"
    tensors = load_file(str(weights))
    key = next(key for key in tensors if key.endswith("embed_tokens.weight"))
    tensors[key] = torch.cat([tensors[key], torch.zeros(30, tensors[key].shape[1])])
    save_file(tensors, str(weights))
    config = json.loads((model / "text_encoder" / "config.json").read_text())
    config["text_config"]["vocab_size"] = 300
    (model / "text_encoder" / "config.json").write_text(json.dumps(config))
    assert main(_generate(model, tmp_path / "x.png")) == 0 and (tmp_path / "x.png").exists()


class _OddTokenizer:
    """A vocabulary of ids 0-2 whose encoding of text still gives id 500 (as a post-processor's own id may)."""

    bos_token_id = 1

    def get_vocab(self) -> dict[str, int]:
        return {"<unk>": 0, "<s>": 1, "a": 2}

    def __call__(self, text: str, **_) -> dict[str, list[int]]:
        return {"input_ids": [1] if not text else [1, 500]}


def test_an_id_a_prompt_gets_past_the_embedding_is_refused_even_where_the_vocabulary_fits():
    tower = torch.nn.Module()
    tower.embed_tokens = torch.nn.Embedding(270, 4)
    with pytest.raises(ModelFileError) as refused:
        encode_prompts(_OddTokenizer(), tower, ["a fox"])
    assert str(refused.value) == ("the tokenizer gives token id 500 for the prompt 'a fox' but the text encoder has "
                                  "an embedding of 270 rows (ids 0 to 269): the tokenizer does not fit it: give the "
                                  "tokenizer released with this text encoder")


# ------------------------------------------------------------------ the prompt enhancer's chat template

@pytest.mark.parametrize("template, why", [
    ("{% if %}", "Expected an expression, got 'end of statement block' at line 1"),
    ("{{ raise_exception('no user turn') }}", "no user turn"),
], ids=["a syntax error", "a template that raises"])
def test_a_chat_template_that_does_not_render_is_refused_before_the_enhancer_is_built(model_with_pe, capsys,
                                                                                     monkeypatch, template, why):
    from ernie_image.runtime.text import enhancer

    monkeypatch.setattr(enhancer, "build_pe_model", lambda *a, **k: pytest.fail("the enhancer was built"))
    (model_with_pe / "pe_tokenizer" / "chat_template.jinja").write_text(template)
    assert _refused(capsys, _enhance(model_with_pe)) == (
        f"the chat template of the tokenizer in {model_with_pe / 'pe_tokenizer'} cannot be rendered ({why}): give "
        f"the tokenizer released with this prompt enhancer: {PE_FIX}")


def test_a_pipe_judges_its_tokenizer_once_not_at_every_run(model, monkeypatch):
    """The check opens the text encoder's file for its shapes: done for the pipe's first run, not again for each."""
    from ernie_image.runtime.core.host import NullHost
    from ernie_image.runtime.core.request import GenerationRequest
    from ernie_image.runtime.formats import tokenizer_fit
    from ernie_image.runtime.formats.sources import ModelSources
    from ernie_image.runtime.local.options import LoadOptions
    from ernie_image.runtime.local.pipe import LocalPipe

    checks = []
    refuse_unfit = tokenizer_fit.refuse_unfit
    monkeypatch.setattr(tokenizer_fit, "refuse_unfit", lambda *args: checks.append(args[2]) or refuse_unfit(*args))
    pipe = LocalPipe.load(ModelSources(model_dir=model), LoadOptions(device="cpu"))
    for _ in range(2):
        pipe.generate(GenerationRequest(prompt="a fox", width=256, height=256, steps=1), NullHost())
    assert checks == ["text encoder"]
