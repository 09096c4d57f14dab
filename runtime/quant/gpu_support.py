"""What each weight format does on the detected device, in words for the Quant selector, and `auto`.

Speeds are those measured or expected for the ERNIE DiT: FP8 GEMMs ran at 1265 vs 752 TFLOP/s bf16 on an
H200 (SM 9.0); NVFP4 matmuls are native only on Blackwell (SM >= 10); elsewhere packed formats are
dequantised per layer per step, which costs a little time and saves the memory.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

FORMATS = ("bf16", "fp8", "q8_0", "q4_k", "nvfp4")
SELECTOR_CHOICES = ("auto",) + FORMATS

# DiT weight bytes per format: 8,032,092,160 quantisable Linear weights + ~1.4 M kept in bf16.
_QUANTISABLE = 8_032_092_160
_KEPT_BF16_BYTES = 2 * 1_397_888
DIT_WEIGHT_BYTES = {
    "bf16": 2 * 8_033_490_048,
    "fp8": _QUANTISABLE + _KEPT_BF16_BYTES,
    "q8_0": _QUANTISABLE * 34 // 32 + _KEPT_BF16_BYTES,
    "q4_k": _QUANTISABLE * 144 // 256 + _KEPT_BF16_BYTES,
    "nvfp4": _QUANTISABLE // 2 + _QUANTISABLE // 16 + _KEPT_BF16_BYTES,
}
# Activations, attention workspace and the allocator's slack at 1 MP, batch 2, kept free beside the weights.
ACTIVATION_RESERVE_BYTES = 4_000_000_000


@dataclass(frozen=True)
class DeviceInfo:
    kind: str  # "cuda" or "cpu"
    name: str
    capability: tuple[int, int] | None
    total_memory: int  # bytes of VRAM (0 on the CPU)

    @property
    def sm(self) -> str:
        return f"SM {self.capability[0]}.{self.capability[1]}" if self.capability else "no GPU"


@lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def cuda_capability(device: torch.device) -> tuple[int, int]:
    """(major, minor) of a CUDA device, asked of the driver once per device (it is checked per forward)."""
    return _capability(device.index if device.index is not None else torch.cuda.current_device())


def detect_device(device: torch.device | str | None = None) -> DeviceInfo:
    device = torch.device(device) if device is not None else (
        torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
    if device.type != "cuda" or not torch.cuda.is_available():
        return DeviceInfo("cpu", "CPU", None, 0)
    props = torch.cuda.get_device_properties(device)
    return DeviceInfo("cuda", props.name, (props.major, props.minor), int(props.total_memory))


def _gb(n: int) -> str:
    return f"{n / 1e9:.1f} GB"


def format_reasons(info: DeviceInfo) -> dict[str, str]:
    """One sentence per format saying what it does on this device; the sizes are the released 8B DiT's, whatever
    model the choice is later applied to."""
    sizes = {f: f"{_gb(b)} for the 8B DiT" for f, b in DIT_WEIGHT_BYTES.items()}
    if info.kind != "cuda":
        packed = "stays packed and is dequantised per layer on the CPU: slower than bf16, only saves RAM"
        return {
            "bf16": f"bf16: reference quality, {sizes['bf16']}; no CUDA GPU found, so it runs on the CPU",
            "fp8": f"FP8 ({sizes['fp8']}) {packed}",
            "q8_0": f"Q8_0 GGUF ({sizes['q8_0']}) {packed}",
            "q4_k": f"Q4_K GGUF ({sizes['q4_k']}) {packed}",
            "nvfp4": f"NVFP4 ({sizes['nvfp4']}) {packed}",
        }
    cap = info.capability or (0, 0)
    sm = info.sm
    fp8 = (f"FP8 runs natively on this GPU ({sm}): FP8 GEMMs, about 0.6-0.75x bf16 step time, {sizes['fp8']}, "
           f"near-bf16 quality" if cap >= (8, 9) else
           f"FP8 stays packed on this GPU ({sm}) and is dequantised per layer: about bf16 speed at half the "
           f"memory ({sizes['fp8']}); natively faster only on SM >= 8.9")
    nvfp4 = (f"NVFP4 runs natively on this GPU ({sm}): FP4 GEMMs, fastest, {sizes['nvfp4']}, small quality loss"
             if cap >= (10, 0) else
             f"NVFP4 stays packed on this GPU ({sm}) and runs at about bf16 speed; natively faster only on SM >= 10 "
             f"({sizes['nvfp4']}, small quality loss)")
    return {
        "bf16": f"bf16: reference quality and speed, {sizes['bf16']}",
        "fp8": fp8,
        "q8_0": f"Q8_0 GGUF stays packed ({sizes['q8_0']}) and is dequantised per layer on the GPU: near-bf16 "
                f"quality, about bf16 speed",
        "q4_k": f"Q4_K GGUF stays packed ({sizes['q4_k']}) and is dequantised per layer on the GPU: for 8-12 GB "
                f"cards, small quality loss, about bf16 speed",
        "nvfp4": nvfp4,
    }


def choose_auto(info: DeviceInfo, vram_budget: int | None = None) -> tuple[str, str]:
    """(format, reason) for `auto`. `vram_budget` = bytes the DiT may use (default: the card's memory)."""
    if info.kind != "cuda":
        return "bf16", "auto -> bf16: no CUDA GPU, and packed formats only add dequantisation work on the CPU"
    budget = vram_budget if vram_budget is not None else max(info.total_memory - ACTIVATION_RESERVE_BYTES, 0)
    cap = info.capability or (0, 0)

    def fits(fmt: str) -> bool:
        return DIT_WEIGHT_BYTES[fmt] <= budget

    budget_text = f"{_gb(budget)} for DiT weights"
    if cap >= (8, 9) and fits("fp8"):
        return "fp8", f"auto -> FP8: native FP8 matmuls on {info.sm} are the fastest near-lossless choice ({budget_text})"
    if fits("bf16"):
        return "bf16", f"auto -> bf16: the full-precision DiT fits ({budget_text}) and {info.sm} has no faster format"
    if fits("q8_0"):
        return "q8_0", f"auto -> Q8_0: bf16 does not fit {budget_text}; Q8_0 is near-lossless at {_gb(DIT_WEIGHT_BYTES['q8_0'])}"
    if cap >= (10, 0) and fits("nvfp4"):
        return "nvfp4", f"auto -> NVFP4: native FP4 on {info.sm}, {_gb(DIT_WEIGHT_BYTES['nvfp4'])} fits {budget_text}"
    if fits("q4_k"):
        return "q4_k", f"auto -> Q4_K: only a 4-bit format fits {budget_text}"
    return "q4_k", (f"auto -> Q4_K: even Q4_K ({_gb(DIT_WEIGHT_BYTES['q4_k'])}) exceeds {budget_text}; "
                    f"blocks will stream from host memory")
