"""ComfyUI's native ERNIE-Image DiT against this pack's DiT, on the same random weights in one process.

    python bench/native_comfy.py --out DIR          # full size on one CUDA GPU, under 2 minutes on an H200
    python bench/native_comfy.py --tiny --out DIR   # CPU smoke test, fp32: native and ours agree within 1e-4

ComfyUI's comfy/ldm/ernie/model.py is not part of this repository: give its path with `--native-model-py PATH`
(or COMFYUI_ERNIE_MODEL_PY; default `.native/model.py`, git-ignored). It runs unmodified against the stand-ins in
bench/comfy_stand_ins.py (which say what of ComfyUI they reproduce), with comfy_kitchen as its `ck`; a copy of
comfy_kitchen under `.native/site` is put first on sys.path when present.

1024x1024 (64x64 latent grid, 4096 image tokens), 256 text tokens, batch 1 and 2, bf16. Rows: native eager, native
with each block torch.compile'd (inductor, as ComfyUI's compile node), ours eager as shipped (projections fused, the
fewer-pass elementwise forms), ours eager replayed as CUDA graphs (what the sampler runs uncompiled), ours compiled
(model.compile.compile_blocks). Ours is built with bench/common.randomise_dit_; native gets the same tensors (its
parameter names are diffusers', as ours are: the state dict is assigned before ours fuses its projections, so the
two share weight memory). Both take the timestep as sigma * 1000 (the --tiny run checks that native given sigma
instead differs clearly). Native's blocks compile under the recompile limit compile_blocks sets for ours. Relative
L2 differences: native vs ours (eager and compiled), each compiled model vs its eager self, and both against an fp32
copy of the same weights (native rounds the modulation to bf16, ours keeps it in fp32: expect native vs ours around
1e-2). Writes DIR/native_comfy.json and DIR/native_comfy.md.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import sys
import time
from pathlib import Path
from types import ModuleType

import torch

from common import REPO_ROOT, environment, table
from eager_graphs import Bench, build_unfused  # also makes the package importable as ernie_image

from ernie_image.runtime.model.compile import (allow_cache_size, compile_available, compile_blocks,  # noqa: E402
                                                fuse_projections)
from ernie_image.runtime.model.dit import ErnieDiT  # noqa: E402
from ernie_image.runtime.model.dit_graphs import DiTGraphs  # noqa: E402

NATIVE_SITE = REPO_ROOT / ".native" / "site"
DEFAULT_NATIVE_MODEL = REPO_ROOT / ".native" / "model.py"
NATIVE_VS_OURS_TINY = 1e-4  # fp32: the same function, computed in another order
# bf16 (native vs ours, compiled vs eager): roundings give about 1e-2 (native's bf16 modulation alone does); the bound
# only catches wrong wiring (weights or positions mismatched give O(1)), it does not judge rounding
BF16_WIRING_BOUND = 1e-1


def native_model_path(given: str | None) -> Path:
    path = Path(given or os.environ.get("COMFYUI_ERNIE_MODEL_PY") or DEFAULT_NATIVE_MODEL)
    if not path.is_file():
        raise SystemExit(f"ComfyUI's ERNIE model.py not found at {path}: pass --native-model-py PATH to "
                         "comfy/ldm/ernie/model.py of a ComfyUI checkout (or set COMFYUI_ERNIE_MODEL_PY)")
    return path


def import_kitchen() -> ModuleType:
    if NATIVE_SITE.is_dir() and str(NATIVE_SITE) not in sys.path:
        sys.path.insert(0, str(NATIVE_SITE))
    import comfy_stand_ins

    try:
        return comfy_stand_ins.import_kitchen()
    except ImportError as error:
        raise SystemExit(f"comfy_kitchen is not importable ({error}): pip install comfy-kitchen, or unpack its wheel "
                         f"under {NATIVE_SITE}") from None


def build_ours(bench: Bench) -> ErnieDiT:
    return build_unfused(bench)


def build_native(module: ModuleType, ours: ErnieDiT) -> torch.nn.Module:
    """Native's model on the meta device, then given ours' (unfused) tensors themselves."""
    import comfy_stand_ins

    native = module.ErnieImageModel(**dataclasses.asdict(ours.config), device="meta", dtype=ours.dtype,
                                    operations=comfy_stand_ins.disable_weight_init)
    native.load_state_dict(ours.state_dict(), strict=True, assign=True)
    return native.eval().requires_grad_(False)


def fp32_outputs(bench: Bench, ours: ErnieDiT) -> dict[int, torch.Tensor]:
    """Ours with every weight in fp32 (no TF32), on each batch's inputs: the reference both bf16 models approximate."""
    with torch.device("meta"):
        reference = ErnieDiT(ours.config)
    reference.load_state_dict({k: v.float() for k, v in ours.state_dict().items()}, assign=True)
    reference.eval().requires_grad_(False)
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        outs = {}
        for batch in (1, 2):
            latents, timestep, text, lens = bench.inputs(batch)
            outs[batch] = reference(latents.float(), timestep.float(), text.float(), lens).float()
        return outs
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved
        del reference


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm()).item()


