"""Each FP8 activation kernel is a custom op with its torch form beside it (runtime/quant/fp8_kernel_call.py): the
gelu product (fp8_gated.py), the adaLN input, with and without the gated residual before it (fp8_modulated.py), and
a plain activation (fp8_rows.py). What holds for
all three: the torch form runs where the kernel cannot; a kernel failure turns the kernels off on that device with
one warning, except inside a CUDA-graph capture, where only that graph holds the torch form; a compiled caller
traces the op whole."""
from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from types import ModuleType
from typing import Callable

import pytest
import torch

from ernie_image.runtime.quant import fp8_gated, fp8_kernel_call, fp8_modulated, fp8_rows

HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (pip install triton)")


@dataclass(frozen=True)
class KernelOp:
    module: ModuleType
    op: Callable  # the registered custom op
    impl: Callable  # what the op runs: the kernel or the torch form
    reference: Callable  # the torch form
    inputs: Callable[[], tuple]


def _gelu_inputs() -> tuple:
    both = torch.randn((6, 128), generator=torch.Generator().manual_seed(1)).bfloat16()
    return both.chunk(2, dim=-1)


def _adaln_inputs() -> tuple:
    generator = torch.Generator().manual_seed(2)
    x = torch.randn((2, 3, 64), generator=generator).bfloat16()
    weight = torch.rand((64,), generator=generator).add_(0.5).bfloat16()
    one_plus_scale = torch.rand((2, 1, 64), generator=generator).add_(0.5)
    shift = torch.randn((2, 1, 64), generator=generator)
    return x, weight, one_plus_scale, shift, 1e-6


def _residual_inputs() -> tuple:
    x, weight, one_plus_scale, shift, eps = _adaln_inputs()
    generator = torch.Generator().manual_seed(4)
    return (x, torch.randn(x.shape, generator=generator).bfloat16(), torch.rand((2, 1, 64), generator=generator),
            weight, one_plus_scale, shift, eps)


def _rows_inputs() -> tuple:
    return (torch.randn((5, 96), generator=torch.Generator().manual_seed(3)).bfloat16(),)


OPS = {
    "gelu product": KernelOp(fp8_gated, fp8_gated.gelu_mul_quantize, fp8_gated._gelu_mul_quantize,
                             fp8_gated.gelu_mul_quantize_reference, _gelu_inputs),
    "adaLN": KernelOp(fp8_modulated, fp8_modulated.norm_modulate_quantize, fp8_modulated._norm_modulate_quantize,
                      fp8_modulated.norm_modulate_quantize_reference, _adaln_inputs),
    "residual, adaLN": KernelOp(fp8_modulated, fp8_modulated.residual_norm_modulate_quantize,
                                fp8_modulated._residual_norm_modulate_quantize,
                                fp8_modulated.residual_norm_modulate_quantize_reference, _residual_inputs),
    "rows": KernelOp(fp8_rows, fp8_rows.quantize_rows, fp8_rows._quantize_rows, fp8_rows.quantize_rows_reference,
                     _rows_inputs),
}
each_op = pytest.mark.parametrize("name", list(OPS))


def assert_same(got: tuple[torch.Tensor, ...], expected: tuple[torch.Tensor, ...]) -> None:
    assert len(got) == len(expected)
    for value, expected_value in zip(got, expected):
        assert value.dtype == expected_value.dtype
        if value.dtype == torch.float8_e4m3fn:
            value, expected_value = value.view(torch.uint8), expected_value.view(torch.uint8)
        assert torch.equal(value, expected_value)


