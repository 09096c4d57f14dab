"""Shared pieces of the GPU benchmarks: environment record, timing, full-size random weights."""
from __future__ import annotations

import datetime
import json
import platform
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
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


def rss_bytes() -> int:
    """This process's resident host memory (VmRSS), in bytes; 0 where /proc does not say it."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def wall_time(run: Callable[[], object], sync: Callable[[], None] = torch.cuda.synchronize) -> tuple[object, float]:
    """One call's result and its wall seconds, the device drained before and after by `sync` (first calls: compile
    included)."""
    sync()
    started = time.perf_counter()
    result = run()
    sync()
    return result, time.perf_counter() - started


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


class BenchRun:
    """One benchmark run on `device`: its rows, its checks and its phases' wall seconds, each printed as it comes."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.rows: list[dict] = []
        self.checks: list[dict] = []
        self.phases: dict[str, float] = {}

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def check(self, what: str, ok: bool, **detail) -> None:
        self.checks.append({"check": what, "ok": bool(ok), **detail})
        print(f"# check {'OK  ' if ok else 'FAIL'} {what} {detail if detail else ''}", flush=True)

    @contextmanager
    def phase(self, name: str):
        """Times the block's wall seconds into `phases[name]`, the device drained at its end."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.sync()
            self.phases[name] = round(time.perf_counter() - started, 2)
            print(f"# phase {name}: {self.phases[name]:.1f} s", flush=True)


class GpuSampler:
    """nvidia-smi samples of SM clock, power and throttle reasons, every 100 ms while a phase runs."""

    def __init__(self) -> None:
        self.samples: list[list[str]] = []
        self.query = "clocks.sm,power.draw,temperature.gpu"
        for reasons in ("clocks_event_reasons.active", "clocks_throttle_reasons.active"):
            try:
                probe = subprocess.run(["nvidia-smi", f"--query-gpu={reasons}", "--format=csv,noheader"],
                                       capture_output=True, text=True)
            except OSError:
                break
            if probe.returncode == 0:
                self.query += "," + reasons
                break

    @contextmanager
    def phase(self):
        try:
            proc = subprocess.Popen(["nvidia-smi", f"--query-gpu={self.query}", "--format=csv,noheader,nounits",
                                     "-lms", "100"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError:
            proc = None
        try:
            yield self
        finally:
            if proc is not None:
                proc.terminate()
                out, _ = proc.communicate(timeout=5)
                self.samples = [[f.strip() for f in line.split(",")] for line in out.splitlines() if "," in line]

    REASONS = {0x4: "power cap", 0x8: "HW slowdown", 0x20: "SW thermal", 0x40: "HW thermal", 0x80: "power brake"}

    def summary(self) -> str:
        """Median SM clock and power while the phase ran, and why the clock was held down (if it was)."""
        rows = [s for s in self.samples if len(s) >= 2 and s[0].replace(".", "").isdigit()]
        if not rows:
            return "no clock samples"
        clock = statistics.median(float(s[0]) for s in rows)
        power = statistics.median(float(s[1]) for s in rows if s[1].replace(".", "").isdigit())
        bits = 0
        for sample in rows:
            if len(sample) > 3 and sample[3].startswith("0x"):
                bits |= int(sample[3], 16)
        reasons = [name for bit, name in self.REASONS.items() if bits & bit]
        return f"SM {clock:.0f} MHz, {power:.0f} W" + (f", {'+'.join(reasons)}" if reasons else "")


BLOCK_GEMMS = ("qkv", "out", "gate_up", "down")  # a fused block's GEMMs, in the order the block runs them


def block_gemm_weights(dit: torch.nn.Module) -> list[dict[str, torch.Tensor]]:
    """Per block, the weight of each GEMM of a model whose projections are fused (model.compile.fuse_projections)."""
    return [{"qkv": b.self_attention.to_qkv.weight, "out": b.self_attention.to_out[0].weight,
             "gate_up": b.mlp.gate_up.weight, "down": b.mlp.linear_fc2.weight} for b in dit.layers]


def block_matmuls(dit: torch.nn.Module, batch: int, seq: int) -> Callable[[], None]:
    """A step's 144 block GEMMs and 36 attentions back to back, on the fused model's own weights and nothing else:
    the floor a step can reach at the clocks the card holds while it runs."""
    generator = torch.Generator(device="cuda").manual_seed(0)
    tokens = batch * seq
    x = torch.randn((tokens, dit.config.hidden_size), device="cuda", generator=generator).bfloat16()
    hidden = torch.randn((tokens, dit.config.ffn_hidden_size), device="cuda", generator=generator).bfloat16()
    q, k, v = (torch.randn((batch, dit.config.num_attention_heads, seq, dit.config.head_dim), device="cuda",
                           generator=generator).bfloat16() for _ in range(3))
    blocks = block_gemm_weights(dit)

    def run() -> None:
        for weights in blocks:
            torch.mm(x, weights["qkv"].t())
            torch.nn.functional.scaled_dot_product_attention(q, k, v)
            torch.mm(x, weights["out"].t())
            torch.mm(x, weights["gate_up"].t())
            torch.mm(hidden, weights["down"].t())
    return run


def dit_config(variant: str = "ERNIE-Image") -> dict:
    return json.loads((REPO_ROOT / "runtime" / "formats" / "configs" / variant / "transformer" / "config.json").read_text())


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


def quantised_copy(model: torch.nn.Module, fmt: str) -> torch.nn.Module:
    """A second DiT sharing `model`'s non-Linear tensors (its projections fused where `model`'s are), every block
    Linear packed to `fmt` on the weights' device."""
    from ernie_image.runtime.model.dit import ErnieDiT

    with torch.device("meta"):
        copy = ErnieDiT(model.config)
    if model.layers[0].self_attention.to_qkv is not None:
        for block in copy.layers:
            block.self_attention.fuse_projections()
            block.mlp.fuse_projections()
    copy.load_state_dict(model.state_dict(), assign=True)
    quantise_block_linears_(copy, fmt)
    return copy.eval().requires_grad_(False)


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
