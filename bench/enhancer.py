"""Prompt-enhancer speed on the GPU with full-size random weights (runtime/formats/configs/ERNIE-Image/pe/config.json).

    python bench/enhancer.py [--new-tokens 256] [--prompt-tokens 128] [--runs 3] [--skip-reference]

A typical request: 1024x1024, a prompt of ~128 tokens after the chat template (Baidu's system text is ~70 of
them), 256 new tokens forced (random weights rarely emit EOS, so EOS is masked until then), Baidu's sampling
(temperature 0.6, top_p 0.95, transformers' top_k 50). Timed through this pack's sampler (private CPU generator,
cancel check per token), once with the static-cache CUDA-graph decoder and once with transformers' forward, then
once through transformers' generate() (diffusers' PE path) for comparison, then the phase costs: moving the PE
to host RAM after its phase and back for the next run.
Prints one JSON line per measurement plus a summary table; about a minute on an H200.
"""
from __future__ import annotations

import argparse
import gc
import json
import time

import torch

from common import REPO_ROOT, import_package, print_environment, table

import_package()

from ernie_image.runtime.model.builders import rebuild_rotary_tables  # noqa: E402
from ernie_image.runtime.text.pe_model import pe_weight_bytes  # noqa: E402
from ernie_image.runtime.text.token_sampler import SamplingSettings, sample_tokens  # noqa: E402

EOS_ID = 2


PE_CONFIG = REPO_ROOT / "runtime" / "formats" / "configs" / "ERNIE-Image" / "pe" / "config.json"


def full_size_pe(device: torch.device, config_path=PE_CONFIG):
    from transformers import Ministral3Config, Ministral3ForCausalLM

    raw = json.loads(open(config_path).read())
    raw = {k: v for k, v in raw.items() if k not in ("architectures", "dtype", "transformers_version", "model_type")}
    config = Ministral3Config(**raw)
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = Ministral3ForCausalLM(config)
    model = model.to_empty(device=device).to(torch.bfloat16)
    generator = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim >= 2:
                param.copy_(torch.randn(param.shape, generator=generator, device=device, dtype=torch.float32)
                            .mul_(0.02).to(param.dtype))
            else:
                param.fill_(1.0)
    rebuild_rotary_tables(model.model, config, device)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval().requires_grad_(False), raw


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--skip-reference", action="store_true", help="skip transformers' generate() comparison")
    parser.add_argument("--config", default=str(PE_CONFIG), help="PE config.json (a tiny one for a CPU smoke test)")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    print_environment()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench/enhancer.py needs a CUDA GPU (or --device cpu with a tiny --config)")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    started = time.perf_counter()
    model, raw = full_size_pe(device, args.config)
    sync()
    build_s = time.perf_counter() - started
    params = sum(p.numel() for p in model.parameters())
    print(json.dumps({"what": "built", "params_b": round(params / 1e9, 3), "build_s": round(build_s, 2),
                      "weights_gb": round(pe_weight_bytes(raw, torch.bfloat16) / 1e9, 2)}))

    prompt = torch.randint(min(1000, raw["vocab_size"] // 2), raw["vocab_size"], (args.prompt_tokens,), generator=torch.Generator().manual_seed(1))
    prompt_ids = [1] + prompt.tolist()[1:]
    settings = SamplingSettings(temperature=0.6, top_p=0.95, top_k=50, max_new_tokens=args.new_tokens,
                                min_new_tokens=args.new_tokens)
    for fast in (True, False):  # warm-up
        sample_tokens(model, prompt_ids, SamplingSettings(max_new_tokens=16, min_new_tokens=16), 0, [EOS_ID], fast=fast)

    rows = []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    tokens_by_path: dict[str, list[int]] = {}
    for fast, path in ((True, "ernie_image sampler, static cache + CUDA graph"),
                       (False, "ernie_image sampler, transformers forward")):
        for run in range(args.runs):
            sampled = sample_tokens(model, prompt_ids, settings, seed=run, eos_ids=[EOS_ID], check_cancel=lambda: None,
                                    fast=fast)
            tokens = len(sampled.token_ids)
            if run == 0:
                tokens_by_path[path] = sampled.token_ids
            row = {"path": path, "run": run, "new tokens": tokens,
                   "prefill ms": round(sampled.prefill_s * 1000, 1), "decode s": round(sampled.decode_s, 3),
                   "PE s": round(sampled.seconds, 3), "tokens/s": round(tokens / sampled.seconds, 1),
                   "decode ms/token": round(sampled.decode_s * 1000 / max(1, tokens - 1), 2)}
            print(json.dumps(row))
            rows.append(row)
    first, second = tokens_by_path.values()
    same = next((i for i, (a, b) in enumerate(zip(first, second)) if a != b), len(first))
    print(json.dumps({"what": "same seed, both paths", "identical leading tokens": same, "of": len(first)}))
    peak_gb = torch.cuda.max_memory_allocated() / 1e9 if device.type == "cuda" else 0.0

    if not args.skip_reference:
        ids = torch.tensor([prompt_ids], device=device)
        torch.manual_seed(0)
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, min_new_tokens=16, do_sample=True,
                       temperature=0.6, top_p=0.95, pad_token_id=11, eos_token_id=EOS_ID)
        sync()
        started = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens,
                             min_new_tokens=args.new_tokens, do_sample=True, temperature=0.6, top_p=0.95,
                             pad_token_id=11, eos_token_id=EOS_ID)
        sync()
        seconds = time.perf_counter() - started
        tokens = out.shape[1] - ids.shape[1]
        row = {"path": "transformers generate (diffusers)", "run": 0, "new tokens": tokens, "PE s": round(seconds, 3),
               "tokens/s": round(tokens / seconds, 1)}
        print(json.dumps(row))
        rows.append(row)

    # Phase costs in LocalPipe with keep_loaded: PE weights to host RAM after the PE phase, back before the next one.
    sync()
    started = time.perf_counter()
    model.to("cpu")
    sync()
    offload_s = time.perf_counter() - started
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    resident_after_offload_gb = torch.cuda.memory_allocated() / 1e9 if device.type == "cuda" else 0.0
    started = time.perf_counter()
    model.to(device)
    sync()
    reload_s = time.perf_counter() - started
    print(json.dumps({"what": "phase", "offload_to_host_s": round(offload_s, 2), "back_to_gpu_s": round(reload_s, 2),
                      "gpu_gb_after_offload": round(resident_after_offload_gb, 2), "peak_gpu_gb": round(peak_gb, 2)}))

    print(f"\nPrompt enhancer, full-size random weights ({params / 1e9:.2f} B params, bf16), prompt "
          f"{args.prompt_tokens} tokens, {args.new_tokens} new tokens forced, 1024x1024 request")
    print(table(rows, ["path", "run", "new tokens", "prefill ms", "decode ms/token", "PE s", "tokens/s"]))
    print(f"peak GPU memory {peak_gb:.2f} GB; offload to host {offload_s:.2f} s, back to GPU {reload_s:.2f} s")


if __name__ == "__main__":
    main()
