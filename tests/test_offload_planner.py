"""The VRAM planner: released sizes from the configs, placements at real budgets, the too-small error, the CLI."""
from __future__ import annotations

import pytest

from ernie_image.runtime.cli.plan import main_plan
from ernie_image.runtime.core.errors import InvalidInputError, MemoryBudgetError
from ernie_image.runtime.formats.config_json import load_config
from ernie_image.runtime.offload.planner import allocator_slack, GiB, auto_budget, plan_memory, spread
from ernie_image.runtime.offload.sizes import ModelSizes, dit_size, format_bytes
from ernie_image.runtime.offload.workspace import Job, dit_workspace

SIZES = ModelSizes.released("turbo")


def test_sizes_come_from_the_released_configs():
    assert SIZES.dit.layers == 36
    assert SIZES.dit.layer_bytes == 436_224_512  # ERNIE.md: one block in bf16
    assert SIZES.dit.total_bytes == 2 * 8_033_490_048  # 8,033,490,048 parameters
    assert SIZES.text.layers == 25  # hidden_states[-2]: the last of 26 layers never loads
    assert 6.6e9 < SIZES.text.total_bytes < 6.7e9  # ERNIE.md: 6.6 GB of the tower are needed
    with_pe = ModelSizes.released("turbo", with_pe=True)
    assert 6.8e9 < with_pe.pe.total_bytes < 6.9e9  # 3.43B parameters, embedding tied to the head


def test_quantised_formats_shrink_only_the_block_linears():
    q4 = ModelSizes.released("turbo", "q4_k")
    assert q4.dit.stem_bytes == SIZES.dit.stem_bytes
    assert 0.28 < q4.dit.layer_bytes / SIZES.dit.layer_bytes < 0.29  # 0.5625 / 2 plus bf16 norms
    assert ModelSizes.released("turbo", "fp8").dit.layer_bytes < SIZES.dit.layer_bytes // 2 + 20_000
    with pytest.raises(InvalidInputError, match="unknown weight format 'int3'"):
        format_bytes("int3")


def test_dit_norms_and_stem_are_counted_in_the_compute_dtype():
    config = load_config("turbo", "transformer")
    bf16, fp32 = dit_size(config, "bf16", 2), dit_size(config, "fp32", 4)
    assert fp32.stem_bytes == 2 * bf16.stem_bytes and fp32.layer_bytes == 2 * bf16.layer_bytes
    q4_fp32 = dit_size(config, "q4_k", 4)
    assert q4_fp32.stem_bytes == fp32.stem_bytes  # the stem is never quantised
    assert q4_fp32.layer_bytes - ModelSizes.released("turbo", "q4_k").dit.layer_bytes == 2 * (2 * 4096 + 2 * 128)


def test_workspace_scales_with_tokens_batch_and_cfg():
    one = dit_workspace(SIZES, Job(1024, 1024, 1, 1.0))
    cfg = dit_workspace(SIZES, Job(1024, 1024, 1, 4.0))
    batch2_cfg = dit_workspace(SIZES, Job(1024, 1024, 2, 4.0))
    assert 0.5 * GiB < one < 1.0 * GiB
    assert cfg > 1.8 * (one - 192 * 1024**2)
    assert batch2_cfg > 1.9 * (cfg - 192 * 1024**2)
    assert dit_workspace(SIZES, Job(1376, 768)) < dit_workspace(SIZES, Job(1024, 1024)) * 1.05


def test_24_gb_keeps_the_whole_dit_resident_and_streams_the_text_tower():
    plan = plan_memory(24 * GiB, Job(), SIZES)
    assert plan.dit.resident == tuple(range(36)) and plan.dit.slots == 0
    assert plan.text.mode == "streamed" and plan.vae.persistent  # the tower's 6.6 GB do not fit beside the DiT
    assert plan.peak + allocator_slack(plan.budget) <= plan.budget


