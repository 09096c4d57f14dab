"""Candidate forms of the FP8 step's memory-bound kernels, for bench/fp8_kernels.py --candidates to time against
the shipped ones (runtime/quant/triton_fp8_kernels.py) and against what the compiler makes of the torch forms.

Each rounds as the form it would replace, so that a candidate that is faster can replace it bit for bit:
- `adaln_factors_once`: the adaLN input kernel (fp8_modulated.py) with its fp32 factors (1 + scale, shift, gate)
  read once a program of several rows, not once a row: for 4096-value rows a row reads 8 KB of activations and
  32-48 KB of factors, so the shipped kernel at one row a program spends most of its reads on factors (from L2);
- `qk_norm_rope`: q's and k's per-head RMSNorm with their weights and ERNIE's split-half RoPE, one program a token
  reading q and k once (the compiled block leaves this to inductor, whose kernel moves ~1.6 TB/s);
- `gelu_one_block`: gelu(gate) * up quantised per row (fp8_gated.py) as the shipped kernel did before it held a
  row as three chunks: the 12288-value row as one block of 16384 lanes (kept to time the two against each other);
- `gelu_persistent`: that kernel's body in a loop over rows, a program or two an SM, Triton's pipelining
  (`num_stages`) loading the next row while one is computed.

Loaded for CUDA tensors, or for CPU tensors under TRITON_INTERPRET=1 (set before this module is imported) to check
their arithmetic without a GPU.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from common import import_package

import_package()

from ernie_image.runtime.core.rounding import power_of_two_at_least  # noqa: E402
from ernie_image.runtime.quant.fp8_kernel_call import quantised_like  # noqa: E402
from ernie_image.runtime.quant.triton_loader import cdiv, kernels_for  # noqa: E402

DEVICE = torch.device("cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda")
_shipped = kernels_for("triton_fp8_kernels", DEVICE)
_bf16, _quantised, _row_scale, _absmax, _gelu_product, _plus = (
    _shipped._bf16, _shipped._quantised, _shipped._row_scale, _shipped._absmax, _shipped._gelu_product,
    _shipped._plus)


@triton.jit
def _per_batch(table, first_batch, last_batch, in_first, cols, mask, n):
    """A program's rows of an fp32 [batches, n] table: read once for the first row's batch and, only where the
    program's rows reach into the next batch, once for that one."""
    first = tl.load(table + first_batch * n + cols, mask=mask, other=0.0)
    if last_batch != first_batch:
        last = tl.load(table + last_batch * n + cols, mask=mask, other=0.0)
    else:
        last = first
    return tl.where(in_first, first[None, :], last[None, :])


