"""The prompt enhancer as a phase of the VRAM plan, on the CPU playing the device: at a budget where the plan
streams the PE layer-wise, the revised prompt is the unbudgeted one, the plan says so, and a cancel while the PE
generates leaves nothing placed."""
from __future__ import annotations

import pytest
import torch

from ernie_image.runtime.core.errors import Cancelled, MemoryBudgetError
from ernie_image.runtime.core.host import NullHost
from ernie_image.runtime.core.request import GenerationRequest
from ernie_image.runtime.demo.tiny import TinySizes, build_tiny_model
from ernie_image.runtime.local.options import LoadOptions
from ernie_image.runtime.local.pipe import LocalPipe
from ernie_image.runtime.offload.planner import GiB, plan_memory
from ernie_image.runtime.text.remote_enhancer import ChatEndpoint

# A text width and depth at which the PE's phase (KV cache for 4096 tokens) outgrows the tiny VAE's decode, so a
# budget exists that fits the PE streamed but not whole.
SIZES = TinySizes(dit_layers=4, text_hidden=96, text_ffn=192, text_layers=8)
PROMPT = "a lighthouse at dusk"


def request(**overrides) -> GenerationRequest:
    settings = dict(prompt=PROMPT, width=256, height=256, steps=1, cfg=1.0, seed=21, use_pe=True,
                    pe_max_new_tokens=12, pe_temperature=0.6)
    settings.update(overrides)
    return GenerationRequest(**settings)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny-pe"), variant="turbo", with_pe=True, sizes=SIZES)


@pytest.fixture(scope="module")
def unbudgeted(model):
    return LocalPipe.load(model, LoadOptions(device="cpu", previews=False)).generate(request(), NullHost())


def budgets_placing_the_pe(model, mode: str, device: str = "cpu", dtype: str = "auto") -> list[int]:
    """The budgets (bytes, in 64 KiB steps) at which the plan places the tiny PE by `mode`."""
    pipe = LocalPipe.load(model, LoadOptions(device=device, dtype=dtype, vram_budget_gb=1.0))
    sizes = pipe.memory.sizes_for(model, pipe.variant, with_pe=True)
    job = pipe.memory.job_for(request(), use_pe=True)
    budgets = []
    for step in range(1, 4000 if device == "cpu" else 24000):  # CUDA adds allocator slack and fixed overheads
        budget = step * 4096 * 16
        try:
            plan = plan_memory(budget, job, sizes, pipe.device.type)
        except MemoryBudgetError:
            continue
        if plan.pe is not None and plan.pe.mode == mode:
            budgets.append(budget)
    assert budgets, f"no budget places the tiny prompt enhancer {mode}"
    return budgets


def pe_streaming_budget_gb(model, device: str = "cpu", dtype: str = "auto") -> float:
    """The largest budget (GiB) at which the plan streams the tiny PE's layers (its phase does not fit whole)."""
    return max(budgets_placing_the_pe(model, "streamed", device, dtype)) / GiB


def pe_phase_budget_gb(model) -> float:
    """The smallest budget (GiB) at which the plan places the tiny PE whole for its phase."""
    return min(budgets_placing_the_pe(model, "phase")) / GiB


def budgeted_pipe(model, keep_loaded: bool = True, **options) -> LocalPipe:
    return LocalPipe.load(model, LoadOptions(device="cpu", previews=False, keep_loaded=keep_loaded,
                                             vram_budget_gb=pe_streaming_budget_gb(model), **options))


def enhancer_row(plan_text: str) -> str:
    return next(line for line in plan_text.splitlines() if line.startswith("enhancer"))


