"""The local prompt enhancer: Baidu's prompt format, diffusers' sampling maths, private seeding, both file layouts."""
from __future__ import annotations

import dataclasses
import json
import types
from pathlib import Path

import pytest
import torch

from ernie_image.runtime.cli.enhance import main_enhance
from ernie_image.runtime.cli.terminal_text import plain_terminal_lines
from ernie_image.runtime.core.errors import InvalidInputError, ModelFileError
from ernie_image.runtime.core.host import NullHost
from ernie_image.runtime.demo.tiny import TinySizes
from ernie_image.runtime.demo.tiny_pe import build_tiny_pe_folder, lively_prompt_enhancer
from ernie_image.runtime.formats.sources import ModelSources
from ernie_image.runtime.text.enhancer import LocalEnhancer, revise_prompts
from ernie_image.runtime.text.pe_model import locate_pe
from ernie_image.runtime.text.pe_prompt import ERNIE_PE_SYSTEM_TEXT, render_chat, user_message
from ernie_image.runtime.text.token_sampler import ExponentialDraws, SamplingSettings, sample_tokens

CPU = torch.device("cpu")
PROMPTS = ["a cat", 'a sign that reads "OPEN" 开门']


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def pe_dir(tmp_path_factory) -> Path:
    return build_tiny_pe_folder(tmp_path_factory.mktemp("pe"), seed=3, max_length=20)


@pytest.fixture(scope="module")
def enhancer(pe_dir) -> LocalEnhancer:
    return LocalEnhancer.load(ModelSources(model_dir=pe_dir), CPU, torch.float32)


def test_user_message_is_baidus_json():
    assert user_message('say "hi" 你好', 848, 1264) == '{"prompt": "say \\"hi\\" 你好", "width": 848, "height": 1264}'


def test_chat_text_is_the_template_shipped_with_the_pe(enhancer):
    text = render_chat(enhancer.tokenizer, "a cat", 1024, 768)
    # The same string ComfyUI's official ERNIE workflow builds by hand (with the prompt JSON-escaped).
    assert text == (f'<s>[SYSTEM_PROMPT]{ERNIE_PE_SYSTEM_TEXT}[/SYSTEM_PROMPT]'
                    f'[INST]{{"prompt": "a cat", "width": 1024, "height": 768}}[/INST]')
    ids = enhancer.input_ids("a cat", 1024, 768)
    assert ids[0] == enhancer.tokenizer.bos_token_id and ids[1] != enhancer.tokenizer.bos_token_id


def test_exactly_one_bos_even_when_the_tokenizer_adds_one(tmp_path):
    folder = build_tiny_pe_folder(tmp_path, seed=3, adds_bos=True)
    bos_adding = LocalEnhancer.load(ModelSources(model_dir=folder), CPU, torch.float32)
    ids = bos_adding.input_ids("a cat", 1024, 1024)
    assert ids.count(bos_adding.tokenizer.bos_token_id) == 1 and ids[0] == bos_adding.tokenizer.bos_token_id


def diffusers_revision(pe_dir: Path, prompt: str, width: int, height: int, seed: int) -> str:
    """diffusers' own PE code path on the same weights, with the global RNG seeded (its only seeding)."""
    from diffusers.pipelines.ernie_image.pipeline_ernie_image import ErnieImagePipeline
    from transformers import AutoTokenizer, Ministral3ForCausalLM

    pipe = types.SimpleNamespace(
        pe=Ministral3ForCausalLM.from_pretrained(str(pe_dir / "pe")).eval(),
        pe_tokenizer=AutoTokenizer.from_pretrained(str(pe_dir / "pe_tokenizer")),
    )
    torch.manual_seed(seed)
    return ErnieImagePipeline._enhance_prompt_with_pe(pipe, prompt, CPU, width=width, height=height)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_revision_equals_diffusers_pe_path(pe_dir, enhancer, seed):
    # diffusers caps new tokens at the tokenizer's model_max_length (20 here) and samples with temperature 0.6,
    # top_p 0.95 and transformers' default top_k 50: the same settings as ours.
    settings = enhancer.settings(0.6, 0.95, max_new_tokens=20)
    for prompt in PROMPTS:
        torch.manual_seed(12345)  # our sampler must not care about the global RNG
        ours = enhancer.revise(prompt, 1024, 1024, seed, settings)
        assert ours.revised == diffusers_revision(pe_dir, prompt, 1024, 1024, seed)
        assert ours.source == "local" and 0 < ours.tokens <= 20


