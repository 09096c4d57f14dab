"""When the DiT's blocks are compiled (local/compile_policy.py): at load, never, or once compiling pays for itself.

"auto" is the ski-rental rule: uncompiled while the extra cost of the uncompiled calls so far plus the coming job's
stays below the compile's cost, compiled from the first job where it no longer does. So a long job that alone
would pay for the compile compiles at once, short jobs run uncompiled until they have spent about one compile, and
what is spent uncompiled never reaches the compile's cost (at most about twice the better choice in hindsight).
"""
from __future__ import annotations

import random

import pytest

from ernie_image.runtime.core.host import NullHost
from ernie_image.runtime.core.request import GenerationRequest
from ernie_image.runtime.local.compile_policy import (BACKGROUND_COMPILE_SECONDS, BACKGROUND_SLOWDOWN,
                                                      COLD_BACKGROUND_COMPILE_SECONDS, COLD_COMPILE_SECONDS,
                                                      COMPILE_SECONDS, COMPILED_CALL_RATIO,
                                                      UNCOMPILED_CALL_ROW_TOKEN_S, CompilePolicy, DitWork)
from ernie_image.runtime.local.options import LoadOptions
from ernie_image.runtime.local.pipe import LocalPipe

TURBO = DitWork(calls=8, rows=1, tokens=4096)  # 1024x1024, CFG 1
BASE = DitWork(calls=50, rows=2, tokens=4096)  # 1024x1024, CFG 4: both branches in each call
BASE_BATCH_4 = DitWork(calls=50, rows=8, tokens=4096)
BASE_BATCH_8 = DitWork(calls=50, rows=16, tokens=4096)
LARGEST = DitWork(calls=50, rows=4, tokens=9216)  # the largest job the random sessions below make


def reference_seconds(work: DitWork, fmt: str, slower: float = 1.0) -> float:
    return work.row_tokens * UNCOMPILED_CALL_ROW_TOKEN_S[fmt] * slower


@pytest.mark.parametrize("choice, expected", [(True, True), (False, False)])
def test_true_and_false_mean_always_and_never(choice, expected):
    policy = CompilePolicy(choice, "fp8")
    for _ in range(50):
        assert policy.compile_before(BASE) is expected
        policy.ran_uncompiled(BASE, reference_seconds(BASE, "fp8"))


@pytest.mark.parametrize("fmt, work, jobs_uncompiled", [
    ("fp8", BASE, 8),  # one Base job uncompiled costs ~0.45 s more: eight of them, then compiled
    ("bf16", BASE, 1),
    ("fp8", TURBO, 102),  # a Turbo image saves ~0.04 s compiled: a hundred and two uncompiled first
    ("bf16", TURBO, 15),
])
def test_auto_runs_uncompiled_until_the_next_job_would_pay_for_the_compile(fmt, work, jobs_uncompiled):
    policy = CompilePolicy("auto", fmt)
    uncompiled = 0
    while not policy.compile_before(work):
        policy.ran_uncompiled(work, reference_seconds(work, fmt))
        uncompiled += 1
        assert uncompiled < 1000
    assert uncompiled == jobs_uncompiled
    assert policy.spent_s < COMPILE_SECONDS[fmt]


def test_a_slower_device_learns_its_speed_from_its_own_runs_and_compiles_sooner():
    fast, slow = CompilePolicy("auto", "bf16"), CompilePolicy("auto", "bf16")
    runs = {}
    for name, policy, slower in (("fast", fast, 1.0), ("slow", slow, 3.0)):
        count = 0
        while not policy.compile_before(TURBO):
            policy.ran_uncompiled(TURBO, reference_seconds(TURBO, "bf16", slower))
            count += 1
        runs[name] = count
    assert runs["slow"] < runs["fast"] / 2
    assert slow.row_token_s == pytest.approx(3 * UNCOMPILED_CALL_ROW_TOKEN_S["bf16"])


