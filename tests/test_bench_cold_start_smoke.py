"""bench/cold_start.py --tiny: the first-image benchmark end to end on the CPU with the tiny model.

The GPU run is the same code at full size: fresh processes that read the weights from files, three images each.
This checks that each row runs in a process of its own, makes its images and reports every split it promises.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


def test_each_row_is_a_fresh_process_that_reports_every_split(tmp_path, tiny_turbo_with_pe):
    out = tmp_path / "out"
    subprocess.run([sys.executable, str(BENCH / "cold_start.py"), "--tiny", "--out", str(out), "--pe-tokens", "6",
                    "--models", str(tiny_turbo_with_pe),
                    "--schedule", "native:empty:ours-turbo-bf16-pe", "native:warm:ours-turbo-bf16-pe"],
                   check=True, capture_output=True, text=True, timeout=600)
    results = json.loads((out / "cold_start.json").read_text())["results"]
    assert [(r["row"]["caches"], r["row"]["pe"]) for r in results] == [("empty", True), ("warm", True)]
    for result in results:
        assert "error" not in result, result
        splits = ("start_and_imports_s", "open_s", "load_s", "first_image_s", "warm_image_s", "to_first_image_s")
        assert all(result[key] > 0 for key in splits), result
        assert len(result["images_s"]) == 3 and result["warm_image_s"] == result["images_s"][-1]
        assert result["to_second_image_s"] - result["to_first_image_s"] >= result["images_s"][1] - 0.02  # rounding
        assert result["to_first_image_s"] >= result["start_and_imports_s"] + result["first_image_s"] - 0.02  # rounding
        assert set(result["first_phases"]) == {"pe_s", "text_s", "sampling_s", "decode_s"}
    table = (out / "cold_start.md").read_text()
    assert "ours-turbo-bf16-pe" in table and table.count("\n") == 4


@pytest.mark.parametrize("argv, error", [
    (["--schedule", "bogus"], "schedule entry 'bogus': use ALLOCATOR:empty|warm:"),
    (["--schedule", "native:empty:ours-turbo-bf16"], "schedule entry 'native:empty:ours-turbo-bf16'"),
    (["--images", "1"], "--images must be 2 or more"),
])
def test_a_bad_schedule_or_image_count_is_refused_before_any_weights_are_written(tmp_path, argv, error):
    done = subprocess.run([sys.executable, str(BENCH / "cold_start.py"), "--tiny", "--out", str(tmp_path / "out"),
                           *argv], capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and error in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "out").exists()
