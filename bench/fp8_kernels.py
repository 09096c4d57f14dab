"""The FP8 step's activation-quantising kernels alone, at the DiT's shapes: each Triton form and launch setting
against what the compiler makes of the torch form.

    python bench/fp8_kernels.py --out DIR [--batch 1]     # CUDA GPU (SM >= 8.9)

Rows (batch x 4352 tokens, 1024x1024 with 256 text tokens):
- gelu(gate) * up quantised per row, gate and up the halves of the [rows, 24576] gate/up output: the kernel
  (runtime/quant/fp8_gated.py) by warps, and the compiled torch form;
- the adaLN input (RMSNorm, weight, modulation) quantised per row, [rows, 4096], alone and after the gated
  residual: the kernel (fp8_modulated.py) by rows a program and warps, and the compiled torch form;
- a bf16 [rows, 4096] activation (the attention's output) quantised per row: the kernel (fp8_rows.py) by rows a
  program and warps, and the compiled torch form.
With --candidates, also the candidate forms of bench/fp8_kernel_candidates.py: the adaLN kernel reading its
factors once a program of 2-8 rows, gelu(gate) * up as one 16384-lane block and as a persistent pipelined loop,
and q/k RMSNorm + RoPE in one Triton program a token against the compiled block's inductor kernel (alone, and
with the attention after it).
Each time is the median of 10 timings of 20 back-to-back calls; GB/s counts the bytes read once and written.
Writes DIR/fp8_kernels.json.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from common import cuda_time_ms, environment, import_package, table

import_package()

from ernie_image.runtime.model.adaln import RMSNorm  # noqa: E402
from ernie_image.runtime.quant import fp8_gated, fp8_modulated, fp8_rows  # noqa: E402
from ernie_image.runtime.quant.fp8 import quantize_activation  # noqa: E402
from ernie_image.runtime.quant.fp8_gated import gelu_mul_quantize_reference  # noqa: E402
from ernie_image.runtime.quant.fp8_modulated import norm_modulate_quantize_reference  # noqa: E402
from ernie_image.runtime.quant.triton_loader import kernels_for  # noqa: E402

SEQ = 4352
HIDDEN, FFN = 4096, 12288


def per_call_ms(run: Callable[[], object], calls: int = 20, repeats: int = 10) -> float:
    """The median of `repeats` timings of `calls` back-to-back calls, per call."""
    def back_to_back() -> None:
        for _ in range(calls):
            run()
    return cuda_time_ms(back_to_back, warmup=1, iters=repeats) / calls


def same(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]) -> str:
    """How far the kernel's e4m3 codes are from the torch form's: the share of codes that differ, the largest gap."""
    apart = (a[0].view(torch.uint8).int() - b[0].view(torch.uint8).int()).abs()
    return f"{float((apart > 0).float().mean()):.1e} differ, max {int(apart.max())}"


def gelu_rows(rows: int) -> list[dict]:
    kernels = kernels_for("triton_fp8_kernels", torch.device("cuda"))
    gate, up = torch.randn((rows, 2 * FFN), device="cuda").mul_(3).bfloat16().chunk(2, dim=-1)
    moved = rows * FFN * (2 + 2 + 1) + rows * 4
    compiled = torch.compile(gelu_mul_quantize_reference)
    forms: dict[str, Callable[[], object]] = {"compiled torch form": lambda: compiled(gate, up)}
    for warps in (8, 16):
        forms[f"three chunks, {warps} warps"] = lambda warps=warps: fp8_gated.launch(kernels, gate, up, warps)
    return measured("gelu(gate)*up -> e4m3", rows, FFN, forms, moved, gelu_mul_quantize_reference(gate, up))


def adaln_rows(rows: int, batch: int, residual: bool) -> list[dict]:
    kernels = kernels_for("triton_fp8_kernels", torch.device("cuda"))
    x = torch.randn((batch, rows // batch, HIDDEN), device="cuda").bfloat16()
    update = torch.randn((batch, rows // batch, HIDDEN), device="cuda").bfloat16()
    gate = torch.randn((batch, 1, HIDDEN), device="cuda") * 0.3
    norm = RMSNorm(HIDDEN, 1e-6).cuda().bfloat16()
    norm.weight.data.uniform_(0.5, 1.5)
    one_plus_scale = torch.rand((batch, 1, HIDDEN), device="cuda") + 0.5
    shift = torch.randn((batch, 1, HIDDEN), device="cuda") * 0.1

    def torch_form(values: torch.Tensor, change: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if residual:  # dit._gated_residual's plain form
            values = values + (gate * change.float()).to(values.dtype)
        return norm_modulate_quantize_reference(values, norm.weight, one_plus_scale, shift, 1e-6)

    moved = rows * HIDDEN * (2 + 1 + (4 if residual else 0)) + rows * 4
    with torch.no_grad():
        reference = torch_form(x, update)
        compiled = torch.compile(torch_form)
        forms: dict[str, Callable[[], object]] = {"compiled torch form": lambda: compiled(x, update)}
        for rows_per_program in (1, 2, 4):
            for warps in (4, 8, 16):
                forms[f"{rows_per_program} rows a program, {warps} warps"] = (
                    lambda warps=warps, per=rows_per_program: fp8_modulated.launch(
                        kernels, x, norm.weight, one_plus_scale, shift, 1e-6, (update, gate) if residual else None,
                        warps, per)[-2:])
        what = "gated residual, adaLN norm, modulate -> e4m3" if residual else "adaLN norm, modulate -> e4m3"
        return measured(what, rows, HIDDEN, forms, moved, reference)


def quantise_rows(rows: int) -> list[dict]:
    kernels = kernels_for("triton_fp8_kernels", torch.device("cuda"))
    x = torch.randn((rows, HIDDEN), device="cuda").bfloat16()
    moved = rows * HIDDEN * (2 + 1) + rows * 4
    compiled = torch.compile(lambda values: quantize_activation(values, per_row=True))
    forms: dict[str, Callable[[], object]] = {"compiled torch form": lambda: compiled(x)}
    for rows_per_program in (1, 2, 4):
        for warps in (4, 8, 16):
            forms[f"{rows_per_program} rows a program, {warps} warps"] = (
                lambda warps=warps, per=rows_per_program: fp8_rows.launch(kernels, x, warps, per))
    return measured("bf16 -> e4m3", rows, HIDDEN, forms, moved, quantize_activation(x, per_row=True))


def candidate_rows(rows: int, batch: int) -> list[dict]:
    """The candidates' rows, each compared with the shipped kernel's output (or, for RoPE, the torch form's)."""
    import fp8_kernel_candidates as candidates

    kernels = kernels_for("triton_fp8_kernels", torch.device("cuda"))
    result = []
    gate, up = torch.randn((rows, 2 * FFN), device="cuda").mul_(3).bfloat16().chunk(2, dim=-1)
    forms: dict[str, Callable[[], object]] = {"shipped, three chunks": lambda: fp8_gated.launch(kernels, gate, up)}
    for warps in (8, 16):
        forms[f"one 16384-lane block, {warps} warps"] = (
            lambda warps=warps: candidates.launch_gelu_one_block(gate, up, warps))
    processors = torch.cuda.get_device_properties(0).multi_processor_count
    for per_processor in (1, 2):
        for stages in (1, 2):
            for warps in (8, 16):
                forms[f"persistent, {per_processor} an SM, {stages} stages, {warps} warps"] = (
                    lambda p=per_processor * processors, s=stages, w=warps: candidates.launch_gelu_persistent(
                        gate, up, p, s, w))
    result += measured("gelu(gate)*up -> e4m3", rows, FFN, forms, rows * FFN * 5 + rows * 4,
                       fp8_gated.launch(kernels, gate, up))
    for residual in (False, True):
        x, update = (torch.randn((batch, rows // batch, HIDDEN), device="cuda").bfloat16() for _ in range(2))
        weight = (torch.rand(HIDDEN, device="cuda") + 0.5).bfloat16()
        factors = [torch.rand((batch, 1, HIDDEN), device="cuda") + 0.5, torch.randn((batch, 1, HIDDEN), device="cuda"),
                   torch.randn((batch, 1, HIDDEN), device="cuda") * 0.3]
        one_plus_scale, shift, gate_factor = factors
        extra = (update, gate_factor) if residual else None
        forms = {"shipped, 1 row a program": lambda: fp8_modulated.launch(kernels, x, weight, one_plus_scale, shift,
                                                                          1e-6, extra)[-2:]}
        for per in (2, 4, 8):
            for warps in (4, 8, 16):
                forms[f"factors once, {per} rows a program, {warps} warps"] = (
                    lambda per=per, warps=warps: candidates.launch_adaln(x, weight, one_plus_scale, shift, 1e-6,
                                                                         extra, warps, per)[-2:])
        what = "gated residual, adaLN norm, modulate -> e4m3" if residual else "adaLN norm, modulate -> e4m3"
        result += measured(what, rows, HIDDEN, forms, rows * HIDDEN * (2 + 1 + (4 if residual else 0)) + rows * 4,
                           fp8_modulated.launch(kernels, x, weight, one_plus_scale, shift, 1e-6, extra)[-2:])
    return result + rope_rows(batch, rows // batch, candidates)


def rope_rows(batch: int, length: int, candidates) -> list[dict]:
    """q/k RMSNorm + RoPE from the stacked q|k|v output: inductor's kernel for the block's plain expressions against
    the candidate, alone and with the attention that reads their outputs."""
    heads, head_dim = HIDDEN // 128, 128
    qkv = torch.randn((batch, length, 3 * HIDDEN), device="cuda").bfloat16()
    angles = torch.rand((batch, length, 1, head_dim), device="cuda") * 6
    cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
    q_weight, k_weight = ((torch.rand(head_dim, device="cuda") + 0.5).bfloat16() for _ in range(2))
    tables = (cos, sin, q_weight, k_weight, heads, 1e-6)
    compiled = torch.compile(candidates.qk_norm_rope_reference)
    reference = candidates.qk_norm_rope_reference(qkv, *tables)
    values = qkv.unflatten(-1, (3, heads, head_dim))[:, :, 2]

    def attended(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), values.transpose(1, 2))

    forms: dict[str, Callable[[], object]] = {
        "compiled torch form": lambda: compiled(qkv, *tables),
        "compiled torch form + attention": lambda: attended(*compiled(qkv, *tables))}
    for warps in (4, 8, 16):
        forms[f"one program a token, {warps} warps"] = (
            lambda w=warps: candidates.launch_qk_norm_rope(qkv, *tables[:4], heads, 1e-6, w))
    forms["one program a token, 8 warps + attention"] = (
        lambda: attended(*candidates.launch_qk_norm_rope(qkv, *tables[:4], heads, 1e-6)))
    moved = batch * length * HIDDEN * 2 * 2 * 2  # q and k read and written
    result = []
    for form, run in forms.items():
        row = {"what": f"q/k RMSNorm + RoPE [{batch * length}, {2 * HIDDEN}]", "form": form}
        ms = per_call_ms(run)
        row.update(ms=round(ms, 4), GB_s=round(moved / ms / 1e6))
        if "attention" not in form:
            got = run()
            row["vs_torch_form"] = "; ".join(f"{float((a != b).float().mean()):.1e} differ"
                                             for a, b in zip(got, reference))
        print(f"# {row}", flush=True)
        result.append(row)
    return result


def measured(what: str, rows: int, n: int, forms: dict[str, Callable[[], object]], moved: int,
             reference: tuple[torch.Tensor, torch.Tensor]) -> list[dict]:
    result = []
    for form, run in forms.items():
        row = {"what": f"{what} [{rows}, {n}]", "form": form}
        try:
            ms = per_call_ms(run)
            got = run()
            row.update(ms=round(ms, 4), GB_s=round(moved / ms / 1e6), vs_torch_form=same(got, reference))
        except Exception as error:  # reported as the row
            row["error"] = f"{type(error).__name__}: {error}"[:200]
        print(f"# {row}", flush=True)
        result.append(row)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--batch", type=int, nargs="+", default=[1])
    parser.add_argument("--candidates", action="store_true", help="also bench/fp8_kernel_candidates.py's forms")
    args = parser.parse_args()
    report: dict = {"environment": environment(), "rows": []}
    with torch.inference_mode():
        for batch in args.batch:
            rows = batch * SEQ
            report["rows"] += (gelu_rows(rows) + adaln_rows(rows, batch, residual=False)
                               + adaln_rows(rows, batch, residual=True) + quantise_rows(rows))
            if args.candidates:
                report["rows"] += candidate_rows(rows, batch)
    print(table(report["rows"], ["what", "form", "ms", "GB_s", "vs_torch_form", "error"]))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fp8_kernels.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
