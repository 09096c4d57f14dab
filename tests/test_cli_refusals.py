"""`ernie-image generate` and `plan` refuse each class of bad input the same way: exit code 2, one line on stderr
naming the cause and the fix, no traceback, nothing written, and no model built or opened first.

"No model built" is watched by spies on the three ways a run reaches a model: the demo model written to its cache
(`cached_model._build`), a model's files opened (`LocalPipe.load`) and a job run (`LocalPipe.generate`). Where the
steps or the variant can only come from a model's files, the refusal comes after `LocalPipe.load` has read the
headers and before any weight is read (`generate` never starts): those cases say so.
"""
from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from ernie_image.runtime.cli.commands import main
from ernie_image.runtime.cli.plan import PCIE_GBPS_RANGE
from ernie_image.runtime.core.number_text import range_text
from ernie_image.runtime.core.request import (BATCH_RANGE, CFG_RANGE, DENOISE_RANGE, MASK_PIXELS_RANGE,
                                              MAX_NEW_TOKENS_RANGE, SEED_RANGE, SHIFT_RANGE, SIDE_RANGE, STEPS_RANGE,
                                              TEMPERATURE_RANGE, TOP_P_RULE)
from ernie_image.runtime.text.encoder import TOKENS_RANGE

PROGRESS = ("sampling: ", "prompt enhancer: ")


@dataclass
class Spy:
    """The model work a command did, in order."""
    events: list[str] = field(default_factory=list)

    def record(self, name: str, original):
        def spied(*args, **kwargs):
            self.events.append(name)
            return original(*args, **kwargs)

        return spied


@dataclass
class Outcome:
    code: int
    out: str
    err_lines: list[str]
    written: list[str]
    model_work: list[str]

    @property
    def line(self) -> str:
        assert len(self.err_lines) == 1, self.err_lines
        return self.err_lines[0]


@pytest.fixture
def spy(monkeypatch) -> Spy:
    from ernie_image.runtime.demo import cached_model
    from ernie_image.runtime.local.pipe import LocalPipe

    watched = Spy()
    monkeypatch.setattr(cached_model, "_build", watched.record("demo model built", cached_model._build))
    monkeypatch.setattr(LocalPipe, "load", watched.record("model files opened", LocalPipe.load))
    monkeypatch.setattr(LocalPipe, "generate", watched.record("job run", LocalPipe.generate))
    return watched


@pytest.fixture
def outputs(tmp_path) -> Path:
    folder = tmp_path / "outputs"
    folder.mkdir()
    return folder


@pytest.fixture
def empty_cache(tmp_path, monkeypatch) -> Path:
    cache = tmp_path / "cache"
    monkeypatch.setenv("ERNIE_IMAGE_CACHE", str(cache))
    return cache


@pytest.fixture
def run(capsys, spy, outputs, empty_cache):
    """`ernie-image COMMAND ARGS` through the CLI's entry point in this process; `generate` writes to `outputs`."""

    def command(*argv: str) -> Outcome:
        out_given = any(arg == "--out" or arg.startswith("--out=") for arg in argv)
        extra = ["--out", str(outputs / "x.png")] if argv[0] == "generate" and not out_given else []
        code = main([*argv, *extra])
        captured = capsys.readouterr()
        lines = [line for line in captured.err.splitlines() if line.strip() and not line.startswith(PROGRESS)]
        return Outcome(code, captured.out, lines, sorted(p.name for p in outputs.iterdir()), list(spy.events))

    return command


def assert_refused(outcome: Outcome, cause: str, fix: str, model_work: tuple[str, ...] = ()) -> str:
    """Exit code 2, one line `error: CAUSE...: FIX`, nothing written, no model work but `model_work`."""
    assert outcome.code == 2, outcome
    line = outcome.line
    assert line.startswith("error: ") and "Traceback" not in line, line
    assert cause in line, (cause, line)
    assert fix in line and line.index(fix) > line.index(cause), (fix, line)  # the fix follows the cause
    assert outcome.out == "" and outcome.written == [], outcome
    assert tuple(outcome.model_work) == model_work, outcome.model_work
    return line


@pytest.fixture(scope="module")
def built_demo_cache(tmp_path_factory) -> Path:
    """A cache holding the demo model already built: refusals must not wait for it to be opened either."""
    from ernie_image.runtime.demo.cached_model import demo_model_sources

    cache = tmp_path_factory.mktemp("built") / "cache"
    demo_model_sources("turbo", cache)
    return cache


# ------------------------------------------------------------------------------------------- step-cache specs
class TestStepCacheSpecs:
    """Every parse error of --step-cache names the form to give, in generate and plan alike."""

    BAD = [
        ("off:threshold=0.1", "step cache off takes no settings, but 'threshold=0.1' follows it",
         "give off alone, or a method with its settings (e.g. dbcache:threshold=0.12)"),
        ("OFF:max_skips=2", "step cache off takes no settings", "give off alone"),
        ("teacache", "step cache method 'teacache' is not known", "use dbcache, fbcache or off"),
        ("dbcache:speed=9", "step cache setting 'speed=9' is not known", "use key=value with a key of threshold"),
        ("dbcache:threshold", "step cache setting threshold needs a value", "give threshold=VALUE, e.g. "
                                                                            "dbcache:threshold=0.08"),
        ("dbcache:threshold=0.1,threshold=0.2", "step cache setting threshold is given twice (0.1 and 0.2)",
         "give it once"),
        ("dbcache:forced=CSC,forced=CCC", "step cache setting forced is given twice (CSC and CCC)", "give it once"),
        ("dbcache:threshold=fast", "step cache threshold 'fast' is not a number",
         "give e.g. dbcache:threshold=0.08 (0..10; a plain decimal"),
        ("dbcache:max_skips=2.5", "step cache max_skips '2.5' is not a whole number",
         "give e.g. dbcache:max_skips=3 (1..100; digits only)"),
        ("fbcache:first_blocks=x", "step cache first_blocks 'x' is not a whole number",
         "give e.g. fbcache:first_blocks=1"),
        ("dbcache:threshold=-1", "step cache threshold -1.0 is not allowed", "use 0..10"),
        ("dbcache:start=0.9,end=0.2", "step cache start 0.9 is after end 0.2", "give a start no later than the end"),
        ("dbcache:max_skips=0", "step cache max_skips 0 is not allowed", "use a whole number 1..100"),
        ("fbcache:first_blocks=4", "fbcache computes one first block and no last block (F1B0), not F4B0",
         "set first_blocks to 1"),
        ("dbcache:forced=SCC", "step cache forced 'SCC' skips the first or the last step",
         "start and end it with C, e.g. forced=C"),
        ("dbcache:forced=CXC", "step cache forced 'CXC' is not a schedule", "give one letter per step, C computed"),
        ("dbcache:forced=CSCC,threshold=0.5,max_skips=1",
         "step cache forced decides which steps run, so threshold and max_skips would do nothing",
         "give forced without them (e.g. dbcache:forced=CSCC), or leave out forced"),
        ("fbcache:start=0.2,forced=CSC", "step cache forced decides which steps run, so start would do nothing",
         "give forced without it (e.g. fbcache:forced=CSC), or leave out forced"),
    ]

    @pytest.mark.parametrize("spec, cause, fix", BAD)
    def test_generate_refuses_it_before_any_model(self, run, spec, cause, fix):
        assert_refused(run("generate", "--step-cache", spec), cause, fix)

    @pytest.mark.parametrize("spec, cause, fix", BAD)
    def test_plan_refuses_it_in_the_same_words(self, run, spec, cause, fix):
        assert_refused(run("plan", "--budget", "12", "--step-cache", spec), cause, fix)

    @pytest.mark.parametrize("spec, cause, fix", BAD)
    def test_the_fix_is_a_form_to_give(self, spec, cause, fix):
        """The part after the cause says what to do: give, use, set or start a value of the accepted form."""
        assert fix.split()[0] in ("give", "use", "set", "start"), fix