@pytest.mark.parametrize("budget_gb", [32, 80])
def test_large_budgets_keep_everything_resident(budget_gb):
    plan = plan_memory(budget_gb * GiB, Job(), SIZES)
    assert plan.all_resident
    assert plan.dit.resident == tuple(range(36)) and plan.dit.slots == 0
    assert plan.pinned_bytes == 0
    assert plan.peak <= plan.budget


@pytest.mark.parametrize("budget_gb, fewest, most", [(16, 25, 31), (12, 15, 21), (4, 0, 0)])
def test_small_budgets_stream_some_blocks_and_fit(budget_gb, fewest, most):
    plan = plan_memory(budget_gb * GiB, Job(), SIZES)
    assert fewest <= len(plan.dit.resident) <= most
    assert len(plan.dit.resident) + len(plan.dit.streamed) == 36
    assert plan.dit.slots == 2
    assert plan.text.mode == "streamed"
    assert plan.peak <= plan.budget
    assert plan.pinned_bytes >= plan.dit.copy_bytes_per_step == len(plan.dit.streamed) * 436_224_512


def test_streamed_blocks_are_spread_between_resident_ones():
    plan = plan_memory(12 * GiB, Job(), SIZES)
    gaps = [b - a for a, b in zip(plan.dit.streamed, plan.dit.streamed[1:])]
    assert max(gaps) - min(gaps) <= 1
    assert spread(4, 36) == (4, 13, 22, 31)


@pytest.mark.parametrize("budget_gb", [10, 12, 16])
@pytest.mark.parametrize("first_blocks", [1, 8, 20])
def test_a_step_caches_decision_is_followed_by_resident_blocks(budget_gb, first_blocks):
    """The host waits at the decision before it queues the next block, whose copy cannot start before it (a block
    that may be skipped is not copied): the two blocks after the first Fn stay resident, the rest spread."""
    job = Job(cfg=4.0, step_cache=True, decision_after_blocks=first_blocks)
    plan = plan_memory(budget_gb * GiB, job, SIZES)
    plain = plan_memory(budget_gb * GiB, Job(cfg=4.0, step_cache=True), SIZES)
    assert len(plan.dit.streamed) == len(plain.dit.streamed) > 2
    assert {first_blocks, first_blocks + 1}.isdisjoint(plan.dit.streamed)
    def widest_gap(streamed):
        return max(b - a for a, b in zip(streamed, streamed[1:]))

    assert widest_gap(plan.dit.streamed) <= widest_gap(plain.dit.streamed) + 2  # still spread out


def test_cfg_and_batch_leave_less_room_for_resident_blocks():
    plain = plan_memory(12 * GiB, Job(), SIZES)
    cfg = plan_memory(12 * GiB, Job(cfg=4.0), SIZES)
    cfg_batch = plan_memory(12 * GiB, Job(batch=2, cfg=4.0), SIZES)
    assert len(plain.dit.resident) >= len(cfg.dit.resident) > len(cfg_batch.dit.resident)
    assert cfg_batch.peak <= 12 * GiB


def test_smaller_formats_fit_more_blocks():
    bf16 = plan_memory(12 * GiB, Job(), SIZES)
    fp8 = plan_memory(12 * GiB, Job(), ModelSizes.released("turbo", "fp8"))
    nvfp4 = plan_memory(4 * GiB, Job(), ModelSizes.released("turbo", "nvfp4"))
    assert fp8.dit.resident == tuple(range(36)) and not bf16.dit.resident == tuple(range(36))
    assert plan_memory(4 * GiB, Job(), SIZES).dit.resident == ()
    assert len(nvfp4.dit.resident) > 0 and nvfp4.peak <= 4 * GiB


def test_too_small_budget_names_the_smallest_that_works():
    with pytest.raises(MemoryBudgetError) as error:
        plan_memory(1 * GiB, Job(1024, 1024), SIZES)
    message = str(error.value)
    assert "1024x1024" in message and "budget is 1.00 GiB" in message
    smallest = float(message.split("at least ")[1].split(" GiB")[0])
    assert plan_memory(int(smallest * GiB), Job(1024, 1024), SIZES).peak <= smallest * GiB
    with pytest.raises(MemoryBudgetError):
        plan_memory(int((smallest - 0.2) * GiB), Job(1024, 1024), SIZES)


