"""What a step cache is asked to do: `StepCacheConfig`, its checks, its text forms (CLI spec, PNG metadata).

Two methods, both cache-dit's block-residual cache (vipshop/cache-dit, caching/cache_blocks/pattern_3_4_5.py and
cache_contexts/cache_manager.py), which ERNIE-Image's block layout (36 identical blocks, no separate text stream)
takes as cache-dit's adapter does (ForwardPattern.Pattern_3, block_adapters/adapters.py `ernie_image_adapter`):

- "dbcache": Dual Block Cache, Fn first blocks always computed and compared, Bn last blocks always computed, the
  middle ones skipped when the first blocks' residual barely changed. cache-dit's defaults: F8B0, threshold 0.08
  (cache_contexts/cache_config.py).
- "fbcache": First-Block-Cache, the same with one first block and no last block (F1B0).

The rule (which steps are computed) is step_cache/rule.py's; the run is step_cache/session.py's. No TeaCache or
MagCache: no calibrated ERNIE-Image coefficients or ratios could be verified in a published source (docs/step-cache.md).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Optional

from .errors import InvalidInputError
from .number_text import DECIMAL_RULE, WHOLE_RULE, decimal_from_text, whole_from_text
from .phrases import counted

METHODS = ("dbcache", "fbcache")
OFF = "off"
DEFAULT_FIRST_BLOCKS = {"dbcache": 8, "fbcache": 1}  # cache-dit: Fn_compute_blocks 8; FBCache is F1B0
DEFAULT_THRESHOLD = 0.08  # cache-dit: residual_diff_threshold 0.08
DEFAULT_START = 0.15  # ComfyUI EasyCache's start_percent; ceil(0.15 * 50) = 8 = cache-dit's max_warmup_steps
DEFAULT_END = 0.95  # ComfyUI EasyCache's end_percent
DEFAULT_MAX_SKIPS = 3  # cache-dit's examples' MC3 (max_continuous_cached_steps)
MAX_THRESHOLD = 10.0
MAX_SKIPS_LIMIT = 100
COMPUTE, SKIP = "C", "S"


@dataclass(frozen=True)
class StepCacheConfig:
    """A block-residual step cache for the DiT (see the module docstring and docs/step-cache.md).

    threshold: a step's middle blocks are skipped when the first blocks' residual changed by less than this (mean
    |r - r_last| / mean |r_last|, r_last from the last computed step); 0 never skips (the cache's bookkeeping
    still runs: the same image as without it, bit for bit). start, end: fractions of the steps between which
    steps may be skipped; the first and the last step are always computed. max_skips: at most this many skipped
    steps in a row. first_blocks / last_blocks (Fn / Bn): blocks always computed before / after the skippable
    middle (None: the method's; fbcache is 1 / 0). forced: one letter per step, C computed, S skipped, instead of
    the threshold (for measuring: bench/step_cache.py); the first and last must be C.
    """
    method: str = "dbcache"
    threshold: float = DEFAULT_THRESHOLD
    start: float = DEFAULT_START
    end: float = DEFAULT_END
    max_skips: int = DEFAULT_MAX_SKIPS
    first_blocks: Optional[int] = None
    last_blocks: Optional[int] = None
    forced: Optional[str] = None

    @property
    def probe_blocks(self) -> int:
        return DEFAULT_FIRST_BLOCKS[self.method] if self.first_blocks is None else self.first_blocks

    @property
    def tail_blocks(self) -> int:
        return 0 if self.last_blocks is None else self.last_blocks

    def validate(self, steps: Optional[int] = None) -> None:
        """Refuse a setting the cache cannot run, in one line; `steps`: also check `forced` against them."""
        if self.method not in METHODS:
            raise InvalidInputError(f"step cache method {self.method!r} is not known: use {', '.join(METHODS)} "
                                    f"(or {OFF})").naming("method")
        _number("threshold", self.threshold, 0.0, MAX_THRESHOLD, "0.08 is cache-dit's default; 0 never skips")
        _number("start", self.start, 0.0, 1.0, "a fraction of the steps, e.g. 0.15")
        _number("end", self.end, 0.0, 1.0, "a fraction of the steps, e.g. 0.95")
        if self.start > self.end:
            raise InvalidInputError(f"step cache start {self.start:g} is after end {self.end:g}: give a start no "
                                    "later than the end, e.g. start=0.15,end=0.95").naming("start", "end")
        _whole("max_skips", self.max_skips, 1, MAX_SKIPS_LIMIT)
        if self.method == "fbcache" and (self.first_blocks not in (None, 1) or self.last_blocks not in (None, 0)):
            blocks = f"F{self.probe_blocks}B{self.tail_blocks}"
            raise InvalidInputError(f"fbcache computes one first block and no last block (F1B0), not {blocks}: set "
                                    f"first_blocks to 1 and last_blocks to 0, or use dbcache for {blocks}"
                                    ).naming("first_blocks", "last_blocks")
        if self.first_blocks is not None:
            _whole("first_blocks", self.first_blocks, 1, 1000)
        if self.last_blocks is not None:
            _whole("last_blocks", self.last_blocks, 0, 1000)
        if self.forced is not None:
            _check_forced(self.forced, steps)

    def metadata(self) -> dict[str, Any]:
        """The settings as a PNG records them: every field that decides which steps are computed (a forced
        schedule decides in place of the threshold, window and skip limit, which are left out)."""
        record: dict[str, Any] = {"method": self.method}
        if self.forced is None:
            record.update(threshold=self.threshold, start=self.start, end=self.end, max_skips=self.max_skips)
        record.update(first_blocks=self.probe_blocks, last_blocks=self.tail_blocks)
        if self.forced is not None:
            record["forced"] = self.forced
        return record

    def blocks_in(self, layers: int) -> tuple[int, int]:
        """(first, last): the blocks this cache runs first and last in a DiT of `layers` blocks, which keeps at least
        one first block and one middle block to skip."""
        return fitted_blocks(layers, self.probe_blocks, self.tail_blocks)

    def fit_note(self, layers: int) -> Optional[str]:
        """The notice for settings a DiT of `layers` blocks cannot run as given; None where it can."""
        first, last = self.blocks_in(layers)
        if (first, last) == (self.probe_blocks, self.tail_blocks):
            return None
        return (f"step cache: F{self.probe_blocks}B{self.tail_blocks} leaves no block to skip in this {layers}-block "
                f"DiT: runs as F{first}B{last}")

    def label(self, blocks: Optional[str] = None) -> str:
        """One short phrase: `dbcache F8B0, threshold 0.08, steps 15%-95%, at most 3 skips in a row`; `blocks`:
        the FnBn that ran, where the DiT had fewer blocks than asked for."""
        head = f"{self.method} {blocks or f'F{self.probe_blocks}B{self.tail_blocks}'}"
        if self.forced is not None:
            return f"{head}, forced schedule"
        return (f"{head}, threshold {self.threshold:g}, steps {self.start * 100:g}%-{self.end * 100:g}%, at most "
                f"{self.max_skips} skip{'s' if self.max_skips != 1 else ''} in a row")

    def spec(self) -> str:
        """The CLI form that gives this config again (`parse_step_cache`)."""
        default = StepCacheConfig(self.method)
        unused = _FORCED_DECIDES if self.forced is not None else ()
        changed = [f"{f.name}={getattr(self, f.name)}" for f in fields(self) if f.name != "method"
                   and f.name not in unused and getattr(self, f.name) != getattr(default, f.name)]
        return self.method + (":" + ",".join(changed) if changed else "")


def fitted_blocks(layers: int, first: int, last: int) -> tuple[int, int]:
    """(first, last) blocks asked for, cut to a DiT of `layers` (>= 2) blocks so one first and one middle block
    remain."""
    first = max(1, min(first, layers - 1))
    return first, max(0, min(last, layers - first - 1))


def _number(name: str, value: Any, low: float, high: float, hint: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not low <= value <= high:
        raise InvalidInputError(f"step cache {name} {value!r} is not allowed: use {low:g}..{high:g} ({hint})"
                                ).naming(name)


def _whole(name: str, value: Any, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise InvalidInputError(f"step cache {name} {value!r} is not allowed: use a whole number {low}..{high}"
                                ).naming(name)


def _check_forced(forced: Any, steps: Optional[int]) -> None:
    example = _schedule_example(steps or 4)
    if not isinstance(forced, str) or not forced or set(forced) - {COMPUTE, SKIP}:
        raise InvalidInputError(f"step cache forced {forced!r} is not a schedule: give one letter per step, "
                                f"{COMPUTE} computed or {SKIP} skipped, e.g. forced={example}").naming("forced")
    if forced[0] != COMPUTE or forced[-1] != COMPUTE:
        raise InvalidInputError(f"step cache forced {forced!r} skips the first or the last step: both are always "
                                f"computed, so start and end it with {COMPUTE}, e.g. forced={example}"
                                ).naming("forced")
    if steps is not None and len(forced) != steps:
        raise InvalidInputError(f"step cache forced schedule has {counted(len(forced), 'letter')} for a run of "
                                f"{counted(steps, 'step')}: give {counted(steps, 'letter')}, one per step ({COMPUTE} "
                                f"computed, {SKIP} skipped, the first and the last {COMPUTE}), or run "
                                f"{counted(len(forced), 'step')}").naming("forced")


_FIELD_TYPES = {"threshold": float, "start": float, "end": float, "max_skips": int, "first_blocks": int,
                "last_blocks": int, "forced": str}
# The values each numeric setting takes, as its refusals say them (validate() holds the same ranges).
_RANGES = {"threshold": f"0..{MAX_THRESHOLD:g}", "start": "0..1", "end": "0..1", "max_skips": f"1..{MAX_SKIPS_LIMIT}",
           "first_blocks": "1..1000", "last_blocks": "0..1000"}


def parse_step_cache(text: str) -> Optional[StepCacheConfig]:
    """`METHOD[:key=value,...]` (the CLI's --step-cache), e.g. `dbcache`, `fbcache:threshold=0.12`,
    `dbcache:first_blocks=4,max_skips=2`; `off` gives None. A setting given twice with two values is refused (the
    same value twice is harmless, as the CLI's repeated options are). Checked in full (one-line InvalidInputError
    naming the form to give). Numbers are plain decimals (number_text): `1_0`, `nan`, `inf` are refused, not read as numbers."""
    if not isinstance(text, str):
        raise InvalidInputError(f"step cache {text!r} is not text: give METHOD[:key=value,...]")
    method, sep, rest = text.strip().partition(":")
    method = method.strip().lower()
    if method == OFF:
        if rest.strip():
            raise InvalidInputError(f"step cache {OFF} takes no settings, but {rest.strip()!r} follows it: give "
                                    f"{OFF} alone, or a method with its settings (e.g. dbcache:threshold=0.12)")
        if sep:  # as a method's empty settings are
            raise InvalidInputError(f"step cache {text.strip()!r} has an empty setting: give {OFF} alone")
        return None
    if method not in METHODS:
        raise InvalidInputError(f"step cache method {method!r} is not known: use {', '.join(METHODS)} or {OFF}, "
                                "optionally followed by :key=value,... (e.g. dbcache:threshold=0.12)")
    values: dict[str, Any] = {}
    items = [part.strip() for part in rest.split(",")]
    if sep and not all(items):
        raise InvalidInputError(f"step cache {text.strip()!r} has an empty setting: give {method} alone, or settings "
                                f"between the commas (e.g. {method}:threshold={_example_value(method, 'threshold')})")
    for item in filter(None, items):
        key, _, value = (piece.strip() for piece in item.partition("="))
        key = key.replace("-", "_").lower()  # as the method's name: either case
        if key in _FIELD_TYPES and not value:
            example = f"{method}:{key}={_example_value(method, key)}"
            raise InvalidInputError(f"step cache setting {key} needs a value: give {key}=VALUE, e.g. {example}")
        if key not in _FIELD_TYPES:
            raise InvalidInputError(f"step cache setting {item!r} is not known: use key=value with a key of "
                                    f"{', '.join(_FIELD_TYPES)}")
        number = _setting_value(method, key, value)
        if key in values and values[key] != number:  # the same value twice is harmless, as for a repeated option
            raise InvalidInputError(f"step cache setting {key} is given twice ({values[key]} and {number}): give it "
                                    "once")
        values[key] = number
    decided = [key for key in _FORCED_DECIDES if key in values]
    if "forced" in values and decided:
        StepCacheConfig(method, forced=values["forced"]).validate()  # a bad schedule first: the fix below shows it
        raise InvalidInputError(f"step cache forced decides which steps run, so {' and '.join(decided)} would do "
                                f"nothing: give forced without {'it' if len(decided) == 1 else 'them'} (e.g. "
                                f"{method}:forced={values['forced']}), or leave out forced").naming("forced", *decided)
    config = StepCacheConfig(method, **values)
    config.validate()
    return config


_FORCED_DECIDES = ("threshold", "start", "end", "max_skips")  # what a forced schedule decides in their place


def _setting_value(method: str, key: str, text: str) -> Any:
    """The value of setting `key` typed as `text`; a number that is not in plain digits is refused."""
    kind = _FIELD_TYPES[key]
    if kind is str:
        return text.upper()
    named = f"step cache {key}"
    number = whole_from_text(text, named) if kind is int else decimal_from_text(text, named)
    if number is None:
        what, form = ("a whole number", WHOLE_RULE) if kind is int else ("a number", f"a plain decimal: {DECIMAL_RULE}")
        raise InvalidInputError(f"step cache {key} {text!r} is not {what}: give e.g. "
                                f"{method}:{key}={_example_value(method, key)} ({_RANGES[key]}; {form})")
    return number


def _schedule_example(steps: int) -> str:
    """A schedule of `steps` letters the cache runs: the first and the last step computed, the others skipped."""
    return COMPUTE if steps == 1 else COMPUTE + SKIP * (steps - 2) + COMPUTE


def _example_value(method: str, key: str) -> str:
    """A value of setting `key` that `method` takes: its default (a schedule of four steps for `forced`)."""
    if key == "forced":
        return _schedule_example(4)
    return str(StepCacheConfig(method).metadata()[key])


def as_config(value: Any) -> Optional[StepCacheConfig]:
    """A StepCacheConfig, a CLI spec string or None (off), as the config (None: off); anything else refused."""
    if value is None or isinstance(value, StepCacheConfig):
        if value is not None:
            value.validate()
        return value
    if isinstance(value, str):
        return parse_step_cache(value)
    raise InvalidInputError(f"step cache {value!r} is not a StepCacheConfig: give "
                            "ernie_image.StepCacheConfig(...), a spec such as 'dbcache:threshold=0.08', or None")