def test_streamed_pe_gives_the_unbudgeted_revision(model, unbudgeted):
    assert unbudgeted.prompts_used[0] != PROMPT and unbudgeted.info["pe"] == "local"
    pipe = budgeted_pipe(model, keep_loaded=True)
    result = pipe.generate(request(), NullHost())
    assert result.prompts_used == unbudgeted.prompts_used
    assert torch.equal(result.latents, unbudgeted.latents)
    # The second run re-enters the parked PE instead of building it again; every forward of it (the prefill, then
    # one per generated token) streams all the layers.
    tower = pipe.parts.enhancer.model.model
    forwards = []
    counter = tower.register_forward_pre_hook(lambda module, args: forwards.append(1))
    copies_before = pipe.memory.pe.streamer.sync.copies
    result = pipe.generate(request(), NullHost())
    counter.remove()
    assert result.prompts_used == unbudgeted.prompts_used
    assert torch.equal(result.latents, unbudgeted.latents)
    assert len(forwards) > 1
    assert pipe.memory.pe.streamer.sync.copies - copies_before >= len(forwards) * SIZES.text_layers
    plan = pipe.memory.plan
    assert plan.pe.mode == "streamed" and plan.pe.layers == SIZES.text_layers
    assert f"streamed layer-wise ({SIZES.text_layers} layers, 2 buffers)" in enhancer_row(pipe.describe())
    assert "pe" in plan.phase_peaks and plan.phase_peaks["pe"] <= plan.budget
    placed = pipe.memory.pe
    assert placed is not None and placed.model is pipe.parts.enhancer.model
    # Between phases the PE's ring is parked: its layers point at the host slab, nothing stays on the device.
    assert placed.streamer.parked
    pipe.release()
    assert pipe.memory.pe is None and pipe.parts.enhancer is None
    assert all(p.is_meta for p in placed.model.parameters()), "release leaves no PE weight behind"


def test_a_phase_placed_pe_gives_the_unbudgeted_revision_and_waits_in_its_host_slab(model, unbudgeted):
    pipe = LocalPipe.load(model, LoadOptions(device="cpu", previews=False, keep_loaded=True,
                                             vram_budget_gb=pe_phase_budget_gb(model)))
    for _ in range(2):  # the second run enters the kept PE again
        result = pipe.generate(request(), NullHost())
        assert result.prompts_used == unbudgeted.prompts_used
        assert torch.equal(result.latents, unbudgeted.latents)
        placed = pipe.memory.pe
        assert placed.mode == "phase" and not placed.phase_weights.on_device
        slab = placed.phase_weights.slab.data.untyped_storage().data_ptr()
        assert {p.untyped_storage().data_ptr() for p in placed.model.parameters()} == {slab}
    pipe.release()
    assert all(p.is_meta for p in placed.model.parameters()) and placed.phase_weights is None


def test_pe_free_after_each_run_releases_the_pe_before_the_text_phase(model, unbudgeted):
    pipe = budgeted_pipe(model, keep_loaded=False)
    result = pipe.generate(request(), NullHost())
    assert result.prompts_used == unbudgeted.prompts_used
    assert pipe.memory.pe is None and pipe.parts.enhancer is None and not pipe.is_loaded()


def test_standalone_enhance_plans_the_pe_too(model, unbudgeted):
    pipe = budgeted_pipe(model)
    revision = pipe.enhance(PROMPT, 256, 256, seed=21, temperature=0.6, max_new_tokens=12)
    assert revision.prompts == unbudgeted.prompts_used
    assert pipe.memory.plan.pe.mode == "streamed" and pipe.memory.pe.streamer.parked


def test_preview_shows_the_pe_only_when_it_runs_here(model):
    pipe = budgeted_pipe(model)
    assert "streamed layer-wise" in enhancer_row(pipe.describe(request()))
    assert not any(line.startswith("enhancer") for line in pipe.describe(request(use_pe=False)).splitlines())
    remote = budgeted_pipe(model, pe_endpoint=ChatEndpoint(url="http://127.0.0.1:9"))
    assert not any(line.startswith("enhancer") for line in remote.describe(request()).splitlines())


