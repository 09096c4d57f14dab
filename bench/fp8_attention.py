"""The DiT's attention in bf16 (PyTorch's SDPA, as the blocks call it) against cuDNN's FP8 flash attention, at the
DiT's shape: speed, and error against an fp32 reference. The measurement behind leaving attention in bf16
(docs/quant-formats.md, "Attention stays bf16"): the pack has no FP8 attention, the cuDNN calls live here.

    python bench/fp8_attention.py --out DIR [--batch 1]     # SM 9.0 GPU; pip install nvidia-cudnn-frontend

cuDNN's FP8 attention (graph.sdpa_fp8): q, k and v in e4m3 with one power-of-two scale each (their maxima taken
to at most 448), the probabilities by 256, the output in e4m3 by half of v's scale (an output row is a convex
combination of v's rows); on SM 9.0 the output must be e4m3.

Rows (batch x 4352 tokens, 1024x1024 with 256 text tokens; 32 heads of 128):
- bf16 SDPA on q, k, v as views of the fused projection's output;
- the FP8 attention alone, on e4m3 q, k, v already made;
- q, k and v quantised per tensor and the FP8 attention, uncompiled and compiled (what a block would run; the
  attention is a custom op, opaque to the compiler).
TFLOP/s counts 4 * S^2 * H * D per batch row. Error: rel. L2 against the fp32 reference, q and k RMS-normalised
as the DiT's are and multiplied by `spread` (the logits' standard deviation), v standard normal. Random inputs
make near-uniform attention, which is not what a trained model's attention looks like.
Writes DIR/fp8_attention.json.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from common import cuda_time_ms, environment, import_package, table

import_package()

import cudnn  # noqa: E402  (nvidia-cudnn-frontend)

SEQ, HEADS, HEAD_DIM = 4352, 32, 128
E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
PROBABILITY_SCALE = 256.0


def quantize_per_tensor(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` as e4m3 times a power-of-two scale that takes its largest magnitude to at most 448, and 1 / that scale
    (fp32, one element, on the device)."""
    largest = x.abs().amax().float().clamp_min(2.0 ** -100)  # an all-zero x: a large finite scale, not inf
    scale = torch.exp2(torch.floor(torch.log2(E4M3_MAX / largest)))
    return (x.float() * scale).to(E4M3), scale.reciprocal().reshape(1)


def attention_e4m3(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q k^T / sqrt(d)) v for bf16 q, k, v [B, S, H, D] (strided views allowed, the last stride 1): the
    output e4m3 [B, S, H, D] and the one-element fp32 factor that takes it back (output * factor)."""
    q8, descale_q = quantize_per_tensor(q)
    k8, descale_k = quantize_per_tensor(k)
    v8, descale_v = quantize_per_tensor(v)
    descale_o = descale_v * 2.0
    return fp8_attention(q8, k8, v8, descale_q, descale_k, descale_v, descale_o.reciprocal()), descale_o


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """What `attention_e4m3` approximates, in fp32: softmax(q k^T / sqrt(d)) v, [B, S, H, D]."""
    q, k, v = (t.float().transpose(1, 2) for t in (q, k, v))
    return torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2)


@torch.library.custom_op("ernie_image_bench::fp8_attention", mutates_args=())
def fp8_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, descale_q: torch.Tensor,
                  descale_k: torch.Tensor, descale_v: torch.Tensor, scale_o: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T descale_q descale_k / sqrt(d)) v descale_v * scale_o, e4m3 in and out, [B, S, H, D] (the
    output contiguous)."""
    plan = _plan_for(q, k, v)
    out = torch.empty(q.shape, dtype=E4M3, device=q.device)
    plan.run(q, k, v, (descale_q, descale_k, descale_v, scale_o), out)
    return out


@fp8_attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, descale_q: torch.Tensor, descale_k: torch.Tensor,
      descale_v: torch.Tensor, scale_o: torch.Tensor) -> torch.Tensor:
    return torch.empty(q.shape, dtype=E4M3, device=q.device)


def _cudnn_layout(t: torch.Tensor) -> tuple[list[int], list[int]]:
    """[B, S, H, D] strides as cuDNN's [B, H, S, D] dims and strides."""
    (b, s, h, d), (sb, ss, sh, sd) = t.shape, t.stride()
    return [b, h, s, d], [sb, sh, ss, sd]


@dataclass
class _Plan:
    """One built cuDNN FP8 attention graph, its tensors' handles and the probability scales it reads."""
    handle: Any
    graph: Any
    inputs: tuple[Any, ...]  # q, k, v, descale_q, descale_k, descale_v, scale_o
    probability_scales: tuple[Any, Any]  # descale_s, scale_s
    probability_values: tuple[torch.Tensor, torch.Tensor]
    output: Any
    maxima: tuple[Any, Any]  # amax_s, amax_o
    workspace_bytes: int

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scales: tuple[torch.Tensor, ...],
            out: torch.Tensor) -> None:
        maxima = torch.empty(2, dtype=torch.float32, device=q.device)
        workspace = torch.empty(self.workspace_bytes, dtype=torch.uint8, device=q.device)
        pack = dict(zip(self.inputs, (q, k, v, *(s.reshape(1, 1, 1, 1) for s in scales))))
        pack.update(zip(self.probability_scales, self.probability_values))
        pack[self.output] = out
        pack.update(zip(self.maxima, (maxima[:1].reshape(1, 1, 1, 1), maxima[1:].reshape(1, 1, 1, 1))))
        cudnn.set_stream(handle=self.handle, stream=torch.cuda.current_stream(q.device).cuda_stream)
        self.graph.execute(pack, workspace, handle=self.handle)