# ------------------------------------------------------------------------------------------- number forms
class TestNumberForms:
    """Numbers are plain decimals: forms Python's int()/float() also take (`1_0`, spaces, nan, inf, other scripts'
    digits) are refused, where `1_0` meant 1.0 would have run at 10."""

    ODD = ["1_0", " 1", "1 ", "nan", "inf", "-inf", "Infinity", "١", "0x10", "1e", "", "1,5"]

    # In a spec, spaces around a value are layout (test_spaces_around_a_setting_are_layout), an empty value "needs a
    # value" (TestStepCacheSpecs) and a comma starts the next setting.
    @pytest.mark.parametrize("text", [text for text in ODD if text.strip() not in ("", "1", "1,5")])
    @pytest.mark.parametrize("setting, kind", [("threshold", "a number"), ("start", "a number"),
                                               ("end", "a number"), ("max_skips", "a whole number"),
                                               ("first_blocks", "a whole number"), ("last_blocks", "a whole number")])
    def test_step_cache_settings(self, run, setting, kind, text):
        assert_refused(run("generate", "--step-cache", f"dbcache:{setting}={text}"),
                       f"step cache {setting} {text.strip()!r} is not {kind}", f"give e.g. dbcache:{setting}=")

    @pytest.mark.parametrize("text", ["0 .1", "0. 1", "1 0"])
    def test_spaces_inside_a_value_are_refused(self, run, text):
        assert_refused(run("generate", "--step-cache", f"dbcache:threshold={text}"),
                       f"step cache threshold {text!r} is not a number", "give e.g. dbcache:threshold=0.08")

    def test_spaces_around_a_setting_are_layout(self):
        from ernie_image.runtime.core.step_cache_config import StepCacheConfig, parse_step_cache

        assert parse_step_cache(" dbcache : threshold = 0.1 , max_skips= 2 ") == StepCacheConfig(
            "dbcache", threshold=0.1, max_skips=2)

    WHOLE_OPTIONS = [("generate", "--width"), ("generate", "--height"), ("generate", "--steps"),
                     ("generate", "--seed"), ("generate", "--batch"), ("generate", "--mask-grow"),
                     ("generate", "--mask-feather"), ("plan", "--width"), ("plan", "--height"), ("plan", "--batch"),
                     ("plan", "--text-tokens")]
    DECIMAL_OPTIONS = [("generate", "--cfg"), ("generate", "--shift"), ("generate", "--denoise"), ("plan", "--cfg"),
                       ("plan", "--pcie-gbps")]

    @pytest.mark.parametrize("text", ODD)
    @pytest.mark.parametrize("command, option", WHOLE_OPTIONS)
    def test_whole_number_options(self, run, command, option, text):
        assert_refused(run(command, f"{option}={text}", *self._needed(command)),
                       f"{option} {text!r} is not a whole number", f"give digits only, e.g. {option} ")

    @pytest.mark.parametrize("text", [t for t in ODD if t not in ("1e", "")] + ["1.5", "2e3"])
    def test_a_decimal_is_not_a_whole_number(self, run, text):
        assert_refused(run("generate", f"--steps={text}"), f"--steps {text!r} is not a whole number", "digits only")

    @pytest.mark.parametrize("text", ODD)
    @pytest.mark.parametrize("command, option", DECIMAL_OPTIONS)
    def test_decimal_options(self, run, command, option, text):
        assert_refused(run(command, f"{option}={text}", *self._needed(command)),
                       f"{option} {text!r} is not a number", f"give a plain decimal, e.g. {option} ")

    @pytest.mark.parametrize("command", ["generate", "plan"])
    @pytest.mark.parametrize("text", ODD)
    def test_the_budget(self, run, command, text):
        assert_refused(run(command, f"--budget={text}"), f"--budget {text!r} is not a number of GiB",
                       "give e.g. --budget 12 (an optional sign, digits, one '.', an optional exponent; no '_', "
                       "spaces, "
                       "nan or inf), or auto")

    ENHANCE_WHOLE = [("enhance", "--width"), ("enhance", "--height"), ("enhance", "--seed"),
                     ("enhance", "--max-new-tokens")]
    ENHANCE_DECIMAL = [("enhance", "--temperature")]
    # The range each number option takes, as its help and its refusals say it: the constants the checks use.
    RANGES = {("generate", "--width"): SIDE_RANGE, ("generate", "--height"): SIDE_RANGE,
              ("generate", "--steps"): STEPS_RANGE, ("generate", "--cfg"): CFG_RANGE,
              ("generate", "--shift"): SHIFT_RANGE, ("generate", "--seed"): SEED_RANGE,
              ("generate", "--batch"): BATCH_RANGE, ("generate", "--denoise"): DENOISE_RANGE,
              ("generate", "--mask-grow"): MASK_PIXELS_RANGE, ("generate", "--mask-feather"): MASK_PIXELS_RANGE,
              ("plan", "--width"): SIDE_RANGE, ("plan", "--height"): SIDE_RANGE, ("plan", "--batch"): BATCH_RANGE,
              ("plan", "--cfg"): CFG_RANGE, ("plan", "--text-tokens"): TOKENS_RANGE,
              ("plan", "--pcie-gbps"): PCIE_GBPS_RANGE,
              ("enhance", "--width"): SIDE_RANGE, ("enhance", "--height"): SIDE_RANGE,
              ("enhance", "--seed"): SEED_RANGE, ("enhance", "--temperature"): TEMPERATURE_RANGE,
              ("enhance", "--max-new-tokens"): MAX_NEW_TOKENS_RANGE}
    OPEN_RANGES = {("enhance", "--top-p"): TOP_P_RULE}  # open at 0: no LOW..HIGH, so said in words

    @pytest.mark.parametrize("command", ["generate", "plan", "enhance"])
    def test_every_number_option_has_a_range(self, command):
        assert set(_number_options(command)) == {option for named, option in [*self.RANGES, *self.OPEN_RANGES]
                                                 if named == command}

    @pytest.mark.parametrize("command, option", list(RANGES) + list(OPEN_RANGES))
    def test_each_states_its_range_in_its_help(self, command, option):
        allowed = self.RANGES.get((command, option))
        assert (self.OPEN_RANGES.get((command, option)) or range_text(allowed)) in _help_of(command, option)

    def test_the_shift_says_its_default_is_baidus(self):
        assert _help_of("generate", "--shift").endswith(f"{range_text(SHIFT_RANGE)} (default 4.0, Baidu's)")

    # float() reads these as inf or -inf: the refusal quotes what was typed, not "inf", and the option's range.
    TOO_LARGE = ["1e400", "-1e999", "+" + "9" * 400]

    @pytest.mark.parametrize("text", TOO_LARGE)
    @pytest.mark.parametrize("command, option", DECIMAL_OPTIONS + ENHANCE_DECIMAL)
    def test_a_number_past_floats_range_is_refused_quoting_it_with_the_options_range(self, run, command, option,
                                                                                     text):
        outcome = run(command, f"{option}={text}", *self._needed(command))
        assert_refused(outcome, f"{option} {_quoted(text)} is not allowed",
                       f"use {range_text(self.RANGES[command, option])}")
        assert " inf" not in outcome.line

    @pytest.mark.parametrize("command", ["generate", "plan"])
    @pytest.mark.parametrize("text", TOO_LARGE)
    def test_a_budget_past_floats_range_is_refused_as_any_budget_out_of_range(self, run, command, text):
        assert_refused(run(command, f"--budget={text}"), f"--budget {_quoted(text)} is not a positive number of GiB "
                       "up to 1e+06", "give the GiB the pipe may use, or auto")

    @pytest.mark.parametrize("option, least", [("--connect-timeout", "more than 0"), ("--read-timeout", "more than 0"),
                                               ("--wait-for-servers", "0 or more")])
    @pytest.mark.parametrize("text", TOO_LARGE)
    def test_a_server_timeout_past_floats_range_is_refused_as_any_timeout_out_of_range(self, run, option, least,
                                                                                       text):
        assert_refused(run("generate", "--server", "http://127.0.0.1:9", f"{option}={text}"),
                       f"{option} {_quoted(text)} is not allowed", f"give a finite number of seconds, {least}")

    @pytest.mark.parametrize("setting", ["threshold", "start", "end"])
    @pytest.mark.parametrize("text", TOO_LARGE)
    def test_a_step_cache_number_past_floats_range_is_too_large(self, run, setting, text):
        outcome = run("generate", "--step-cache", f"dbcache:{setting}={text}")
        assert_refused(outcome, f"step cache {setting} {_quoted(text)} is too large", "give a number within the range")
        assert " inf" not in outcome.line

    # float() reads these as 0 (or -0): a range without 0 would refuse "0.0", which nobody typed.
    TOO_CLOSE_TO_0 = ["1e-400", "-2.5e-999", "0." + "0" * 400 + "1"]
    RANGE_WITHOUT_0 = [("generate", "--shift"), ("generate", "--denoise"), ("plan", "--pcie-gbps")]
    RANGE_WITH_0 = [("generate", "--cfg"), ("plan", "--cfg"), ("enhance", "--temperature")]

    def test_these_are_the_decimal_options_whose_range_has_no_0_and_those_whose_range_holds_it(self):
        assert sorted(self.RANGE_WITHOUT_0 + self.RANGE_WITH_0) == sorted(self.DECIMAL_OPTIONS + self.ENHANCE_DECIMAL)
        assert all(self.RANGES[key][0] > 0 for key in self.RANGE_WITHOUT_0)
        assert all(self.RANGES[key][0] <= 0 <= self.RANGES[key][1] for key in self.RANGE_WITH_0)

    @pytest.mark.parametrize("text", TOO_CLOSE_TO_0)
    @pytest.mark.parametrize("command, option", RANGE_WITHOUT_0)
    def test_a_number_too_close_to_0_for_float_is_refused_quoting_it_where_the_range_has_no_0(self, run, command,
                                                                                              option, text):
        line = assert_refused(run(command, f"{option}={text}", *self._needed(command)),
                              f"{option} {_quoted(text)} is not allowed",
                              f"use {range_text(self.RANGES[command, option])}")
        assert f"{option} 0.0 " not in line

    @pytest.mark.parametrize("text", TOO_CLOSE_TO_0)
    @pytest.mark.parametrize("command, option", RANGE_WITH_0)
    def test_a_number_too_close_to_0_for_float_reads_as_0_where_the_range_holds_0(self, command, option, text):
        args = _parser(command).parse_args([*self._needed(command), f"{option}={text}"])
        assert str(getattr(args, option[2:].replace("-", "_"))) == "0.0"  # never -0.0

    @pytest.mark.parametrize("setting", ["threshold", "start"])
    def test_a_step_cache_number_too_close_to_0_for_float_reads_as_0_which_its_range_holds(self, setting):
        from ernie_image.runtime.core.step_cache_config import parse_step_cache

        assert str(getattr(parse_step_cache(f"dbcache:{setting}=1e-400"), setting)) == "0.0"

    @pytest.mark.parametrize("text", ["9" * 41, "-" + "1" * 5000, "0" * 60 + "7" * 41])  # int() stops at 4300
    @pytest.mark.parametrize("command, option", WHOLE_OPTIONS + ENHANCE_WHOLE)
    def test_a_whole_number_of_more_digits_than_any_range_is_refused_with_the_range_in_one_short_line(
            self, run, command, option, text):
        line = assert_refused(run(command, f"{option}={text}", *self._needed(command)),
                              f"{option} {_quoted(text)} is not allowed",
                              f"use {range_text(self.RANGES[command, option])}")
        assert len(line) < 200, line

    @pytest.mark.parametrize("text, number", [("0" * 5000 + "8", 8), ("-" + "0" * 5000 + "3", -3), ("+" + "0" * 41, 0)])
    @pytest.mark.parametrize("command, option", WHOLE_OPTIONS + ENHANCE_WHOLE)
    def test_leading_zeros_are_not_digits_however_many(self, command, option, text, number):
        """int() refuses more than 4300 digits, leading zeros counted: they are dropped before it reads the number."""
        args = _parser(command).parse_args([*self._needed(command), f"{option}={text}"])
        assert getattr(args, option[2:].replace("-", "_")) == number

    @pytest.mark.parametrize("setting", ["max_skips", "first_blocks", "last_blocks"])
    def test_a_step_cache_whole_number_of_5000_digits_is_too_large(self, run, setting):
        line = assert_refused(run("generate", "--step-cache", f"dbcache:{setting}={'1' * 5000}"),
                              f"step cache {setting} {_quoted('1' * 5000)} is too large", "give a number within the "
                              "range")
        assert len(line) < 200, line

    def test_a_decimal_past_floats_range_in_5000_digits_is_quoted_shortly(self, run):
        line = assert_refused(run("generate", "--cfg", "9" * 5000), f"--cfg {_quoted('9' * 5000)} is not allowed",
                              f"use {range_text(CFG_RANGE)}")
        assert len(line) < 200, line

    @pytest.mark.parametrize("option", ["--connect-timeout", "--read-timeout", "--wait-for-servers"])
    @pytest.mark.parametrize("text", ["1_0", "nan", "inf", " 5"])
    def test_server_timeouts(self, run, option, text):
        assert_refused(run("generate", "--server", "http://127.0.0.1:9", f"{option}={text}"),
                       f"{option} {text!r} is not a number of seconds", "give e.g. 30 (an optional sign, digits")

    @pytest.mark.parametrize("argv, value", [(("--cfg", "4.5"), 4.5), (("--cfg", ".5"), 0.5), (("--cfg", "+2"), 2.0),
                                             (("--cfg", "1e1"), 10.0), (("--steps", "+7"), 7),
                                             (("--shift", "3."), 3.0), (("--cfg", "-0"), 0.0),
                                             (("--cfg", "-0.0"), 0.0)])
    def test_plain_forms_are_read(self, argv, value):
        from ernie_image.runtime.cli.generate import _add_generate_arguments
        from ernie_image.runtime.cli.parser import OneLineParser

        parser = OneLineParser(prog="test")
        _add_generate_arguments(parser)
        read = getattr(parser.parse_args(list(argv)), argv[0][2:])
        assert read == value and str(read) == str(value)  # -0 reads as 0: a message never shows "-0"

    @pytest.mark.parametrize("command, option", list(RANGES) + list(OPEN_RANGES))
    def test_a_value_past_the_top_of_its_range_is_refused_naming_the_option_and_the_value_as_typed(self, run, command,
                                                                                                   option):
        """Whichever check refuses it (the parser's, the request's, the PE's sampling), the line names the flag, not
        a Python name, and the number as it was typed."""
        high = self.RANGES.get((command, option), (0, 1))[1]
        whole = (command, option) in self.WHOLE_OPTIONS + self.ENHANCE_WHOLE
        text = str(int(high) + 1) if whole else f"{high + 0.5:g}"
        line = run(command, f"{option}={text}", *self._needed(command)).line
        assert line.startswith(f"error: {option} {text} is not allowed"), line

    @staticmethod
    def _needed(command: str) -> tuple[str, ...]:
        """What `command` needs besides the option tested: plan a budget, enhance a prompt."""
        return {"plan": ("--budget", "12"), "enhance": ("--prompt", "a fox")}.get(command, ())


