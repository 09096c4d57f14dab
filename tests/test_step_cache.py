"""The step cache (runtime/step_cache/): the documented rule exactly, residuals that stay with their step, CFG branch
and batch row, threshold 0 giving the uncached image bit for bit, and every CPU path the DiT runs on.

A DiT whose blocks add known amounts (ControlledDiT) makes every relative change and every cached residual a
number the test states by hand. The tiny random models check the paths: CFG length groups, batches, img2img and
inpainting, streamed blocks (the streamer copies exactly the blocks that run), LoRA merged and branch, FP8 /
GGUF / NVFP4, Cancel mid-run, the CLI, the node and the pipe views.
"""
from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

import pytest
import torch
from torch import nn

from ernie_image.nodes.comfy_names import comfy_words
from ernie_image.runtime.cli.names import cli_message
from ernie_image.runtime.core.errors import Cancelled, InvalidInputError, MemoryBudgetError
from ernie_image.runtime.core.host import NullHost
from ernie_image.runtime.local.options import LoadOptions
from ernie_image.runtime.local.pipe import LocalPipe
from ernie_image.runtime.core.request import GenerationRequest
from ernie_image.runtime.offload.streamer import LayerStreamer
from ernie_image.runtime.step_cache import StepCacheConfig, parse_step_cache
from ernie_image.runtime.step_cache.rule import SkipRule, relative_change, skippable_window
from ernie_image.runtime.step_cache.session import GUESSED_BLOCKS, BlockSplit, StepCacheRun
from ernie_image.runtime.step_cache.view import StepCachePipe, with_step_cache
from ernie_image.runtime.demo.tiny import TinySizes, build_tiny_model
from streaming_budgets import least_budget_gb, middle_streaming_budget_gb

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: threads only add overhead

SIZES = TinySizes(dit_layers=6)
BASE = GenerationRequest(prompt="a red fox in snow", negative_prompt="blurry", width=256, height=256, steps=8,
                         cfg=3.0, seed=11, batch=2)  # CFG's two branches have texts of other lengths: two groups
FORCED = "CSSCSCSC"


class LogHost(NullHost):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def log(self, message: str) -> None:
        self.lines.append(message)


# ------------------------------------------------------------------------------------------------ the rule
def test_the_window_is_the_documented_one():
    assert skippable_window(StepCacheConfig(), 50) == range(8, 48)  # 0.15 * 50 = 7.5 -> 8; 0.95 * 50 = 47.5 -> 48
    assert skippable_window(StepCacheConfig(), 8) == range(2, 7)  # Turbo: the last step (7) is always computed
    assert skippable_window(StepCacheConfig(start=0.0, end=1.0), 10) == range(1, 9)  # never the first or last
    assert skippable_window(StepCacheConfig(start=0.15), 20) == range(3, 19)  # 0.15 * 20 is 3, not 3.0000000000000004
    assert len(skippable_window(StepCacheConfig(), 2)) == 0


def test_the_rule_skips_below_the_threshold_within_the_window_and_caps_skips_in_a_row():
    config = StepCacheConfig(threshold=0.1, start=0.2, end=0.8, max_skips=2)  # 10 steps: window 2..7
    changes = [None, 0.5, 0.05, 0.05, 0.05, 0.2, 0.01, 0.01, 0.01, 0.01]
    rule = SkipRule(config, 10)
    measured = []
    for step, change in enumerate(changes):
        if rule.measures(step):
            measured.append(step)
        rule.decide(step, change if rule.measures(step) else None)
    # 0, 1: before the window; 2, 3 skipped; 4 computed unmeasured (2 in a row); 5 over the threshold; 6, 7 skipped;
    # 8 after the window; 9 the last.
    assert "".join(rule.schedule) == "CCSSCCSSCC"
    assert measured == [2, 3, 5, 6, 7]
    assert rule.changes == {2: 0.05, 3: 0.05, 5: 0.2, 6: 0.01, 7: 0.01}


def test_threshold_zero_never_skips_and_a_forced_schedule_decides_alone():
    rule = SkipRule(StepCacheConfig(threshold=0.0, start=0.0, end=1.0), 5)
    assert [rule.decide(step, 0.0 if rule.measures(step) else None) for step in range(5)] == [False] * 5
    rule = SkipRule(StepCacheConfig(forced="CSSSC", max_skips=1), 5)
    assert [rule.decide(step, 99.0 if rule.measures(step) else None) for step in range(5)] == [False, True, True,
                                                                                               True, False]
    assert relative_change(0.0, 0.0) == 0.0 and relative_change(1.0, 0.0) == math.inf


@pytest.mark.parametrize("spec, error", [
    ("dbcache:forced=SCC", "skips the first or the last step"),
    ("dbcache:threshold=-1", "threshold -1.0 is not allowed"),
    ("dbcache:start=0.9,end=0.2", "start 0.9 is after end 0.2"),
    ("dbcache:max_skips=0", "max_skips 0 is not allowed"),
    ("fbcache:first_blocks=4", "fbcache computes one first block"),
    ("teacache", "method 'teacache' is not known"),
    ("dbcache:speed=9", "setting 'speed=9' is not known"),
    ("dbcache:threshold=fast", "threshold 'fast' is not a number"),
])
def test_a_bad_spec_is_one_line(spec, error):
    with pytest.raises(InvalidInputError, match=error):
        parse_step_cache(spec)