_plans: dict[tuple, _Plan] = {}
_handles: dict[int, Any] = {}


def _plan_for(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> _Plan:
    key = (q.device.index, tuple(q.shape), q.stride(), k.stride(), v.stride())
    plan = _plans.get(key)
    if plan is None:
        plan = _plans[key] = _build(q, k, v)
    return plan


def _build(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> _Plan:
    handle = _handles.get(q.device.index)
    if handle is None:
        with torch.cuda.device(q.device):
            handle = _handles.setdefault(q.device.index, cudnn.create_handle())
    e4m3, fp32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
    graph = cudnn.pygraph(io_data_type=e4m3, intermediate_data_type=fp32, compute_data_type=fp32, handle=handle)
    inputs = []
    for name, t in (("q", q), ("k", k), ("v", v)):
        dims, strides = _cudnn_layout(t)
        inputs.append(graph.tensor(name=name, dim=dims, stride=strides, data_type=e4m3))
    scalar = dict(dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=fp32)
    descale_q, descale_k, descale_v, descale_s, scale_s, scale_o = (
        graph.tensor(name=name, **scalar) for name in ("descale_q", "descale_k", "descale_v", "descale_s",
                                                       "scale_s", "scale_o"))
    output, _, amax_s, amax_o = graph.sdpa_fp8(
        q=inputs[0], k=inputs[1], v=inputs[2], descale_q=descale_q, descale_k=descale_k, descale_v=descale_v,
        descale_s=descale_s, scale_s=scale_s, scale_o=scale_o, is_inference=True,
        attn_scale=q.shape[-1] ** -0.5, use_causal_mask=False, name="fp8_attention")
    dims, strides = _cudnn_layout(torch.empty(q.shape, dtype=E4M3, device="meta"))
    output.set_output(True).set_dim(dims).set_stride(strides).set_data_type(e4m3)
    for maximum in (amax_s, amax_o):
        maximum.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(fp32)
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plans()
    probability = (torch.full((1, 1, 1, 1), 1.0 / PROBABILITY_SCALE, device=q.device),
                   torch.full((1, 1, 1, 1), PROBABILITY_SCALE, device=q.device))
    return _Plan(handle, graph, (*inputs, descale_q, descale_k, descale_v, scale_o), (descale_s, scale_s),
                 probability, output, (amax_s, amax_o), graph.get_workspace_size())


def projected(batch: int, spread: float, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v as views of one [B, S, 3, H, D] bf16 tensor, q and k with RMS `spread`**0.5 per head."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    qkv = torch.randn(batch, SEQ, 3, HEADS, HEAD_DIM, device="cuda", generator=generator)
    q_k = qkv[:, :, :2]
    q_k.mul_(spread ** 0.5 * torch.rsqrt(q_k.pow(2).mean(-1, keepdim=True)))
    qkv = qkv.bfloat16()
    return qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]


def bf16_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    out = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return out.transpose(1, 2)


def fp8_dequantised(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    out, descale = attention_e4m3(q, k, v)
    return out.float() * descale


def rel_l2(a: torch.Tensor, reference: torch.Tensor) -> float:
    return float((a.float() - reference).norm() / reference.norm())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--batch", type=int, default=1)
    args = parser.parse_args()
    if torch.cuda.get_device_capability() != (9, 0):
        raise SystemExit("cuDNN's FP8 attention with an e4m3 output needs an SM 9.0 GPU")
    report: dict = {"environment": environment(), "speed": [], "error": []}
    report["environment"].update(cudnn_frontend=cudnn.__version__, cudnn=cudnn.backend_version_string())
    flop = 4 * args.batch * SEQ * SEQ * HEADS * HEAD_DIM
    q, k, v = projected(args.batch, 1.0)
    (q8, dq), (k8, dk), (v8, dv) = (quantize_per_tensor(t.contiguous()) for t in (q, k, v))
    scale_o = (dv * 2).reciprocal()
    compiled = torch.compile(attention_e4m3, fullgraph=True)
    rows: list[tuple[str, Callable[[], object]]] = [
        ("bf16 SDPA", lambda: bf16_sdpa(q, k, v)),
        ("FP8 attention alone", lambda: fp8_attention(q8, k8, v8, dq, dk, dv, scale_o)),
        ("quantise q, k, v + FP8 attention", lambda: attention_e4m3(q, k, v)),
        ("quantise q, k, v + FP8 attention, compiled", lambda: compiled(q, k, v)),
    ]
    for name, run in rows:
        ms = cuda_time_ms(run, warmup=3, iters=20)
        report["speed"].append({"batch": args.batch, "form": name, "ms": round(ms, 4),
                                "TFLOP/s": round(flop / ms / 1e9)})
        print(report["speed"][-1], flush=True)
    for spread in (1.0, 4.0, 16.0):
        q, k, v = projected(args.batch, spread, seed=1)
        reference = attention_reference(q, k, v)
        report["error"].append({"spread": spread, "bf16 SDPA": f"{rel_l2(bf16_sdpa(q, k, v), reference):.5f}",
                                "FP8 attention": f"{rel_l2(fp8_dequantised(q, k, v), reference):.5f}"})
        print(report["error"][-1], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fp8_attention.json").write_text(json.dumps(report, indent=1))
    print(table(report["speed"], ["batch", "form", "ms", "TFLOP/s"]))
    print(table(report["error"], ["spread", "bf16 SDPA", "FP8 attention"]))


if __name__ == "__main__":
    main()