class TestEnhanceNumbers:
    """`ernie-image enhance` reads its numbers as generate and plan do: the same odd forms are refused in the same
    words, before any prompt enhancer is opened or server asked."""

    WHOLE = ["--width", "--height", "--seed", "--max-new-tokens"]
    DECIMAL = ["--temperature", "--top-p"]

    @pytest.mark.parametrize("text", TestNumberForms.ODD)
    @pytest.mark.parametrize("option", WHOLE)
    def test_whole_number_options(self, run, option, text):
        assert_refused(run("enhance", "--prompt", "a fox", f"{option}={text}"),
                       f"{option} {text!r} is not a whole number", f"give digits only, e.g. {option} ")

    @pytest.mark.parametrize("text", TestNumberForms.ODD)
    @pytest.mark.parametrize("option", DECIMAL)
    def test_decimal_options(self, run, option, text):
        assert_refused(run("enhance", "--prompt", "a fox", f"{option}={text}"),
                       f"{option} {text!r} is not a number", f"give a plain decimal, e.g. {option} ")

    @pytest.mark.parametrize("argv, name, value", [
        (("--temperature", ".5"), "temperature", 0.5), (("--top-p", "1e-1"), "top_p", 0.1),
        (("--seed", "+7"), "seed", 7), (("--max-new-tokens", "64"), "max_new_tokens", 64)])
    def test_plain_forms_are_read(self, argv, name, value):
        from ernie_image.runtime.cli.enhance import _parser

        assert getattr(_parser().parse_args(["--prompt", "x", *argv]), name) == value

    def test_a_second_seed_is_refused_as_generate_refuses_it(self, run):
        assert_refused(run("enhance", "--prompt", "a fox", "--seed", "1", "--seed", "2"),
                       "--seed is given twice ('1' and '2') and the command takes one", "give it once")


