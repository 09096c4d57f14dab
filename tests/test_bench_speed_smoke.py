"""bench/speed.py --pe-e2e --tiny: the whole-image prompt-enhancer benchmark, end to end on the CPU with tiny models.

The GPU run is the same code with full-size random weights; these tests make sure it writes every row it promises,
with real (positive) timings, the forced rewrite length in both pipelines, and that a row's fresh-process run works.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"

OURS = [("Turbo", "FP8"), ("Turbo", "bf16"), ("Base", "FP8")]
DIFFUSERS = [("Turbo", "bf16 eager"), ("Base", "bf16 eager")]


@pytest.fixture(scope="module")
def pe_e2e():
    sys.path.insert(0, str(BENCH))
    try:
        import pe_e2e

        assert Path(pe_e2e.__file__).resolve().parent == BENCH
        yield pe_e2e
    finally:
        sys.path.remove(str(BENCH))


def _positive(text: str) -> bool:
    return float(text) > 0


def test_smoke_run_writes_every_row_with_positive_phase_times(pe_e2e, tmp_path):
    pe_e2e.main(["--tiny", "--out", str(tmp_path), "--cold-process", "none"])
    record = json.loads((tmp_path / "pe_e2e.json").read_text())
    rows = record["table"]
    got = [(r["pipeline"].split()[0], r["preset"], r["DiT"], r["PE"]) for r in rows]
    want = [("ours", preset, dit, pe) for preset, dit in OURS for pe in ("on", "off")]
    want += [("diffusers", preset, dit, pe) for preset, dit in DIFFUSERS for pe in ("on", "off")]
    assert got == want
    forced = record["config"]["pe_tokens"]
    for row in rows:
        assert _positive(row["warm s"]), row
        for phase in ("text s", "DiT s", "VAE s"):
            assert _positive(row[phase]), (phase, row)
        assert row["pipeline"].startswith("diffusers") and row["preset"] == "Base" or _positive(row["first in process s"])
        if row["PE"] == "on":
            assert _positive(row["PE s"]) and row["PE tokens"] == str(forced), row
        else:
            assert row["PE s"] == "" and row["PE tokens"] == "", row
    targets = {(r["preset"], r["DiT"]): r["target s"] for r in rows if r["pipeline"].startswith("ours") and r["PE"] == "on"}
    assert targets == {("Turbo", "FP8"): "<= 2.0", ("Turbo", "bf16"): "<= 2.4", ("Base", "FP8"): "<= 10.5"}
    for row in record["rows"]:  # the raw images: the phases never add up to more than the wall time
        for image in ([row["first"]] if row["first"] else []) + row["warm"]:
            assert image["wall_s"] > 0 and image["other_s"] > -1e-3, row["key"]
    assert record["environment"]["torch"] and record["config"]["tiny"] is True
    markdown = (tmp_path / "pe_e2e.md").read_text()
    assert markdown.count("\n| ours (LocalPipe) |") == 6 and markdown.count("\n| diffusers ErnieImagePipeline |") == 4
    assert "SMOKE RUN" in markdown and f"exactly {forced} new tokens" in markdown


@pytest.mark.slow
def test_a_row_runs_in_a_fresh_process_through_speed_py(pe_e2e, tmp_path):
    """The cold column's path: speed.py --pe-e2e --cold-child in a new interpreter, timed from its start."""
    args = pe_e2e.argparse.Namespace(tiny=True, size=256, pe_tokens=4, cold_timeout=300)
    results = pe_e2e.fresh_process_runs(args, ["ours-turbo-fp8-on"])
    result = results["ours-turbo-fp8-on"]
    assert "error" not in result, result
    phases_s = result["start_and_imports_s"] + result["build_s"] + result["prepare_dit_s"] + result["image_s"]
    rounding_s = 4 * 0.005  # each figure is rounded to 10 ms on its own
    assert result["process_s"] + rounding_s >= phases_s > 0
    assert result["image"]["pe_tokens"] == 4 and result["image"]["dit_s"] > 0 and result["image"]["vae_s"] > 0


def test_a_row_that_does_not_exist_is_refused_before_anything_runs(pe_e2e, tmp_path):
    with pytest.raises(SystemExit, match="no row 'ours-turbo-fp16-on'; rows are .*ours-turbo-fp8-on"):
        pe_e2e.main(["--tiny", "--out", str(tmp_path), "--cold-process", "ours-turbo-fp16-on"])
    assert list(tmp_path.iterdir()) == []
