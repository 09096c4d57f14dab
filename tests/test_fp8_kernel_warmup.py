"""The FP8 activation kernels compile beside the DiT's load (runtime/quant/fp8_kernel_warmup.py), in exactly the
forms the DiT's launches then use, so a first image with an empty kernel cache does not wait for Triton: each
`compile_ahead` specialises as its `launch` does, and on a GPU no launch compiles anything after the warm-up, for any
token count, eager or inside a CUDA-graph capture, under either allocator."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from ernie_image.runtime.quant import fp8_gated, fp8_kernel_warmup, fp8_modulated, fp8_rows
from ernie_image.runtime.quant.fp8 import native_fp8_supported
from ernie_image.runtime.quant.triton_loader import kernels_for

HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (pip install triton)")
needs_fp8_gpu = pytest.mark.skipif(
    not (HAS_TRITON and torch.cuda.is_available() and native_fp8_supported(torch.device("cuda"))),
    reason="needs a CUDA GPU with FP8 GEMMs (SM >= 8.9) and triton")
REPO_ROOT = Path(__file__).resolve().parent.parent

Call = tuple[str, tuple, dict]


class Recording:
    """A stand-in for the kernels module that records each launch (`kernel[grid](...)`) and each `warmup(...)`."""

    def __init__(self) -> None:
        self.calls: list[Call] = []

    def __getattr__(self, name: str) -> "_Kernel":
        return _Kernel(name, self.calls)


class _Kernel:
    def __init__(self, name: str, calls: list[Call]) -> None:
        self.name, self.calls = name, calls

    def __getitem__(self, grid: tuple) -> Callable[..., None]:
        return lambda *args, **kwargs: self.calls.append((self.name, args, kwargs))

    def warmup(self, *args: Any, grid: tuple, **kwargs: Any) -> None:
        self.calls.append((self.name, args, kwargs))


def _specialised_as(value: Any, on_value: bool) -> tuple:
    """What Triton compiles an argument by: a pointer's element type and 16-byte alignment (a tensor, or the dtype
    `warmup` is given for one), an integer's width and, unless the kernel does not specialise on it, whether it is
    1 or a multiple of 16; a float's type."""
    if isinstance(value, torch.Tensor):
        return "pointer", value.dtype, value.data_ptr() % 16 == 0
    if isinstance(value, torch.dtype):
        return "pointer", value, True
    if isinstance(value, int):
        width = "i32" if -2**31 <= value < 2**31 else "i64"
        return ("int", width) + ((value == 1, value % 16 == 0) if on_value else ())
    assert isinstance(value, float), value
    return ("fp32",)


def _form(call: Call) -> tuple:
    """The compiled form a recorded call asks for, judged by the kernel's own parameters."""
    name, args, kwargs = call
    kernel = getattr(kernels_for("triton_fp8_kernels", torch.device("cuda")), name)
    runtime_params = [param for param in kernel.params if not param.is_constexpr]
    assert len(args) == len(runtime_params), (name, len(args), [param.name for param in runtime_params])
    return name, tuple(_specialised_as(value, not param.do_not_specialize)
                       for value, param in zip(args, runtime_params)), tuple(sorted(kwargs.items()))


def _recorded(run: Callable[[Recording], object]) -> tuple:
    recording = Recording()
    run(recording)
    assert len(recording.calls) == 1, recording.calls
    return _form(recording.calls[0])


HIDDEN, FFN = 256, 768


