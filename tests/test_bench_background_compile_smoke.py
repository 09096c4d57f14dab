"""bench/background_compile.py --tiny: the background-compile measurement end to end on the CPU with a tiny DiT.

The GPU run is the same code at full size with Inductor; this checks that the thread compiles a twin of block 0 while
uncompiled calls run, that the real blocks then compile and agree with the uncompiled output, and that every row
the docstring promises is written with a real timing."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench"


def test_tiny_run_overlaps_uncompiled_calls_with_the_twin_compile_and_writes_every_row(tmp_path):
    sys.path.insert(0, str(BENCH))
    try:
        import background_compile

        assert Path(background_compile.__file__).resolve().parent == BENCH
        args = argparse.Namespace(out=str(tmp_path), format="bf16", batch=2, iters=2, tiny=True)
        report = background_compile.run(args)
    finally:
        sys.path.remove(str(BENCH))
    assert all(check["ok"] for check in report["checks"]), report["checks"]
    rows = {row["row"]: row for row in report["rows"]}
    assert list(rows) == ["uncompiled call, alone", "uncompiled call, while the twin compiles",
                          "background compile + first twin call (wall)", "first call after compile_blocks (the switch)",
                          "compiled call"]
    assert rows["uncompiled call, while the twin compiles"]["calls"] >= 1  # calls whose time overlapped the compile
    assert all(row["ms"] is not None and row["ms"] > 0 for row in rows.values())
    assert json.loads((tmp_path / "background_compile.json").read_text())["rows"] == report["rows"]