def test_whatever_the_jobs_a_job_runs_uncompiled_only_while_its_estimate_keeps_the_spend_below_one_compile():
    generator = random.Random(7)
    for _ in range(200):
        fmt = generator.choice(["bf16", "fp8"])
        policy = CompilePolicy("auto", fmt)
        slower = generator.uniform(0.5, 4.0)  # this device against the H200's figure
        while True:
            work = DitWork(generator.choice([1, 4, 8, 20, 50]), generator.choice([1, 2, 4]),
                           generator.choice([1024, 4096, 9216]))
            estimate = policy.extra_s(work.row_tokens * policy.row_token_s)
            if policy.compile_before(work):
                assert policy.spent_s + estimate >= COMPILE_SECONDS[fmt]
                break
            assert policy.spent_s + estimate < COMPILE_SECONDS[fmt]
            policy.ran_uncompiled(work, reference_seconds(work, fmt, slower))
        # Once the device's speed is learnt (from the first job on), the estimates are exact: below one compile and
        # what the first job, estimated at the H200's speed, cost beyond its estimate (at most the largest job's).
        assert policy.spent_s < COMPILE_SECONDS[fmt] + policy.extra_s(reference_seconds(LARGEST, fmt, 4.0))


def test_what_counts_is_the_uncompiled_time_beyond_the_compiled_one():
    policy = CompilePolicy("auto", "fp8")
    policy.ran_uncompiled(TURBO, 2.0)
    assert policy.spent_s == pytest.approx(2.0 * (1 - COMPILED_CALL_RATIO["fp8"]))
    policy.ran_uncompiled(TURBO, 0.0)  # nothing measured: nothing learnt
    assert policy.spent_s == pytest.approx(2.0 * (1 - COMPILED_CALL_RATIO["fp8"]))


def test_other_formats_are_priced_as_bf16_and_a_bad_choice_is_refused():
    assert CompilePolicy("auto", "GGUF Q4_K").format == "bf16"
    with pytest.raises(ValueError, match="True, False or 'auto'"):
        CompilePolicy("yes")


@pytest.mark.parametrize("value", ["sometimes", "yes", "AUTO", None, 1, 0, 2.5])
def test_load_options_refuse_another_compile_value_in_one_line(value):
    from ernie_image.runtime.core.errors import InvalidInputError

    with pytest.raises(InvalidInputError) as refused:
        LoadOptions(compile=value).validate()
    assert str(refused.value) == f"compile {value!r} is not supported: use True, False or 'auto'"


@pytest.mark.parametrize("name", ["keep_loaded", "previews", "pe_compile", "cuda_graphs"])
@pytest.mark.parametrize("value", ["false", "no", "auto", None, 1, 0])
def test_a_switch_is_true_or_false_never_a_value_that_would_read_as_one(name, value):
    """"false" and "no" are truthy strings: taken as given they would switch the option on."""
    from ernie_image.runtime.core.errors import InvalidInputError

    with pytest.raises(InvalidInputError, match=f"^{name} {value!r} is not supported: use True or False$"):
        LoadOptions(**{name: value}).validate()


def test_compile_asked_for_where_it_cannot_run_is_said_in_the_description(tiny_turbo_folder):
    pipe = LocalPipe.load(tiny_turbo_folder, LoadOptions(device="cpu", compile=True))
    assert "eager (compile asked for: it needs a CUDA device and Triton, and cpu has not both)" in pipe.describe()


def test_the_pipe_asks_before_each_dit_phase_and_compiles_once_when_it_pays(tiny_turbo_folder, monkeypatch):
    """CPU: the compiler is made "available" and compile_blocks recorded, so the policy's wiring is what runs."""
    from ernie_image.runtime.local import compile_policy, description, parts

    compiled = []
    monkeypatch.setattr(parts, "compile_available", lambda device: True)
    monkeypatch.setattr(description, "compile_available", lambda device: True)
    monkeypatch.setattr(parts, "compile_blocks", lambda dit: compiled.append(dit) or True)
    monkeypatch.setattr(parts, "caches_hold", lambda weight_format, device: True)  # priced at COMPILE_SECONDS
    monkeypatch.setitem(compile_policy.COMPILE_SECONDS, "bf16", 1e9)  # never pays: stays uncompiled
    pipe = LocalPipe.load(tiny_turbo_folder, LoadOptions(device="cpu", previews=False))
    request = GenerationRequest(prompt="a fox", width=256, height=256, steps=2, seed=1)
    host = NullHost()
    pipe.generate(request, host)
    policy = pipe.parts.compile_policy
    assert compiled == [] and policy.spent_s > 0 and policy.row_token_s != UNCOMPILED_CALL_ROW_TOKEN_S["bf16"]
    assert "compiled once that pays for itself" in pipe.describe()

    monkeypatch.setitem(compile_policy.COMPILE_SECONDS, "bf16", policy.spent_s)  # paid for from the next job on
    pipe.generate(request, host)
    assert compiled == [pipe.parts.dit]
    assert any(message.startswith("compiling the DiT's blocks") for message in host.messages)
    spent = policy.spent_s
    pipe.generate(request, host)
    assert compiled == [pipe.parts.dit] and policy.spent_s == spent  # compiled calls are not counted
    assert "DiT float32, compiled" in pipe.describe()


