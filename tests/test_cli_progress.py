"""The CLI's progress (cli/console.py): a tqdm bar with its rate and time left on a terminal; in a log, whole lines,
one each tenth of the way or every few seconds, never counts run together; each count names what it counts, the
prompt enhancer's in tokens."""
from __future__ import annotations

import io
import re

import pytest

from ernie_image.runtime.cli import console as console_module
from ernie_image.runtime.cli.commands import main
from ernie_image.runtime.cli.console import Console, ConsoleHost, plain_count
from ernie_image.runtime.core.host import NullHost, show_progress_phase


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def logged_sampling(steps: range, total: int) -> str:
    """What a Console writes into a log for the sampling phase's counts `steps` of `total`."""
    log = io.StringIO()
    console = Console(log)
    console.phase("sampling", "step")
    for step in steps:
        console.progress(step, total)
    return log.getvalue()


def test_a_log_gets_whole_lines_naming_what_is_counted():
    logged = logged_sampling(range(1, 9), 8)
    lines = logged.splitlines()
    assert "\r" not in logged and len(lines) == 8
    assert all(re.fullmatch(rf"sampling: step {n}/8 \(\d+%\)(, .+ left)?", line) for n, line in enumerate(lines, 1))
    assert lines[-1].startswith("sampling: step 8/8 (100%)")


def test_a_long_run_logs_a_line_each_tenth_of_the_way():
    counts = [int(re.match(r"sampling: step (\d+)/1000", line).group(1))
              for line in logged_sampling(range(1, 1001), 1000).splitlines()]
    assert counts == [1, 100, 200, 300, 400, 500, 600, 700, 800, 900, 1000]


def test_a_slow_run_logs_a_line_every_few_seconds(monkeypatch):
    clock = iter(range(0, 10_000, 6))  # six seconds between calls
    monkeypatch.setattr(console_module, "clock", lambda: float(next(clock)))
    lines = logged_sampling(range(1, 6), 1000).splitlines()
    assert [line.split(" (")[0] for line in lines] == [f"sampling: step {n}/1000" for n in range(1, 6)]
    assert lines[1] == "sampling: step 2/1000 (0%), 6.00 s/step, 1:39:48 left"


def test_a_notice_between_counts_is_a_line_of_its_own():
    log = io.StringIO()
    console = Console(log)
    console.phase("sampling", "step")
    console.progress(1, 2)
    console.line("a notice")
    console.progress(2, 2)
    assert [line.split(" (")[0] for line in log.getvalue().splitlines()] == [
        "sampling: step 1/2", "a notice", "sampling: step 2/2"]


def test_a_terminal_gets_a_bar_with_its_rate_and_the_time_left_and_notices_above_it():
    screen = Terminal()
    console = Console(screen)
    console.phase("prompt enhancer", "token")
    console.progress(16, 512)
    console.line("a notice")
    console.progress(32, 512)
    console.end_progress()
    shown = screen.getvalue()
    assert "prompt enhancer:" in shown and "32/512" in shown and "a notice\n" in shown
    assert re.search(r"\[\d\d:\d\d<[\d:?]+, +[\d.?]+(token/s|s/token)\]", shown), shown


def test_the_plain_count_says_the_rate_and_the_time_left():
    assert plain_count("sampling", "step", 3, 8, 1.5) == "sampling: step 3/8 (37%), 2.00 steps/s, 00:02 left"
    assert plain_count("prompt enhancer", "token", 0, 512, 0.0) == "prompt enhancer: token 0/512 (0%)"


def test_hosts_without_progress_phase_are_left_alone_and_the_null_host_records_it():
    class Bare:
        pass

    show_progress_phase(Bare(), "sampling", "step")
    host = NullHost()
    show_progress_phase(host, "sampling", "step")
    assert host.progress_phases == [("sampling", "step")]
    log = io.StringIO()
    console_host = ConsoleHost(console=Console(log))
    show_progress_phase(console_host, "prompt enhancer", "token")
    console_host.progress(16, 512)
    assert log.getvalue().startswith("prompt enhancer: token 16/512")


@pytest.mark.usefixtures("one_thread")
def test_generate_and_the_prompt_enhancer_log_named_counts_one_a_line(tiny_turbo_with_pe, tmp_path, capsys):
    code = main(["generate", "--model-dir", str(tiny_turbo_with_pe), "--device", "cpu", "--width", "256",
                 "--height", "256", "--steps", "3", "--use-pe", "--prompt", "a fox", "--out", str(tmp_path / "x.png")])
    err = capsys.readouterr().err
    assert code == 0 and "\r" not in err, err
    counts = [line for line in err.splitlines() if re.match(r"(sampling|prompt enhancer): ", line)]
    assert [line.split(" (")[0] for line in counts if line.startswith("sampling")] == [
        "sampling: step 1/3", "sampling: step 2/3", "sampling: step 3/3"]
    assert all(re.fullmatch(r"prompt enhancer: token \d+/512 \(\d+%\)(, .+ left)?", line)
               for line in counts if line.startswith("prompt enhancer")), counts
