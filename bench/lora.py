"""LoRA speed and memory on the GPU, against the base DiT in the same run, full-size random weights.

    python bench/lora.py --out lora.json                 # H200: branch and merged rows, about 8 minutes
    python bench/lora.py --merged-only --out lora.json   # merged rows only, about 4 minutes
    python bench/lora.py --tiny --out lora.json          # CPU smoke run on a tiny DiT (no compile, no FP8)

Rank-32 and rank-128 LoRAs on every block Linear (q, k, v, out, gate, up, fc2 of all 36 blocks), written as
bf16 safetensors and read back through the runtime's own reader. Rows: compiled bf16 DiT step (1024x1024, 256
text tokens, batch 1) without and with a LoRA; the same for block Linears packed to FP8; the time to apply a
LoRA and to switch to another of the same shape with the DiT resident and with blocks streamed at a 12 GB
budget; the device memory a LoRA adds against its size; the host memory of streamed blocks before and after.
Branch rows: the LoRA beside the base weights, so the step ratio is the branch's own cost. Merged rows (lora_mode
"merge"): the delta added into the resident weights in place (bf16 rank 32 and 128, FP8 rank 32, and at 12 GB
where streamed blocks keep the branch), with the apply time of the first merge (it makes the host copy of the
weights) and of a switch (restore from the host copy, merge again), the host copy's size, the device memory it
adds (after and at its peak during the apply), whether anything recompiled, and whether removing every LoRA gives
the base output bit for bit.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # as the CLI sets it

import torch

from common import (cuda_time_ms, dit_config, import_package, print_environment, quantise_block_linears_,
                    quantised_copy, randomise_dit_, rss_bytes, table)

import_package()

from safetensors.torch import save_file  # noqa: E402

from ernie_image.runtime.local.memory import measured_dit_size  # noqa: E402
from ernie_image.runtime.lora.apply import apply_loras  # noqa: E402
from ernie_image.runtime.lora.attach import apply_stack  # noqa: E402
from ernie_image.runtime.lora.keys import dit_linear_shapes  # noqa: E402
from ernie_image.runtime.lora.parsed import load_lora  # noqa: E402
from ernie_image.runtime.model.compile import compile_blocks, fuse_projections  # noqa: E402
from ernie_image.runtime.model.dit import DiTConfig, ErnieDiT  # noqa: E402
from ernie_image.runtime.offload.placement import DiTPlacement  # noqa: E402
from ernie_image.runtime.offload.planner import GiB, plan_dit, plan_memory  # noqa: E402
from ernie_image.runtime.offload.sizes import ModelSizes  # noqa: E402
from ernie_image.runtime.offload.workspace import Job  # noqa: E402

TINY = {"hidden_size": 64, "num_attention_heads": 2, "num_layers": 6, "ffn_hidden_size": 128, "in_channels": 128,
        "out_channels": 128, "patch_size": 1, "text_in_dim": 48, "rope_theta": 256, "rope_axes_dim": [8, 12, 12]}


class Bench:
    def __init__(self, tiny: bool, fp8: bool = True, rank128: bool = True) -> None:
        self.tiny = tiny
        self.with_fp8 = fp8
        self.switches = ("rank32 A", "rank32 B", "rank128", "base again") if rank128 else ("rank32 A", "rank32 B",
                                                                                         "base again")
        self.device = torch.device("cpu" if tiny else "cuda")
        self.dtype = torch.float32 if tiny else torch.bfloat16
        self.config = DiTConfig.from_dict(TINY if tiny else dit_config("ERNIE-Image-Turbo"))
        self.side = 256 if tiny else 1024
        self.text_tokens = 16 if tiny else 256
        self.folder = Path(tempfile.mkdtemp(prefix="ernie-lora-bench-"))
        self.rows: list[dict] = []
        self.facts: dict = {}

    # -- inputs -------------------------------------------------------------------------------------

    def write_lora(self, rank: int, seed: int) -> Path:
        """A LoRA on every block Linear, bf16, ai-toolkit layout (lora_A / lora_B + alpha)."""
        generator = torch.Generator().manual_seed(seed)
        state = {}
        for path, (rows, cols) in dit_linear_shapes(self.config).items():
            if not path.startswith("layers."):
                continue
            down = torch.randn((rank, cols), generator=generator) / cols ** 0.5
            up = torch.randn((rows, rank), generator=generator) * 0.05 / rank ** 0.5
            state[f"diffusion_model.{path}.lora_A.weight"] = down.to(torch.bfloat16)
            state[f"diffusion_model.{path}.lora_B.weight"] = up.to(torch.bfloat16)
            state[f"diffusion_model.{path}.alpha"] = torch.tensor(float(rank))
        path = self.folder / f"rank{rank}-{seed}.safetensors"
        save_file(state, str(path))
        return path

    def inputs(self):
        generator = torch.Generator(device=self.device).manual_seed(1)
        side = self.side // 16
        latents = torch.randn((1, 128, side, side), generator=generator, device=self.device).to(self.dtype)
        text = torch.randn((1, self.text_tokens, self.config.text_in_dim), generator=generator,
                           device=self.device).to(self.dtype)
        timestep = torch.full((1,), 700.0, device=self.device, dtype=self.dtype)
        return latents, timestep, text, [self.text_tokens]

    def build_dit(self) -> ErnieDiT:
        with torch.device(self.device):
            dit = ErnieDiT(self.config).to(self.dtype)
        dit.eval().requires_grad_(False)
        randomise_dit_(dit, seed=0)
        return dit

    # -- measuring ----------------------------------------------------------------------------------

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def seconds(self, run) -> float:
        self.sync()
        started = time.perf_counter()
        run()
        self.sync()
        return time.perf_counter() - started

    def step_ms(self, dit: ErnieDiT, args) -> float:
        with torch.inference_mode():
            if self.device.type == "cuda":
                return cuda_time_ms(lambda: dit(*args), warmup=2, iters=8)
            dit(*args)
            return 1e3 * min(self.seconds(lambda: dit(*args)) for _ in range(3))

    def first_call_s(self, dit: ErnieDiT, args) -> float:
        with torch.inference_mode():
            return self.seconds(lambda: dit(*args))

    @staticmethod
    def graphs() -> int:
        return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])

    def row(self, name: str, **values) -> None:
        row = {"row": name, **{k: (round(v, 3) if isinstance(v, float) else v) for k, v in values.items()}}
        self.rows.append(row)
        print("# " + json.dumps(row), flush=True)

    def allocated(self) -> int:
        return torch.cuda.memory_allocated() if self.device.type == "cuda" else 0

    # -- the runs -----------------------------------------------------------------------------------

    def compiled_bf16(self, loras: dict[str, Path]) -> None:
        dit = self.build_dit()
        if self.device.type == "cuda":
            fuse_projections(dit)
        compiled = compile_blocks(dit)
        args = self.inputs()
        label = "bf16 compiled" if compiled else f"{str(self.dtype).replace('torch.', '')} eager"
        graphs = self.graphs()
        first = self.first_call_s(dit, args)
        base_ms = self.step_ms(dit, args)
        self.row(f"{label}: base", step_ms=base_ms, first_call_s=first, new_graphs=self.graphs() - graphs)
        for name in self.switches:
            before_bytes = self.allocated()
            graphs = self.graphs()
            stack = [] if name == "base again" else [(load_lora(loras[name], self.config), 1.0)]
            apply_s = self.seconds(lambda: apply_stack(dit, stack))
            added = self.allocated() - before_bytes
            first = self.first_call_s(dit, args)
            ms = self.step_ms(dit, args)
            lora_bytes = sum(p.branch_params() for p, _ in stack) * self.dtype.itemsize
            self.row(f"{label}: {'switch to ' if name == 'rank32 B' else ''}{name}", step_ms=ms,
                     x_base=ms / base_ms, apply_s=apply_s, first_call_s=first, new_graphs=self.graphs() - graphs,
                     lora_MB=lora_bytes / 1e6, extra_vram_MB=added / 1e6 if name == "rank32 A" else "")
        if self.device.type == "cuda" and self.with_fp8:
            self.fp8(dit, loras, args)
        dit = None
        self.clean()

    def fp8(self, bf16: ErnieDiT, loras: dict[str, Path], args) -> None:
        apply_stack(bf16, [])
        dit = quantised_copy(bf16, "fp8")
        compile_blocks(dit)
        graphs = self.graphs()
        first = self.first_call_s(dit, args)
        base_ms = self.step_ms(dit, args)
        self.row("FP8 compiled: base", step_ms=base_ms, first_call_s=first, new_graphs=self.graphs() - graphs)
        graphs = self.graphs()
        apply_s = self.seconds(lambda: apply_stack(dit, [(load_lora(loras["rank32 A"], self.config), 1.0)]))
        first = self.first_call_s(dit, args)
        ms = self.step_ms(dit, args)
        self.row("FP8 compiled: rank32", step_ms=ms, x_base=ms / base_ms, apply_s=apply_s, first_call_s=first,
                 new_graphs=self.graphs() - graphs)

    def streamed_dit(self, loras: dict[str, Path]) -> tuple[ErnieDiT, DiTPlacement, str]:
        """A new DiT placed as the planner streams it with a rank-32 LoRA's branch counted in its stem: half its
        blocks streamed on the tiny model, within 12 GiB at full size. The DiT, its placement, the budget's words."""
        dit = self.build_dit()
        if self.device.type == "cuda":
            fuse_projections(dit)
        sizes = ModelSizes.released("turbo")
        lora_bytes = load_lora(loras["rank32 A"], self.config).branch_params() * self.dtype.itemsize
        measured = measured_dit_size(dit, sizes.dit.largest_linear_params)
        stem_bytes = measured.stem_bytes + lora_bytes
        sizes = dataclasses.replace(sizes, dit=dataclasses.replace(measured, stem_bytes=stem_bytes))
        if self.tiny:
            plan = plan_dit(sizes, self.config.num_layers // 2, 2, 0)
            budget = "tiny: half the blocks streamed"
        else:
            plan = plan_memory(12 * GiB, Job(self.side, self.side, 1, 1.0, self.text_tokens), sizes).dit
            budget = "12 GiB"
        placement = DiTPlacement(dit, plan, self.device)
        self.clean()
        return dit, placement, budget

    def streamed(self, loras: dict[str, Path]) -> None:
        dit, placement, budget = self.streamed_dit(loras)
        plan = placement.plan
        args = self.inputs()
        host_before, rss_before = placement.streamer.host_bytes, rss_bytes()
        base_ms = self.step_ms(dit, args)
        self.row(f"streamed ({budget}, {len(plan.streamed)} of {plan.layers} blocks streamed): base", step_ms=base_ms)
        for name in ("rank32 A", "rank32 B"):
            parsed = load_lora(loras[name], self.config)
            apply_s = self.seconds(lambda: apply_stack(dit, [(parsed, 1.0)]))
            ms = self.step_ms(dit, args)
            self.row(f"streamed: {'switch to ' if name == 'rank32 B' else ''}{name}", step_ms=ms, x_base=ms / base_ms,
                     apply_s=apply_s, host_slab_MB_before=host_before / 1e6,
                     host_slab_MB_after=placement.streamer.host_bytes / 1e6,
                     rss_GB_before=rss_before / 1e9, rss_GB_after=rss_bytes() / 1e9)
        placement.release()
        dit = placement = None
        self.clean()

    # -- merged ------------------------------------------------------------------------------------------

    def merge_step(self, dit: ErnieDiT, stack, streamed=()) -> dict:
        """Apply `stack` merged; the apply time, the device memory it adds (held after, peak during), the host copy."""
        before = self.allocated()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        applied = None

        def run() -> None:
            nonlocal applied
            applied = apply_loras(dit, stack, streamed)

        seconds = self.seconds(run)
        peak = torch.cuda.max_memory_allocated() - before if self.device.type == "cuda" else 0
        return {"apply_s": seconds, "extra_vram_MB": (self.allocated() - before) / 1e6, "peak_vram_MB": peak / 1e6,
                "host_copy_MB": applied.backup_bytes / 1e6, "pinned_MB": applied.backup_pinned_bytes / 1e6,
                "merged_layers": applied.merged_layers, "branch_layers": applied.branch_layers}

    def merged_rows(self, dit: ErnieDiT, label: str, loras: dict[str, Path], names: tuple[str, ...], args,
                    streamed=()) -> None:
        """Base step, then each LoRA of `names` merged in turn (the first makes the host copy, later ones switch),
        then every LoRA removed: the output compared with the base bit for bit."""
        graphs = self.graphs()
        first = self.first_call_s(dit, args)
        base_ms = self.step_ms(dit, args)
        with torch.inference_mode():
            base_out = dit(*args).clone()
        self.row(f"{label}: base", step_ms=base_ms, first_call_s=first, new_graphs=self.graphs() - graphs)
        for index, name in enumerate(names):
            parsed = load_lora(loras[name], self.config)
            graphs = self.graphs()
            measured = self.merge_step(dit, [(parsed, 1.0, "merge")], streamed)
            ms = self.step_ms(dit, args)
            what = "merge" if index == 0 else "switch to merged"
            self.row(f"{label}: {what} {name}", step_ms=ms, x_base=ms / base_ms, new_graphs=self.graphs() - graphs,
                     lora_MB=parsed.branch_params() * self.dtype.itemsize / 1e6, **measured)
        graphs = self.graphs()
        measured = self.merge_step(dit, [], streamed)
        ms = self.step_ms(dit, args)
        with torch.inference_mode():
            exact = bool(torch.equal(dit(*args), base_out))
        self.row(f"{label}: all LoRAs removed", step_ms=ms, x_base=ms / base_ms, new_graphs=self.graphs() - graphs,
                 bit_exact_base=exact, apply_s=measured["apply_s"], host_copy_MB=measured["host_copy_MB"])
        # The first merge above also paid the first touch of the host memory it locked (on a virtual machine just
        # started, the hypervisor's faults); a merge after a removal makes its host copy anew on touched memory.
        parsed = load_lora(loras[names[0]], self.config)
        measured = self.merge_step(dit, [(parsed, 1.0, "merge")], streamed)
        self.row(f"{label}: merge {names[0]} again (a new host copy)", **measured)
        self.merge_step(dit, [], streamed)

    def merged_bf16(self, loras: dict[str, Path]) -> None:
        dit = self.build_dit()
        if self.device.type == "cuda":
            fuse_projections(dit)
        compiled = compile_blocks(dit)
        label = "merged bf16 compiled" if compiled else f"merged {str(self.dtype).replace('torch.', '')} eager"
        names = tuple(n for n in ("rank32 A", "rank32 B", "rank128") if n in self.switches)
        self.merged_rows(dit, label, loras, names, self.inputs())
        dit = None
        self.clean()

    def merged_fp8(self, loras: dict[str, Path]) -> None:
        dit = self.build_dit()
        for block in dit.layers:
            block.self_attention.fuse_projections()
            block.mlp.fuse_projections()
        quantise_block_linears_(dit, "fp8")
        compile_blocks(dit)
        self.clean()
        self.merged_rows(dit, "merged FP8 compiled", loras, ("rank32 A", "rank32 B"), self.inputs())
        dit = None
        self.clean()

    def merged_streamed(self, loras: dict[str, Path]) -> None:
        """At 12 GB the streamed blocks keep the branch; the resident blocks and the stem merge."""
        dit, placement, budget = self.streamed_dit(loras)
        plan = placement.plan
        label = f"merged, streamed ({budget}, {len(plan.streamed)} of {plan.layers} blocks streamed)"
        self.merged_rows(dit, label, loras, ("rank32 A", "rank32 B"), self.inputs(), streamed=plan.streamed)
        placement.release()
        dit = placement = None
        self.clean()

    def parse_times(self, loras: dict[str, Path]) -> None:
        from ernie_image.runtime.lora import parsed as parsed_module

        for name in ("rank32 A", "rank128"):
            parsed_module._cache.clear()
            seconds = self.seconds(lambda: load_lora(loras[name], self.config))
            self.row(f"read + check {name} file", read_s=seconds, file_MB=loras[name].stat().st_size / 1e6)

    def clean(self) -> None:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run on a tiny DiT")
    parser.add_argument("--out", type=Path, help="write the rows and the environment as JSON here")
    parser.add_argument("--skip-fp8", action="store_true", help="no FP8 rows (saves two compiles)")
    parser.add_argument("--skip-rank128", action="store_true", help="no rank-128 row (saves one compile)")
    parser.add_argument("--skip-streamed", action="store_true", help="no streamed rows")
    parser.add_argument("--merged-only", action="store_true", help="only the merged rows (no branch rows)")
    args = parser.parse_args()
    if not args.tiny and not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU: run with --tiny for a CPU smoke run")
    environment = print_environment()
    bench = Bench(args.tiny, fp8=not args.skip_fp8, rank128=not args.skip_rank128)
    started = time.perf_counter()
    loras = {"rank32 A": bench.write_lora(32, 1), "rank32 B": bench.write_lora(32, 2), "rank128": bench.write_lora(128, 3)}
    bench.parse_times(loras)
    if not args.merged_only:
        bench.compiled_bf16(loras)
        if not args.skip_streamed:
            bench.streamed(loras)
    bench.merged_bf16(loras)
    if bench.device.type == "cuda" and not args.skip_fp8:
        bench.merged_fp8(loras)
    if not args.skip_streamed:
        bench.merged_streamed(loras)
    columns = ["row", "step_ms", "x_base", "apply_s", "first_call_s", "new_graphs", "lora_MB", "extra_vram_MB",
               "peak_vram_MB", "host_copy_MB", "pinned_MB", "merged_layers", "branch_layers", "bit_exact_base",
               "read_s", "host_slab_MB_before", "host_slab_MB_after", "rss_GB_before", "rss_GB_after"]
    model = "tiny" if args.tiny else "ERNIE-Image-Turbo"
    config = f"{model} DiT, {bench.side}x{bench.side}, {bench.text_tokens} text tokens, batch 1"
    print(f"\n{environment['gpu']}, torch {environment['torch']}, {config}; {time.perf_counter() - started:.0f} s\n")
    print(table(bench.rows, [c for c in columns if any(c in r for r in bench.rows)]))
    if args.out:
        args.out.write_text(json.dumps({"environment": environment, "config": config, "rows": bench.rows}, indent=2))


if __name__ == "__main__":
    main()