@needs_triton
@each_op
@pytest.mark.parametrize("capturing", [True, False])
def test_a_kernel_failure_inside_a_graph_capture_leaves_the_kernels_on_for_other_calls(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, name: str, capturing: bool) -> None:
    """Under cudaMallocAsync Triton cannot check a capture's own allocations ("cpu tensor?"): that graph holds the
    torch form; any other failure turns the kernels off on that device from then on, said once."""
    kernel_op = OPS[name]

    def refuse(*args, **kwargs):
        raise ValueError("Pointer argument (at 0) cannot be accessed from Triton (cpu tensor?)")

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(fp8_kernel_call, "_failed", set())
    monkeypatch.setattr(kernel_op.module, "launch", refuse)
    monkeypatch.setattr(fp8_kernel_call, "_in_a_capture", lambda device: capturing)
    inputs = kernel_op.inputs()
    with caplog.at_level(logging.DEBUG, logger=fp8_kernel_call.__name__):
        assert_same(kernel_op.impl(*inputs), kernel_op.reference(*inputs))
    assert fp8_kernel_call._failed == (set() if capturing else {"cpu"})
    warnings = [record for record in caplog.records if record.levelno == logging.WARNING]
    assert len(warnings) == (0 if capturing else 1)
    if not capturing:
        monkeypatch.setattr(kernel_op.module, "launch", lambda *args, **kwargs: pytest.fail("the kernel ran again"))
        assert_same(kernel_op.impl(*inputs), kernel_op.reference(*inputs))