def test_bigger_jobs_need_bigger_minimum_budgets():
    def smallest(job: Job) -> float:
        with pytest.raises(MemoryBudgetError) as error:
            plan_memory(GiB // 4, job, SIZES)
        return float(str(error.value).split("at least ")[1].split(" GiB")[0])

    assert smallest(Job(1024, 1024)) < smallest(Job(1024, 1024, batch=2, cfg=4.0)) < smallest(Job(2048, 2048, cfg=4.0))


def test_vae_decodes_in_tiles_only_when_the_whole_image_does_not_fit():
    assert plan_memory(12 * GiB, Job(), SIZES).vae.tile is None
    tight = plan_memory(int(2.6 * GiB), Job(), SIZES)
    assert tight.vae.tile == 512 and tight.peak + allocator_slack(tight.budget) <= 2.6 * GiB


def test_prompt_enhancer_loads_for_its_phase_when_it_fits():
    sizes = ModelSizes.released("turbo", with_pe=True)
    assert plan_memory(16 * GiB, Job(use_pe=True), sizes).pe.mode == "phase"
    small = plan_memory(4 * GiB, Job(use_pe=True), sizes)
    assert small.pe.mode == "streamed" and "slow" in small.notes[0]


def test_auto_budget_keeps_a_reserve():
    total = 24 * GiB
    assert auto_budget(20 * GiB, total) == 20 * GiB - int(0.04 * total)
    assert auto_budget(100, total) == 0


def test_table_shows_resident_streamed_bytes_and_copy():
    table = plan_memory(12 * GiB, Job(), SIZES).table(pcie_gbps=55)
    assert "streamed" in table and "resident" in table and "2 buffers" in table
    assert "copy per DiT step" in table and "at 55 GB/s" in table
    assert "pinned host" in table


def test_cli_prints_the_plan(capsys):
    assert main_plan(["--budget", "12", "--width", "1024", "--height", "1024", "--cfg", "4", "--batch", "2"]) == 0
    out = capsys.readouterr().out
    assert "budget 12.00 GiB" in out and "DiT batch 4" in out


@pytest.mark.parametrize("argv,expected", [
    (["--budget", "1", "--width", "1024", "--height", "1024"], "needs at least"),
    (["--budget", "12", "--width", "1000", "--height", "1024"], "multiple of 16"),
    (["--budget", "-3"], "not a positive number"),
    (["--budget", "abc"], "--budget 'abc' is not a number of GiB: give e.g. --budget 12"),  # was a traceback
    (["--budget", "12", "--cfg", "nan"], "--cfg 'nan' is not a number"),  # was accepted
    (["--budget", "12", "--cfg", "101"], "--cfg 101.0 is not allowed: use 0..100"),
])
def test_cli_reports_bad_input_in_one_line_with_exit_code_2(capsys, argv, expected):
    assert main_plan(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], lines


@pytest.mark.parametrize("job, fmt, offered, not_offered", [
    (Job(1024, 1024), "q4_k", ["raise the budget", "lower the size"], ["batch", "smaller weight format"]),
    (Job(256, 256), "nvfp4", ["raise the budget"], ["lower the", "smaller weight format"]),
    (Job(512, 512, batch=2), "bf16", ["lower the size or the batch", "a smaller weight format (q4_k, nvfp4)"], []),
    (Job(1024, 1024), "q8_0", ["a smaller weight format (q4_k, nvfp4)"], []),
])
def test_a_budget_too_small_offers_only_the_fixes_that_lower_this_jobs_minimum(job, fmt, offered, not_offered):
    """Not a smaller weight format than the one in use, nor a batch of one, nor a size at the least one."""
    with pytest.raises(MemoryBudgetError) as refused:
        plan_memory(int(0.5 * GiB), job, ModelSizes.released("turbo", fmt))
    fixes = str(refused.value).rsplit(" GiB: ", 1)[1]
    assert all(fix in fixes for fix in offered) and not any(fix in fixes for fix in not_offered), fixes
