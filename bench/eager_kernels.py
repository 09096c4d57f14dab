"""The uncompiled DiT block's elementwise passes one by one at full size (1024x1024, 256 text tokens, batch 1,
bf16), with the alternatives each could take, timed back to back in a CUDA graph so launches do not count.

    python bench/eager_kernels.py --out DIR

Writes DIR/eager_kernels.json; `bench/kernel_profile.py dit` shows the same passes inside a whole step.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from common import environment, table
from gemv_shapes import graph_ms

TOKENS, WIDTH, HEADS, HEAD = 4352, 4096, 32, 128


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    cuda = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1, TOKENS, WIDTH, **cuda)
    weight = torch.rand(WIDTH, **cuda) + 0.5
    scale, shift = torch.randn(1, 1, WIDTH, **cuda) * 0.1, torch.randn(1, 1, WIDTH, **cuda) * 0.1
    factor32 = weight.float() * (1 + scale.float())
    qkv = torch.randn(1, TOKENS, 3, HEADS, HEAD, **cuda)
    q_k = qkv[:, :, :2]
    q_k_contiguous = q_k.contiguous()
    cos = torch.rand(1, TOKENS, 2, 1, HEAD, **cuda)
    gate_up = torch.randn(1, TOKENS, 2 * 3 * WIDTH, **cuda)
    gate, up = gate_up.chunk(2, dim=-1)
    gate_c, up_c = gate.contiguous(), up.contiguous()
    normed = F.rms_norm(x, (WIDTH,), weight=weight, eps=1e-6)
    n_qk = q_k_contiguous.clone()
    half = HEAD // 2

    def rms_rows(t):
        squares = torch.linalg.vector_norm(t, dim=-1, keepdim=True, dtype=torch.float32).square_()
        return t * torch.rsqrt(squares.div_(HEAD).add_(1e-6)).to(t.dtype)

    def rope_halves(n):
        out = n * cos
        out[..., :half].addcmul_(n[..., half:], cos[..., :half])
        out[..., half:].addcmul_(n[..., :half], cos[..., half:])
        return out

    def rope_cat(n):
        return (n * cos).addcmul_(torch.cat((n[..., half:], n[..., :half]), dim=-1), cos)

    cases = {
        "adaLN norm: rms_norm, bf16 weight": lambda: F.rms_norm(x, (WIDTH,), weight=weight, eps=1e-6),
        "adaLN norm: rms_norm, fp32 weight (mixed)": lambda: F.rms_norm(x, (WIDTH,), weight=factor32[0, 0], eps=1e-6),
        "modulate: addcmul(shift, n, scale) bf16": lambda: torch.addcmul(shift, normed, scale),
        "modulate: + n (add_)": lambda: normed.clone().add_(normed),
        "modulate: n + shift (broadcast add)": lambda: normed + shift,
        "residual: addcmul(x, update, gate) bf16": lambda: torch.addcmul(x, normed, scale),
        "q/k rms: rms_norm on the strided view": lambda: F.rms_norm(q_k, (HEAD,), eps=1e-6),
        "q/k rms: rms_norm contiguous": lambda: F.rms_norm(q_k_contiguous, (HEAD,), eps=1e-6),
        "q/k rms: vector_norm + product (strided)": lambda: rms_rows(q_k),
        "q/k rms: vector_norm + product (contiguous)": lambda: rms_rows(q_k_contiguous),
        "rope: mul + two half addcmul_": lambda: rope_halves(n_qk),
        "rope: mul + cat + addcmul_": lambda: rope_cat(n_qk),
        "gelu(gate) strided": lambda: F.gelu(gate),
        "gelu(gate) contiguous": lambda: F.gelu(gate_c),
        "gelu(gate) * up contiguous, in place": lambda: F.gelu(gate_c).mul_(up_c),
        "gelu(gate) * up strided": lambda: up * F.gelu(gate),
    }
    rows = []
    with torch.inference_mode():
        for name, run in cases.items():
            try:
                ms = graph_ms(run, repeats=20)
                rows.append({"pass": name, "us": round(ms * 1000, 1)})
            except Exception as error:  # an op that cannot be captured: say so
                rows.append({"pass": name, "error": f"{type(error).__name__}: {error}"[:120]})
    print(table(rows, ["pass", "us", "error"]))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "eager_kernels.json").write_text(json.dumps({"environment": environment(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