@each_op
def test_without_the_interpreter_the_cpu_runs_the_torch_form(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    kernel_op = OPS[name]
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(kernel_op.module, "launch", lambda *args, **kwargs: pytest.fail("the kernel ran"))
    inputs = kernel_op.inputs()
    assert_same(kernel_op.impl(*inputs), kernel_op.reference(*inputs))


@each_op
def test_a_compiled_caller_traces_the_op_whole(name: str) -> None:
    kernel_op = OPS[name]
    inputs = kernel_op.inputs()
    doubled = (inputs[0] * 2, *inputs[1:])
    compiled = torch.compile(lambda first, *rest: kernel_op.op(first * 2, *rest), backend="aot_eager",
                             fullgraph=True)
    assert_same(compiled(*inputs), kernel_op.reference(*doubled))


@each_op
def test_the_ops_shapes_without_running_it_are_the_torch_forms(name: str) -> None:
    kernel_op = OPS[name]
    inputs = kernel_op.inputs()
    expected = kernel_op.reference(*inputs)
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fake_inputs = tuple(mode.from_tensor(value) if isinstance(value, torch.Tensor) else value
                            for value in inputs)
        got = kernel_op.op(*fake_inputs)
    assert [(t.shape, t.dtype, t.stride()) for t in got] == [(t.shape, t.dtype, t.stride()) for t in expected]


@each_op
@pytest.mark.parametrize("capturing", [False, True])
def test_inside_a_graph_capture_a_refused_launch_is_made_again_with_the_tensors_addresses(
        monkeypatch: pytest.MonkeyPatch, name: str, capturing: bool) -> None:
    """Triton asks the driver about a tensor's address before a launch, which fails for memory a capture under
    cudaMallocAsync allocated itself; an integer address it takes as it is. Outside a capture a refusal is a
    failure (the torch forms from then on)."""
    kernel_op = OPS[name]
    asked = []

    def refuse_tensors(*args, addresses=False, **kwargs):
        asked.append(addresses)
        if not addresses:
            raise ValueError("Pointer argument cannot be accessed from Triton (cpu tensor?)")
        return kernel_op.reference(*kernel_op.inputs())

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(fp8_kernel_call, "_failed", set())
    monkeypatch.setattr(fp8_kernel_call, "_in_a_capture", lambda device: capturing)
    monkeypatch.setattr(kernel_op.module, "launch", refuse_tensors)
    kernel_op.impl(*kernel_op.inputs())
    assert asked == ([False, True] if capturing else [False])
    assert fp8_kernel_call._failed == (set() if capturing else {"cpu"})


def test_a_tensor_given_by_its_address_must_be_16_byte_aligned() -> None:
    whole = torch.zeros(64, dtype=torch.bfloat16)
    assert fp8_kernel_call.as_arguments((whole, whole[8:]), addresses=True) == (whole.data_ptr(), whole.data_ptr() + 16)
    assert fp8_kernel_call.as_arguments((whole,), addresses=False)[0] is whole
    with pytest.raises(ValueError, match="16-byte aligned"):
        fp8_kernel_call.as_arguments((whole[1:],), addresses=True)


SIGNATURES = {  # each kernel's arguments as the launches pass them, at the DiT's widths
    "gelu_mul_quantize_kernel": ({"gate": "*bf16", "up": "*bf16", "out": "*fp8e4nv", "scale": "*fp32",
                                  "gate_row_stride": "i64", "up_row_stride": "i64", "n": "i32", "CHUNK": "constexpr"},
                                 {"CHUNK": 4096}, fp8_gated.default_warps(4096)),
    "rms_modulate_quantize_kernel": ({"x": "*bf16", "update": "*bf16", "gate": "*fp32", "x_out": "*bf16",
                                      "weight": "*bf16", "one_plus_scale": "*fp32", "shift": "*fp32",
                                      "out": "*fp8e4nv", "scale": "*fp32", "rows": "i32", "rows_per_batch": "i32",
                                      "n": "i32", "eps": "fp32", "BLOCK": "constexpr", "ROWS": "constexpr",
                                      "RESIDUAL": "constexpr"},
                                     {"BLOCK": 4096, "ROWS": 1, "RESIDUAL": True},
                                     fp8_modulated.default_warps(4096, residual=True)),
    "row_quantize_kernel": ({"x": "*bf16", "out": "*fp8e4nv", "scale": "*fp32", "x_row_stride": "i64", "rows": "i32",
                             "n": "i32", "BLOCK": "constexpr", "ROWS": "constexpr"}, {"BLOCK": 4096, "ROWS": 1},
                            fp8_rows.default_warps(4096)),
}


@needs_triton
@pytest.mark.parametrize("kernel", list(SIGNATURES))
@pytest.mark.parametrize("addresses", [False, True], ids=["tensors", "addresses"])
def test_each_kernel_compiles_for_hopper_without_a_gpu(kernel: str, addresses: bool) -> None:
    """Triton's front end and ptxas accept the kernel for SM 9.0 (what a GPU would compile on first use), given
    tensors or their addresses; given addresses its loads stay vectorised."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from ernie_image.runtime.quant.triton_loader import kernels_for

    kernels = kernels_for("triton_fp8_kernels", torch.device("cuda"))
    assert kernels is not None
    signature, constexprs, warps = SIGNATURES[kernel]
    if addresses:
        signature = {name: "i64" if kind.startswith("*") else kind for name, kind in signature.items()}
    signature = {**signature, "ADDRESSES": "constexpr"}
    aligned = {(index,): [["tt.divisibility", 16]] for index, kind in enumerate(signature.values()) if kind != "constexpr"}
    source = ASTSource(fn=getattr(kernels, kernel), signature=signature, constexprs={**constexprs, "ADDRESSES": addresses},
                       attrs=aligned)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    assert "cubin" in compiled.asm
    assert ".v4." in compiled.asm["ptx"] or ".v2." in compiled.asm["ptx"], "no vectorised load or store"


needs_fp8_gpu = pytest.mark.skipif(
    not (HAS_TRITON and torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)),
    reason="needs a CUDA GPU with FP8 (SM >= 8.9) and triton")


@pytest.mark.gpu
@needs_fp8_gpu
@each_op
def test_on_the_gpu_a_cuda_graph_holds_the_kernel_itself_under_either_allocator(monkeypatch: pytest.MonkeyPatch,
                                                                                name: str) -> None:
    """The GPU suite runs under the default allocator and under cudaMallocAsync, whose captures allocate memory that
    Triton cannot check: the kernel is given its tensors' addresses and the replay computes what it computes."""
    kernel_op = OPS[name]
    inputs = tuple(value.cuda() if isinstance(value, torch.Tensor) else value for value in kernel_op.inputs())
    eager = kernel_op.op(*inputs)
    monkeypatch.setattr(kernel_op.module, kernel_op.reference.__name__,
                        lambda *args, **kwargs: pytest.fail("the graph holds the torch form"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = kernel_op.op(*inputs)
    graph.replay()
    torch.cuda.synchronize()
    assert_same(captured, eager)