@triton.jit(do_not_specialize=["rows", "rows_per_batch"])
def adaln_factors_once(x, update, gate, x_out, weight, one_plus_scale, shift, out, scale, rows, rows_per_batch, n,
                       eps, BLOCK: tl.constexpr, ROWS: tl.constexpr, RESIDUAL: tl.constexpr):
    """rms_modulate_quantize_kernel's arithmetic, ROWS rows a program (ROWS <= rows_per_batch, so a program's rows
    lie in at most two batches), each factor read once a program."""
    first = tl.program_id(0).to(tl.int64) * ROWS
    row = first + tl.arange(0, ROWS)[:, None]
    cols_1d = tl.arange(0, BLOCK)
    cols = cols_1d[None, :]
    in_row = cols_1d < n
    mask = (row < rows) & (cols < n)
    first_batch = first // rows_per_batch
    last_batch = (tl.minimum(first + ROWS, rows) - 1) // rows_per_batch
    in_first = (row // rows_per_batch) == first_batch
    values = tl.load(x + row * n + cols, mask=mask, other=0.0).to(tl.float32)
    if RESIDUAL:
        factor = _per_batch(gate, first_batch, last_batch, in_first, cols_1d, in_row, n)
        gated = _bf16(factor * tl.load(update + row * n + cols, mask=mask, other=0.0).to(tl.float32))
        values = _bf16(values + gated)
        tl.store(x_out + row * n + cols, values.to(tl.bfloat16), mask=mask)
    mean_square = tl.reduce(values * values, 1, _plus)[:, None] / n
    normed = _bf16(values * tl.math.rsqrt(mean_square + eps))
    normed = _bf16(normed * tl.load(weight + cols_1d, mask=in_row, other=0.0).to(tl.float32)[None, :])
    factor = _per_batch(one_plus_scale, first_batch, last_batch, in_first, cols_1d, in_row, n)
    offset = _per_batch(shift, first_batch, last_batch, in_first, cols_1d, in_row, n)
    modulated = _bf16(normed * factor + offset)
    row_scale = _row_scale(_absmax(modulated, mask, 1))[:, None]
    tl.store(out + row * n + cols, _quantised(modulated, row_scale), mask=mask)
    tl.store(scale + row, row_scale, mask=row < rows)


def launch_adaln(x: torch.Tensor, weight: torch.Tensor, one_plus_scale: torch.Tensor, shift: torch.Tensor,
                 eps: float, residual: tuple[torch.Tensor, torch.Tensor] | None, num_warps: int,
                 rows_per_program: int) -> tuple[torch.Tensor, ...]:
    """As fp8_modulated.launch: (e4m3 rows, scales), with `residual` (update, gate) (new x, e4m3 rows, scales)."""
    batch, length, width = x.shape
    if rows_per_program > length:
        raise ValueError(f"{rows_per_program} rows a program reach past a batch of {length}")
    rows = batch * length
    out, scale = quantised_like(rows, width, x.device)
    update, gate = residual if residual is not None else (x, one_plus_scale)
    x_out = torch.empty_like(x) if residual is not None else x
    adaln_factors_once[(cdiv(rows, rows_per_program),)](
        x, update, gate, x_out, weight, one_plus_scale, shift, out, scale, rows, length, width, eps,
        BLOCK=power_of_two_at_least(width), ROWS=rows_per_program, RESIDUAL=residual is not None,
        num_warps=num_warps)
    return (out, scale) if residual is None else (x_out, out, scale)


@triton.jit
def qk_norm_rope(qkv, cos, sin, q_weight, k_weight, q_out, k_out, eps, HEADS: tl.constexpr,
                 HEAD_DIM: tl.constexpr):
    """One token's q and k [HEADS, HEAD_DIM] from its stacked q|k|v row: RMSNorm per head (fp32, times the weight,
    rounded to bf16), then x * cos + rotate_half(x) * sin with each product and the sum rounded to bf16, as the
    eager forms round."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.arange(0, HEADS)[:, None]
    dim = tl.arange(0, HEAD_DIM)[None, :]
    partner = (dim + HEAD_DIM // 2) % HEAD_DIM
    sign = tl.where(dim < HEAD_DIM // 2, -1.0, 1.0)
    cos_row = tl.load(cos + token * HEAD_DIM + dim).to(tl.float32)
    sin_row = tl.load(sin + token * HEAD_DIM + dim).to(tl.float32)
    for which in tl.static_range(2):
        source = qkv + token * 3 * HEADS * HEAD_DIM + which * HEADS * HEAD_DIM
        weight = q_weight if which == 0 else k_weight
        target = q_out if which == 0 else k_out
        values = tl.load(source + head * HEAD_DIM + dim).to(tl.float32)
        partners = tl.load(source + head * HEAD_DIM + partner).to(tl.float32)
        inverse = tl.math.rsqrt(tl.reduce(values * values, 1, _plus)[:, None] / HEAD_DIM + eps)
        normed = _bf16(values * inverse * tl.load(weight + dim).to(tl.float32))
        normed_partners = _bf16(partners * inverse * tl.load(weight + partner).to(tl.float32))
        rotated = _bf16(_bf16(normed * cos_row) + _bf16(sign * normed_partners * sin_row))
        tl.store(target + token * HEADS * HEAD_DIM + head * HEAD_DIM + dim, rotated.to(tl.bfloat16))


def launch_qk_norm_rope(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_weight: torch.Tensor,
                        k_weight: torch.Tensor, heads: int, eps: float, num_warps: int = 8
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [B, S, heads, head_dim] from qkv [B, S, 3 * heads * head_dim] and cos, sin [B, S, 1, head_dim]."""
    batch, length, width = qkv.shape
    head_dim = width // 3 // heads
    q_out = qkv.new_empty((batch, length, heads, head_dim))
    k_out = torch.empty_like(q_out)
    qk_norm_rope[(batch * length,)](qkv, cos, sin, q_weight, k_weight, q_out, k_out, eps, HEADS=heads,
                                    HEAD_DIM=head_dim, num_warps=num_warps)
    return q_out, k_out


def qk_norm_rope_reference(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_weight: torch.Tensor,
                           k_weight: torch.Tensor, heads: int, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The compiled block's plain expressions (dit.Attention.forward with RopeTables.apply's plain form)."""
    q, k, _ = qkv.chunk(3, dim=-1)
    head_dim = q.shape[-1] // heads
    q = F.rms_norm(q.unflatten(-1, (heads, -1)), (head_dim,), q_weight, eps)
    k = F.rms_norm(k.unflatten(-1, (heads, -1)), (head_dim,), k_weight, eps)

    def rotated(x: torch.Tensor) -> torch.Tensor:
        first, second = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-second, first), dim=-1) * sin

    return rotated(q), rotated(k)


@triton.jit
def gelu_one_block(gate, up, out, scale, gate_row_stride, up_row_stride, n, BLOCK: tl.constexpr):
    """The former gelu_mul_quantize_kernel: one program a row, the row as one power-of-two block."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    product = _gelu_product(tl.load(gate + row * gate_row_stride + cols, mask=mask, other=0.0).to(tl.float32),
                            tl.load(up + row * up_row_stride + cols, mask=mask, other=0.0).to(tl.float32))
    row_scale = _row_scale(_absmax(product, mask))
    tl.store(out + row * n + cols, _quantised(product, row_scale), mask=mask)
    tl.store(scale + row, row_scale)


