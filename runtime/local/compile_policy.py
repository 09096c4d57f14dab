"""When a LocalPipe compiles its DiT's blocks: at load (`compile=True`), never (`False`), or, by default ("auto"),
once compiling has paid for itself.

Compiled blocks make a DiT call faster (H200, 1024x1024, batch 1: bf16 131 against 151 ms uncompiled, FP8 86-87
against 90-92 ms, every FP8 activation quantised by its own kernel either way) but each process pays for the
compile before its first compiled call: with warm inductor caches about 2.4 s (bf16) and 3.7 s (FP8), with empty
ones 7-16 s (docs/performance.md#the-first-image-after-a-restart).
A user who makes a handful of Turbo images per restart never earns that back. "auto" is the ski-rental rule: run
uncompiled while what the uncompiled calls have cost beyond compiled ones, plus what the job about to run would cost,
stays below the compile's cost; compile before the first job where it no longer does. Whatever the number of jobs,
that spends about twice what the better choice in hindsight would have at most (as far as the estimates hold), and
a single long job (Base: 100 DiT calls at CFG) compiles at once when it alone would pay for it. The compile's cost
is the one from warm caches where inductor's cache holds the blocks already (model/compile_marks.py), else the one
from empty caches: a first install runs uncompiled longer than a restart does.

Where the blocks can compile on a thread beside the run (model/background_compile.py: a resident DiT without LoRAs
whose calls are replayed as CUDA graphs, room in the plan for a second call's activations, no step cache, a job whose
uncompiled DiT calls outlast the compile, so that it overlaps them and not the Python-bound phases around them),
the compile costs the caller what it slows the calls it overlaps (about 0.3 of its wall seconds, measured inside a
pipe), not its seconds, and the calls it overlaps still run uncompiled. That is cheaper than compiling first for
FP8 from empty caches (~6 s against 16 s), not from warm ones (~4 s against 3.7 s) nor for bf16: a job that outlasts
it and whose calls after it pay for it compiles beside its calls; smaller jobs and Turbo compile first, when the rule
says so. Since FP8's uncompiled calls are within 5% of its compiled ones, an FP8 pipe compiles late either way: after
8 Base jobs at 1024x1024 with warm caches, 35 with empty ones, and a batch of eight Base images (72 s of calls, 52 s
of them after the compile) saves 2.6 s, less than the 6 s the compile beside it costs.

The estimate of a job's uncompiled time is per DiT call and image-token row, from the pipe's own uncompiled runs once
it has one, else from the H200's figure (a slower GPU makes uncompiled calls dearer, so it compiles sooner).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

CompileChoice = Union[bool, str]  # True, False or "auto"

# Compiled call time / uncompiled call time, by DiT weight format (H200: bench/eager_graphs.py for bf16; FP8 with
# q/k/v and gate/up stacked as a pipe loads them, bench/fp8_step.py, three runs on 2026-12-03 with every activation
# quantised by its kernel: 86.4-87.2 against 90.2-91.8 ms at batch 1).
# "fp8 apart": FP8 projections each their own GEMM (where the device does not multiply FP8 natively, or the pipe
# is not bf16): 90.4 against 94.0 ms.
COMPILED_CALL_RATIO = {"bf16": 0.87, "fp8": 0.95, "fp8 apart": 0.96}
# A process's compile of the blocks, seconds (H200, 16 cores, bench/cold_start.py): with inductor's caches holding
# them already (model/compile_marks.py), and from empty caches.
COMPILE_SECONDS = {"bf16": 2.4, "fp8": 3.7, "fp8 apart": 3.7}
COLD_COMPILE_SECONDS = {"bf16": 7.0, "fp8": 16.0, "fp8 apart": 16.0}
# The same compile on a thread beside a Base job's uncompiled calls (H200, bench/cold_start.py, FP8, CFG's two text
# lengths: a static and a dynamic-shape graph): its wall seconds, and what it cost the job beyond the uncompiled calls'
# own extra, as a fraction of them (the calls it overlaps run slower; those of a second job, which run eagerly, more).
# bf16 is scaled from FP8 by bench/background_compile.py's ratio of the two (one static graph, nothing else running).
BACKGROUND_COMPILE_SECONDS = {"bf16": 16.4, "fp8": 13.4, "fp8 apart": 13.4}
COLD_BACKGROUND_COMPILE_SECONDS = {"bf16": 19.3, "fp8": 20.0, "fp8 apart": 20.0}
BACKGROUND_SLOWDOWN = 0.3
# Uncompiled seconds per DiT call and image-token row before the pipe has measured its own (H200: 151 ms bf16 for
# one 1024x1024 row of 4096 image tokens; FP8 90 ms, its projections stacked, 94 ms apart).
UNCOMPILED_CALL_ROW_TOKEN_S = {"bf16": 0.151 / 4096, "fp8": 0.090 / 4096, "fp8 apart": 0.094 / 4096}
LATENT_PIXELS = 16  # an image token is 16x16 pixels (the VAE's 8x, then 2x2 patches)
OTHER_FORMAT = "bf16"  # GGUF, NVFP4, fp16, fp32: priced as bf16


@dataclass
class DitWork:
    """A job's DiT work: its calls (steps x call groups), the rows each call runs and the image tokens per row."""
    calls: int
    rows: int
    tokens: int

    @property
    def row_tokens(self) -> int:
        return self.calls * self.rows * self.tokens

    @classmethod
    def of(cls, request, uses_cfg: bool) -> "DitWork":
        """A GenerationRequest's sampling: its steps, each over the batch (doubled by CFG's negative branch)."""
        tokens = (request.width // LATENT_PIXELS) * (request.height // LATENT_PIXELS)
        return cls(request.steps, request.batch * (2 if uses_cfg else 1), tokens)


Placement = Optional[str]  # "beside" the job's calls, "first" (before them) or None (not yet)


class CompilePolicy:
    def __init__(self, choice: CompileChoice, weight_format: str = "bf16", caches_warm: bool = True) -> None:
        if not (isinstance(choice, bool) or choice == "auto"):
            raise ValueError(f"compile {choice!r}: use True, False or 'auto'")
        self.choice = choice
        self.set_format(weight_format)
        self.caches_warm = caches_warm  # whether inductor's caches hold the compile already (compile_marks.py)
        self.spent_s = 0.0  # what the uncompiled calls so far cost beyond compiled ones
        self._measured_row_token_s: Optional[float] = None

    def set_format(self, weight_format: str) -> None:
        self.format = weight_format if weight_format in COMPILE_SECONDS else OTHER_FORMAT

    def compile_s(self, beside: bool = False) -> float:
        """What compiling costs this process: less where inductor's caches hold the blocks already, and only the
        calls it slows where it runs `beside` a job's calls."""
        return BACKGROUND_SLOWDOWN * self.background_s if beside else self.foreground_s

    @property
    def foreground_s(self) -> float:
        return (COMPILE_SECONDS if self.caches_warm else COLD_COMPILE_SECONDS)[self.format]

    def cheaper_in_background(self) -> bool:
        """Whether the compile costs the caller less beside the calls than before them: what it slows the calls it
        overlaps, and what those calls, run uncompiled, cost beyond compiled ones. FP8 from empty caches: ~9 s
        against 16 s; not from warm ones (~6 s against 3.7 s), nor bf16 (~8 s against 7 s from empty caches)."""
        return self.compile_s(beside=True) + self.extra_s(self.background_s) < self.foreground_s

    @property
    def background_s(self) -> float:
        """The wall seconds of the compile beside the calls."""
        return (BACKGROUND_COMPILE_SECONDS if self.caches_warm else COLD_BACKGROUND_COMPILE_SECONDS)[self.format]

    def outlasts_a_background_compile(self, work: DitWork) -> bool:
        """Whether `work`'s DiT calls, uncompiled, last as long as a compile beside them: then the compile overlaps
        them (replayed graphs, which leave Python to the compile's thread) and not the Python-bound phases around
        them (a prompt enhancer beside it ran two to three times slower)."""
        return self.uncompiled_s(work) >= self.background_s

    @property
    def row_token_s(self) -> float:
        if self._measured_row_token_s is not None:
            return self._measured_row_token_s
        return UNCOMPILED_CALL_ROW_TOKEN_S[self.format]

    def uncompiled_s(self, work: DitWork) -> float:
        """`work`'s DiT calls, uncompiled, as estimated."""
        return work.row_tokens * self.row_token_s

    def extra_s(self, uncompiled_s: float) -> float:
        """What `uncompiled_s` of uncompiled DiT calls cost beyond the same calls compiled."""
        return uncompiled_s * (1.0 - COMPILED_CALL_RATIO[self.format])

    def compile_before(self, work: DitWork, beside: bool = False) -> bool:
        """Whether compiling the blocks for a job doing `work` pays (decided by the pipe before its DiT phase):
        before its calls, or `beside` them, where the calls the compile overlaps still run uncompiled."""
        if self.choice != "auto":
            return bool(self.choice)
        uncompiled = self.uncompiled_s(work)
        compiled_part = max(0.0, uncompiled - self.background_s) if beside else uncompiled
        return self.spent_s + self.extra_s(compiled_part) >= self.compile_s(beside)

    def placement(self, work: DitWork, beside_possible: bool) -> Placement:
        """Where the compile goes for a job doing `work`: beside its calls where that is possible (the pipe's
        memory and graphs allow it), costs less than compiling first and pays within the job; else first, where
        that pays; else nowhere yet."""
        if self.choice != "auto":
            return "first" if self.choice else None
        if (beside_possible and self.cheaper_in_background() and self.outlasts_a_background_compile(work)
                and self.compile_before(work, beside=True)):
            return "beside"
        return "first" if self.compile_before(work) else None

    def ran_uncompiled(self, work: DitWork, seconds: float, learn: bool = True) -> None:
        """A job's DiT calls ran uncompiled in `seconds`: count their extra cost, and (`learn`: nothing else slowed
        them, as a compile beside them does) learn this device's speed."""
        if work.row_tokens <= 0 or seconds <= 0:
            return
        self.spent_s += self.extra_s(seconds)
        if learn:
            self._measured_row_token_s = seconds / work.row_tokens