class TestLoraStrengths:
    """The strength after a .safetensors path is a plain decimal (core/number_text): spaces, `_`, nan, inf and
    other scripts' digits are refused naming the form, before any model is built; a plain one past -10..10 is
    refused as out of range."""

    @pytest.mark.parametrize("text", [" 0.5", "0.5 ", "0 .5", "1_0", "nan", "inf", "-inf", "Infinity", "١", "٠.٥",
                                      "0x1", "1e", "", "1,5", "strong"])
    def test_a_strength_not_in_plain_decimal_form(self, run, tmp_path, text):
        lora = tmp_path / "style.safetensors"
        assert_refused(run("generate", "--lora", f"{lora}:{text}"),
                       f"LoRA style.safetensors strength {text!r} is not a number",
                       f"give --lora {lora}:0.8 (an optional sign, digits, one '.', an optional exponent; no '_', "
                       "spaces, nan or inf), "
                       "or leave ':STRENGTH' out for 1.0")

    @pytest.mark.parametrize("text, shown", [("11", "11.0"), ("-1e2", "-100.0")])
    def test_a_plain_strength_out_of_range(self, run, tmp_path, text, shown):
        assert_refused(run("generate", "--lora", f"{tmp_path / 'style.safetensors'}:{text}"),
                       f"LoRA style.safetensors strength {shown} is not allowed", "use a finite value from -10 to 10")

    @pytest.mark.parametrize("text", ["1e999", "-1e400"])
    def test_a_strength_past_floats_range_is_refused_quoting_it_with_the_range(self, run, tmp_path, text):
        assert_refused(run("generate", "--lora", f"{tmp_path / 'style.safetensors'}:{text}"),
                       f"LoRA style.safetensors strength {text!r} is not allowed", "use -10..10")

    @pytest.mark.parametrize("text, strength", [("0.5", 0.5), ("+.25", 0.25), ("-1", -1.0), ("2e-1", 0.2)])
    def test_plain_strengths_are_read(self, text, strength):
        from ernie_image.runtime.cli.lora_args import parse_lora_argument

        assert parse_lora_argument(f"a.safetensors:{text}").strength == strength