@triton.jit
def gelu_persistent(gate, up, out, scale, gate_row_stride, up_row_stride, rows, n, BLOCK: tl.constexpr,
                    STAGES: tl.constexpr):
    """gelu_mul_quantize_kernel's body for rows program_id, program_id + programs, ..."""
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    first, step = tl.program_id(0).to(tl.int64), tl.num_programs(0).to(tl.int64)
    for row in tl.range(first, rows, step, num_stages=STAGES):
        product = _gelu_product(tl.load(gate + row * gate_row_stride + cols, mask=mask, other=0.0).to(tl.float32),
                                tl.load(up + row * up_row_stride + cols, mask=mask, other=0.0).to(tl.float32))
        row_scale = _row_scale(_absmax(product, mask))
        tl.store(out + row * n + cols, _quantised(product, row_scale), mask=mask)
        tl.store(scale + row, row_scale)


def launch_gelu_one_block(gate: torch.Tensor, up: torch.Tensor, num_warps: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows, n = gate.shape
    out, scale = quantised_like(rows, n, gate.device)
    gelu_one_block[(rows,)](gate, up, out, scale, gate.stride(0), up.stride(0), n, BLOCK=power_of_two_at_least(n),
                            num_warps=num_warps)
    return out, scale


def launch_gelu_persistent(gate: torch.Tensor, up: torch.Tensor, programs: int, stages: int, num_warps: int
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    rows, n = gate.shape
    out, scale = quantised_like(rows, n, gate.device)
    gelu_persistent[(min(programs, rows),)](gate, up, out, scale, gate.stride(0), up.stride(0), rows, n,
                                            BLOCK=power_of_two_at_least(n), STAGES=stages, num_warps=num_warps)
    return out, scale
