"""What the VRAM plan and the commands around it tell the user is what the run does, in one unit.

- The VAE rows name the tile side the pass runs with, read from the plan's own record (`VaePlan.tile`), which is
  what the run hands the decoder: a whole-image pass above 1536x1536 tiles by itself at the VAE's sample size,
  and a budget too small for the whole image tiles at 512 pixels.
- Budgets and planned memory are GiB everywhere (help, the plan, refusals, the Loader's tooltip); copy speeds are
  GB/s.
- Every step-cache setting a refusal lists is in `--help`.
"""
from __future__ import annotations

import re

import pytest

from ernie_image.runtime.cli.commands import main
from ernie_image.runtime.offload.planner import GiB, plan_memory
from ernie_image.runtime.offload.sizes import ModelSizes
from ernie_image.runtime.offload.workspace import Job, vae_workspace

SIZES = ModelSizes.released("turbo", "bf16")


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def vae_row(table: str, phase: str = "VAE decode") -> str:
    rows = [line for line in table.splitlines() if line.startswith(phase)]
    assert len(rows) == 1, table
    return rows[0]


# ------------------------------------------------------------------------------------------- VAE tiles
class TestVaeTileLabels:
    """`ernie-image plan` at each class of size and budget: the label says the tile the plan decided."""

    CASES = [  # budget GiB, side, placement label, tile the plan records
        (12, 1024, "resident, whole image", None),
        (12, 1536, "resident, whole image", None),  # the largest image decoded whole
        (12, 1552, "resident, 1024-pixel tiles", 1024),  # the next size up tiles by itself (the VAE's sample size)
        (12, 2048, "resident, 1024-pixel tiles", 1024),
        (12, 4096, "resident, 1024-pixel tiles", 1024),
        (80, 2048, "resident, 1024-pixel tiles", 1024),  # room to spare does not change how a large image decodes
        (3, 1024, "loaded per decode, 512-pixel tiles", 512),  # a budget too small for the whole image
    ]

    @pytest.mark.parametrize("budget, side, label, tile", CASES)
    def test_the_plan_command_says_what_the_plan_decided(self, capsys, budget, side, label, tile):
        code, out, err = run(capsys, "plan", "--budget", str(budget), "--width", str(side), "--height", str(side))
        assert code == 0 and err == ""
        row = vae_row(out)
        assert row.startswith(f"VAE decode   {label} "), row
        plan = plan_memory(budget * GiB, Job(side, side), SIZES)
        assert plan.vae.tile == tile  # the record the run reads (LocalPipe.decode)
        work = float(row.split()[-2])
        assert work == round(vae_workspace(SIZES, plan.job, plan.vae.tile) / GiB, 2)  # the tile's work memory

    @pytest.mark.parametrize("budget, side, label, tile", [
        (80, 1024, "resident, whole image", None), (80, 2048, "resident, 1024-pixel tiles", 1024),
        (12, 2048, "loaded for its phase, then dropped, 512-pixel tiles", 512)])
    def test_the_encode_row_too(self, budget, side, label, tile):
        plan = plan_memory(budget * GiB, Job(side, side, encode=True), SIZES)
        assert vae_row(plan.table(), "VAE encode").startswith(f"VAE encode   {label} ")
        assert plan.encode.tile == tile

    @pytest.mark.parametrize("side, label, tile", [(256, "whole image", None), (1552, "256-pixel tiles", 256)])
    def test_a_run_decodes_with_the_tile_its_plan_shows(self, capsys, monkeypatch, tmp_path, side, label, tile):
        """The demo model (VAE sample size 256) on the CPU with a budget: the plan line the run prints and the tile
        the decoder is configured with come from one record."""
        from ernie_image.runtime.model import vae_decode

        monkeypatch.setenv("ERNIE_IMAGE_CACHE", str(tmp_path / "cache"))
        tiles: list = []
        configure = vae_decode.configure_tiling
        monkeypatch.setattr(vae_decode, "configure_tiling", lambda vae, t: (tiles.append(t), configure(vae, t))[1])
        code, out, err = run(capsys, "generate", "--steps", "1", "--width", str(side), "--height", str(side),
                             "--budget", "4", "--out", str(tmp_path / "x.png"))
        assert code == 0, err
        assert tiles == [tile]
        assert vae_row(err).startswith(f"VAE decode   resident, {label} "), err

    @pytest.mark.parametrize("side, label", [(1024, "whole image"), (1552, "256-pixel tiles")])
    def test_the_pipes_description_shows_the_same_label(self, tiny_turbo_folder, side, label):
        """What the Loader's and the Sampler's plan text are made of (LocalPipe.describe)."""
        from ernie_image import GenerationRequest, LoadOptions, LocalPipe, ModelSources

        pipe = LocalPipe.load(ModelSources(model_dir=tiny_turbo_folder), LoadOptions(device="cpu", vram_budget_gb=4))
        text = pipe.describe(GenerationRequest(prompt="", width=side, height=side))
        assert vae_row(text).startswith(f"VAE decode   resident, {label} "), text
        if side == 1024:  # the Loader's own text: the plan of a 1024x1024 image
            assert vae_row(pipe.describe()).startswith("VAE decode   resident, whole image ")


# ------------------------------------------------------------------------------------------- units
GB_NOT_PER_SECOND = re.compile(r"\bGB\b(?!/s)")