def test_same_seed_same_revision_whatever_the_global_rng(enhancer):
    settings = enhancer.settings(0.6, 0.95, max_new_tokens=16)
    first = enhancer.revise(PROMPTS[0], 1024, 1024, 7, settings).revised
    torch.manual_seed(999)
    torch.rand(1000)
    state = torch.get_rng_state()
    again = enhancer.revise(PROMPTS[0], 1024, 1024, 7, settings).revised
    assert again == first
    assert torch.equal(torch.get_rng_state(), state), "the PE must not draw from or reseed the global RNG"
    others = {enhancer.revise(PROMPTS[0], 1024, 1024, seed, settings).revised for seed in (8, 9, 10)}
    assert others - {first}, "other seeds should give other revisions"


def test_batch_revises_each_distinct_prompt_once_independent_of_position(enhancer):
    settings = enhancer.settings(0.6, 0.95, max_new_tokens=12)
    alone = enhancer.revise(PROMPTS[1], 1024, 1024, 5, settings).revised
    batch = revise_prompts(enhancer, [PROMPTS[0], PROMPTS[1], PROMPTS[0]], 1024, 1024, 5, settings)
    assert batch.prompts[1] == alone and batch.prompts[0] == batch.prompts[2]
    assert len(batch.revisions) == 2
    info = batch.info()
    assert info["pe"] == "local" and info["pe_tokens"] == sum(r.tokens for r in batch.revisions)
    assert info["pe_s"] > 0 and info["pe_tokens_per_s"] > 0


def test_prefetched_draws_pick_multinomials_tokens_seed_for_seed():
    draws, reference = ExponentialDraws(torch.Generator().manual_seed(11), 4096), torch.Generator().manual_seed(11)
    try:
        for step in range(40):
            logits = torch.randn((1, 4096), generator=torch.Generator().manual_seed(step)) * 4
            if step % 2:  # a top-k-like support: most entries impossible
                logits[:, torch.randperm(4096, generator=torch.Generator().manual_seed(step))[:4000]] = -float("inf")
            probs = torch.softmax(logits, dim=-1)
            assert draws.sample(probs) == torch.multinomial(probs, 1, generator=reference).item()
    finally:
        draws.close()


def test_size_is_part_of_the_request(enhancer):
    square = enhancer.input_ids("a cat", 1024, 1024)
    tall = enhancer.input_ids("a cat", 848, 1264)
    assert square != tall


def test_greedy_revision_ignores_the_seed(enhancer):
    settings = enhancer.settings(0.0, 0.95, max_new_tokens=12)
    assert enhancer.revise("a cat", 1024, 1024, 0, settings).revised == enhancer.revise("a cat", 1024, 1024, 1,
                                                                                         settings).revised


def test_the_token_cap_truncates_and_says_so(enhancer):
    host = NullHost()
    capped = enhancer.revise(PROMPTS[0], 1024, 1024, 0, enhancer.settings(0.6, 0.95, 4, min_new_tokens=4), host)
    assert capped.tokens == 4 and capped.truncated
    assert any("4-token cap" in message for message in host.messages)


