"""The prompt enhancer placed whole for its phase and streamed layer-wise under a VRAM plan
(offload.placement.PePlacement), full-size random weights (runtime/formats/configs/ERNIE-Image/pe/config.json), against the
same PE resident on the GPU.

    python bench/pe_streamed.py [--new-tokens 64] [--prompt-tokens 128]

Checks that the streamed PE samples the resident PE's tokens for one seed, and measures what streaming costs:
tokens/s (every token copies all decoder layers over PCIe), peak GPU memory during the phase, and the GPU memory
left once the phase is over (ring parked, stem back in host memory). Prints JSON lines and a summary line.
"""
from __future__ import annotations

import argparse
import gc
import json
import time

import torch

from common import import_package, print_environment
from enhancer import EOS_ID, PE_CONFIG, full_size_pe

import_package()

from ernie_image.runtime.offload.placement import PePlacement  # noqa: E402
from ernie_image.runtime.offload.planner import LayeredPlan  # noqa: E402
from ernie_image.runtime.text.token_sampler import SamplingSettings, sample_tokens  # noqa: E402


def run(model, prompt_ids: list[int], settings: SamplingSettings) -> tuple[list[int], float]:
    torch.cuda.synchronize()
    sampled = sample_tokens(model, prompt_ids, settings, seed=3, eos_ids=[EOS_ID], check_cancel=lambda: None)
    torch.cuda.synchronize()
    return sampled.token_ids, sampled.seconds


def phase_rows(model, prompt_ids, settings, resident_ids, layers: int, cuda: torch.device, before: int) -> dict:
    """The PE placed whole for its phase (what a 12 GB plan does): the first placement from pageable host memory,
    a rewrite, leaving (nothing copied back), entering again from the page-locked slab."""
    started = time.perf_counter()
    placed = PePlacement(model, LayeredPlan("phase", 0, 0, 0, 0, layers), cuda)
    torch.cuda.synchronize()
    first_place_s = time.perf_counter() - started
    phase_ids, phase_s = run(model, prompt_ids, settings)
    started = time.perf_counter()
    placed.leave()
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    leave_s = time.perf_counter() - started
    left_gb = (torch.cuda.memory_allocated() - before) / 1e9
    started = time.perf_counter()
    placed.enter()
    torch.cuda.synchronize()
    enter_s = time.perf_counter() - started
    again_ids, again_s = run(model, prompt_ids, settings)
    placed.leave()
    torch.cuda.empty_cache()
    tokens = len(phase_ids)
    return {"phase_first_place_s": round(first_place_s, 2), "phase_tokens_per_s": round(tokens / again_s, 1),
            "phase_leave_s": round(leave_s, 3), "phase_gpu_gb_after_leave": round(left_gb, 3),
            "phase_enter_s": round(enter_s, 3), "phase_enter_gb_per_s": round(placed.phase_weights.nbytes / 1e9
                                                                              / enter_s, 1),
            "phase_same_tokens": phase_ids == resident_ids and again_ids == resident_ids,
            "phase_rewrite_s": round(again_s, 2)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--slots", type=int, default=2)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/pe_streamed.py needs a CUDA GPU")
    print_environment()
    cuda = torch.device("cuda")
    model, raw = full_size_pe(cuda, PE_CONFIG)
    prompt = torch.randint(min(1000, raw["vocab_size"] // 2), raw["vocab_size"], (args.prompt_tokens,), generator=torch.Generator().manual_seed(1))
    prompt_ids = [1] + prompt.tolist()[1:]
    settings = SamplingSettings(temperature=0.6, top_p=0.95, top_k=50, max_new_tokens=args.new_tokens,
                                min_new_tokens=args.new_tokens)
    run(model, prompt_ids, SamplingSettings(max_new_tokens=4, min_new_tokens=4))  # warm-up
    resident_ids, resident_s = run(model, prompt_ids, settings)

    model.to("cpu")
    gc.collect()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    layers = len(model.model.layers)
    phase = phase_rows(model, prompt_ids, settings, resident_ids, layers, cuda, before)
    plan = LayeredPlan("streamed", args.slots, 0, 0, 0, layers)  # PePlacement reads only mode and slots
    started = time.perf_counter()
    placed = PePlacement(model, plan, cuda)
    torch.cuda.synchronize()
    place_s = time.perf_counter() - started
    ring_bytes = placed.streamer.ring_bytes  # `leave` parks the ring: read it while it is allocated
    torch.cuda.reset_peak_memory_stats()
    streamed_ids, streamed_s = run(model, prompt_ids, settings)
    peak = torch.cuda.max_memory_allocated()
    started = time.perf_counter()
    placed.leave()
    torch.cuda.empty_cache()
    leave_s = time.perf_counter() - started
    after = torch.cuda.memory_allocated()
    started = time.perf_counter()
    placed.enter()
    again_ids, _ = run(model, prompt_ids, settings)
    enter_s = time.perf_counter() - started
    placed.release()

    tokens = len(streamed_ids)
    result = {
        "same_tokens_as_resident": streamed_ids == resident_ids, "same_after_leave_enter": again_ids == resident_ids,
        "new_tokens": tokens, "resident_tokens_per_s": round(tokens / resident_s, 1),
        "streamed_tokens_per_s": round(tokens / streamed_s, 1), "place_s": round(place_s, 2),
        "peak_gpu_gb": round(peak / 1e9, 2), "ring_gb": round(ring_bytes / 1e9, 2),
        "gpu_gb_after_leave": round((after - before) / 1e9, 3), "leave_s": round(leave_s, 2),
        "enter_and_run_s": round(enter_s, 2), **phase,
    }
    print(json.dumps(result))
    print(f"phase PE: {result['phase_tokens_per_s']} tokens/s, enter {result['phase_enter_s']} s "
          f"({result['phase_enter_gb_per_s']} GB/s), leave {result['phase_leave_s']} s, first placement "
          f"{result['phase_first_place_s']} s, same tokens: {result['phase_same_tokens']}")
    print(f"streamed PE: {result['streamed_tokens_per_s']} tokens/s (resident {result['resident_tokens_per_s']}), "
          f"peak {result['peak_gpu_gb']} GB, {result['gpu_gb_after_leave']} GB left after the phase, same tokens: "
          f"{result['same_tokens_as_resident'] and result['same_after_leave_enter']}")


if __name__ == "__main__":
    main()