class TestOneUnit:
    """Every budget and planned amount a user reads says GiB; GB appears only as GB/s (copy speeds)."""

    OUTPUTS = [
        ("plan", "--budget", "12"),
        ("plan", "--budget", "12", "--step-cache", "dbcache", "--cfg", "4", "--batch", "2"),
        ("plan", "--budget", "12", "--step-cache", "fbcache"),
        ("plan", "--budget", "4", "--width", "2048", "--height", "2048"),  # streamed: the copy per step
    ]
    REFUSALS = [
        (("plan", "--budget", "abc"), "is not a number of GiB"),
        (("plan", "--budget", "0"), "is not a positive number of GiB"),
        (("plan", "--budget", "2"), "needs at least 2.5 GiB of VRAM with everything streamed; the budget is 2.00 GiB"),
        (("plan", "--budget", "4.2", "--cfg", "4", "--batch", "2", "--step-cache", "dbcache"),
         "to 4.8 GiB, or leave out the step cache"),
        (("generate", "--budget", "nan"), "is not a number of GiB"),
        (("generate", "--budget", "0.001"), "needs at least 0.1 GiB of VRAM"),
    ]

    @pytest.mark.parametrize("argv", OUTPUTS)
    def test_plan_output(self, capsys, argv):
        code, out, err = run(capsys, *argv)
        assert code == 0 and err == ""
        assert "GiB" in out and not GB_NOT_PER_SECOND.search(out), out

    @pytest.mark.parametrize("argv, words", REFUSALS)
    def test_refusals(self, capsys, monkeypatch, tmp_path, argv, words):
        monkeypatch.setenv("ERNIE_IMAGE_CACHE", str(tmp_path / "cache"))
        code, out, err = run(capsys, *argv, *(("--out", str(tmp_path / "x.png")) if argv[0] == "generate" else ()))
        assert code == 2 and out == "" and len(err.splitlines()) == 1, err
        assert words in err and not GB_NOT_PER_SECOND.search(err), err

    @pytest.mark.parametrize("command", ["plan", "generate"])
    def test_the_budgets_help(self, capsys, command):
        code, out, _ = run(capsys, command, "--help")
        budget_help = " ".join(out.split("\n  --budget BUDGET", 1)[1].split("\n  --", 1)[0].split())
        assert code == 0 and budget_help.startswith("VRAM budget in GiB (1024 MiB, as nvidia-smi counts)"), budget_help

    def test_the_loaders_tooltip(self):
        from ernie_image.nodes.loader import ErnieImageLoader

        tooltip = ErnieImageLoader.INPUT_TYPES()["required"]["vram_budget_gb"][1]["tooltip"]
        assert tooltip.startswith("GPU memory this model may use, in GiB (1024 MiB, as nvidia-smi counts). ")
        assert not GB_NOT_PER_SECOND.search(tooltip)

    def test_the_library_refusal(self):
        from ernie_image import LoadOptions
        from ernie_image.runtime.core.errors import InvalidInputError

        with pytest.raises(InvalidInputError, match=r"is not a positive number of GiB up to 1e\+06: give the GiB"):
            LoadOptions(vram_budget_gb=-1).validate()


# ------------------------------------------------------------------------------------------- step-cache help
@pytest.mark.parametrize("command", ["generate", "plan"])
def test_every_step_cache_setting_a_refusal_lists_is_in_help(capsys, command):
    code, _, err = run(capsys, command, "--step-cache", "dbcache:speed=9", *(("--budget", "12") if command == "plan"
                                                                            else ()))
    keys = err.split("with a key of ", 1)[1].strip().split(", ")
    assert code == 2 and "forced" in keys and "threshold" in keys, err
    _, out, _ = run(capsys, command, "--help")
    step_cache_help = " ".join(out.split("--step-cache METHOD[:key=value,...]\n", 1)[1].split())
    missing = [key for key in keys if re.search(rf"\b{key}\b", step_cache_help) is None]
    assert missing == [], step_cache_help
    assert "forced (one letter per step, C computed or S skipped, the first and the last C" in step_cache_help


@pytest.mark.parametrize("spec, note, runs", [
    ("dbcache:first_blocks=40", "step cache: F40B0 leaves no block to skip in this 36-block DiT: runs as F35B0", "F35B0"),
    ("dbcache:first_blocks=30,last_blocks=10", "F30B10 leaves no block to skip in this 36-block DiT: runs as F30B5",
     "F30B5"),
    ("dbcache:first_blocks=20,last_blocks=4", None, "F20B4"),
])
def test_plan_says_the_blocks_a_step_cache_runs_as_generate_does(capsys, spec, note, runs):
    code, out, _ = run(capsys, "plan", "--budget", "12", "--step-cache", spec)
    assert code == 0
    assert (note in out) if note else ("leaves no block" not in out), out
    assert f"step cache (dbcache {runs}," in out


@pytest.mark.parametrize("variant, cfg, dit_batch", [("base", 4, 2), ("turbo", 1, 1)])
def test_the_plan_runs_each_model_at_the_cfg_generate_runs_it_at_by_default(capsys, variant, cfg, dit_batch):
    """Base runs at CFG 4, a doubled DiT batch: its plan is that job's, not Turbo's CFG 1."""
    code, out, err = run(capsys, "plan", "--budget", "12", "--variant", variant)
    assert code == 0 and err == "", err
    assert f", CFG {cfg} (DiT batch {dit_batch}, " in out.splitlines()[0], out