def test_min_new_tokens_masks_eos_until_reached(enhancer):
    ids = enhancer.input_ids(PROMPTS[0], 1024, 1024)
    greedy = SamplingSettings(temperature=0.0, max_new_tokens=6)
    first = sample_tokens(enhancer.model, ids, greedy, 0, eos_ids=[]).token_ids[0]
    # The token greedy decoding starts with, declared EOS: it ends the answer at once unless masked.
    assert sample_tokens(enhancer.model, ids, greedy, 0, eos_ids=[first]).token_ids == []
    held = sample_tokens(enhancer.model, ids, dataclasses.replace(greedy, min_new_tokens=3), 0, eos_ids=[first])
    assert len(held.token_ids) >= 3 and first not in held.token_ids[:3]


def test_bad_settings_are_refused_with_the_fix_under_the_requests_names(enhancer):
    """GenerationRequest's names (pe_top_p, ...), recorded for the front ends to word as theirs."""
    for settings, name, fix in (((0.6, 0.0, 512), "pe_top_p 0 ", "use a value in (0, 1]"),
                                ((-1.0, 0.95, 512), "pe_temperature -1 ", "use 0..5"),
                                ((0.6, 0.95, 0), "pe_max_new_tokens 0 ", "use 1..8192")):
        with pytest.raises(InvalidInputError) as refused:
            enhancer.settings(*settings)
        assert str(refused.value).startswith(name + "is not allowed: " + fix)
        assert refused.value.settings == (name.split()[0],)


def test_another_parts_file_given_as_the_pe_is_named_as_that_before_a_tokenizer_is_sought(tiny_turbo_folder):
    dit = tiny_turbo_folder / "transformer" / "diffusion_pytorch_model.safetensors"
    with pytest.raises(ModelFileError, match="is not an ERNIE-Image prompt enhancer: it is the ERNIE-Image "
                                             r"transformer \(DiT\)"):
        LocalEnhancer.load(ModelSources(pe=dit), CPU, torch.float32)


def test_missing_pe_is_a_clear_error(tmp_path):
    with pytest.raises(ModelFileError, match="no prompt enhancer"):
        LocalEnhancer.load(ModelSources(model_dir=tmp_path), CPU, torch.float32)


def test_comfy_single_file_gives_the_same_revision_as_the_folder(tmp_path):
    """ComfyUI's ernie-image-prompt-enhancer.safetensors: `model.`-keys, no lm_head, Tekken tokenizer inside."""
    from ernie_image.runtime.demo.comfy_files import save_comfy_layout
    from ernie_image.runtime.demo.tiny import build_dit, build_text_encoder, build_vae

    sizes = TinySizes()
    pe = lively_prompt_enhancer(sizes, seed=4)
    comfy = save_comfy_layout(tmp_path / "comfy", "turbo", build_dit(sizes, 0), build_text_encoder(sizes, 1),
                              build_vae(sizes, 2), pe)
    folder = build_tiny_pe_folder(tmp_path / "diffusers", model=pe)
    single = LocalEnhancer.load(ModelSources(pe=comfy.pe), CPU, torch.float32)
    assert single.tokenizer.chat_template is None  # the file carries none: Baidu's template is used
    reference = LocalEnhancer.load(ModelSources(model_dir=folder), CPU, torch.float32)
    assert single.input_ids(PROMPTS[1], 1024, 1024) == reference.input_ids(PROMPTS[1], 1024, 1024)
    settings = reference.settings(0.6, 0.95, 12)
    assert single.revise(PROMPTS[1], 1024, 1024, 3, settings).revised == \
        reference.revise(PROMPTS[1], 1024, 1024, 3, settings).revised