class CancelAtCall(NullHost):
    """Raises Cancelled at its `at`-th check_cancel; remembers whether the PE's ring was live at that moment."""

    def __init__(self, at: int, pipe: LocalPipe) -> None:
        super().__init__()
        self.at = at
        self.pipe = pipe
        self.calls = 0
        self.pe_was_streaming = False

    def check_cancel(self) -> None:
        self.calls += 1
        if self.calls == self.at:
            placed = self.pipe.memory.pe
            self.pe_was_streaming = placed is not None and not placed.streamer.parked
            raise Cancelled("generation cancelled by the user")


def test_cancel_while_the_pe_generates_leaves_nothing_placed(model, unbudgeted):
    pipe = budgeted_pipe(model, keep_loaded=True)
    # check_cancel runs before each streamed layer (hooks) and before each token (sampler): the prefill makes L
    # calls, then each token 1 + L; the sampler's check before token 3 is call L + 3 (1 + L) + 1.
    layers = SIZES.text_layers
    host = CancelAtCall(layers + 3 * (1 + layers) + 1, pipe)
    with pytest.raises(Cancelled):
        pipe.generate(request(), host)
    assert host.pe_was_streaming, "the cancel came in the middle of the PE's generation"
    assert pipe.memory.pe is None and pipe.memory.plan is None and pipe.memory.text is None
    assert pipe.parts.enhancer is None and not pipe.is_loaded()
    # The next run starts clean and revises the prompt exactly as before.
    assert pipe.generate(request(), NullHost()).prompts_used == unbudgeted.prompts_used


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_the_gpu_the_streamed_pe_matches_the_resident_one_and_hands_its_memory_back(model):
    # fp32: the resident PE decodes through the CUDA-graph decoder and the streamed one through transformers'
    # forward; in bf16 their logits differ by rounding, which can flip a sampled token.
    options = dict(device="cuda", dtype="fp32", previews=False, keep_loaded=True)
    resident = LocalPipe.load(model, LoadOptions(vram_budget_gb=40.0, **options))
    expected = resident.enhance(PROMPT, 256, 256, seed=21, max_new_tokens=12).prompts
    assert resident.memory.plan.pe.mode == "resident"
    resident.release()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()

    pipe = LocalPipe.load(model, LoadOptions(vram_budget_gb=pe_streaming_budget_gb(model, "cuda", "fp32"), **options))
    for _ in range(2):
        assert pipe.enhance(PROMPT, 256, 256, seed=21, max_new_tokens=12).prompts == expected
        assert pipe.memory.plan.pe.mode == "streamed" and pipe.memory.pe.streamer.parked
        assert torch.cuda.memory_allocated() == before, "the parked PE holds no device memory between phases"
        assert pipe.parts.enhancer.model.lm_head.weight.device.type == "cpu"
    pipe.release()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_the_gpu_a_streamed_untied_pe_keeps_its_whole_stem_on_the_device():
    from ernie_image.runtime.demo.tiny import build_prompt_enhancer
    from ernie_image.runtime.offload.placement import PePlacement
    from ernie_image.runtime.offload.planner import LayeredPlan

    model = build_prompt_enhancer(SIZES, seed=5).requires_grad_(False)
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone(), requires_grad=False)
    ids = torch.tensor([[1, 40, 41, 42, 43, 44]])
    with torch.inference_mode():
        want = model(input_ids=ids).logits.clone()
    placement = PePlacement(model, LayeredPlan("streamed", 2, 0, 0, 0, SIZES.text_layers), torch.device("cuda"))
    stem = [name for name, t in list(model.named_parameters()) + list(model.named_buffers())
            if not name.startswith("model.layers.") and t.device.type != "cuda"]
    assert stem == [], "the embedding, norm, rotary tables and untied head all sit on the device"
    with torch.inference_mode():
        got = model(input_ids=ids.cuda()).logits.cpu()
    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)
    placement.release()
    assert all(t.is_meta for t in model.parameters())