def test_off_with_an_empty_setting_is_refused_as_a_method_with_one_is() -> None:
    with pytest.raises(InvalidInputError, match=r"^step cache 'off:' has an empty setting: give off alone$"):
        parse_step_cache("off:")


def test_a_forced_schedule_that_is_not_one_is_named_before_the_settings_it_would_override() -> None:
    """The conflict's fix shows the schedule given: a bad one is refused first, so the example shown runs."""
    with pytest.raises(InvalidInputError, match=r"forced 'X' is not a schedule"):
        parse_step_cache("dbcache:forced=x,threshold=5")


@pytest.mark.parametrize("spec", ["dbcache:", "dbcache:,,", "fbcache: ,", "dbcache:threshold=0.1,", "dbcache:,max_skips=2"])
def test_an_empty_setting_is_refused_rather_than_read_as_the_defaults(spec):
    with pytest.raises(InvalidInputError, match=r"has an empty setting: give \w+ alone, or settings between the "
                                                r"commas \(e\.g\. \w+:threshold=[0-9.]+\)$") as refused:
        parse_step_cache(spec)
    assert isinstance(parse_step_cache(str(refused.value).rsplit(" ", 1)[1].rstrip(")")), StepCacheConfig)


def test_method_and_setting_names_are_read_in_either_case():
    assert parse_step_cache("DBCACHE:Threshold=0.1,MAX_SKIPS=2") == StepCacheConfig("dbcache", threshold=0.1,
                                                                                     max_skips=2)


SETTINGS = [field.name for field in dataclasses.fields(StepCacheConfig) if field.name != "method"]


@pytest.mark.parametrize("method", ["dbcache", "fbcache"])
@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("form", ["{}", "{}=", " {} = ", "{}, threshold=0.1"])
def test_a_known_setting_without_a_value_says_it_needs_one_with_an_example_that_parses(method, setting, form):
    spec = f"{method}:" + form.format(setting.replace("_", "-") if form == "{}=" else setting)
    with pytest.raises(InvalidInputError) as refused:
        parse_step_cache(spec)
    message = str(refused.value)
    assert "\n" not in message and message.startswith(f"step cache setting {setting} needs a value: give "
                                                       f"{setting}=VALUE, e.g. {method}:{setting}="), message
    example = message.rsplit(" ", 1)[1]
    assert isinstance(parse_step_cache(example), StepCacheConfig)  # the example is one the user can run


def test_every_setting_is_in_the_documented_settings_list():
    docs = (Path(__file__).resolve().parent.parent / "docs" / "step-cache.md").read_text(encoding="utf-8")
    settings_list = docs.split("## What it does", 1)[1].split("\n## ", 1)[0]
    assert [name for name in SETTINGS if f"`{name}`" not in settings_list] == []


def test_a_setting_given_twice_with_one_value_is_that_setting():
    """As a repeated CLI option: the same value twice, however written, is harmless (two values are refused,
    tests/test_cli_refusals.py)."""
    assert parse_step_cache("dbcache:threshold=0.1,threshold=.10") == StepCacheConfig("dbcache", threshold=0.1)
    assert parse_step_cache("dbcache:forced=csc,forced=CSC") == StepCacheConfig("dbcache", forced="CSC")


def test_specs_parse_and_print_back():
    assert parse_step_cache("off") is None
    config = parse_step_cache("dbcache:threshold=0.12,max-skips=2,first_blocks=4")
    assert config == StepCacheConfig("dbcache", threshold=0.12, max_skips=2, first_blocks=4)
    assert parse_step_cache(config.spec()) == config
    forced = parse_step_cache("dbcache:first_blocks=4,forced=cssc")
    assert forced == StepCacheConfig("dbcache", first_blocks=4, forced="CSSC")
    assert parse_step_cache(forced.spec()) == forced
    built = StepCacheConfig("dbcache", threshold=0.3, forced="CSSC")  # the library takes both; forced decides
    assert built.spec() == "dbcache:forced=CSSC"
    assert parse_step_cache("fbcache").probe_blocks == 1 and parse_step_cache("fbcache").tail_blocks == 0
    assert BlockSplit.of(36, 8, 0) == BlockSplit(tuple(range(8)), tuple(range(8, 36)), ())
    assert BlockSplit.of(36, 4, 2).last == (34, 35) and BlockSplit.of(6, 8, 0).first == (0, 1, 2, 3, 4)


# ------------------------------------------------------------- a DiT whose residual changes are set by the test
class _AddBlock(nn.Module):
    def __init__(self, owner: "ControlledDiT", index: int) -> None:
        super().__init__()
        self.owner_ref = [owner]  # not a submodule
        self.index = index

    def forward(self, x: torch.Tensor, ctx) -> torch.Tensor:
        step, code = ctx
        return x + self.owner_ref[0].amount(self.index, step, code)[:, None, None]