def _gate_up(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The halves of a stacked gate/up projection's output, as the DiT's MLP hands them over."""
    gate, up = torch.zeros((rows, 2 * FFN), dtype=torch.bfloat16).chunk(2, dim=-1)
    return gate, up


def _adaln_inputs(batch: int, tokens: int) -> tuple[torch.Tensor, ...]:
    x = torch.zeros((batch, tokens, HIDDEN), dtype=torch.bfloat16)
    factors = torch.zeros((batch, 1, HIDDEN), dtype=torch.float32)
    return x, torch.ones(HIDDEN, dtype=torch.bfloat16), factors, factors.clone()


@needs_triton
@pytest.mark.parametrize("addresses", [False, True], ids=["tensors", "addresses"])
@pytest.mark.parametrize("batch, tokens", [(1, 4352), (2, 4133), (1, 37)])
class TestEachFormCompiledAheadIsTheFormALaunchOfAnyTokenCountUses:
    def test_gelu_product(self, addresses: bool, batch: int, tokens: int) -> None:
        gate, up = _gate_up(batch * tokens)
        launched = _recorded(lambda kernels: fp8_gated.launch(kernels, gate, up, addresses=addresses))
        assert _recorded(lambda kernels: fp8_gated.compile_ahead(kernels, FFN, addresses)) == launched

    @pytest.mark.parametrize("residual", [False, True], ids=["alone", "after the residual"])
    def test_adaln_input(self, addresses: bool, batch: int, tokens: int, residual: bool) -> None:
        x, weight, one_plus_scale, shift = _adaln_inputs(batch, tokens)
        gated = (torch.zeros_like(x), torch.zeros_like(one_plus_scale)) if residual else None
        launched = _recorded(lambda kernels: fp8_modulated.launch(kernels, x, weight, one_plus_scale, shift, 1e-6,
                                                                  gated, addresses=addresses))
        ahead = _recorded(lambda kernels: fp8_modulated.compile_ahead(kernels, HIDDEN, residual, addresses))
        assert ahead == launched

    def test_rows(self, addresses: bool, batch: int, tokens: int) -> None:
        x = torch.zeros((batch * tokens, HIDDEN), dtype=torch.bfloat16)
        launched = _recorded(lambda kernels: fp8_rows.launch(kernels, x, addresses=addresses))
        assert _recorded(lambda kernels: fp8_rows.compile_ahead(kernels, HIDDEN, addresses)) == launched


def test_the_address_forms_double_the_forms_compiled_ahead() -> None:
    assert len(fp8_kernel_warmup.kernel_forms(HIDDEN, FFN, addresses=False)) == 4
    assert len(fp8_kernel_warmup.kernel_forms(HIDDEN, FFN, addresses=True)) == 8


def test_nothing_compiles_ahead_for_a_dit_on_the_cpu() -> None:
    assert fp8_kernel_warmup.start(torch.device("cpu"), HIDDEN, FFN) is None


_ON_THE_GPU = """
import json, sys, torch
from pathlib import Path
from ernie_image.runtime.quant import fp8_gated, fp8_kernel_warmup, fp8_modulated, fp8_rows

cache = Path(sys.argv[1])
hidden, ffn = 256, 768

def compiled():  # kernels in Triton's cache: folders holding a cubin (a launcher, built at a first launch, holds none)
    return sorted(folder.name for folder in cache.iterdir() if any(folder.glob("*.cubin")))

fp8_kernel_warmup.start(torch.device("cuda"), hidden, ffn).join()
compiled_ahead = compiled()

def dit_kernels(tokens):
    gate, up = torch.randn((tokens, 2 * ffn), device="cuda").bfloat16().chunk(2, dim=-1)
    fp8_gated.gelu_mul_quantize(gate, up)
    x = torch.randn((1, tokens, hidden), device="cuda").bfloat16()
    weight = torch.ones(hidden, device="cuda", dtype=torch.bfloat16)
    factors = torch.randn((1, 1, hidden), device="cuda")
    fp8_modulated.norm_modulate_quantize(x, weight, factors, factors, 1e-6)
    fp8_modulated.residual_norm_modulate_quantize(x, torch.randn_like(x), factors, weight, factors, factors, 1e-6)
    fp8_rows.quantize_rows(x[0])

for tokens in (4352, 4133, 37):
    dit_kernels(tokens)
torch.cuda.synchronize()
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    dit_kernels(4133)
graph.replay()
torch.cuda.synchronize()
print(json.dumps({"ahead": compiled_ahead, "after": compiled()}))
"""


@pytest.mark.gpu
@needs_fp8_gpu
@pytest.mark.parametrize("allocator", ["native", "cudaMallocAsync"])
def test_on_the_gpu_no_launch_compiles_a_kernel_after_the_warm_up_eager_or_captured(tmp_path: Path,
                                                                                     allocator: str) -> None:
    cache, site = tmp_path / "triton", tmp_path / "site"
    cache.mkdir()
    site.mkdir()
    (site / "ernie_image").symlink_to(REPO_ROOT, target_is_directory=True)  # this checkout, as `ernie_image`
    python_path = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    environment = {**os.environ, "TRITON_CACHE_DIR": str(cache), "PYTORCH_CUDA_ALLOC_CONF": f"backend:{allocator}",
                   "PYTHONPATH": python_path}
    done = subprocess.run([sys.executable, "-c", _ON_THE_GPU, str(cache)], env=environment, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    kernels = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(kernels["ahead"]) == len(fp8_kernel_warmup.kernel_forms(256, 768, allocator == "cudaMallocAsync"))
    assert kernels["after"] == kernels["ahead"], "a launch compiled a kernel form the warm-up did not"