def compiled_rows(bench: Bench, label: str, run, eager_outs: dict, outs: dict, diffs: list[dict]) -> None:
    for batch in (1, 2):
        args = bench.inputs(batch)
        first = time.perf_counter()
        outs[batch] = run(*args)
        bench.sync()
        compile_s = time.perf_counter() - first
        rel = rel_l2(outs[batch], eager_outs[batch])
        diffs.append({"comparison": f"{label} compiled vs {label} eager", "batch": batch, "rel_l2": f"{rel:.2e}"})
        bound = NATIVE_VS_OURS_TINY if bench.tiny else BF16_WIRING_BOUND
        bench.check(f"{label} compiled b{batch} vs {label} eager: relative L2 <= {bound}", rel <= bound,
                    rel_l2=f"{rel:.2e}")
        bench.measure(f"{label}, blocks compiled", batch, lambda: run(*args), first_call_s=round(compile_s, 1))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tiny", action="store_true", help="CPU smoke test with a tiny DiT in fp32")
    parser.add_argument("--out", type=Path, required=True, help="folder for native_comfy.json and native_comfy.md")
    parser.add_argument("--native-model-py", help="ComfyUI's comfy/ldm/ernie/model.py (or COMFYUI_ERNIE_MODEL_PY)")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--skip-compile", action="store_true")
    parser.add_argument("--skip-fp32-reference", action="store_true")
    args = parser.parse_args()
    model_py = native_model_path(args.native_model_py)
    started = time.perf_counter()
    device = torch.device("cpu" if args.tiny else "cuda")
    if args.tiny:
        torch.set_num_threads(1)  # a tiny model gains nothing from threads, and they stall on a busy machine
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench/native_comfy.py needs a CUDA GPU (or --tiny for the CPU smoke test)")
    ck = import_kitchen()
    import comfy_stand_ins

    native_module = comfy_stand_ins.load_native_model(model_py, ck)
    bench = Bench(device, args.tiny, args.iters)
    env = environment()
    env.update({"comfy_kitchen": _kitchen_version(ck), "comfy_kitchen_path": str(Path(ck.__file__).parent),
                "native_model_py": str(model_py),
                "native_model_py_sha256": hashlib.sha256(model_py.read_bytes()).hexdigest()})
    print("# " + json.dumps(env), flush=True)
    kitchen: dict = {"backends": {name: _backend_state(info) for name, info in ck.list_backends().items()}}
    diffs: list[dict] = []
    native_eager, native_compiled, ours_eager, ours_compiled = {}, {}, {}, {}
    with torch.inference_mode():
        with bench.phase("build"):
            ours = build_ours(bench)
            native = build_native(native_module, ours)
            shared = (native.layers[0].self_attention.to_q.weight.data_ptr()
                      == ours.layers[0].self_attention.to_q.weight.data_ptr())
            bench.check("native and ours share weight memory", shared)
        reference: dict = {}
        if device.type == "cuda" and not args.skip_fp32_reference:
            with bench.phase("fp32 reference"):
                reference = fp32_outputs(bench, ours)
                torch.cuda.empty_cache()
        with bench.phase("eager"):
            fuse_projections(ours)  # as the pack ships it on CUDA (the same maths on the CPU)
            for batch in (1, 2):
                run_args = bench.inputs(batch)
                with comfy_stand_ins.kitchen_backends(native_module, "rms_rope_split_half") as chosen:
                    native_eager[batch] = native(*run_args[:3])
                kitchen["rms_rope_split_half"] = sorted(set(chosen))
                ours_eager[batch] = ours(*run_args)
                rel = rel_l2(native_eager[batch], ours_eager[batch])
                bound = NATIVE_VS_OURS_TINY if bench.tiny else BF16_WIRING_BOUND
                diffs.append({"comparison": "native eager vs ours eager", "batch": batch, "rel_l2": f"{rel:.2e}"})
                bench.check(f"b{batch}: native eager vs ours eager: relative L2 <= {bound}", rel <= bound,
                            rel_l2=f"{rel:.2e}")
                if bench.tiny and batch == 1:  # the comparison sees the timestep: native given sigma, not sigma*1000
                    wrong = rel_l2(native(run_args[0], run_args[1] / 1000, run_args[2]), ours_eager[batch])
                    bench.check("a wrong timestep scale shows: native(sigma) vs ours(sigma*1000) relative L2 > 1e-2",
                                wrong > 1e-2, rel_l2=f"{wrong:.2e}")
                bench.measure("native eager", batch, lambda: native(*run_args[:3]))
                bench.measure("ours eager (as shipped)", batch, lambda: ours(*run_args))
                if device.type == "cuda":
                    graphs = DiTGraphs(ours)
                    bench.measure("ours eager + CUDA graphs (as the sampler runs it)", batch,
                                  lambda: graphs(*run_args))
                    graphs.invalidate()
        kitchen["rms_rope_split_half_cuda"] = kitchen.get("rms_rope_split_half") == ["cuda"]
        print(f"# comfy_kitchen: {json.dumps(kitchen)}", flush=True)
        if not args.skip_compile and compile_available(device):
            with bench.phase("native compiled"):
                # the recompile limit compile_blocks sets for ours, so that neither falls back to eager blocks
                allow_cache_size()
                for layer in native.layers:  # each block, as ComfyUI's compile node does
                    layer.compile(backend="inductor")
                compiled_rows(bench, "native", lambda x, t, c, lens: native(x, t, c), native_eager, native_compiled,
                              diffs)
            with bench.phase("ours compiled"):
                compile_blocks(ours)
                compiled_rows(bench, "ours", ours, ours_eager, ours_compiled, diffs)
            for batch in (1, 2):
                diffs.append({"comparison": "native compiled vs ours compiled", "batch": batch,
                              "rel_l2": f"{rel_l2(native_compiled[batch], ours_compiled[batch]):.2e}"})
        for name, outs in (("native eager", native_eager), ("ours eager", ours_eager),
                           ("native compiled", native_compiled), ("ours compiled", ours_compiled)):
            for batch, out in outs.items():
                if batch in reference:
                    diffs.append({"comparison": f"{name} vs fp32 reference", "batch": batch,
                                  "rel_l2": f"{rel_l2(out, reference[batch]):.2e}"})
    native_ms = {r["batch"]: r["ms"] for r in bench.rows if r["variant"] == "native eager" and r.get("ms")}
    for row in bench.rows:
        if row.get("ms") and row["batch"] in native_ms:
            row["x native eager"] = round(row["ms"] / native_ms[row["batch"]], 3)
    bench.phases["total"] = round(time.perf_counter() - started, 1)
    title = (f"ERNIE-Image DiT step, ComfyUI native vs this pack, {bench.size}x{bench.size}, {bench.text_tokens} text "
             f"tokens, {str(bench.dtype).replace('torch.', '')}, {env['gpu']}, torch {env['torch']}, "
             f"comfy_kitchen {env['comfy_kitchen']} "
             f"(rms_rope_split_half on {'/'.join(kitchen['rms_rope_split_half'])})")
    markdown = "\n\n".join([
        f"### {title}",
        table(bench.rows, ["variant", "batch", "ms", "x native eager", "first_call_s", "error"]),
        table(diffs, ["comparison", "batch", "rel_l2"]),
    ]) + "\n"
    print("\n" + markdown)
    failed = [c for c in bench.checks if not c["ok"]]
    print(f"checks: {len(bench.checks) - len(failed)} passed, {len(failed)} failed; phases (s): {bench.phases}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "native_comfy.md").write_text(markdown)
    (args.out / "native_comfy.json").write_text(json.dumps(
        {"environment": env, "title": title, "comfy_kitchen": kitchen, "rows": bench.rows, "differences": diffs,
         "checks": bench.checks, "phases_s": bench.phases}, indent=1))
    if failed:
        raise SystemExit(f"{len(failed)} check(s) failed: {[c['check'] for c in failed]}")


def _backend_state(info: dict) -> str:
    if info["available"]:
        return "available"
    reason = f"unavailable: {info['unavailable_reason']}" if info["unavailable_reason"] else ""
    return ", ".join(part for part in ("disabled" if info["disabled"] else "", reason) if part)


def _kitchen_version(ck: ModuleType) -> str:
    from importlib import metadata

    try:
        return metadata.version("comfy_kitchen")
    except metadata.PackageNotFoundError:
        return getattr(ck, "__version__", "unknown")


if __name__ == "__main__":
    main()