class ControlledDiT(nn.Module):
    """prepare: x0 = the latents as tokens; the first blocks add probe[step] (every row), the middle ones
    1000 * (step + 1) + the row's code (so a reused residual names its step and row), the last ones 0.5. The
    timestep is the step number, the row code the text's first value."""

    def __init__(self, layers: int, first: int, last: int, probe: list[float]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_AddBlock(self, i) for i in range(layers))
        self.split = BlockSplit.of(layers, first, last)
        self.probe = probe
        self.block_runner = lambda index, block, x, ctx: block(x, ctx)
        self.structure_version = 0
        self.calls: list[tuple[int, int]] = []  # (step, block) run

    def amount(self, index: int, step: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
        """What block `index` adds at step `step`: the first block of each run adds its amount, the others 0."""
        s = int(step[0])
        self.calls.append((s, index))
        if index == self.split.first[0]:
            return torch.full_like(code, self.probe[s])
        if index == self.split.middle[0]:
            return 1000.0 * (s + 1) + code
        if self.split.last and index == self.split.last[0]:
            return torch.full_like(code, 0.5)
        return torch.zeros_like(code)

    def project_text(self, text):
        return text

    def prepare(self, latents, timestep, text, text_lens):
        return latents.flatten(2).transpose(1, 2), (timestep, text[:, 0, 0].float()), None

    def finish(self, x, conditioning, grid):
        return x.transpose(1, 2).reshape(x.shape[0], -1, *grid)


def controlled_run(config: StepCacheConfig, probe: list[float], codes: list[float], lengths: list[int],
                   layers: int = 6):
    dit = ControlledDiT(layers, config.probe_blocks, config.tail_blocks, probe)
    rows = [torch.full((length, 4), code) for code, length in zip(codes, lengths)]
    run = StepCacheRun(config, dit, rows, torch.device("cpu"), torch.float32, len(probe), NullHost())
    outputs = []
    for step in range(len(probe)):
        latents = torch.zeros(len(codes), 4, 2, 3)
        outputs.append(run(latents, torch.full((len(codes),), float(step))))
    return dit, run, outputs


def test_a_controlled_dit_is_computed_and_skipped_exactly_as_the_rule_says():
    # probe residual per step; change against the last computed step's: |p - p_last| / |p_last|
    probe = [8.0, 8.0, 8.5, 8.25, 8.5, 10.0, 10.5, 10.0, 10.0, 10.0]
    config = StepCacheConfig(threshold=0.1, start=0.0, end=1.0, max_skips=2, first_blocks=2, last_blocks=1)
    dit, run, _ = controlled_run(config, probe, [1.0, 2.0], [3, 3])
    report = run.close()
    # 1: 0/8 skip; 2: 0.5/8 skip; 3: two in a row, computed (last 8.25); 4: 0.25/8.25 skip; 5: 1.75/8.25 compute
    # (last 10); 6: 0.05 skip; 7: 0 skip; 8: two in a row, computed; 9: the last step.
    assert report.schedule == "CSSCSCSSCC"
    assert report.changes == {1: 0.0, 2: 0.0625, 4: 0.25 / 8.25, 5: 1.75 / 8.25, 6: 0.05, 7: 0.0}
    split = BlockSplit.of(6, 2, 1)
    for step, letter in enumerate(report.schedule):  # one call group (equal text lengths): its blocks in order
        ran = [block for s, block in dit.calls if s == step]
        assert ran == (list(range(6)) if letter == "C" else list(split.first + split.last)), (step, ran)
    assert report.line().endswith("5 of 10 steps computed, 5 skipped")


def test_a_skipped_step_reuses_the_residual_of_its_own_group_row_and_last_computed_step():
    """Two CFG-like groups (text lengths 3 and 5), two rows each, distinct codes: a skipped step's output is its own
    first blocks' output plus the middle residual of the same row at the last computed step, nothing else."""
    probe = [4.0] * 8
    config = StepCacheConfig(forced="CSSCSCSC", first_blocks=1, last_blocks=2)
    codes, lengths = [1.0, 2.0, 3.0, 4.0], [3, 3, 5, 5]
    _, run, outputs = controlled_run(config, probe, codes, lengths)
    assert [len(g.text_lens) for g in run.groups] == [2, 2]  # rows 0-1 and 2-3 run as separate calls
    last_computed = 0
    for step, (letter, velocity) in enumerate(zip(FORCED, outputs)):
        if letter == "C":
            last_computed = step
        for row, code in enumerate(codes):
            expected = 4.0 + 1000.0 * (last_computed + 1) + code + 0.5
            assert torch.equal(velocity[row], torch.full_like(velocity[row], expected)), (step, row)


# ---------------------------------------------------------------------------------- the pipe, on tiny models
@pytest.fixture(scope="module")
def base_model(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-base"), variant="base", sizes=SIZES).model_dir


@pytest.fixture(scope="module")
def base_pipe(base_model) -> LocalPipe:
    return LocalPipe.load(base_model, LoadOptions(device="cpu"))


@pytest.fixture(scope="module")
def uncached(base_pipe):
    return base_pipe.generate(BASE, NullHost())


def cached(request: GenerationRequest, spec: str) -> GenerationRequest:
    return dataclasses.replace(request, step_cache=parse_step_cache(spec))


def test_threshold_zero_gives_the_uncached_image_bit_for_bit(base_pipe, uncached):
    host = LogHost()
    result = base_pipe.generate(cached(BASE, "dbcache:threshold=0,start=0,end=1,first_blocks=2"), host)
    assert torch.equal(result.latents, uncached.latents) and torch.equal(result.images, uncached.images)
    info = result.info["step_cache"]
    assert info["schedule"] == "C" * 8 and len(info["changes"]) == 6  # measured on every step but the ends
    assert "step cache (dbcache F2B0, threshold 0, steps 0%-100%, at most 3 skips in a row): 8 of 8 steps " \
           "computed, 0 skipped" in host.lines
    assert result.request.metadata()["step_cache"] == {"method": "dbcache", "threshold": 0.0, "start": 0.0,
                                                       "end": 1.0, "max_skips": 3, "first_blocks": 2,
                                                       "last_blocks": 0}


def test_a_forced_schedule_is_recorded_without_the_settings_it_decides_in_place_of():
    config = parse_step_cache(f"fbcache:forced={FORCED}")
    assert config.metadata() == {"method": "fbcache", "first_blocks": 1, "last_blocks": 0, "forced": FORCED}


@pytest.mark.parametrize("spec", [None, "dbcache:threshold=0,start=0,end=1,first_blocks=2", f"fbcache:forced={FORCED}"])
def test_a_run_projects_its_text_once_per_call_group_whatever_the_steps(base_pipe, uncached, spec):
    dit = base_pipe.parts.load_dit()
    projected: list[tuple[int, ...]] = []
    hook = dit.text_proj.register_forward_hook(lambda module, args, output: projected.append(tuple(args[0].shape)))
    try:
        result = base_pipe.generate(BASE if spec is None else cached(BASE, spec), NullHost())
    finally:
        hook.remove()
    assert len(projected) == 2  # CFG's negative and positive: two call groups, eight steps
    if spec is None or "threshold=0" in spec:
        assert torch.equal(result.latents, uncached.latents)


def test_a_forced_schedule_computes_the_steps_it_names_and_says_so(base_pipe, uncached):
    host = LogHost()
    result = base_pipe.generate(cached(BASE, f"dbcache:forced={FORCED},first_blocks=2,last_blocks=1"), host)
    assert result.info["step_cache"]["schedule"] == FORCED
    assert result.info["step_cache"]["steps_computed"] == 4 and result.info["step_cache"]["blocks_run"] == "F2B1 of 6"
    assert any(line.endswith("4 of 8 steps computed, 4 skipped") for line in host.lines)
    assert not torch.equal(result.latents, uncached.latents) and torch.isfinite(result.latents).all()
    again = base_pipe.generate(cached(BASE, f"dbcache:forced={FORCED},first_blocks=2,last_blocks=1"), NullHost())
    assert torch.equal(again.latents, result.latents)  # nothing of one run leaks into the next


def test_a_dit_smaller_than_the_blocks_asked_for_runs_what_it_can_with_a_notice(base_pipe):
    host = LogHost()
    result = base_pipe.generate(cached(dataclasses.replace(BASE, batch=1, steps=3), "dbcache:forced=CSC"), host)
    assert "F8B0 leaves no block to skip in this 6-block DiT: runs as F5B0" in host.lines[0]
    record = result.info["step_cache"]
    assert record["blocks_run"] == "F5B0 of 6"
    # The record says what ran, and what was asked for beside it: nothing in it contradicts the run.
    assert (record["first_blocks"], record["last_blocks"], record["blocks_asked"]) == (5, 0, "F8B0")
    fitting = base_pipe.generate(cached(dataclasses.replace(BASE, batch=1, steps=3),
                                        "dbcache:forced=CSC,first_blocks=2"), NullHost())
    assert "blocks_asked" not in fitting.info["step_cache"]


@pytest.mark.parametrize("what", ["img2img", "inpaint", "turbo-cfg1"])
def test_image_inputs_and_cfg_1_run_bit_for_bit_at_threshold_zero(base_pipe, what):
    generator = torch.Generator().manual_seed(3)
    image = torch.rand(1, 256, 256, 3, generator=generator)
    settings = {"img2img": dict(init_image=image, denoise=0.6),
                "inpaint": dict(init_image=image, mask=(torch.rand(256, 256, generator=generator) > 0.5).float(),
                                denoise=0.9, batch=1),
                "turbo-cfg1": dict(cfg=1.0, negative_prompt="")}[what]
    request = dataclasses.replace(BASE, steps=5, **settings)
    plain = base_pipe.generate(request, NullHost())
    zero = base_pipe.generate(cached(request, "dbcache:threshold=0,start=0,first_blocks=3"), NullHost())
    assert torch.equal(zero.images, plain.images)
    forced = base_pipe.generate(cached(request, "fbcache:forced=CSCSC"), NullHost())
    assert forced.info["step_cache"]["schedule"] == "CSCSC" and torch.isfinite(forced.images).all()


# ------------------------------------------------------------------------------------------ streamed blocks
def test_streamed_blocks_give_the_resident_image_and_a_skipped_step_copies_one_guessed_block_it_does_not_run(
        base_model, base_pipe):
    request = cached(dataclasses.replace(BASE, batch=1), f"dbcache:forced={FORCED},first_blocks=2,last_blocks=1")
    resident = base_pipe.generate(request, NullHost())
    budget = middle_streaming_budget_gb(base_model, request, "cpu")
    pipe = LocalPipe.load(base_model, LoadOptions(device="cpu", vram_budget_gb=budget, keep_loaded=True))
    first = pipe.generate(request, NullHost())
    assert torch.equal(first.latents, resident.latents)
    streamer = pipe.memory.dit.streamer
    streamed = pipe.memory.plan.dit.streamed
    assert streamer is not None and set(streamed) & {2, 3, 4}  # some skippable middle block is streamed
    streamer.sync.trace = []
    assert torch.equal(pipe.generate(request, NullHost()).latents, resident.latents)  # the ring wraps across runs
    host_of = {t.data_ptr(): index for index, t in zip(streamer.streamed, streamer._host)}
    copied = [host_of[event[2]] for event in streamer.sync.trace if event[0] == "copy"]
    split = BlockSplit.of(6, 2, 1)
    expected = []
    guessed = [index for index in split.middle if index in streamed][:GUESSED_BLOCKS]
    for letter in FORCED:  # two groups per step (CFG), each its first pass, then each its second
        if letter == "C":
            blocks = split.first * 2 + (split.middle + split.last) * 2  # a guess confirmed is copied once, in order
        else:  # the guess is copied before the decision and dropped by it
            blocks = split.first * 2 + tuple(guessed) + split.last * 2
        expected += [index for index in blocks if index in streamed]
    assert copied == expected
    assert ("join",) not in streamer.sync.trace  # the route was known ahead: the stream never restarted
    assert not streamer.following_route
    plain = dataclasses.replace(request, step_cache=None)  # the uncached run after it streams as before
    assert torch.equal(pipe.generate(plain, NullHost()).latents, base_pipe.generate(plain, NullHost()).latents)
    pipe.release()


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory) -> Path:
    """A tiny Base model whose DiT is wide enough that its activations, not the VAE's, set the least budget."""
    sizes = TinySizes(dit_hidden=256, dit_heads=8, dit_ffn=512)
    return build_tiny_model(tmp_path_factory.mktemp("tiny-wide"), variant="base", sizes=sizes).model_dir


# The least budget with the step cache's residuals, and without: a budget between them is refused for the cache alone.
BUDGET_REFUSAL = re.compile(
    r"^a 256x256 batch-1 job \(CFG 3, DiT fp32\) with a step cache needs at least (?P<needed>[\d.]+) GiB of VRAM with "
    r"everything streamed, (?P<without>[\d.]+) GiB without it: the step cache's residual tensors raise the minimum "
    r"above the budget of (?P<budget>[\d.]+) GiB: raise the budget \((?P<budget_name>.+)\) to (?P=needed) GiB, or "
    r"leave out the step cache \((?P<cache_name>.+)\)$")


@pytest.mark.parametrize("between", [0.02, 0.5, 0.98])
def test_a_budget_only_the_step_cache_s_residuals_exceed_is_refused_naming_both_minimums_and_both_fixes(
        wide_model, between):
    request = cached(dataclasses.replace(BASE, batch=1, steps=2), "dbcache")
    with_cache = least_budget_gb(wide_model, request, "cpu")
    without_cache = least_budget_gb(wide_model, dataclasses.replace(request, step_cache=None), "cpu")
    assert without_cache < with_cache
    budget = without_cache + between * (with_cache - without_cache)
    pipe = LocalPipe.load(wide_model, LoadOptions(device="cpu", vram_budget_gb=budget))
    with pytest.raises(MemoryBudgetError) as refused:
        pipe.generate(request, NullHost())
    assert pipe.parts.dit is None and pipe.memory.plan is None  # refused before anything loads
    message = str(refused.value)
    said = BUDGET_REFUSAL.match(message)
    assert said, message
    step = 4096 / 2**30  # the least budgets are found to 4 KiB
    assert float(said["needed"]) >= with_cache - step and float(said["without"]) >= without_cache - step
    shown = 10 ** -len(said["needed"].split(".")[1])  # rounded up to the digits shown, never further
    assert float(said["needed"]) < with_cache + shown and float(said["without"]) < without_cache + shown
    assert float(said["without"]) <= float(said["budget"]) < float(said["needed"])  # shown as far as they differ
    assert abs(float(said["budget"]) - budget) <= 0.5 * 10 ** -len(said["budget"].split(".")[1]) + 1e-12
    assert (said["budget_name"], said["cache_name"]) == ("vram_budget_gb", "step_cache")
    assert BUDGET_REFUSAL.match(cli_message(refused.value)).group("budget_name", "cache_name") == (
        "--budget", "--step-cache")
    assert BUDGET_REFUSAL.match(comfy_words(message, refused.value.settings)).group("budget_name", "cache_name") == (
        "the Loader's vram_budget_gb", "the Step Cache node")
    plain = dataclasses.replace(request, step_cache=None)  # the same budget runs the job without the cache
    assert torch.isfinite(pipe.generate(plain, NullHost()).images).all()


def test_a_budget_below_the_minimum_without_the_step_cache_is_refused_without_blaming_the_cache(wide_model):
    request = cached(dataclasses.replace(BASE, batch=1, steps=2), "dbcache")
    without_cache = least_budget_gb(wide_model, dataclasses.replace(request, step_cache=None), "cpu")
    pipe = LocalPipe.load(wide_model, LoadOptions(device="cpu", vram_budget_gb=without_cache / 2))
    refusal = (r"^a 256x256 batch-1 job \(CFG 3, DiT fp32\) needs at least .* GiB of VRAM with everything streamed; "
               r"the budget is .* GiB: raise the budget, ")
    with pytest.raises(MemoryBudgetError, match=refusal) as refused:
        pipe.generate(request, NullHost())
    assert "step cache" not in str(refused.value)


@pytest.mark.parametrize("spec", ["dbcache:threshold=10,start=0,end=1,max_skips=1,first_blocks=2,last_blocks=1",
                                  "dbcache:threshold=10,start=0,end=1,max_skips=3,first_blocks=2,last_blocks=0",
                                  f"dbcache:forced={FORCED},first_blocks=2,last_blocks=1"])
def test_every_step_that_may_be_skipped_has_its_first_streamed_middle_block_guessed(base_model, base_pipe, spec,
                                                                                    monkeypatch):
    request = cached(dataclasses.replace(BASE, batch=1), spec)
    resident = base_pipe.generate(request, NullHost())
    budget = middle_streaming_budget_gb(base_model, request, "cpu")
    pipe = LocalPipe.load(base_model, LoadOptions(device="cpu", vram_budget_gb=budget, keep_loaded=True))
    guesses: list[tuple[int, ...]] = []  # the blocks each guess put on the route
    original = LayerStreamer.guess

    def recording(self, indices, limit) -> None:
        known = len(self._guessed)
        original(self, indices, limit)
        guesses.append(tuple(self.streamed[k] for k in list(self._guessed)[known:]))

    monkeypatch.setattr(LayerStreamer, "guess", recording)
    result = pipe.generate(request, NullHost())
    assert torch.equal(result.latents, resident.latents)
    report = result.info["step_cache"]
    first_blocks, last_blocks = (int(spec.split(f"{name}=")[1].split(",")[0])
                                 for name in ("first_blocks", "last_blocks"))
    split = BlockSplit.of(len(pipe.parts.dit.layers), first_blocks, last_blocks)
    first_streamed_middle = next(index for index in split.middle if index in pipe.memory.plan.dit.streamed)
    assert "S" in report["schedule"] and len(guesses) == len(report["changes"]), (report, guesses)
    assert all(guess == (first_streamed_middle,) for guess in guesses), guesses
    pipe.release()

def test_cancel_mid_step_releases_and_the_next_run_is_whole(base_model, base_pipe, cancel_after):
    request = cached(dataclasses.replace(BASE, batch=1, steps=4), "dbcache:forced=CSSC,first_blocks=2")
    want = base_pipe.generate(request, NullHost()).latents
    for budget in (None, middle_streaming_budget_gb(base_model, request, "cpu")):
        pipe = LocalPipe.load(base_model, LoadOptions(device="cpu", vram_budget_gb=budget, keep_loaded=True))
        counting = cancel_after(10**6)
        pipe.generate(request, counting)
        host = cancel_after(counting.calls_at_last_step - 8)  # a few checks before the steps' end: inside them
        with pytest.raises(Cancelled):
            pipe.generate(request, host)
        if budget is not None:
            assert pipe.memory.dit is None and pipe.parts.dit is None  # released, as without the cache
        assert torch.equal(pipe.generate(request, NullHost()).latents, want)
        pipe.release()


# ------------------------------------------------------------------------------------------ formats and LoRAs
@pytest.mark.parametrize("quant", ["fp8", "q8_0", "nvfp4"])
def test_packed_formats_run_bit_for_bit_at_threshold_zero(base_model, quant):
    pipe = LocalPipe.load(base_model, LoadOptions(device="cpu", quant=quant))
    request = dataclasses.replace(BASE, steps=4, batch=1)
    plain = pipe.generate(request, NullHost())
    assert torch.equal(pipe.generate(cached(request, "dbcache:threshold=0,start=0,first_blocks=2"),
                                     NullHost()).latents, plain.latents)
    assert pipe.generate(cached(request, "dbcache:forced=CSSC,first_blocks=2"),
                         NullHost()).info["step_cache"]["steps_skipped"] == 2


@pytest.mark.parametrize("mode", ["merge", "branch"])
def test_loras_merged_or_branched_run_bit_for_bit_at_threshold_zero_and_views_keep_both(base_model, base_pipe,
                                                                                       tmp_path, mode):
    import lora_files as lf

    lora = lf.write_ai_toolkit(tmp_path / "l.safetensors",
                               lf.random_lora(lf.linear_shapes(lf.dit_weights(base_model)), 2, seed=9))
    request = dataclasses.replace(BASE, steps=4, batch=1)
    with_lora = base_pipe.with_loras([(lora, 0.8)], mode=mode)
    plain = with_lora.generate(request, NullHost())
    cached_view = with_lora.with_step_cache("dbcache:threshold=0,start=0,first_blocks=2")
    assert isinstance(cached_view, StepCachePipe) and cached_view.loras == with_lora.loras
    result = cached_view.generate(request, NullHost())
    assert torch.equal(result.latents, plain.latents) and "step_cache" in result.info
    assert result.info["loras"][0]["mode"] == mode
    # a LoRA after the cache keeps the cache; the base pipe itself stays uncached
    later = base_pipe.with_step_cache("dbcache:forced=CSSC,first_blocks=2").with_loras([(lora, 0.8)], mode=mode)
    assert isinstance(later, StepCachePipe) and later.generate(request, NullHost()).info["step_cache"]["schedule"] \
        == "CSSC"
    assert "step_cache" not in base_pipe.generate(request, NullHost()).info


# ----------------------------------------------------------------------------------------- views and the node
def test_views_replace_rather_than_stack_and_a_remote_pipe_refuses(base_pipe):
    first = with_step_cache(base_pipe, "dbcache")
    second = first.with_step_cache("fbcache:threshold=0.2")
    assert second.inner is base_pipe and second.step_cache.method == "fbcache"
    assert first.with_step_cache(None) is base_pipe and "step cache: dbcache F8B0" in first.describe()

    class Remote:
        kind = "remote"

        def generate(self, request, host):
            raise AssertionError("never run")

    with pytest.raises(InvalidInputError, match="step caching runs only on a local pipe"):
        with_step_cache(Remote(), "dbcache")
    from ernie_image.runtime.step_cache.view import refuse_remote

    with pytest.raises(InvalidInputError, match="only on a local pipe"):
        refuse_remote(cached(BASE, "dbcache"))
    with pytest.raises(InvalidInputError, match="step_cache 'dbcache' is not a StepCacheConfig"):
        dataclasses.replace(BASE, step_cache="dbcache").validate()
    with pytest.raises(InvalidInputError, match="forced schedule has 3 letters for a run of 8 steps: give 8 letters"):
        cached(BASE, "dbcache:forced=CSC").validate()


def test_the_node_makes_the_view_and_names_no_step_count_it_cannot_know(base_pipe):
    """The node runs before the Sampler that decides the steps: its text gives the window as fractions of the
    steps, whatever the model's default step count; the Sampler's text after a run names the steps it ran."""
    from ernie_image.nodes.step_cache import ErnieImageStepCache

    node = ErnieImageStepCache()
    out = node.apply(base_pipe, "dbcache", 0.1, 0.15, 0.95, 2, first_blocks=4, last_blocks=1)
    view = out["result"][0]
    assert view.step_cache == StepCacheConfig(threshold=0.1, max_skips=2, first_blocks=4, last_blocks=1)
    assert out["ui"]["text"][0] == "dbcache F4B1, threshold 0.1, steps 15%-95%, at most 2 skips in a row"
    assert node.apply(base_pipe, "fbcache", 0.08, 0.15, 0.95, 3, first_blocks=1, last_blocks=0)["result"][0] \
        .step_cache.probe_blocks == 1
    assert node.apply(view, "off", 0.08, 0.15, 0.95, 3)["result"][0] is base_pipe
    with pytest.raises(InvalidInputError, match="threshold nan is not allowed"):
        node.apply(base_pipe, "dbcache", float("nan"), 0.15, 0.95, 3)


@pytest.mark.parametrize("default_steps", [50, 8, 30, None])
def test_the_node_text_is_the_same_whatever_the_pipes_default_steps(base_pipe, default_steps):
    from ernie_image.nodes.step_cache import ErnieImageStepCache

    class DefaultsOf:  # the pipe, with another default step count
        def __init__(self, inner) -> None:
            self.inner = inner
            self.defaults = {} if default_steps is None else {**inner.defaults, "steps": default_steps}

        def __getattr__(self, name):
            return getattr(self.inner, name)

    text = ErnieImageStepCache().apply(DefaultsOf(base_pipe), "dbcache", 0.08, 0.15, 0.95, 3)["ui"]["text"][0]
    assert text == "dbcache F8B0, threshold 0.08, steps 15%-95%, at most 3 skips in a row"


@pytest.mark.parametrize("first_blocks, last_blocks", [(8, 0), (4, 0), (1, 2), (2, 1)])
def test_the_node_refuses_block_counts_fbcache_does_not_run_as_the_cli_does(base_pipe, first_blocks, last_blocks):
    """fbcache is F1B0: block counts it would not run are refused in the node, the CLI and the library alike, in
    one line naming the node's widgets, before anything runs."""
    from ernie_image.nodes.step_cache import ErnieImageStepCache

    blocks = f"F{first_blocks}B{last_blocks}"
    expected = (f"fbcache computes one first block and no last block (F1B0), not {blocks}: set first_blocks to 1 "
                f"and last_blocks to 0, or use dbcache for {blocks}")
    with pytest.raises(InvalidInputError) as node_refusal:
        ErnieImageStepCache().apply(base_pipe, "fbcache", 0.08, 0.15, 0.95, 3, first_blocks=first_blocks,
                                    last_blocks=last_blocks)
    assert str(node_refusal.value) == expected
    with pytest.raises(InvalidInputError) as cli_refusal:
        parse_step_cache(f"fbcache:first_blocks={first_blocks},last_blocks={last_blocks}")
    assert str(cli_refusal.value) == expected
    with pytest.raises(InvalidInputError, match=r"not F\dB\d: set first_blocks to 1"):
        StepCacheConfig("fbcache", first_blocks=first_blocks, last_blocks=last_blocks).validate()


@pytest.mark.parametrize("method, blocks", [("dbcache", "F8B0"), ("fbcache", "F1B0")])
def test_the_nodes_untouched_block_widgets_give_each_method_its_own_counts(base_pipe, method, blocks):
    """Switching the method with the block widgets as the node made them runs that method's own split."""
    from ernie_image.nodes.step_cache import ErnieImageStepCache

    optional = ErnieImageStepCache.INPUT_TYPES()["optional"]
    widgets = {name: spec[1]["default"] for name, spec in optional.items()}
    out = ErnieImageStepCache().apply(base_pipe, method, 0.08, 0.15, 0.95, 3, **widgets)
    assert out["ui"]["text"][0].startswith(f"{method} {blocks},")


def test_the_sampler_node_says_how_many_steps_were_computed(base_pipe):
    from ernie_image.nodes.sampler import ErnieImageSampler
    from ernie_image.nodes.step_cache import ErnieImageStepCache

    view = ErnieImageStepCache().apply(base_pipe, "fbcache", 0.08, 0.15, 0.95, 3, first_blocks=1,
                                       last_blocks=0)["result"][0]
    view = with_step_cache(view, "fbcache:forced=CSSC")  # the node's settings, decisions fixed for the test
    out = ErnieImageSampler().generate(pipe=view, prompt="a red fox", negative_prompt="blurry", resolution="custom",
                                       width=256, height=256, steps=4, cfg=3.0, seed=1, batch_size=1, shift=4.0,
                                       use_pe=False)
    assert "step cache (fbcache F1B0, forced schedule): 2 of 4 steps computed, 2 skipped" in out["ui"]["text"][0]


# -------------------------------------------------------------------------------------------- the command line
def test_the_cli_records_the_cache_and_writes_the_comparison(tmp_path, capsys, tiny_turbo_folder):
    from ernie_image.runtime.cli import main
    from ernie_image.runtime.files.png_output import read_png_settings

    out, compare = tmp_path / "x.png", tmp_path / "compare.png"
    assert main(["generate", "--model-dir", str(tiny_turbo_folder), "--width", "256", "--height", "256",
                 "--steps", "4", "--step-cache", "fbcache:forced=CSSC", "--step-cache-compare", str(compare),
                 "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert captured.out.split() == [str(out), str(compare)]
    assert "2 of 4 steps computed, 2 skipped" in captured.err and "against the uncached image: PSNR" in captured.err
    settings = read_png_settings(out)
    assert settings["step_cache"]["schedule"] == "CSSC" and settings["step_cache"]["method"] == "fbcache"
    side = read_png_settings(compare)
    assert side["comparison"]["panels"] == "uncached | cached | |difference| x8" and side["comparison"]["psnr_db"] > 0
    from PIL import Image

    with Image.open(compare) as image:
        assert image.size == (3 * 256, 256)


@pytest.mark.parametrize("argv, error", [
    (["--step-cache", "dbcache:threshold=x"], "threshold 'x' is not a number"),
    (["--step-cache", "dbcache:threshold"], "setting threshold needs a value: give threshold=VALUE, e.g. "
                                            "dbcache:threshold=0.08\n"),
    (["--step-cache-compare", "c.png"], "--step-cache-compare needs --step-cache METHOD"),
    (["--step-cache", "dbcache", "--server", "http://127.0.0.1:9"], "--step-cache runs on the local model only"),
])
def test_cli_refusals_come_before_any_model_is_read(argv, error, capsys, tmp_path):
    from ernie_image.runtime.cli import main

    assert main(["generate", *argv, "--out", str(tmp_path / "x.png")]) == 2
    assert error in capsys.readouterr().err
