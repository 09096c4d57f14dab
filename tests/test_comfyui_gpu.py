"""The pack inside a real ComfyUI on a CUDA GPU, as users run it, with full-size random weights, driven headless.

ComfyUI (ERNIE_COMFYUI_DIR, v0.8.0 tested) starts on the GPU with this pack in its custom_nodes/ and full-size
random ERNIE-Image weights written in code as the Comfy-Org single files (bench/comfy_full_size.py) in its
models/ folders, under the names the example workflows expect. It is driven through POST /prompt, /history,
/free and /interrupt, twice over:
  cudaMallocAsync  ComfyUI's own start-up, which selects PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync;
  aimdo            tests/comfyui_aimdo_launcher.py: comfy-aimdo's DynamicVRAM hooks loaded before torch, the way
                   current ComfyUI's main.py starts (ComfyUI v0.8.0's own models do not use them).
Measured, printed as "GPU-SUITE {json}" lines and checked: step time inside ComfyUI against the runtime alone
(what the CLI runs) on the same files, within 5%; each job's device-memory peak within its VRAM budget; device
memory and page-locked host memory back to the baseline after "Free model and node cache"; a ComfyUI-managed
model (its own VAELoader + VAEDecode on the pack's latent) resident beside the pack's pipe, loaded once.

Needs: CUDA in this Python, ERNIE_COMFYUI_DIR, ERNIE_COMFYUI_PYTHON (default: this one) with ComfyUI's and the
pack's requirements and comfy-aimdo. ERNIE_GPU_MODELS_DIR reuses weights already written there. The whole suite
is one command: scripts/gpu_comfyui_suite.sh. ERNIE_GPU_SUITE_DRY_RUN=1 runs the same driving code on the CPU
with tiny models and no measurements (for working on the suite without a GPU).
"""
from __future__ import annotations

import contextlib
import copy
import json
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import pytest

from comfyui_server import (COMFY_DIR, COMFY_PYTHON, PACK_NAME, REPO_ROOT, Server, api_workflow, base_directory,
                            comfyui_found, free_port, get_json, node_of, nothing_of_dropped_pipes_alive,
                            place_tiny_models, post, run_prompt, running, saved_images)
from waiting import wait_until_async

DRY_RUN = os.environ.get("ERNIE_GPU_SUITE_DRY_RUN") == "1"
GiB = 1024**3
START_TIMEOUT_S = 240
STEP_TIME_TOLERANCE = 0.05
# After "Free model and node cache" the process keeps its CUDA context, cuBLAS workspaces and compiled kernels.
FREED_DEVICE_SLACK = 1.5 * GiB
PINNED_SLACK = 64 * 1024**2  # locked and pinned host memory left after the free, over the start's
SIDE = 256 if DRY_RUN else 1024
STEPS = 2 if DRY_RUN else 8


def _cuda_here() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.comfyui,
    pytest.mark.slow,
    pytest.mark.skipif(not comfyui_found(),
                       reason="needs a real ComfyUI: set ERNIE_COMFYUI_DIR (v0.8.0 tested) and ERNIE_COMFYUI_PYTHON"),
    pytest.mark.skipif(not DRY_RUN and not _cuda_here(),
                       reason="needs a CUDA GPU (ERNIE_GPU_SUITE_DRY_RUN=1 runs the driving code on the CPU)"),
]


def report(name: str, **values: Any) -> None:
    print("GPU-SUITE " + json.dumps({"measure": name, **values}, default=str), flush=True)