def test_the_pe_given_as_the_file_inside_its_folder_is_the_pe_given_as_the_folder(tmp_path):
    """--pe .../pe/model.safetensors: the pe_tokenizer/ (chat template, BOS) and generation_config.json (top_k) of
    its diffusers folder count as for --pe .../pe and --model-dir, and the rewrite is the same."""
    folder = build_tiny_pe_folder(tmp_path / "m", seed=3, adds_bos=True)
    generation = folder / "pe" / "generation_config.json"
    generation.write_text(json.dumps({**json.loads(generation.read_text()), "top_k": 7}))
    reference = LocalEnhancer.load(ModelSources(model_dir=folder), CPU, torch.float32)
    settings = reference.settings(0.6, 0.95, 12)
    for given in (folder / "pe" / "model.safetensors", folder / "pe"):
        enhancer = LocalEnhancer.load(ModelSources(pe=given), CPU, torch.float32)
        assert enhancer.located.tokenizer_folder == folder / "pe_tokenizer" and enhancer.top_k == reference.top_k == 7
        assert enhancer.tokenizer.chat_template == reference.tokenizer.chat_template is not None
        assert enhancer.input_ids(PROMPTS[1], 1024, 1024) == reference.input_ids(PROMPTS[1], 1024, 1024)
        assert enhancer.revise(PROMPTS[1], 1024, 1024, 3, settings).revised == \
            reference.revise(PROMPTS[1], 1024, 1024, 3, settings).revised


@pytest.mark.parametrize("config_beside", [None, {"_class_name": "AutoencoderKLFlux2"},
                                           {"architectures": ["Mistral3ForConditionalGeneration"]}],
                         ids=["no config", "the VAE's config", "the text encoder's config"])
def test_a_pe_file_outside_its_folder_reads_nothing_beside_it(tmp_path, config_beside):
    """A PE file in a folder whose config.json is not the PE's (ComfyUI's models/text_encoders/) is a single file:
    a generation_config.json beside it and a pe_tokenizer/ next to that folder belong to something else."""
    folder = build_tiny_pe_folder(tmp_path / "m", seed=3)
    elsewhere = tmp_path / "models" / "text_encoders"
    elsewhere.mkdir(parents=True)
    (elsewhere / "pe.safetensors").symlink_to(folder / "pe" / "model.safetensors")
    (elsewhere / "generation_config.json").write_text(json.dumps({"top_k": 7}))
    (tmp_path / "models" / "pe_tokenizer").symlink_to(folder / "pe_tokenizer")
    if config_beside is not None:
        (elsewhere / "config.json").write_text(json.dumps(config_beside))
    located = locate_pe(ModelSources(pe=elsewhere / "pe.safetensors"))
    assert located.tokenizer_folder is None and located.generation_config == {}


def test_cli_prints_only_the_revised_prompt(pe_dir, enhancer, capsys):
    code = main_enhance(["--model-dir", str(pe_dir), "--prompt", PROMPTS[0], "--width", "848", "--height", "1264",
                         "--seed", "11", "--max-new-tokens", "10", "--device", "cpu"])
    captured = capsys.readouterr()
    expected = enhancer.revise(PROMPTS[0], 848, 1264, 11, enhancer.settings(0.6, 0.95, 10)).revised
    assert code == 0 and captured.out == plain_terminal_lines(expected) + "\n"  # a random PE's control characters
    assert "tokens/s" in captured.err


def test_cli_refuses_a_bad_size(pe_dir):
    with pytest.raises(InvalidInputError, match="width 1000"):
        main_enhance(["--model-dir", str(pe_dir), "--prompt", "x", "--width", "1000"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_the_gpu_a_seed_gives_one_revision_and_the_phase_hands_the_memory_back(pe_dir):
    cuda = torch.device("cuda")
    gpu = LocalEnhancer.load(ModelSources(model_dir=pe_dir), cuda, torch.bfloat16)
    settings = gpu.settings(0.6, 0.95, 16)
    first = gpu.revise(PROMPTS[1], 1024, 1024, 5, settings)
    torch.cuda.manual_seed_all(77)
    torch.rand(10, device=cuda)
    assert gpu.revise(PROMPTS[1], 1024, 1024, 5, settings).revised == first.revised
    gpu.offload()
    assert gpu.model.get_input_embeddings().weight.device.type == "cpu"
    assert gpu.revise(PROMPTS[1], 1024, 1024, 5, settings).revised == first.revised  # back on the GPU for the phase
    gpu.release()
