"""Prompt-enhancer decode, token by token: before and after, where a token's time goes, FP8 weights' logits cost.

    python bench/pe_decode.py --out DIR          # full-size random PE (3.43B) on a CUDA GPU, ~2 minutes on an H200
    python bench/pe_decode.py --tiny --out DIR   # CPU smoke test of the same code with the tiny PE

Baidu's sampling (temperature 0.6, top_p 0.95, top_k 50), a 128-token prompt, 256 new tokens forced (random weights
rarely emit EOS). Rows:
- before: the previous decoder (transformers' seven-kernel RMSNorm, grouped-query SDPA through the math kernels)
  and the previous sampling (warpers on the GPU, 131072 probabilities copied to the host, CPU exponential race);
- after: `sample_tokens` as the pack runs it now (fewer kernels per step, sampling on the GPU, next step queued
  before the host reads the token);
- breakdown: the graph replay alone (before / after / FP8), each sampling alone, end to end;
- a 256-token rewrite (prefill + decode), bf16 and FP8;
- logits change, teacher-forced over 64 tokens chosen greedily by an fp32 copy: bf16 before, bf16 after and FP8
  against fp32, and after / FP8 against bf16 before (max and mean absolute change, relative L2, top-1 agreement).
Asserted in the same run: a seed twice gives one rewrite; the after decoder's replay equals its own eager step.
Writes DIR/pe_decode.json.
"""
from __future__ import annotations

import argparse
import copy
import gc
import json
import time
from pathlib import Path

import torch

from common import BenchRun, environment, import_package, table

import_package()

from ernie_image.runtime.model.compile import compile_available  # noqa: E402
from ernie_image.runtime.text.device_sampling import DeviceTokenDraws  # noqa: E402
from ernie_image.runtime.text.pe_quant import quantize_pe_layers_  # noqa: E402
from ernie_image.runtime.text.static_decoder import StaticCacheDecoder  # noqa: E402
from ernie_image.runtime.text.token_sampler import (ExponentialDraws, SamplingSettings, _warpers,  # noqa: E402
                                                    sample_tokens)

EOS_ID = 2


class Run(BenchRun):
    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.label = "bf16" if device.type == "cuda" else "fp32"  # the tiny CPU model runs in fp32

    def row(self, **fields) -> None:
        self.rows.append(fields)
        print("# " + json.dumps(fields), flush=True)

    def per_call_ms(self, run, count: int) -> float:
        """Mean ms of `count` back-to-back calls, device drained before and after."""
        self.sync()
        started = time.perf_counter()
        for _ in range(count):
            run()
        self.sync()
        return (time.perf_counter() - started) * 1e3 / count


def build(tiny: bool, device: torch.device):
    if tiny:
        from ernie_image.runtime.demo.tiny_pe import lively_prompt_enhancer

        model = lively_prompt_enhancer(seed=4).eval().requires_grad_(False).to(device)
        return model, model.config.vocab_size
    from enhancer import full_size_pe

    model, raw = full_size_pe(device)
    return model, raw["vocab_size"]


