"""bench/step_cache.py --smoke: the step-cache benchmark end to end on the CPU with a tiny DiT.

The GPU run is the same code at full size; this makes sure it writes every row it promises (each placement, format,
preset and run, with the forced schedules it names), with real timings, and the overhead summary per combination.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


@pytest.fixture(scope="module")
def step_cache_bench():
    sys.path.insert(0, str(BENCH))
    try:
        import step_cache

        assert Path(step_cache.__file__).resolve().parent == BENCH
        yield step_cache
    finally:
        sys.path.remove(str(BENCH))


def test_forced_schedules_spread_the_skips_and_keep_the_ends():
    sys.path.insert(0, str(BENCH))
    try:
        from step_cache import forced_schedule
    finally:
        sys.path.remove(str(BENCH))
    assert forced_schedule(8, 0) == "CCCCCCCC" and forced_schedule(8, 6) == "CSSSSSSC"
    assert forced_schedule(50, 24).count("S") == 24 and forced_schedule(50, 24)[::49] == "CC"
    assert forced_schedule(10, 4) == "CSCSCSCSCC"


def test_smoke_run_writes_every_row_with_its_schedule(step_cache_bench, tmp_path):
    step_cache_bench.main(["--smoke", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "step_cache.json").read_text())
    assert saved["config"]["smoke"] is True and saved["environment"]["torch"]
    rows = [r for r in saved["rows"] if "error" not in r]
    assert not [r for r in saved["rows"] if "error" in r], saved["rows"]
    combos = {(r["placement"].split(" ")[0], r["format"], r["mode"]) for r in rows}
    assert combos == {(p, f, "eager") for p in ("resident", "streamed") for f in ("bf16", "fp8")}
    for combo in combos:
        for preset, settings in saved["config"]["presets"].items():
            steps, skips = settings["steps"], settings["skips"]
            got = {r["run"]: r for r in rows if (r["placement"].split(" ")[0], r["format"], r["mode"]) == combo
                   and r["preset"] == preset}
            assert set(got) == {"uncached", "never skips", "never skips, no sync"} | {f"forced {k}" for k in skips}
            assert got["never skips"]["schedule"] == "C" * steps and got["uncached"]["computed"] == steps
            for k in skips:
                assert got[f"forced {k}"]["schedule"].count("S") == k == got[f"forced {k}"]["skipped"]
            assert all(r["s"] > 0 for r in got.values())
            assert int(got["never skips"]["cache MiB"]) >= 0
    assert len(saved["overhead"]) == len(combos) * len(saved["config"]["presets"])
