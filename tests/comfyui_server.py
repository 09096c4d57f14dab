"""A real ComfyUI for the end-to-end tests: where it is, a base directory holding this pack, start-up and shutdown,
tiny models under the released file names, and the part of ComfyUI's HTTP and WebSocket API the tests drive.

ERNIE_COMFYUI_DIR: a ComfyUI checkout (its folder, with main.py; v0.8.0 tested). ERNIE_COMFYUI_PYTHON: a Python
with ComfyUI's requirements and this pack's dependencies (default: the one running the tests).
ERNIE_COMFYUI_FRONTEND_ROOT: another editor for the browser tests (ComfyUI's --front-end-root), e.g. the `static`
folder of an unpacked comfyui-frontend-package wheel; by default ComfyUI serves the frontend package it has.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Protocol

import pytest

from waiting import wait_until, wait_until_async

aiohttp = pytest.importorskip("aiohttp")

REPO_ROOT = Path(__file__).resolve().parent.parent
COMFY_DIR = os.environ.get("ERNIE_COMFYUI_DIR", "")
COMFY_PYTHON = os.environ.get("ERNIE_COMFYUI_PYTHON", sys.executable)
FRONTEND_ROOT = os.environ.get("ERNIE_COMFYUI_FRONTEND_ROOT", "")
PACK_NAME = "ernie_image"
RUN_TIMEOUT_S = 300
# ComfyUI's binary WebSocket events that carry a preview picture (protocol.BinaryEventTypes); 3 is a node's text.
PREVIEW_EVENTS = (1, 2, 4)
LOG_TAIL = 4000  # characters of ComfyUI's log a start-up failure shows


def comfyui_found() -> bool:
    return bool(COMFY_DIR) and (Path(COMFY_DIR) / "main.py").is_file()


# The marks of every test module that starts a real ComfyUI: `pytestmark = COMFYUI_SUITE`.
COMFYUI_SUITE = [
    pytest.mark.comfyui,
    pytest.mark.slow,
    pytest.mark.skipif(
        not comfyui_found(),
        reason="needs a real ComfyUI: set ERNIE_COMFYUI_DIR to a ComfyUI checkout (v0.8.0 tested) and "
               "ERNIE_COMFYUI_PYTHON to a Python with its requirements and this pack's dependencies",
    ),
]


# ------------------------------------------------------------------------------------------ the server
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def base_directory(tmp_path_factory: pytest.TempPathFactory, name: str) -> Path:
    """A fresh ComfyUI --base-directory with this pack linked into its custom_nodes/."""
    base = tmp_path_factory.mktemp(name)
    (base / "custom_nodes").mkdir()
    (base / "custom_nodes" / PACK_NAME).symlink_to(REPO_ROOT, target_is_directory=True)
    return base


@dataclass
class Server:
    """A started ComfyUI: where it answers, its process and its log."""

    url: str
    process: subprocess.Popen
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@contextmanager
def running(command: list[str], log_path: Path, port: int, start_timeout_s: float, stop_timeout_s: float,
            env: Optional[dict[str, str]] = None) -> Iterator[subprocess.Popen]:
    """ComfyUI started by `command` in ERNIE_COMFYUI_DIR (its output in `log_path`), listening on `port` once this
    yields; terminated on leaving (killed if it is still there after `stop_timeout_s`)."""
    if FRONTEND_ROOT and "main.py" in command and "--front-end-root" not in command:
        command = [*command, "--front-end-root", FRONTEND_ROOT]
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(command, cwd=COMFY_DIR, stdout=log_file, stderr=subprocess.STDOUT,
                                   env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    try:
        wait_listening(process, port, log_path, start_timeout_s)
        yield process
    finally:
        process.terminate()
        try:
            process.wait(stop_timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


def wait_listening(process: subprocess.Popen, port: int, log_path: Path, timeout_s: float) -> None:
    def listening() -> bool:
        if process.poll() is not None:
            pytest.fail(f"ComfyUI exited with {process.returncode} while starting:\n{_log_tail(log_path)}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return True
        except OSError:
            return False

    wait_until(listening, timeout_s, poll_s=0.2, what=lambda: f"ComfyUI listening:\n{_log_tail(log_path)}")


def _log_tail(log_path: Path) -> str:
    return log_path.read_text(errors="replace")[-LOG_TAIL:]


def place_tiny_models(models: Path, scratch: Path) -> dict[str, Path]:
    """Tiny models under the file names the example workflows expect; returns name -> path."""
    from ernie_image.runtime.cli.quantize import read_bf16_dit
    from ernie_image.runtime.demo.tiny import build_tiny_model
    from ernie_image.runtime.quant.writer import write_quantized_file
    from lora_files import write_example_loras

    turbo = build_tiny_model(scratch / "turbo", layout="comfy", variant="turbo")
    base = build_tiny_model(scratch / "base", layout="comfy", variant="base", with_pe=True)
    placed = {
        "diffusion_models/ernie-image-turbo.safetensors": turbo.dit,
        "diffusion_models/ernie-image.safetensors": base.dit,
        "text_encoders/ministral-3-3b.safetensors": turbo.text_encoder,
        "text_encoders/ernie-image-prompt-enhancer.safetensors": base.pe,
        "vae/flux2-vae.safetensors": turbo.vae,
    }
    paths: dict[str, Path] = {}
    for relative, source in placed.items():
        target = models / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, target)
        paths[Path(relative).name] = target
    gguf = models / "diffusion_models" / "ernie-image-turbo-UD-Q4_K_M.gguf"
    write_quantized_file(read_bf16_dit(turbo.dit), "q8_0", gguf, variant="turbo")
    paths[gguf.name] = gguf
    paths.update(write_example_loras(models / "loras", turbo.dit))  # the LoRAs the two-LoRA workflow names
    misplaced = models / "text_encoders" / "not-a-text-encoder.safetensors"
    shutil.copyfile(turbo.dit, misplaced)
    paths[misplaced.name] = misplaced
    return paths


# --------------------------------------------------------------------------------------------- the API
class Served(Protocol):
    url: str


async def get_json(comfy: Served, path: str) -> Any:
    async with aiohttp.ClientSession() as session:
        async with session.get(comfy.url + path) as response:
            assert response.status == 200, f"GET {path} -> {response.status}"
            return await response.json()


async def nothing_of_dropped_pipes_alive(comfy: Served, seen: dict[str, Any]) -> bool:
    """Nothing of a dropped local pipe outlives it: its parts, memory and built models are gone with it. `seen`
    keeps the last answer, whose `orphaned_weights_held_by` names what holds them when they are not."""
    seen.update(await get_json(comfy, "/ernie_image/memory"))
    if seen["weight_owners_alive"] == 0 and seen["orphaned_models"] == 0:
        return True
    seen.update(await get_json(comfy, "/ernie_image/memory?holders=1"))
    return False


async def post(comfy: Served, path: str, body: Any) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as session:
        async with session.post(comfy.url + path, json=body) as response:
            text = await response.text()
            return response.status, (json.loads(text) if text.strip().startswith(("{", "[")) else text)


@dataclass
class Run:
    prompt_id: str
    outcome: str  # execution_success, execution_error or execution_interrupted
    messages: list[dict[str, Any]] = field(default_factory=list)
    previews: int = 0  # preview pictures received
    history: dict[str, Any] = field(default_factory=dict)

    def of_type(self, kind: str) -> list[dict[str, Any]]:
        return [m["data"] for m in self.messages if m["type"] == kind]

    @property
    def error(self) -> Optional[dict[str, Any]]:
        errors = self.of_type("execution_error")
        return errors[0] if errors else None


async def run_prompt(comfy: Served, graph: dict[str, Any],
                     interrupt_when: Optional[Callable[[dict[str, Any], int], bool]] = None,
                     extra_data: Optional[dict[str, Any]] = None) -> Run:
    """Queue a prompt and follow it on the WebSocket to its end; press Cancel once `interrupt_when(event, previews)`.
    `extra_data`: what the editor sends with a prompt (its preview method, say)."""
    client_id = uuid.uuid4().hex
    queued = {"prompt": graph, "client_id": client_id, **({"extra_data": extra_data} if extra_data else {})}
    async with aiohttp.ClientSession() as session:
        async with session.ws_connect(f"{comfy.url}/ws?clientId={client_id}") as ws:
            async with session.post(f"{comfy.url}/prompt", json=queued) as response:
                body = await response.json()
                assert response.status == 200, f"POST /prompt -> {response.status}: {json.dumps(body)[:2000]}"
            run = Run(prompt_id=body["prompt_id"], outcome="")
            interrupted = False
            deadline = time.monotonic() + RUN_TIMEOUT_S
            while not run.outcome:
                message = await ws.receive(timeout=max(1.0, deadline - time.monotonic()))
                if message.type == aiohttp.WSMsgType.BINARY:
                    run.previews += int.from_bytes(message.data[:4], "big") in PREVIEW_EVENTS
                    continue
                if message.type != aiohttp.WSMsgType.TEXT:
                    pytest.fail(f"WebSocket closed: {message}")
                event = json.loads(message.data)
                data = event.get("data") or {}
                if data.get("prompt_id") not in (None, run.prompt_id):
                    continue
                run.messages.append(event)
                if interrupt_when is not None and not interrupted and interrupt_when(event, run.previews):
                    interrupted = True
                    async with session.post(f"{comfy.url}/interrupt", json={}) as answer:
                        assert answer.status == 200
                if event["type"] in ("execution_success", "execution_error", "execution_interrupted"):
                    run.outcome = event["type"]
        # ComfyUI sends execution_success before it writes the history entry: wait for the entry.
        async def history_entry() -> dict[str, Any]:
            async with session.get(f"{comfy.url}/history/{run.prompt_id}") as response:
                return (await response.json()).get(run.prompt_id, {})

        run.history = await wait_until_async(history_entry, poll_s=0.1,
                                             what=f"the history entry of prompt {run.prompt_id}")
    return run


def saved_images(run: Run) -> list[dict[str, str]]:
    return [image for output in run.history.get("outputs", {}).values() for image in output.get("images", [])]


# ---------------------------------------------------------------------------------------------- graphs
def api_workflow(name: str) -> dict[str, Any]:
    """A shipped workflow in API format (workflows/api/<name>.json)."""
    return json.loads((REPO_ROOT / "workflows" / "api" / f"{name}.json").read_text())


def node_of(graph: dict[str, Any], class_type: str) -> tuple[str, dict[str, Any]]:
    return next((node_id, node) for node_id, node in graph.items() if node["class_type"] == class_type)