# ---------------------------------------------------------------------------------------------- the device
def device_used_bytes() -> int:
    """Device memory in use on GPU 0 (nvidia-smi; this test process never creates a CUDA context)."""
    if DRY_RUN:
        return 0
    out = subprocess.check_output(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"])
    return int(out.decode().split()[0]) * 1024**2


def process_memory(pid: int) -> dict[str, int]:
    """Resident, locked and pinned host memory of a process (/proc/PID/status; VmPin counts pinned pages)."""
    values: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name in ("VmRSS", "VmLck", "VmPin"):
            values[name] = int(rest.split()[0]) * 1024
    return values


# ---------------------------------------------------------------------------------------------- the models
@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    given = os.environ.get("ERNIE_GPU_MODELS_DIR")
    if given and (Path(given) / "diffusion_models" / "ernie-image-turbo.safetensors").is_file():
        return Path(given)
    models = Path(given) if given else tmp_path_factory.mktemp("gpu_models")
    if DRY_RUN:
        place_tiny_models(models, tmp_path_factory.mktemp("tiny"))
        return models
    started = time.monotonic()
    done = subprocess.run([COMFY_PYTHON, str(REPO_ROOT / "bench" / "comfy_full_size.py"), str(models)],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    report("full_size_weights_written", seconds=round(time.monotonic() - started, 1), files=json.loads(done.stdout.splitlines()[-1]))
    return models


def files(models: Path) -> dict[str, Path]:
    return {"dit": models / "diffusion_models" / "ernie-image-turbo.safetensors",
            "text_encoder": models / "text_encoders" / "ministral-3-3b.safetensors",
            "vae": models / "vae" / "flux2-vae.safetensors"}


# ------------------------------------------------------------------------------------------------ ComfyUI
@dataclass
class GpuComfy(Server):
    mode: str
    baseline_device: int
    baseline_host: dict[str, int]
    spawned_at: float = 0.0  # time.monotonic() when the server's process was started
    images_done: int = 0


# ERNIE_GPU_SUITE_MODES=cudaMallocAsync (or aimdo) runs one pass, to split the suite over two device commands.
MODES = tuple(m for m in os.environ.get("ERNIE_GPU_SUITE_MODES", "cudaMallocAsync,aimdo").split(",") if m)


@pytest.fixture(scope="module", params=MODES)
def comfy(request: pytest.FixtureRequest, models_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    mode = request.param
    base = base_directory(tmp_path_factory, f"comfy_{mode}")
    (base / "models").symlink_to(models_dir, target_is_directory=True)
    web = base / "web"  # headless: no frontend package needed
    web.mkdir()
    (web / "index.html").write_text("<!doctype html><title>headless</title>")
    port = free_port()
    arguments = ["--listen", "127.0.0.1", "--port", str(port), "--base-directory", str(base), "--front-end-root",
                 str(web), "--preview-method", "auto"] + (["--cpu"] if DRY_RUN else [])
    if mode == "aimdo":
        if DRY_RUN:
            pytest.skip("comfy-aimdo hooks CUDA allocations: nothing to run on the CPU")
        command = [COMFY_PYTHON, str(REPO_ROOT / "tests" / "comfyui_aimdo_launcher.py"), COMFY_DIR, *arguments]
    else:
        command = [COMFY_PYTHON, "main.py", *arguments]
    baseline_device = device_used_bytes()
    log_path = base / "comfyui.log"
    spawned_at = time.monotonic()
    with running(command, log_path, port, START_TIMEOUT_S, stop_timeout_s=30) as process:
        server = GpuComfy(f"http://127.0.0.1:{port}", process, log_path, mode, baseline_device,
                          process_memory(process.pid), spawned_at)
        report("comfyui_listening", mode=mode, from_start_s=round(time.monotonic() - spawned_at, 2))
        if mode == "aimdo":
            assert "aimdo: DynamicVRAM hooks on cuda" in server.log(), server.log()[-3000:]
        report("comfyui_started", mode=mode, device_used_gib=round(baseline_device / GiB, 2),
               host=server.baseline_host)
        yield server


# ------------------------------------------------------------------------------------------------- graphs
def sized(graph: dict[str, Any], steps: int = STEPS, seed: Optional[int] = None, keep_loaded: Optional[bool] = None
          ) -> dict[str, Any]:
    graph = copy.deepcopy(graph)
    for node in graph.values():
        inputs = node["inputs"]
        if node["class_type"] in ("ErnieImageSampler", "ErnieImageTurboSampler"):
            inputs.update(resolution="custom", width=SIDE, height=SIDE, steps=steps)
            if seed is not None:
                inputs["seed"] = seed
        if node["class_type"] == "ErnieImageLoader" and keep_loaded is not None:
            inputs["keep_loaded"] = keep_loaded
    return graph


async def memory(comfy: GpuComfy) -> dict[str, Any]:
    return await get_json(comfy, "/ernie_image/memory")


async def no_pipe_alive(comfy: GpuComfy) -> bool:
    return (await memory(comfy))["live_pipes"] == 0


async def last_run(comfy: GpuComfy) -> dict[str, Any]:
    runs = [p["last_run"] for p in (await memory(comfy))["pipes"] if p.get("last_run")]
    assert runs, "no local pipe reported a finished job"
    return runs[-1]


async def run_ok(comfy: GpuComfy, graph: dict[str, Any], label: str, run_out: Optional[list] = None) -> Any:
    started = time.monotonic()
    run = await run_prompt(comfy, graph)
    if run_out is not None:
        run_out.append(run)
    assert run.outcome == "execution_success", f"{label}: {run.error}"
    assert saved_images(run), f"{label}: no image saved"
    info = await last_run(comfy)
    comfy.images_done += 1
    if comfy.images_done == 1:  # the first image after ComfyUI starts: from its process start, the start included
        report("first_image_from_server_start", mode=comfy.mode, label=label,
               seconds=round(time.monotonic() - comfy.spawned_at, 2))
    report(label, mode=comfy.mode, wall_s=round(time.monotonic() - started, 2),
           step_s=round(info["sampling_s"] / info["steps"], 4), **{k: v for k, v in info.items() if k != "device"})
    return info


def job_peak(info: dict[str, Any]) -> int:
    """The job's own device-memory peak: the allocator's high-water mark less what others held when it started."""
    return int(info["peak_reserved"]) - (int(info["reserved_at_start"]) - int(info["held_at_start"]))


def runtime_alone(models: Path, budget_gb: Optional[float], seed: int, quant: str = "none") -> dict[str, Any]:
    """The same job with the runtime alone (LocalPipe, what the CLI runs), twice in one process: the second's info."""
    script = f"""
import json, sys
sys.path.insert(0, {str(REPO_ROOT / 'tests')!r})
import conftest
from ernie_image import GenerationRequest, LoadOptions, LocalPipe, ModelSources, NullHost
paths = {json.dumps({k: str(v) for k, v in files(models).items()})}
sources = ModelSources(dit=paths["dit"], text_encoder=paths["text_encoder"], vae=paths["vae"])
pipe = LocalPipe.load(sources, LoadOptions(device={'"cpu"' if DRY_RUN else '"auto"'}, vram_budget_gb={budget_gb!r}, keep_loaded=True,
                                        quant={quant!r}))
request = GenerationRequest(prompt={PROMPT!r}, width={SIDE}, height={SIDE}, steps={STEPS}, cfg=1.0, shift=4.0, seed={seed})
for _ in range(2):
    result = pipe.generate(request, NullHost())
print("INFO " + json.dumps(result.info))
"""
    done = subprocess.run([COMFY_PYTHON, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(next(line for line in done.stdout.splitlines() if line.startswith("INFO "))[5:])


PROMPT = "A red fox sitting in fresh snow at dawn, soft golden light"


def prompt_of(graph: dict[str, Any]) -> None:
    for node in graph.values():
        if node["class_type"] in ("ErnieImageSampler", "ErnieImageTurboSampler") and not isinstance(node["inputs"].get("prompt"), list):
            node["inputs"]["prompt"] = PROMPT


# -------------------------------------------------------------------------------------------------- tests
# Ordered so that consecutive tests share a Loader (ComfyUI's cache keeps it, weights placed): each cold load
# (files -> pinned host memory -> device, quantise, compile) costs tens of seconds at full size. Under comfy-aimdo
# the 12 GB job, the free and the log are checked; the other jobs would repeat what cudaMallocAsync showed.
def only(comfy: GpuComfy, *modes: str) -> None:
    if comfy.mode not in modes:
        pytest.skip(f"run under {', '.join(modes)} only (one device command has room for one pass of it)")


def graph_12gb(seed: int) -> dict[str, Any]:
    graph = sized(api_workflow("ernie_image_turbo_12gb_budget"), seed=seed, keep_loaded=True)
    prompt_of(graph)
    return graph


async def test_turbo_at_a_12_gb_budget_stays_within_it_at_the_runtimes_step_time(comfy: GpuComfy, models_dir: Path) -> None:
    await run_ok(comfy, graph_12gb(11), "turbo_12gb_cold")
    warm = await run_ok(comfy, graph_12gb(12), "turbo_12gb_warm")  # the Loader cached: weights placed
    if DRY_RUN:
        return
    assert warm["allocator"] == "cudaMallocAsync", warm
    assert job_peak(warm) <= 12 * GiB, f"peak {job_peak(warm) / GiB:.2f} GiB over the 12 GiB budget"
    if comfy.mode != "cudaMallocAsync":
        return
    alone = runtime_alone(models_dir, 12.0, seed=11, quant="auto")  # the workflow's Quant Config says auto
    inside, outside = warm["sampling_s"] / warm["steps"], alone["sampling_s"] / alone["steps"]
    report("turbo_12gb_step_time", mode=comfy.mode, comfyui_step_s=round(inside, 4), runtime_step_s=round(outside, 4),
           ratio=round(inside / outside, 4), runtime_peak_gib=round(job_peak(alone) / GiB, 2),
           comfyui_peak_gib=round(job_peak(warm) / GiB, 2))
    assert abs(inside / outside - 1) <= STEP_TIME_TOLERANCE, f"ComfyUI {inside:.4f} s/step, runtime {outside:.4f}"


async def test_free_model_and_node_cache_gives_device_and_pinned_memory_back(comfy: GpuComfy) -> None:
    await run_ok(comfy, graph_12gb(13), "before_free")
    held = await memory(comfy)
    pinned_held = sum((p.get("host_bytes") or {}).get("pinned", 0) for p in held["pipes"])
    during = {"device": device_used_bytes(), **process_memory(comfy.process.pid)}
    status, _ = await post(comfy, "/free", {"unload_models": True, "free_memory": True})
    assert status == 200
    await wait_until_async(lambda: no_pipe_alive(comfy), 60, poll_s=0.5, what="the node cache dropping the pipe")
    seen: dict[str, Any] = {}
    await wait_until_async(lambda: nothing_of_dropped_pipes_alive(comfy, seen), 30, poll_s=0.5,
                           what=lambda: f"the dropped pipe's weights going with it (held by: "
                                        f"{seen.get('orphaned_weights_held_by')})")

    last: dict[str, int] = {}  # the latest reading, reported and asserted when the memory is never given back

    def given_back() -> Optional[dict[str, int]]:
        now = {"device": device_used_bytes(), **process_memory(comfy.process.pid)}
        last.update(now)
        pinned_back = all(now[key] <= comfy.baseline_host.get(key, 0) + PINNED_SLACK
                          for key in ("VmLck", "VmPin") if key in now)
        return now if DRY_RUN or (now["device"] <= comfy.baseline_device + FREED_DEVICE_SLACK and pinned_back) else None

    # The driver and the kernel see the memory back a moment after the pipe is gone: wait for that, not a fixed time.
    with contextlib.suppress(AssertionError):  # never given back: the latest figures are reported and asserted below
        await wait_until_async(given_back, 30, poll_s=0.5)
    after = dict(last)
    allocator = (await memory(comfy))["device"]  # held by tensors (allocated) or only kept by the allocator
    report("free_model_and_node_cache", mode=comfy.mode, pinned_by_pack_before=pinned_held,
           baseline={"device": comfy.baseline_device, **comfy.baseline_host}, during=during, after=after,
           allocator_after=allocator)
    if DRY_RUN:
        return
    assert pinned_held > 0, "a 12 GB plan of a 16 GB DiT streams blocks: the pack should have held pinned slabs"
    assert after["device"] <= comfy.baseline_device + FREED_DEVICE_SLACK, (
        f"device memory {after['device'] / GiB:.2f} GiB after the free, {comfy.baseline_device / GiB:.2f} at start; "
        f"PyTorch's allocator: {allocator}")
    for key in ("VmLck", "VmPin"):
        if key in after:
            assert after[key] <= comfy.baseline_host.get(key, 0) + PINNED_SLACK, (key, during, after)


def with_core_vae_decode(graph: dict[str, Any]) -> dict[str, Any]:
    """The pack's LATENT decoded by ComfyUI's own VAELoader + VAEDecode: a ComfyUI-managed model beside the pipe."""
    graph = copy.deepcopy(graph)
    sampler_id, _ = node_of(graph, "ErnieImageTurboSampler")
    graph["core_vae"] = {"class_type": "VAELoader", "inputs": {"vae_name": "flux2-vae.safetensors"}}
    graph["core_decode"] = {"class_type": "VAEDecode", "inputs": {"samples": [sampler_id, 1], "vae": ["core_vae", 0]}}
    graph["core_save"] = {"class_type": "SaveImage", "inputs": {"images": ["core_decode", 0], "filename_prefix": "core"}}
    return graph


async def test_turbo_at_auto_with_a_comfyui_managed_model_resident_beside_it(comfy: GpuComfy) -> None:
    only(comfy, "cudaMallocAsync")
    graph = sized(api_workflow("ernie_image_turbo_local"), seed=21)
    prompt_of(graph)
    await run_ok(comfy, graph, "turbo_auto_cold")
    warm = await run_ok(comfy, sized(graph, seed=22), "turbo_auto_warm")
    plan = next(p["plan"] for p in (await memory(comfy))["pipes"] if p.get("last_run"))
    assert DRY_RUN or "on cuda" in plan, plan
    if DRY_RUN:  # ComfyUI builds its FLUX.2 VAE at full size: the tiny VAE does not load into it
        return
    assert job_peak(warm) < 139 * GiB
    loads_before = comfy.log().count("Requested to load")
    step_times = []
    for seed in (23, 24, 25):  # the same Loader: its pipe stays cached and loaded
        info = await run_ok(comfy, with_core_vae_decode(sized(graph, seed=seed)), f"core_vae_beside_pipe_{seed}")
        step_times.append(info["sampling_s"] / info["steps"])
        pipes = (await memory(comfy))["pipes"]
        assert any(p["kind"] == "local" and p["loaded"] for p in pipes), "the pipe lost its weights"
    loads = comfy.log().count("Requested to load") - loads_before
    report("core_model_beside_pipe", mode=comfy.mode, core_model_loads=loads,
           step_s=[round(t, 4) for t in step_times], auto_step_s=round(warm["sampling_s"] / warm["steps"], 4))
    assert loads <= 1, f"ComfyUI loaded its VAE {loads} times in 3 runs: the two evict each other"
    assert max(step_times) / min(step_times) - 1 <= STEP_TIME_TOLERANCE, step_times


async def test_base_with_the_prompt_enhancer_then_a_cancel(comfy: GpuComfy) -> None:
    only(comfy, "cudaMallocAsync")
    graph = sized(api_workflow("ernie_image_base_prompt_enhancer"), seed=31)
    # The suite's base file is a hard link to the Turbo file, whose metadata says Turbo: the widget sets Base.
    node_of(graph, "ErnieImageLoader")[1]["inputs"]["variant"] = "base"
    runs: list = []
    info = await run_ok(comfy, graph, "base_with_pe", runs)
    assert info["variant"] == "base", info
    shown = json.dumps(runs[0].history.get("outputs", {}))
    assert "prompt enhancer (local)" in shown, shown[:2000]  # the Prompt Enhancer node's timing, shown on the graph

    long_run = sized(graph, steps=200, seed=32)  # the PE node is cached: only the Sampler runs, and is cancelled
    sampler_id, _ = node_of(long_run, "ErnieImageSampler")

    def third_step(event: dict[str, Any], previews: int) -> bool:
        data = event.get("data") or {}
        return event["type"] == "progress" and data.get("node") == sampler_id and data.get("max") == 200 and data["value"] >= 3

    cancelled = await run_prompt(comfy, long_run, interrupt_when=third_step)
    assert cancelled.outcome == "execution_interrupted", cancelled.error
    steps = [m["value"] for m in cancelled.of_type("progress") if m.get("node") == sampler_id and m.get("max") == 200]
    held = [p for p in (await memory(comfy))["pipes"] if p["kind"] == "local" and p["loaded"]]
    report("base_cancel", mode=comfy.mode, last_step_seen=max(steps or [0]), device_used_gib=round(device_used_bytes() / GiB, 2))
    assert steps and max(steps) <= 4, f"Cancel did not stop within one step: {steps}"
    assert not held, f"weights still held after Cancel: {held}"


async def test_a_gguf_dit(comfy: GpuComfy) -> None:
    only(comfy, "cudaMallocAsync")
    graph = sized(api_workflow("ernie_image_turbo_gguf"), seed=41)
    prompt_of(graph)
    await run_ok(comfy, graph, "gguf_cold")
    await run_ok(comfy, sized(graph, seed=42), "gguf_warm")


def tracebacks(log: str) -> list[str]:
    """Every traceback in a log: its header and the indented frame lines under it."""
    blocks, lines = [], log.splitlines()
    for index, line in enumerate(lines):
        if line.startswith("Traceback"):
            frames = [line]
            for following in lines[index + 1:]:
                if not following.startswith(" "):
                    frames.append(following)
                    break
                frames.append(following)
            blocks.append("\n".join(frames))
    return blocks


def test_the_log_has_no_out_of_memory_and_no_traceback_from_the_pack(comfy: GpuComfy) -> None:
    log = comfy.log()
    assert "OutOfMemoryError" not in log and "CUDA out of memory" not in log, log[-3000:]
    ours = [block for block in tracebacks(log) if f"custom_nodes/{PACK_NAME}/" in block or "ernie_image" in block]
    assert not ours, ours[0]