# ------------------------------------------------------------------------------------------- options given twice
class TestRepeatedOptions:
    """An option naming one thing (a file, the prompt, the seed, the step cache, an output, a key) given twice with
    different values is refused: the command takes one and would silently drop the other. The same value twice is
    harmless, and a tuning setting (size, steps, CFG, budget, device...) keeps argparse's rule: the last one wins."""

    ONCE = [
        ("generate", "--step-cache", "dbcache", "fbcache:threshold=0.1",
         "give it once, with all its settings after the method (e.g. dbcache:threshold=0.12,max_skips=2)"),
        ("generate", "--step-cache", "dbcache:forced=CSC", "off", "give it once"),
        ("plan", "--step-cache", "dbcache", "fbcache", "give it once, with all its settings after the method"),
        ("generate", "--prompt", "a fox", "a cat", "give it once (--batch N makes N images of it)"),
        ("generate", "--negative", "blurry", "dark", "give it once"),
        ("generate", "--seed", "1", "2", "give it once (run the command once per seed)"),
        ("generate", "--model-dir", "/m1", "/m2", "give it once"),
        ("generate", "--dit", "a.safetensors", "b.safetensors", "give it once"),
        ("generate", "--text-encoder", "a.safetensors", "b.safetensors", "give it once"),
        ("generate", "--vae", "a.safetensors", "b.safetensors", "give it once"),
        ("generate", "--tokenizer", "t1", "t2", "give it once"),
        ("generate", "--pe", "pe1", "pe2", "give it once"),
        ("generate", "--init-image", "a.png", "b.png", "give it once"),
        ("generate", "--mask", "a.png", "b.png", "give it once"),
        ("generate", "--out", "{out}/a.png", "{out}/b.png", "give it once"),
        ("generate", "--step-cache-compare", "{out}/a.png", "{out}/b.png", "give it once"),
        ("generate", "--pe-url", "http://a:1", "http://b:1", "give it once"),
        ("generate", "--pe-model", "a", "b", "give it once"),
        ("generate", "--api-key-env", "KEY_ONE", "KEY_TWO", "give it once"),
        ("generate", "--api-key-file", "key-one.txt", "key-two.txt", "give it once"),
        ("generate", "--pe-api-key-env", "KEY_ONE", "KEY_TWO", "give it once"),
        ("generate", "--pe-api-key-file", "key-one.txt", "key-two.txt", "give it once"),
    ]

    KEY_OPTIONS = ("--api-key-env", "--api-key-file", "--pe-api-key-env", "--pe-api-key-file")

    @pytest.mark.parametrize("command, option, first, second, fix", ONCE)
    def test_a_second_different_value_is_refused(self, run, outputs, command, option, first, second, fix):
        first, second = (value.format(out=outputs) for value in (first, second))
        values = "with two values" if option in self.KEY_OPTIONS else f"({_quoted(first)} and {_quoted(second)})"
        line = assert_refused(run(command, option, first, f"{option}={second}"),
                              f"{option} is given twice {values} and the command takes one", fix)
        if option in self.KEY_OPTIONS:  # a key pasted where its variable's name or file belongs is never printed
            assert first not in line.split(option, 1)[1] and second not in line.split(option, 1)[1], line

    @pytest.mark.parametrize("option, first, second", [("--dit", "a", "b"),
                                                       ("--out", "{out}/a.safetensors", "{out}/b.safetensors")])
    def test_quantize_refuses_a_second_dit_or_output_rather_than_keeping_the_last(self, run, outputs, option, first,
                                                                                  second):
        first, second = (value.format(out=outputs) for value in (first, second))
        assert_refused(run("quantize", "--format", "fp8", option, first, option, second),
                       f"{option} is given twice ({_quoted(first)} and {_quoted(second)}) and the command takes one",
                       "give it once")

    @pytest.mark.parametrize("name", ["a\tb.safetensors", "a\nb.gguf", "\x1b[31mred.gguf"])
    def test_quantize_refuses_an_output_name_with_a_control_character(self, run, outputs, name):
        assert_refused(run("quantize", "--dit", "d", "--format", "fp8", "--out", str(outputs / name)),
                       "holds a control character", "give a name without one")
        assert list(outputs.iterdir()) == []

    def test_quantize_refuses_an_empty_output_naming_the_files_it_writes(self, run):
        assert_refused(run("quantize", "--dit", "d", "--format", "fp8", "--out="), "--out is empty",
                       "give a .safetensors (fp8, nvfp4) or .gguf (q8_0, q4_k) path")

    def test_a_long_value_is_quoted_without_its_middle(self, run):
        long_prompt = "a fox " * 100 + "at dawn"
        line = assert_refused(run("generate", "--prompt", long_prompt, "--prompt", "a cat"), "--prompt is given "
                              "twice ('a fox a fox a fox a ... a fox a fox at dawn' and 'a cat')", "give it once")
        assert len(line) < 200

    @pytest.mark.parametrize("command, option, first, second, fix", ONCE)
    def test_the_same_value_twice_is_harmless(self, outputs, command, option, first, second, fix):
        first = first.format(out=outputs)
        args = _parser(command).parse_args([option, first, f"{option}={first}"])
        assert str(getattr(args, option[2:].replace("-", "_"))) == first

    SAME_MEANING = [
        ("generate", "--seed", "7", "07"), ("generate", "--seed", "7", "+7"), ("enhance", "--seed", "3", "003"),
        ("generate", "--model-dir", "m", "m/"), ("generate", "--model-dir", "m", "./m"),
        ("generate", "--model-dir", "/a/m", "/a//b/../m/"),
        ("generate", "--dit", "~/d.safetensors", "{home}/d.safetensors"),
        ("generate", "--pe", "pe", "pe/."), ("generate", "--init-image", "a.png", "./a.png"),
        ("generate", "--out", "{out}/a.png", "{out}//a.png"), ("generate", "--out", "a.png", "{cwd}/a.png"),
        ("generate", "--model-dir", "m", "{cwd}/m"),
        ("generate", "--step-cache", "dbcache:threshold=0.1", "dbcache:threshold=.1"),
        ("plan", "--step-cache", "fbcache:max_skips=2,threshold=0.1", "fbcache:threshold=0.10,max_skips=02"),
    ]

    @pytest.mark.parametrize("command, option, first, second", SAME_MEANING,
                             ids=[" ".join(case) for case in SAME_MEANING])
    def test_two_texts_of_one_value_are_one_value(self, outputs, monkeypatch, command, option, first, second):
        """Compared as read: a number by its value, a path as the file system reads it (~ expanded, normalised)."""
        monkeypatch.setenv("HOME", "/home/someone")
        first, second = (text.format(out=outputs, home="/home/someone", cwd=os.getcwd()) for text in (first, second))
        extra = ["--prompt", "x"] if command == "enhance" else []
        name = option[2:].replace("-", "_")
        args = _parser(command).parse_args([*extra, option, first, option, second])
        assert getattr(args, name) == getattr(_parser(command).parse_args([*extra, option, second]), name)

    DIFFERENT_MEANING = [
        ("--seed", "7", "70"), ("--seed", "7", "-7"), ("--model-dir", "m", "m2"), ("--model-dir", "m", "../m"),
        ("--model-dir", "m", "/m"), ("--model-dir", "a/m", "a/M"), ("--pe", "pe", "pe/model.safetensors"),
    ]

    @pytest.mark.parametrize("option, first, second", DIFFERENT_MEANING,
                             ids=[" ".join(case) for case in DIFFERENT_MEANING])
    def test_two_texts_of_two_values_are_refused_quoting_both(self, run, option, first, second):
        assert_refused(run("generate", option, first, option, second),
                       f"{option} is given twice ({first!r} and {second!r}) and the command takes one", "give it once")

    def test_a_parse_starts_afresh_and_leaves_nothing_on_the_namespace(self):
        parser = _parser("generate")
        first = parser.parse_args(["--seed", "1"])
        second = parser.parse_args(["--seed", "2"])  # not "given twice": the first parse is over
        assert (first.seed, second.seed) == (1, 2)
        assert not [name for name in vars(second) if name.startswith("_")]

    @pytest.mark.parametrize("command, option, first, last, cause, fix", [
        ("generate", "--width", "256", "100", "--width 100 is not allowed", "use 256"),
        ("generate", "--steps", "4", "1001", "--steps 1001 is not allowed", "use 1..1000"),
        ("generate", "--cfg", "2", "101", "--cfg 101.0 is not allowed", "use 0..100"),
        ("generate", "--budget", "12", "0", "--budget 0 is not a positive number", "give the GiB the pipe may use"),
        ("generate", "--batch", "2", "0", "--batch 0 is not allowed", "use 1..64"),
        ("generate", "--device", "cpu", "tpu", "--device 'tpu' is not supported", "use auto, cpu, cuda or cuda:N"),
        ("plan", "--width", "512", "100", "--width 100 is not allowed", "use 256"),
        ("plan", "--cfg", "2", "101", "--cfg 101.0 is not allowed", "use 0..100"),
        ("plan", "--batch", "2", "0", "--batch 0 is not allowed", "use 1..64")])
    def test_a_tuning_setting_given_again_overrides_the_first(self, run, command, option, first, last, cause, fix):
        """The last value is the one checked (and the one a run would use: _parser's value below)."""
        outcome = run(command, option, first, option, last, *(("--budget", "12") if command == "plan" else ()))
        assert_refused(outcome, cause, fix)
        assert str(getattr(_parser(command).parse_args([option, last, option, first]), option[2:])) in (first,
                                                                                                        first + ".0")