@pytest.mark.parametrize("quant, native_fp8, expected", [
    ("none", True, "bf16"), ("fp8", True, "fp8"), ("fp8", False, "fp8 apart"), ("q8_0", True, "bf16")])
def test_before_its_dit_is_built_a_job_is_priced_in_the_format_loading_will_make(tiny_turbo_folder, monkeypatch,
                                                                                 quant, native_fp8, expected):
    """Priced as bf16, a Base job quantised to FP8 on load ran uncompiled where it paid for the compile (seen on the
    H200). FP8 is priced with its projections stacked where the device multiplies FP8 natively in bf16 (loading
    stacks them there), else each apart."""
    from ernie_image.runtime.local import parts

    monkeypatch.setattr(parts, "native_fp8_supported", lambda device: native_fp8)
    pipe = LocalPipe.load(tiny_turbo_folder, LoadOptions(device="cpu", quant=quant, dtype="bf16"))
    assert pipe.parts.dit is None and pipe.parts.planned_dit_format() == expected


@pytest.mark.parametrize("fmt, work, warm, jobs_uncompiled", [
    ("fp8", BASE, True, 8),  # a restart: the compile mostly loads from inductor's cache, eight Base jobs first
    ("fp8", BASE, False, 35),  # a first install: the compile from empty caches costs ~16 s, 35 Base jobs first
    ("bf16", TURBO, False, 44),
])
def test_a_compile_from_empty_caches_is_priced_as_one(fmt, work, warm, jobs_uncompiled):
    policy = CompilePolicy("auto", fmt, caches_warm=warm)
    assert policy.compile_s() == (COMPILE_SECONDS if warm else COLD_COMPILE_SECONDS)[fmt]
    uncompiled = 0
    while not policy.compile_before(work):
        policy.ran_uncompiled(work, reference_seconds(work, fmt))
        uncompiled += 1
    assert uncompiled == jobs_uncompiled


def test_the_caches_are_warm_once_this_gpu_and_torch_compiled_that_format_into_them(tmp_path, monkeypatch):
    import torch

    from ernie_image.runtime.model import compile_marks

    cache = tmp_path / "torchinductor"
    monkeypatch.setattr(compile_marks, "inductor_cache_folder", lambda: cache)
    monkeypatch.setattr(compile_marks, "device_name", lambda device: "NVIDIA H200")
    gpu = torch.device("cuda:0")
    assert not compile_marks.caches_hold("fp8", gpu)
    compile_marks.mark_compiled("fp8", gpu)  # no cache folder yet: nothing to vouch for, nothing written
    assert not cache.exists()
    cache.mkdir()
    compile_marks.mark_compiled("fp8", gpu)
    assert compile_marks.caches_hold("fp8", gpu) and not compile_marks.caches_hold("bf16", gpu)
    assert not compile_marks.caches_hold("fp8", torch.device("cpu"))
    monkeypatch.setattr(compile_marks, "device_name", lambda device: "NVIDIA GeForce RTX 4090")
    assert not compile_marks.caches_hold("fp8", gpu)  # another GPU compiles other kernels
    (cache / compile_marks.MARKS_FILE).write_text("[not a mark")
    assert not compile_marks.caches_hold("fp8", gpu)  # a damaged mark: priced as empty caches, and rewritten
    compile_marks.mark_compiled("fp8", gpu)
    assert compile_marks.caches_hold("fp8", gpu) and sorted(p.name for p in cache.iterdir()) == [
        compile_marks.MARKS_FILE]
    (cache / compile_marks.MARKS_FILE).unlink()
    (cache / compile_marks.MARKS_FILE).mkdir()  # a mark that cannot be read or written: no error, no scratch file
    compile_marks.mark_compiled("bf16", gpu)
    assert not compile_marks.caches_hold("bf16", gpu)
    assert sorted(p.name for p in cache.iterdir()) == [compile_marks.MARKS_FILE]