def sample_before(model, prompt_ids: list[int], settings: SamplingSettings, seed: int) -> tuple[list[int], float, float]:
    """The decode loop as it was: previous decoder kernels, warpers then a CPU exponential race per token."""
    device = model.get_input_embeddings().weight.device
    use_graph = device.type == "cuda"
    decoder = StaticCacheDecoder(model, len(prompt_ids) + settings.max_new_tokens, use_graph=use_graph, fused=False)
    draws = None
    try:
        started = time.perf_counter()
        logits = decoder.prefill(prompt_ids)
        draws = ExponentialDraws(torch.Generator().manual_seed(seed), logits.shape[-1])
        warpers = _warpers(settings)
        eos = torch.tensor([EOS_ID], device=device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        prefilled = time.perf_counter()
        tokens: list[int] = []
        while len(tokens) < settings.max_new_tokens:
            if len(tokens) < settings.min_new_tokens:
                logits[:, eos] = -float("inf")
            scores = logits
            for warp in warpers:
                scores = warp(None, scores)
            tokens.append(draws.sample(torch.softmax(scores, dim=-1).cpu()))
            if len(tokens) >= settings.max_new_tokens:
                break
            logits = decoder.next_logits(tokens[-1])
        finished = time.perf_counter()
    finally:
        decoder.close()
        if draws is not None:
            draws.close()
    return tokens, prefilled - started, finished - prefilled


def replay_ms(run: Run, model, prompt_ids: list[int], fused: bool, steps: int,
              compiled: bool = False) -> tuple[float, torch.Tensor, str]:
    """ms of one decode step alone (graph replay on CUDA), plus the last logits and the decoder's kind."""
    use_graph = run.device.type == "cuda"
    decoder = StaticCacheDecoder(model, len(prompt_ids) + steps + 2, use_graph=use_graph, fused=fused,
                                 compiled=compiled)
    try:
        decoder.prefill(prompt_ids)
        logits = decoder.next_logits(5)
        ms = run.per_call_ms(lambda: decoder.next_logits(7), steps)
        kind = "CUDA graph" if decoder.graph is not None else "eager"
        return ms, logits.clone(), kind
    finally:
        decoder.close()


def teacher_forced(model, prompt_ids: list[int], tokens: list[int], fused: bool, compiled: bool = False) -> torch.Tensor:
    """[len(tokens) + 1, vocab] fp32 logits after the prompt and after each forced token (eager steps)."""
    decoder = StaticCacheDecoder(model, len(prompt_ids) + len(tokens) + 1, use_graph=False, fused=fused,
                                 compiled=compiled)
    try:
        out = [decoder.prefill(prompt_ids).float().cpu()]
        for token in tokens:
            out.append(decoder.next_logits(token).float().cpu())
        return torch.cat(out)
    finally:
        decoder.close()


def compare(name: str, got: torch.Tensor, want: torch.Tensor) -> dict:
    diff = (got - want).abs()
    return {"logits": name, "max abs change": round(diff.max().item(), 4), "mean abs change": round(diff.mean().item(), 5),
            "relative L2": round(((got - want).norm() / want.norm()).item(), 5),
            "top-1 agreement": round((got.argmax(-1) == want.argmax(-1)).float().mean().item(), 3),
            "logit std": round(want.std().item(), 3)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tiny", action="store_true", help="CPU smoke test with the tiny PE")
    parser.add_argument("--out", type=Path, required=True, help="folder for pe_decode.json")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--forced", type=int, default=64, help="teacher-forced tokens for the logits comparison")
    args = parser.parse_args()
    started = time.perf_counter()
    device = torch.device("cpu" if args.tiny else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench/pe_decode.py needs a CUDA GPU (or --tiny for the CPU smoke test)")
    if args.tiny:
        args.new_tokens, args.prompt_tokens, args.forced = min(args.new_tokens, 48), min(args.prompt_tokens, 40), 16
    env = environment()
    print("# " + json.dumps(env), flush=True)
    run = Run(device)
    logits_rows: list[dict] = []
    with torch.inference_mode():
        with run.phase("build"):
            model, vocab = build(args.tiny, device)
        prompt = torch.randint(min(1000, vocab // 2), vocab, (args.prompt_tokens,),
                               generator=torch.Generator().manual_seed(1))
        prompt_ids = [1] + prompt.tolist()[1:]
        settings = SamplingSettings(temperature=0.6, top_p=0.95, top_k=50, max_new_tokens=args.new_tokens,
                                    min_new_tokens=args.new_tokens)
        with run.phase("warm-up"):
            warm = SamplingSettings(max_new_tokens=16, min_new_tokens=16)
            sample_tokens(model, prompt_ids, warm, 0, [EOS_ID])
            sample_before(model, prompt_ids, warm, 0)

        with run.phase("rewrites, before and after"):
            for index in range(args.runs):
                tokens, prefill_s, decode_s = sample_before(model, prompt_ids, settings, seed=index)
                run.row(path=f"{run.label} before", run=index, tokens=len(tokens), prefill_ms=round(prefill_s * 1e3, 1),
                        decode_ms_per_token=round(decode_s * 1e3 / max(1, len(tokens) - 1), 3),
                        rewrite_s=round(prefill_s + decode_s, 3))
            seen = []
            for index in range(args.runs):
                sampled = sample_tokens(model, prompt_ids, settings, seed=0, eos_ids=[EOS_ID], check_cancel=lambda: None)
                seen.append(sampled.token_ids)
                count = len(sampled.token_ids)
                run.row(path=f"{run.label} after", run=index, tokens=count, prefill_ms=round(sampled.prefill_s * 1e3, 1),
                        decode_ms_per_token=round(sampled.decode_s * 1e3 / max(1, count - 1), 3),
                        rewrite_s=round(sampled.seconds, 3))
            run.check("same seed twice: the same rewrite", all(s == seen[0] for s in seen), tokens=len(seen[0]))

        with run.phase("breakdown"):
            steps = 16 if args.tiny else 128
            before_ms, _, kind = replay_ms(run, model, prompt_ids, fused=False, steps=steps)
            run.row(path=f"{run.label} before", part=f"decode step alone ({kind})", ms=round(before_ms, 3))
            after_ms, logits, kind = replay_ms(run, model, prompt_ids, fused=True, steps=steps)
            run.row(path=f"{run.label} after", part=f"decode step alone ({kind})", ms=round(after_ms, 3))
            if compile_available(device):
                first = time.perf_counter()
                compiled_ms, _, kind = replay_ms(run, model, prompt_ids, fused=True, steps=steps, compiled=True)
                run.row(path=f"{run.label} compiled", part=f"decode step alone ({kind})", ms=round(compiled_ms, 3),
                        first_use_s=round(time.perf_counter() - first, 1))
                sampled = sample_tokens(model, prompt_ids, settings, seed=0, eos_ids=[EOS_ID], compiled=True)
                again = sample_tokens(model, prompt_ids, settings, seed=0, eos_ids=[EOS_ID], compiled=True)
                count = len(sampled.token_ids)
                run.row(path=f"{run.label} compiled", run=0, tokens=count, prefill_ms=round(again.prefill_s * 1e3, 1),
                        decode_ms_per_token=round(again.decode_s * 1e3 / max(1, count - 1), 3),
                        rewrite_s=round(again.seconds, 3))
                run.check("compiled: same seed twice, the same rewrite", sampled.token_ids == again.token_ids)
            if device.type == "cuda":
                graph = StaticCacheDecoder(model, len(prompt_ids) + 40, use_graph=True)
                eager = StaticCacheDecoder(model, len(prompt_ids) + 40, use_graph=False)
                graph.prefill(prompt_ids)
                eager.prefill(prompt_ids)
                same = all(torch.equal(graph.next_logits(t), eager.next_logits(t)) for t in range(10, 40))
                graph.close()
                eager.close()
                run.check("after decoder: graph replay == its eager step, bit for bit (30 tokens)", same)
            draws = DeviceTokenDraws(0.6, 50, 0.95, seed=0, device=device)
            run.row(path=f"{run.label} after", part="sampling alone (device: top-k, top-p, race)",
                    ms=round(run.per_call_ms(lambda: draws.sample(logits), steps), 3))
            cpu_draws = ExponentialDraws(torch.Generator().manual_seed(0), logits.shape[-1])
            warpers = _warpers(settings)

            def old_sampling():
                scores = logits
                for warp in warpers:
                    scores = warp(None, scores)
                return cpu_draws.sample(torch.softmax(scores, dim=-1).cpu())
            try:
                run.row(path=f"{run.label} before", part="sampling alone (warpers, copy to host, CPU race)",
                        ms=round(run.per_call_ms(old_sampling, steps), 3))
            finally:
                cpu_draws.close()

        with run.phase("FP8 weights"):
            fp8 = copy.deepcopy(model)
            packed = quantize_pe_layers_(fp8, "fp8")
            weights_gb = sum(t.numel() * t.element_size() for t in list(fp8.parameters()) + list(fp8.buffers())) / 1e9
            fp8_ms, _, kind = replay_ms(run, fp8, prompt_ids, fused=True, steps=steps)
            run.row(path="FP8 after", part=f"decode step alone ({kind})", ms=round(fp8_ms, 3), packed_linears=packed,
                    weights_gb=round(weights_gb, 2))
            sampled = sample_tokens(fp8, prompt_ids, settings, seed=0, eos_ids=[EOS_ID])
            count = len(sampled.token_ids)
            run.row(path="FP8 after", run=0, tokens=count, prefill_ms=round(sampled.prefill_s * 1e3, 1),
                    decode_ms_per_token=round(sampled.decode_s * 1e3 / max(1, count - 1), 3),
                    rewrite_s=round(sampled.seconds, 3))

        with run.phase("logits change, teacher-forced"):
            reference_model = copy.deepcopy(model).float()
            reference_first = teacher_forced(reference_model, prompt_ids, [], fused=False)
            forced, logits_now = [], reference_first[-1]
            decoder = StaticCacheDecoder(reference_model, len(prompt_ids) + args.forced + 1, use_graph=False,
                                         fused=False)
            decoder.prefill(prompt_ids)
            for _ in range(args.forced):  # the fp32 model's greedy continuation
                forced.append(int(logits_now.argmax()))
                logits_now = decoder.next_logits(forced[-1]).float().cpu()
            decoder.close()
            want = teacher_forced(reference_model, prompt_ids, forced, fused=False)
            del reference_model
            gc.collect()
            before = teacher_forced(model, prompt_ids, forced, fused=False)
            after = teacher_forced(model, prompt_ids, forced, fused=True)
            if compile_available(device):
                logits_rows.append(compare(f"{run.label} compiled vs fp32",
                                           teacher_forced(model, prompt_ids, forced, fused=True, compiled=True), want))
            fp8_logits = teacher_forced(fp8, prompt_ids, forced, fused=True)
            logits_rows += [compare(f"{run.label} before vs fp32", before, want),
                            compare(f"{run.label} after vs fp32", after, want),
                            compare("FP8 after vs fp32", fp8_logits, want),
                            compare(f"{run.label} after vs {run.label} before", after, before),
                            compare(f"FP8 after vs {run.label} before", fp8_logits, before)]
            for row in logits_rows:
                print("# " + json.dumps(row), flush=True)
            del fp8
    run.phases["total"] = round(time.perf_counter() - started, 1)
    title = (f"Prompt enhancer decode, {'tiny PE, CPU' if args.tiny else 'full-size random PE, bf16'}, prompt "
             f"{args.prompt_tokens} tokens, {args.new_tokens} new tokens forced, {env['gpu']}, torch {env['torch']}")
    print("\n" + title)
    print(table([r for r in run.rows if "run" in r], ["path", "run", "tokens", "prefill_ms", "decode_ms_per_token",
                                                     "rewrite_s"]))
    print()
    print(table([r for r in run.rows if "part" in r], ["path", "part", "ms", "weights_gb", "first_use_s"]))
    print()
    print(table(logits_rows, ["logits", "max abs change", "mean abs change", "relative L2", "top-1 agreement",
                              "logit std"]))
    failed = [c for c in run.checks if not c["ok"]]
    print(f"\nchecks: {len(run.checks) - len(failed)} passed, {len(failed)} failed; phases (s): {run.phases}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "pe_decode.json").write_text(json.dumps(
        {"environment": env, "title": title, "rows": run.rows, "logits": logits_rows, "checks": run.checks,
         "phases_s": run.phases}, indent=1))
    if failed:
        raise SystemExit(f"{len(failed)} check(s) failed: {[c['check'] for c in failed]}")


if __name__ == "__main__":
    main()
