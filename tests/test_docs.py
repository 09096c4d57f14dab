"""The README and docs/ as a reader meets them: a short front door, links that lead somewhere, and a headline chart
that is what its JSON draws."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
README = REPO_ROOT / "README.md"
CHART_SCRIPT = REPO_ROOT / "bench" / "headline_chart.py"
CHART = REPO_ROOT / "docs" / "img" / "headline_step_time.svg"
MAX_README_LINES = 260

# [text](target) and ![alt](target); a target ends at whitespace or the closing parenthesis.
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def pages() -> list[Path]:
    return [README, *sorted((REPO_ROOT / "docs").glob("*.md"))]


def heading_anchors(page: Path) -> set[str]:
    """GitHub's anchors for a page's headings: lower case, punctuation dropped, spaces to hyphens, repeats -1, -2."""
    text = FENCE.sub("", page.read_text())
    anchors: set[str] = set()
    for line in text.splitlines():
        match = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        slug = re.sub(r"[^\w\- ]", "", match.group(1).replace("`", "").lower()).replace(" ", "-")
        anchor, n = slug, 0
        while anchor in anchors:
            n += 1
            anchor = f"{slug}-{n}"
        anchors.add(anchor)
    return anchors


def relative_links(page: Path) -> list[str]:
    text = FENCE.sub("", page.read_text())
    return [target for target in LINK.findall(text) if not re.match(r"[a-z][a-z0-9+.-]*:", target)]


def test_the_readme_is_a_front_door_of_at_most_260_lines():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines; move detail to docs/"


def test_the_quick_start_is_two_commands():
    text = README.read_text()
    section = text.split("## Quick start", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block, "README.md's Quick start has no bash block"
    commands = [line for line in block.group(1).splitlines() if line.strip()]
    assert len(commands) == 2, commands
    assert commands[1] == "bash .ci/run"
    assert "ernie-image generate" in commands[0]


def test_every_relative_link_in_the_readme_and_docs_points_to_something_that_exists():
    broken = []
    for page in pages():
        for target in relative_links(page):
            path_part, _, anchor = target.partition("#")
            destination = (page.parent / path_part).resolve() if path_part else page
            if not destination.exists():
                broken.append(f"{page.relative_to(REPO_ROOT)}: {target} (no such file)")
            elif anchor and destination.suffix == ".md" and anchor not in heading_anchors(destination):
                broken.append(f"{page.relative_to(REPO_ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_the_design_pages_layer_map_names_only_what_the_repository_holds():
    layers = FENCE.findall((REPO_ROOT / "docs" / "design.md").read_text())[0]
    named = [line.split()[0] for line in layers.splitlines()[1:-1] if line and not line[0].isspace()]
    assert {"web/", "nodes/", "runtime/", "tests/"} <= set(named)
    assert [name for name in named if not (REPO_ROOT / name).exists()] == []


def test_the_docs_point_nowhere_outside_the_repository():
    outside = [f"{page.relative_to(REPO_ROOT)}: {target}" for page in pages() for target in relative_links(page)
               if REPO_ROOT not in (page.parent / target.partition("#")[0]).resolve().parents
               and (page.parent / target.partition("#")[0]).resolve() != REPO_ROOT]
    assert not outside, outside
    for page in pages():
        assert "../shared" not in page.read_text(), f"{page.name} names a path outside the repository"


def test_the_readme_links_every_docs_page():
    text = README.read_text()
    missing = [page.name for page in pages()[1:] if f"docs/{page.name}" not in text]
    assert not missing, f"README.md does not link {missing}"


def test_the_headline_chart_script_runs_and_the_chart_is_current(tmp_path):
    out = tmp_path / "chart.svg"
    done = subprocess.run([sys.executable, str(CHART_SCRIPT), "--out", str(out)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert out.read_text().startswith("<svg")
    assert out.read_bytes() == CHART.read_bytes(), "docs/img/ is stale: run python3 bench/headline_chart.py"
    check = subprocess.run([sys.executable, str(CHART_SCRIPT), "--check"], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stderr


def test_the_chart_check_fails_on_a_stale_chart(tmp_path):
    stale = tmp_path / "stale.svg"
    stale.write_text("<svg/>\n")
    check = subprocess.run([sys.executable, str(CHART_SCRIPT), "--check", "--out", str(stale)], capture_output=True,
                           text=True, timeout=60)
    assert check.returncode == 1 and "run python3 bench/headline_chart.py" in check.stderr


def test_every_chart_figure_is_in_the_performance_page():
    """The JSON copies dated figures from docs/performance.md; it never holds one of its own."""
    import json

    data = json.loads((REPO_ROOT / "bench" / "results" / "headline.json").read_text())
    performance = (REPO_ROOT / "docs" / "performance.md").read_text()
    missing = [f"{bar['label']}: {bar['ms']}" for group in data["groups"] for bar in group["bars"]
               if f"{bar['ms']:.1f}" not in performance or bar["measured"].split()[0] not in performance]
    assert not missing, missing