def _quoted(value: str) -> str:
    """A value as a refusal quotes it: whole up to 40 characters, else its first and last 20."""
    return repr(value if len(value) <= 40 else value[:20] + "..." + value[-20:])


def _parser(command: str):
    from ernie_image.runtime.cli import enhance, generate, plan, quantize

    return {"generate": generate.build_parser, "plan": plan.build_parser, "enhance": enhance._parser,
            "quantize": quantize._parser}[command]()


def _number_options(command: str) -> list[str]:
    from ernie_image.runtime.cli.parser import NumberOption

    return [action.option_strings[0] for action in _parser(command)._actions if isinstance(action, NumberOption)]


def _help_of(command: str, option: str) -> str:
    """The lines `ernie-image COMMAND --help` gives `option` (its name, its metavar, its help), joined in one."""
    lines = _parser(command).format_help().splitlines()
    start = next(index for index, line in enumerate(lines) if line.split()[:1] == [option])
    said = [lines[start]]
    for line in lines[start + 1:]:
        if not line.startswith(" " * 4):  # the next option, or the next group
            break
        said.append(line)
    return " ".join(" ".join(said).split())


# ------------------------------------------------------------------------------------------- prompt enhancer files
class TestPromptEnhancerFiles:
    """--pe and --tokenizer belong to a model the command line gives; the demo model has no prompt enhancer, so a
    --pe FILE without a model was silently unused (and the notice said no PE file was given)."""

    def test_pe_without_a_model_is_refused_naming_the_demo_model(self, run, tmp_path):
        pe = tmp_path / "pe.safetensors"
        pe.write_bytes(b"x")
        for extra in ((), ("--use-pe",)):
            line = assert_refused(run("generate", "--pe", str(pe), *extra), f"--pe {pe} needs a model",
                                  "give the model too, or leave out --pe")
            assert "the tiny demo model runs, which has no prompt enhancer" in line
            assert "`ernie-image enhance --pe FILE --prompt TEXT` shows its rewrite alone" in line

    def test_a_tokenizer_without_a_model_is_refused(self, run, tmp_path):
        assert_refused(run("generate", "--tokenizer", str(tmp_path)), f"--tokenizer {tmp_path} needs a model",
                       "give the model too, or leave out --tokenizer")

    @pytest.mark.parametrize("use_pe", [(), ("--use-pe",)], ids=["without --use-pe", "with --use-pe"])
    def test_pe_with_a_model_runs_and_without_use_pe_a_notice_says_it_is_unused(self, run, tiny_turbo_with_pe,
                                                                                use_pe):
        """A script may give --pe on every run and turn the prompt enhancer on and off with --use-pe."""
        outcome = run("generate", "--model-dir", str(tiny_turbo_with_pe), "--pe", str(tiny_turbo_with_pe / "pe"),
                      "--steps", "1", "--width", "256", "--height", "256", *use_pe)
        assert outcome.code == 0 and outcome.written == ["x.png"], outcome
        told = [line for line in outcome.err_lines if "--pe is not used" in line]
        assert told == ([] if use_pe else ["--pe is not used without --use-pe"])

    def test_pe_and_a_pe_server_together_are_refused(self, run, tiny_turbo_with_pe):
        assert_refused(run("generate", "--model-dir", str(tiny_turbo_with_pe), "--pe", str(tiny_turbo_with_pe / "pe"),
                           "--use-pe", "--pe-url", "http://127.0.0.1:9"),
                       "--pe and --pe-url both name a prompt enhancer", "give one of them")

    def test_the_demo_model_with_use_pe_alone_says_truthfully_that_it_has_none(self, run, built_demo_cache,
                                                                              monkeypatch):
        monkeypatch.setenv("ERNIE_IMAGE_CACHE", str(built_demo_cache))
        outcome = run("generate", "--use-pe", "--steps", "1")
        assert outcome.code == 0, outcome
        assert ("prompt enhancer is on but this model has none (no pe/ folder, PE file or PE server): the prompt is "
                "used as written") in outcome.err_lines