def test_the_cache_folder_is_found_as_inductor_finds_it_and_left_as_it_is(tmp_path, monkeypatch):
    from ernie_image.runtime.model import compile_marks

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "not-yet"))
    assert compile_marks.inductor_cache_folder() == tmp_path / "not-yet"
    assert not (tmp_path / "not-yet").exists()


@pytest.mark.parametrize("fmt, beside_cheaper, at_once, first_only", [("fp8", True, None, None),
                                                                       ("bf16", False, "first", "first")])
def test_from_empty_caches_a_job_that_outlasts_the_compile_compiles_where_that_pays_at_once(
        fmt, beside_cheaper, at_once, first_only):
    """Beside the calls the compile costs what it slows them, and the calls it overlaps still run uncompiled: for
    FP8 from empty caches that is cheaper than compiling first, but a batch of eight Base images (72 s of calls, 52 s
    of them after a 20 s compile) saves 2.6 s compiled, less than the 6 s the compile slows its calls (FP8's
    uncompiled calls are within 5% of the compiled ones): it runs uncompiled. For bf16 compiling first is cheaper,
    and the same batch pays for that at once."""
    policy = CompilePolicy("auto", fmt, caches_warm=False)
    assert policy.outlasts_a_background_compile(BASE_BATCH_8)
    assert policy.cheaper_in_background() is beside_cheaper
    assert policy.placement(BASE_BATCH_8, beside_possible=True) == at_once
    assert policy.placement(BASE_BATCH_8, beside_possible=False) == first_only
    assert policy.compile_s(beside=True) == pytest.approx(BACKGROUND_SLOWDOWN * COLD_BACKGROUND_COMPILE_SECONDS[fmt])
    uncompiled = reference_seconds(BASE_BATCH_8, fmt)
    assert policy.compile_before(BASE_BATCH_8, beside=True) == (
        policy.extra_s(uncompiled - COLD_BACKGROUND_COMPILE_SECONDS[fmt]) >= policy.compile_s(beside=True))


def test_beside_the_calls_the_compile_must_be_paid_for_by_the_calls_after_it():
    """A batch of four Base FP8 images outlasts the compile, but its 16 s of calls after it save 0.8 s, less than the
    6 s the compile slows the others: no compile yet, beside or first."""
    policy = CompilePolicy("auto", "fp8", caches_warm=False)
    assert policy.outlasts_a_background_compile(BASE_BATCH_4) and policy.cheaper_in_background()
    assert not policy.compile_before(BASE_BATCH_4, beside=True)
    assert policy.placement(BASE_BATCH_4, beside_possible=True) is None


@pytest.mark.parametrize("choice, placed", [(True, "first"), (False, None)])
def test_a_compile_asked_for_or_refused_is_never_placed_beside_the_calls(choice, placed):
    assert CompilePolicy(choice, "fp8", caches_warm=False).placement(BASE_BATCH_8, beside_possible=True) == placed


@pytest.mark.parametrize("fmt", ["fp8", "bf16"])
def test_one_base_image_is_over_before_a_compile_from_empty_caches_beside_it_would_be(fmt):
    """It would run on into the next job's phases: the compile is made before a job's calls instead."""
    assert not CompilePolicy("auto", fmt, caches_warm=False).outlasts_a_background_compile(BASE)


@pytest.mark.parametrize("fmt", ["fp8", "bf16"])
def test_from_warm_caches_compiling_first_is_cheaper_than_beside_the_calls(fmt):
    policy = CompilePolicy("auto", fmt, caches_warm=True)
    assert not policy.cheaper_in_background()
    assert BACKGROUND_SLOWDOWN * BACKGROUND_COMPILE_SECONDS[fmt] >= COMPILE_SECONDS[fmt]


@pytest.mark.parametrize("fmt", ["fp8", "bf16"])
def test_a_turbo_job_is_over_before_a_compile_beside_it_would_be(fmt):
    """Its prompt enhancer, text encoder and decoder would run beside the compile, two to three times slower."""
    assert not CompilePolicy("auto", fmt).outlasts_a_background_compile(TURBO)
