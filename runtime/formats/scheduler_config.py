"""A diffusers folder's scheduler/scheduler_config.json, read for what it says against how the pack samples.

The pack samples as ERNIE-Image's released scheduler does (FlowMatchEulerDiscreteScheduler with a static shift, Euler
steps), the shift being a request setting (4.0 by default, the released value). diffusers samples with the folder's
own config. Where that config says otherwise (another shift, dynamic shifting, other sigmas), a job says so in a
notice instead of sampling otherwise in silence; the file is not needed, so one that cannot be read is a notice too.
"""
from __future__ import annotations

import math
import stat
from pathlib import Path
from typing import Any, Optional

from ..core.errors import ModelFileError, NamedLine, naming_line
from .config_json import RepeatedConfigKey, read_config

LABEL = "scheduler/scheduler_config.json"
RELEASED_SHIFT = 4.0
# What the released config sets that the pack's sampler takes as given, with the released values.
FIXED = {"use_dynamic_shifting": False, "use_karras_sigmas": False, "use_exponential_sigmas": False,
         "use_beta_sigmas": False, "invert_sigmas": False, "shift_terminal": None, "stochastic_sampling": False,
         "num_train_timesteps": 1000}
_AS_RELEASED = "this pack samples as ERNIE-Image's released scheduler (a static shift, Euler steps)"


def scheduler_notices(model_dir: Optional[Path], shift: float) -> list[NamedLine]:
    """The notices for a job sampling with `shift` from the model folder `model_dir` (none where it has no
    scheduler config, or one that agrees)."""
    if model_dir is None:
        return []
    path = Path(model_dir) / "scheduler" / "scheduler_config.json"
    try:
        kind = path.stat().st_mode  # follows a link
    except FileNotFoundError:
        if path.parent.is_symlink() and not path.parent.exists():
            return [_unreadable("its scheduler/ folder is a link to nothing", shift)]
        return [_unreadable("a link to nothing", shift)] if path.is_symlink() else []
    except OSError as error:
        return [_unreadable(error.strerror or "cannot be looked at", shift)]
    if not stat.S_ISREG(kind):  # a folder, or a FIFO a read would wait on for ever
        return [_unreadable("not a file", shift)]
    try:
        config = read_config(path)
    except RepeatedConfigKey:
        return [_unreadable("it holds a key twice, so which value is meant is not known", shift)]
    except ModelFileError:  # unreadable, empty, damaged or cut short: the file is not needed
        return [_unreadable("not a readable JSON object", shift)]
    notices = []
    said = config.get("shift", RELEASED_SHIFT)
    # The run's setting named first: a front end words the first "shift" as its own (--shift), not the file's field.
    if not _positive_number(said):
        notices.append(naming_line(f"this run uses shift {shift:g}: {LABEL} gives {said!r} for it, not a positive "
                                   "number", "shift"))
    elif float(said) != shift:
        notices.append(naming_line(f"give shift {float(said):g} to sample as {LABEL} says (this run uses "
                                   f"{shift:g})", "shift"))
    others = [f"{key} {config[key]!r}" for key, released in FIXED.items() if key in config and config[key] != released]
    if others:
        notices.append(NamedLine(f"{LABEL} sets {', '.join(others)}; {_AS_RELEASED}, without them"))
    return notices


def _unreadable(why: str, shift: float) -> NamedLine:
    return NamedLine(f"{LABEL} cannot be read ({why}); {_AS_RELEASED}, shift {shift:g}")


def _positive_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