# ------------------------------------------------------------------------------------------- forced schedules
class TestForcedScheduleLength:
    """A forced schedule of another length than the run's steps is refused before any model is built or opened
    wherever the command line tells the steps; where only the model's files name the variant (and so the default
    steps), right after their headers are read, before any weight."""

    FIX = "one per step (C computed, S skipped, the first and the last C), or run 3 steps"

    @pytest.mark.parametrize("argv, steps", [((), 8), (("--steps", "5"), 5), (("--variant", "base"), 50),
                                             (("--variant", "turbo", "--steps", "2"), 2)])
    def test_on_the_demo_model(self, run, argv, steps):
        assert_refused(run("generate", "--step-cache", "dbcache:forced=CSC", *argv),
                       f"step cache forced schedule has 3 letters for a run of {steps} steps",
                       f"give {steps} letters, {self.FIX}")

    def test_on_the_built_demo_model_too(self, run, built_demo_cache, monkeypatch):
        monkeypatch.setenv("ERNIE_IMAGE_CACHE", str(built_demo_cache))
        assert_refused(run("generate", "--step-cache", "dbcache:forced=CSC"),
                       "3 letters for a run of 8 steps", self.FIX)

    @pytest.mark.parametrize("argv, steps", [(("--steps", "6"), 6), (("--variant", "base"), 50)])
    def test_on_a_model_when_the_command_line_tells_the_steps(self, run, tiny_turbo_folder, argv, steps):
        assert_refused(run("generate", "--model-dir", str(tiny_turbo_folder), "--step-cache", "dbcache:forced=CSC",
                           *argv), f"3 letters for a run of {steps} steps", self.FIX)

    def test_on_a_model_whose_files_name_the_variant(self, run, tiny_turbo_folder):
        assert_refused(run("generate", "--model-dir", str(tiny_turbo_folder), "--step-cache", "dbcache:forced=CSC"),
                       "3 letters for a run of 8 steps", self.FIX, model_work=("model files opened",))


