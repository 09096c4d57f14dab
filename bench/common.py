"""Shared pieces of the GPU benchmarks: environment record, timing, full-size random weights."""
from __future__ import annotations

import datetime
import json
import platform
import statistics
import sys
from pathlib import Path
from typing import Callable

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent


def import_package() -> None:
    """Make the repository importable as `ernie_image` without installing it, the way the tests do."""
    tests = str(REPO_ROOT / "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)
    import conftest  # noqa: F401  (registers the package on import)


def environment() -> dict:
    record = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none",
    }
    for name in ("diffusers", "transformers", "triton"):
        try:
            record[name] = __import__(name).__version__
        except ImportError:
            record[name] = "absent"
    return record


def print_environment() -> dict:
    record = environment()
    print("# " + json.dumps(record))
    return record


def cuda_time_ms(run: Callable[[], object], warmup: int = 3, iters: int = 10) -> float:
    """Median of `iters` timed calls (CUDA events), after `warmup` calls."""
    for _ in range(warmup):
        run()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def dit_config(variant: str = "ERNIE-Image") -> dict:
    return json.loads((REPO_ROOT / "runtime" / "configs" / variant / "transformer" / "config.json").read_text())


@torch.no_grad()
def randomise_dit_(model: torch.nn.Module, seed: int = 0) -> None:
    """Random weights whose activations stay finite over 36 blocks (default init overflows: see ERNIE.md)."""
    generators: dict[str, torch.Generator] = {}
    for name, param in model.named_parameters():
        if param.ndim >= 2:
            device = str(param.device)
            generator = generators.setdefault(device, torch.Generator(device=param.device).manual_seed(seed))
            fan_in = param[0].numel()
            scale = 0.02 if "adaLN_modulation" in name else 0.5
            values = torch.randn(param.shape, generator=generator, device=param.device, dtype=torch.float32)
            param.copy_((values * (scale / fan_in ** 0.5)).to(param.dtype))
        elif name.endswith("weight"):
            param.fill_(1.0)
        else:
            param.zero_()


def quantise_block_linears_(model: torch.nn.Module, fmt: str) -> None:
    """Pack every Linear of a DiT's blocks to `fmt` in place (QuantLinear, quantised on the weights' device)."""
    from ernie_image.runtime.quant.linear import quantize_linears
    from ernie_image.runtime.quant.writer import quantize_weight

    state = {key: quantize_weight(value, fmt) for key, value in model.state_dict().items()
             if key.startswith("layers.") and key.endswith(".weight") and value.dim() == 2}
    quantize_linears(model, state)


def dit_flops(width: int = 1024, height: int = 1024, text_tokens: int = 256, layers: int = 36,
              hidden: int = 4096, ffn: int = 12288) -> float:
    seq = (width // 16) * (height // 16) + text_tokens
    return layers * (8 * seq * hidden ** 2 + 6 * seq * hidden * ffn + 4 * seq ** 2 * hidden)


def table(rows: list[dict], columns: list[str]) -> str:
    widths = {c: max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in columns}
    lines = [" | ".join(c.ljust(widths[c]) for c in columns), "-|-".join("-" * widths[c] for c in columns)]
    for row in rows:
        lines.append(" | ".join(str(row.get(c, "")).ljust(widths[c]) for c in columns))
    return "\n".join(lines)
