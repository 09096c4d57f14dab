"""The prompt enhancer as a phase of LocalPipe.generate: the DiT gets the revised prompt, and the user sees it."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ernie_image.runtime.core.host import NullHost
from ernie_image.runtime.core.request import GenerationRequest
from ernie_image.runtime.demo.tiny import build_tiny_model
from ernie_image.runtime.formats.sources import ModelSources
from ernie_image.runtime.local.options import LoadOptions
from ernie_image.runtime.local.pipe import LocalPipe
from ernie_image.runtime.text.enhancer import LocalEnhancer
from ernie_image.runtime.text.remote_enhancer import ChatEndpoint

from test_enhancer_remote import ChatServer

PROMPT = "a lighthouse at dusk"


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model_dir(tiny_turbo_with_pe) -> Path:
    return tiny_turbo_with_pe


def request(**overrides) -> GenerationRequest:
    settings = dict(prompt=PROMPT, width=256, height=256, steps=2, cfg=1.0, seed=21, use_pe=True,
                    pe_max_new_tokens=12)
    settings.update(overrides)
    return GenerationRequest(**settings)


def cpu_pipe(sources: ModelSources, **options) -> LocalPipe:
    return LocalPipe.load(sources, LoadOptions(device="cpu", dtype="fp32", previews=False, **options))


def test_generation_uses_and_reports_the_revised_prompt(model_dir):
    enhancer = LocalEnhancer.load(ModelSources(model_dir=model_dir), torch.device("cpu"), torch.float32)
    expected = enhancer.revise(PROMPT, 256, 256, 21, enhancer.settings(0.6, 0.95, 12)).revised
    assert expected != PROMPT

    pipe = cpu_pipe(ModelSources(model_dir=model_dir), keep_loaded=False)
    result = pipe.generate(request(), NullHost())
    assert result.prompts_used == [expected]
    assert result.info["pe"] == "local" and result.info["pe_tokens"] > 0
    assert result.info["pe_s"] > 0 and result.info["pe_tokens_per_s"] > 0
    assert pipe.parts.enhancer is None, "keep_loaded=False: the PE phase leaves nothing behind"

    # The DiT saw exactly the revised prompt: same image as asking for it with the PE off.
    plain = cpu_pipe(ModelSources(model_dir=model_dir), keep_loaded=False).generate(
        request(prompt=expected, use_pe=False), NullHost())
    assert plain.prompts_used == [expected] and "pe_s" not in plain.info
    assert torch.equal(result.images, plain.images)


def test_kept_pe_is_reused_and_gives_the_same_revision(model_dir):
    pipe = cpu_pipe(ModelSources(model_dir=model_dir), keep_loaded=True)
    first = pipe.generate(request(batch=2), NullHost())
    kept = pipe.parts.enhancer
    assert kept is not None
    second = pipe.generate(request(batch=2), NullHost())
    assert pipe.parts.enhancer is kept
    assert first.prompts_used == second.prompts_used and first.prompts_used[0] == first.prompts_used[1]
    pipe.release()
    assert pipe.parts.enhancer is None


def test_pe_switch_off_leaves_the_prompt_alone(model_dir):
    result = cpu_pipe(ModelSources(model_dir=model_dir)).generate(request(use_pe=False), NullHost())
    assert result.prompts_used == [PROMPT] and "pe_s" not in result.info


def test_pe_on_without_a_pe_says_so_and_goes_on(tmp_path):
    sources = build_tiny_model(tmp_path / "no-pe", layout="diffusers", variant="turbo")
    host = NullHost()
    result = cpu_pipe(sources).generate(request(), host)
    assert result.prompts_used == [PROMPT]
    assert any("has none" in message for message in host.messages)
    assert result.request.use_pe is False, "the settings recorded say what ran: no enhancer"


def test_remote_pe_revises_then_the_local_dit_runs_with_the_pe_off(model_dir):
    with ChatServer() as server:
        endpoint = ChatEndpoint(url=server.url, read_timeout_s=5.0)
        pipe = cpu_pipe(ModelSources(model_dir=model_dir), pe_endpoint=endpoint)
        result = pipe.generate(request(seed=4), NullHost())
        server.faults.append("500")
        host = NullHost()
        fallback = pipe.generate(request(seed=4), host)
    assert result.prompts_used == [f"revised: {PROMPT} @4"] and result.info["pe"] == "remote"
    assert pipe.parts.enhancer is None, "a remote PE loads nothing locally"
    assert fallback.prompts_used == [PROMPT] and fallback.info["pe"] == "original"
    assert any("original prompt is used" in message for message in host.messages)
    assert result.request.use_pe and not fallback.request.use_pe, "the settings recorded say what ran"


@pytest.mark.parametrize("pe_compile", [False, True])
def test_the_enhancers_step_is_compiled_only_when_asked_for_apart_from_the_dits(model_dir, monkeypatch, pe_compile):
    """Compiling the PE's step costs 8-60 s a process to save about 0.2 s a rewrite: the DiT's compile option does not
    bring it along; `pe_compile` does, where the compiler is available."""
    from ernie_image.runtime.local import parts

    monkeypatch.setattr(parts, "compile_available", lambda device: True)
    pipe = cpu_pipe(ModelSources(model_dir=model_dir), compile=True, pe_compile=pe_compile)
    enhancer = pipe.parts.load_enhancer(NullHost(), placed=False)
    assert enhancer.compiled_decode is pe_compile