# ------------------------------------------------------------------------------------------- budgets
class TestBudgets:
    """One wording for a bad budget in generate and plan (LoadOptions' check), a budget below the job's least one
    refused before the demo model is built or opened, and a truthful notice for a budget on the CPU."""

    @pytest.mark.parametrize("budget, cause", [
        ("abc", "--budget 'abc' is not a number of GiB"), ("1_0", "--budget '1_0' is not a number of GiB"),
        ("nan", "--budget 'nan' is not a number of GiB"),
        ("0", "--budget 0 is not a positive number of GiB up to 1e+06"),
        ("-1", "--budget -1 is not a positive number of GiB"), ("2e6", "--budget 2e6 is not a positive number of GiB")])
    def test_generate_and_plan_refuse_a_bad_budget_in_the_same_line(self, run, budget, cause):
        generate, plan = run("generate", "--budget", budget), run("plan", "--budget", budget)
        assert_refused(generate, cause, "or auto")
        assert_refused(plan, cause, "or auto")
        assert generate.line == plan.line

    def test_a_budget_out_of_range_reads_as_the_library_says_it(self, run):
        line = assert_refused(run("generate", "--budget", "0"), "--budget 0 is not a positive number of GiB up to "
                              "1e+06", "give the GiB the pipe may use, or auto (free VRAM minus a reserve)")
        assert "None" not in line and "vram_budget_gb" not in line

    @pytest.mark.parametrize("cache", ["empty", "built"])
    def test_a_budget_below_the_demo_jobs_least_is_refused_before_the_demo_model(self, run, cache, empty_cache,
                                                                                 built_demo_cache, monkeypatch):
        if cache == "built":
            monkeypatch.setenv("ERNIE_IMAGE_CACHE", str(built_demo_cache))
        assert_refused(run("generate", "--budget", "0.001"),
                       "a 256x256 batch-1 job (CFG 1, DiT fp32) needs at least 0.1 GiB of VRAM with everything "
                       "streamed; the budget is 0.001 GiB", "raise the budget")
        assert not empty_cache.exists()

    def test_a_budget_below_a_models_least_is_refused_before_any_weight(self, run, tiny_turbo_folder):
        assert_refused(run("generate", "--model-dir", str(tiny_turbo_folder), "--budget", "0.001", "--device", "cpu"),
                       "needs at least 0.1 GiB of VRAM", "raise the budget", model_work=("model files opened",))

    def test_plan_shows_what_the_step_cache_adds(self, run):
        outcome = run("plan", "--budget", "12", "--cfg", "4", "--batch", "2", "--step-cache", "dbcache")
        assert outcome.code == 0 and outcome.err_lines == []
        assert "VRAM plan: budget 12.00 GiB" in outcome.out
        assert ("step cache (dbcache F8B0, threshold 0.08, steps 15%-95%, at most 3 skips in a row): its residual "
                "tensors add 0.88 GiB to the DiT's work memory; least budget 4.8 GiB with it, 3.9 GiB without"
                ) in outcome.out
        without = run("plan", "--budget", "12", "--cfg", "4", "--batch", "2")
        assert "step cache" not in without.out and without.out != outcome.out.rsplit("\n", 2)[0]

    def test_plan_refuses_a_budget_only_the_step_cache_puts_out_of_reach_as_generate_does(self, run):
        assert_refused(run("plan", "--budget", "4.2", "--cfg", "4", "--batch", "2", "--step-cache", "dbcache"),
                       "a 1024x1024 batch-2 job (CFG 4, DiT bf16) with a step cache needs at least 4.8 GiB of VRAM "
                       "with everything streamed, 3.9 GiB without it",
                       "raise the budget (--budget) to 4.8 GiB, or leave out the step cache (--step-cache)")
        assert run("plan", "--budget", "4.2", "--cfg", "4", "--batch", "2").code == 0

    def test_plan_says_when_another_phase_decides_the_least_budget(self, run):
        outcome = run("plan", "--budget", "12", "--step-cache", "fbcache")
        assert "least budget 2.5 GiB with it or without (another phase needs more than the DiT)" in outcome.out

    def test_a_budget_on_the_cpu_gets_a_notice_saying_what_it_does(self, run, tiny_turbo_folder):
        argv = ("generate", "--model-dir", str(tiny_turbo_folder), "--device", "cpu", "--steps", "1", "--width",
                "256", "--height", "256")
        notice = ("--budget 4 has no GPU memory to save on the CPU (the weights are in host memory either way): the "
                  "run is placed within it as if the CPU were a GPU, so blocks that do not fit are copied every step, "
                  "which only costs time; leave --budget out without a CUDA device")
        with_budget = run(*argv, "--budget", "4")
        assert with_budget.code == 0 and with_budget.err_lines.count(notice) == 1, with_budget.err_lines
        assert "VRAM plan: budget 4.00 GiB on cpu" in "\n".join(with_budget.err_lines)  # as the notice says
        without = run(*argv)
        assert without.code == 0 and not any("--budget" in line for line in without.err_lines)


# ------------------------------------------------------------------------------------------- the real process
@pytest.mark.parametrize("argv, cause", [
    (["generate", "--step-cache", "off:threshold=0.1"], "step cache off takes no settings"),
    (["generate", "--step-cache", "dbcache", "--step-cache", "fbcache"], "--step-cache is given twice"),
    (["generate", "--step-cache", "dbcache:threshold=1_0"], "step cache threshold '1_0' is not a number"),
    (["plan", "--budget", "1_0"], "--budget '1_0' is not a number of GiB"),
])
def test_the_command_refuses_in_one_line_without_a_traceback(tmp_path, argv, cause):
    """`python -m ernie_image` as a user runs it (this checkout, linked as the package): one line, exit 2, nothing
    written in the folder it runs in, no demo model built."""
    site, work = tmp_path / "site", tmp_path / "work"
    site.mkdir()
    work.mkdir()
    (site / "ernie_image").symlink_to(Path(__file__).resolve().parent.parent, target_is_directory=True)
    env = {**os.environ, "PYTHONPATH": str(site), "ERNIE_IMAGE_CACHE": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-m", "ernie_image", *argv], capture_output=True, text=True, timeout=300,
                          cwd=work, env=env)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: " + cause), done.stderr
    assert done.stdout == "" and list(work.iterdir()) == [] and not (tmp_path / "cache").exists()


@pytest.mark.parametrize("value", ["", " "])
@pytest.mark.parametrize("argv", [("generate", "--model-dir"), ("generate", "--dit"), ("generate", "--text-encoder"),
                                  ("generate", "--vae"), ("generate", "--tokenizer"), ("generate", "--pe"),
                                  ("generate", "--init-image"), ("generate", "--mask"),
                                  ("quantize", "--format", "fp8", "--out", "q.safetensors", "--dit"),
                                  ("enhance", "--prompt", "x", "--model-dir"), ("enhance", "--prompt", "x", "--pe")])
def test_an_empty_path_is_refused_not_read_as_the_current_folder(run, argv, value):
    *command, option = argv
    assert_refused(run(*command, f"{option}={value}"), f"{option} is empty", "give a path")


@pytest.mark.parametrize("argv", [("generate", "--cfg", "-1e2"), ("generate", "--seed", "-5."), ("generate", "--cfg"),
                                  ("plan", "--budget", "12", "--cfg", "-1e-3")])
def test_an_option_left_without_its_value_says_how_to_give_one_that_starts_with_a_dash(run, argv):
    """argparse reads `--cfg -1e2`'s value as another option; `--cfg=-1e2` is read as the value."""
    option = next(arg for arg in reversed(argv) if arg.startswith("--"))
    assert_refused(run(*argv), f"{option} needs a value", f"one that starts with '-' as {option}=VALUE")


@pytest.mark.parametrize("command, suffix", [("generate", ".png"), ("quantize", ".safetensors")])
def test_the_name_a_refusal_suggests_for_a_dash_is_one_the_parser_takes(run, command, suffix):
    needed = ("--dit", "missing", "--format", "fp8") if command == "quantize" else ()
    line = assert_refused(run(command, *needed, "--out", "-"), "--out - is not a", f"give e.g. --out=-{suffix}")
    suggested = line.rsplit("give e.g. ", 1)[1]
    assert str(getattr(_parser(command).parse_args([*needed, suggested]), "out")) == f"-{suffix}"


@pytest.mark.parametrize("argv", [("generate",), ("quantize", "--dit", "missing", "--format", "fp8")])
def test_an_output_name_ending_in_a_slash_is_no_file_name(run, argv, tmp_path):
    """Path() drops a trailing '/': `--out shot.png/` would write the file `shot.png`."""
    out = f"{tmp_path}/shot{'.png' if argv[0] == 'generate' else '.safetensors'}/"
    assert_refused(run(*argv, "--out", out), f"--out {out} ends in '/', as a folder's name does, and is no folder",
                   "without the '/'")
