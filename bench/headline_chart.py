"""Draws the README's headline chart from bench/results/headline.json: one DiT step against ComfyUI's native DiT and
diffusers, resident and under VRAM budgets. The SVG is written by hand (no plotting package) and depends only on
the JSON, so the same JSON always gives the same file.

    python3 bench/headline_chart.py            # writes docs/img/headline_step_time.svg
    python3 bench/headline_chart.py --check    # exit 1 when that file is not what the JSON draws

Every figure in the JSON is a dated measurement copied from docs/performance.md; add a figure there first.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from xml.sax.saxutils import escape

REPO_ROOT = Path(__file__).resolve().parent.parent
DATA = REPO_ROOT / "bench" / "results" / "headline.json"
OUT = REPO_ROOT / "docs" / "img" / "headline_step_time.svg"

COLOURS = {"pack": "#2563eb", "comfyui": "#d97706", "diffusers": "#6b7280"}
NAMES = {"pack": "this pack", "comfyui": "ComfyUI native", "diffusers": "diffusers"}
WIDTH = 860
LABEL_W = 360  # the label column, right-aligned against the bars
BAR_X = LABEL_W + 10
BAR_MAX_W = 390
ROW_H = 22
FONT = "font-family=\"DejaVu Sans, Helvetica, Arial, sans-serif\""


def load(path: Path) -> dict:
    data = json.loads(path.read_text())
    for group in data["groups"]:
        for bar in group["bars"]:
            if bar["who"] not in COLOURS:
                raise SystemExit(f"{path}: bar {bar['label']!r} has who={bar['who']!r}; use one of {sorted(COLOURS)}")
            if not (isinstance(bar["ms"], (int, float)) and bar["ms"] > 0 and bar.get("measured")):
                raise SystemExit(f"{path}: bar {bar['label']!r} needs a positive ms and its measured date")
    return data


def text(x: float, y: float, body: str, *, size: int = 12, anchor: str = "start", weight: str = "normal",
         fill: str = "#111827") -> str:
    return (f'<text x="{x:.1f}" y="{y:.1f}" {FONT} font-size="{size}" font-weight="{weight}" '
            f'text-anchor="{anchor}" fill="{fill}">{escape(body)}</text>')


def draw(data: dict) -> str:
    unit = data.get("unit", "ms")
    top = max(bar["ms"] for group in data["groups"] for bar in group["bars"])
    axis_max = math.ceil(top / 50.0) * 50.0
    parts: list[str] = []
    y = 26.0
    parts.append(text(16, y, data["title"], size=15, weight="bold"))
    y += 22
    x = 16.0
    for who in COLOURS:
        parts.append(f'<rect x="{x:.1f}" y="{y - 10:.1f}" width="12" height="12" fill="{COLOURS[who]}"/>')
        parts.append(text(x + 17, y, NAMES[who]))
        x += 30 + 7.2 * len(NAMES[who])
    y += 14
    for group in data["groups"]:
        y += 22
        parts.append(text(16, y, group["title"], size=13, weight="bold"))
        dates = sorted({bar["measured"] for bar in group["bars"]})
        y += 16
        parts.append(text(16, y, f"{group['source']}, {'; '.join(dates)}; {group.get('note', '')}".rstrip("; "),
                          size=11, fill="#4b5563"))
        y += 8
        for bar in group["bars"]:
            width = BAR_MAX_W * bar["ms"] / axis_max
            parts.append(text(LABEL_W, y + 15, bar["label"], anchor="end"))
            parts.append(f'<rect x="{BAR_X}" y="{y + 4:.1f}" width="{width:.1f}" height="{ROW_H - 6}" '
                         f'fill="{COLOURS[bar["who"]]}"/>')
            parts.append(text(BAR_X + width + 6, y + 15, f"{bar['ms']:.1f} {unit}"))
            y += ROW_H
    setup = data["setup"]
    y += 22
    parts.append(text(16, y, f"{setup['gpu']}; torch {setup['torch']}, CUDA {setup['cuda']}, triton {setup['triton']}, "
                             f"Python {setup['python']}, diffusers {setup['diffusers']}", size=11, fill="#4b5563"))
    y += 15
    parts.append(text(16, y, f"{setup['weights']}. Drawn by bench/headline_chart.py from bench/results/headline.json.",
                      size=11, fill="#4b5563"))
    height = int(y + 14)
    head = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
            f'viewBox="0 0 {WIDTH} {height}" role="img" aria-label="{escape(data["title"])}">')
    background = f'<rect x="0" y="0" width="{WIDTH}" height="{height}" fill="#ffffff"/>'
    return "\n".join([head, background, *parts, "</svg>"]) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DATA, help="the figures (default: bench/results/headline.json)")
    parser.add_argument("--out", type=Path, default=OUT, help="the SVG to write (default: docs/img/headline_step_time.svg)")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 when --out differs from the drawing")
    args = parser.parse_args(argv)
    svg = draw(load(args.data))
    if args.check:
        current = args.out.read_text() if args.out.is_file() else None
        if current != svg:
            print(f"{args.out} is not what {args.data} draws: run python3 bench/headline_chart.py", file=sys.stderr)
            return 1
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(svg)
    print(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
