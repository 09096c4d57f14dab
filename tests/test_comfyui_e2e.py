"""The pack inside a real ComfyUI, driven through ComfyUI's own HTTP and WebSocket API.

Needs a ComfyUI checkout: ERNIE_COMFYUI_DIR (its folder, with main.py) and ERNIE_COMFYUI_PYTHON (a Python with
ComfyUI's requirements and this pack's dependencies; default: this one). The server runs headless on the CPU
(`--cpu --listen 127.0.0.1`) with a temporary --base-directory: the pack is linked into its custom_nodes/ and
tiny random models built with the real classes are put in its models/ folders under the released file names,
so the example workflows run as shipped (only their size and step count are shrunk for the CPU).
"""
from __future__ import annotations

import copy
import io
import json
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from comfyui_server import (COMFYUI_SUITE, COMFY_PYTHON, PACK_NAME, REPO_ROOT, Server, api_workflow, base_directory,
                            free_port, get_json, node_of, nothing_of_dropped_pipes_alive, place_tiny_models, post,
                            run_prompt, running, saved_images)
from waiting import wait_until_async

API_WORKFLOWS = sorted((REPO_ROOT / "workflows" / "api").glob("*.json"))
NODE_IDS = ("ErnieImageLoader", "ErnieImageSampler", "ErnieImageTurboSampler", "ErnieImageQuantConfig",
            "ErnieImageRemoteBackend", "ErnieImagePromptEnhancer", "ErnieImageLoRA", "ErnieImageStepCache")
TEST_SIDE = 256
MAX_TEST_STEPS = 4
START_TIMEOUT_S = 180
# An API key only ComfyUI's environment holds: it must reach the server and nothing else.
KEY_VARIABLE = "ERNIE_E2E_SGLANG_KEY"
KEY_LABEL = "e2e-sglang"  # the user's keys file binds KEY_VARIABLE's key to the fake server under this label
SECRET_KEY = "e2e-s3cret-" + uuid.uuid4().hex

pytestmark = COMFYUI_SUITE

aiohttp = pytest.importorskip("aiohttp")


# ------------------------------------------------------------------------------------------ the server
INPUT_IMAGE = "example.png"  # the picture the image-in workflows' Load Image names
MASK_BOX = (64, 64, 192, 192)  # transparent in the picture: Load Image's MASK is 1 there (the area to repaint)


def place_input_image(input_folder: Path) -> Path:
    """A TEST_SIDE square RGBA picture in ComfyUI's input folder: a colour gradient, its alpha 0 inside MASK_BOX."""
    import numpy as np
    from PIL import Image

    ramp = np.linspace(0, 255, TEST_SIDE, dtype=np.uint8)
    pixels = np.zeros((TEST_SIDE, TEST_SIDE, 4), dtype=np.uint8)
    pixels[..., 0], pixels[..., 1] = ramp[None, :], ramp[:, None]
    pixels[..., 2], pixels[..., 3] = 128, 255
    left, top, right, bottom = MASK_BOX
    pixels[top:bottom, left:right, 3] = 0
    input_folder.mkdir(parents=True, exist_ok=True)
    path = input_folder / INPUT_IMAGE
    Image.fromarray(pixels, "RGBA").save(path)
    return path


@dataclass
class Comfy(Server):
    base: Path
    models: dict[str, Path]


@pytest.fixture(scope="module")
def comfy(tmp_path_factory: pytest.TempPathFactory):
    base = base_directory(tmp_path_factory, "comfy_base")
    models = place_tiny_models(base / "models", tmp_path_factory.mktemp("tiny"))
    place_input_image(base / "input")
    port = free_port()
    log_path = base / "comfyui.log"
    command = [COMFY_PYTHON, "main.py", "--cpu", "--listen", "127.0.0.1", "--port", str(port),
               "--base-directory", str(base), "--preview-method", "auto"]
    with running(command, log_path, port, START_TIMEOUT_S, stop_timeout_s=20, env={KEY_VARIABLE: SECRET_KEY}) as process:
        yield Comfy(f"http://127.0.0.1:{port}", process, log_path, base, models)


# --------------------------------------------------------------------------------------------- the API
async def view_image(comfy: Comfy, image: dict[str, str]):
    from PIL import Image

    async with aiohttp.ClientSession() as session:
        async with session.get(f"{comfy.url}/view", params={**image}) as response:
            assert response.status == 200
            return Image.open(io.BytesIO(await response.read())).convert("RGB")


def shrunk(graph: dict[str, Any]) -> dict[str, Any]:
    """The shipped workflow, at 256x256 and at most 4 steps so it runs in seconds on a CPU (a hires fix's upscale
    included: its second pass then runs at 256x256 too)."""
    graph = copy.deepcopy(graph)
    for node in graph.values():
        if node["class_type"] in ("ErnieImageSampler", "ErnieImageTurboSampler"):
            node["inputs"].update(resolution="custom", width=TEST_SIDE, height=TEST_SIDE,
                                  steps=min(node["inputs"]["steps"], MAX_TEST_STEPS))
        if node["class_type"] == "ImageScale":
            node["inputs"].update(width=TEST_SIDE, height=TEST_SIDE)
    return graph


# ----------------------------------------------------------------------------------------------- tests
def test_pack_imports_cleanly(comfy: Comfy) -> None:
    log = comfy.log()
    pack_path = str(comfy.base / "custom_nodes" / PACK_NAME)
    assert f"Cannot import {pack_path}" not in log, log[-3000:]
    timing = [line for line in log.splitlines() if line.rstrip().endswith(pack_path)]
    assert timing and "IMPORT FAILED" not in timing[0], timing


async def test_object_info_lists_every_node_with_its_inputs(comfy: Comfy) -> None:
    from ernie_image.nodes import NODE_CLASS_MAPPINGS

    info = await get_json(comfy, "/object_info")
    for node_id in NODE_IDS:
        assert node_id in info, f"{node_id} missing from /object_info"
        served = info[node_id]
        declared = NODE_CLASS_MAPPINGS[node_id].INPUT_TYPES()
        assert served["category"] == "ERNIE-Image" and served["description"]
        for section in ("required", "optional"):
            assert list(served["input"].get(section, {})) == list(declared.get(section, {}))
            for name, spec in served["input"].get(section, {}).items():
                assert spec[1].get("tooltip"), f"{node_id}.{name} has no tooltip in ComfyUI"
        assert served["output"] == list(NODE_CLASS_MAPPINGS[node_id].RETURN_TYPES)
    # The Loader lists the files placed in ComfyUI's folders, .gguf included through the pack's own key.
    loader = info["ErnieImageLoader"]["input"]["required"]
    assert "ernie-image-turbo.safetensors" in loader["diffusion_model"][0]
    assert "ernie-image-turbo-UD-Q4_K_M.gguf" in loader["diffusion_model"][0]
    assert "ministral-3-3b.safetensors" in loader["text_encoder"][0]
    assert "flux2-vae.safetensors" in loader["vae"][0]
    seed = info["ErnieImageSampler"]["input"]["required"]["seed"][1]
    assert seed.get("control_after_generate") is True


async def test_web_extension_docs_and_templates_are_served(comfy: Comfy) -> None:
    async with aiohttp.ClientSession() as session:
        extensions = await (await session.get(f"{comfy.url}/extensions")).json()
        assert f"/extensions/{PACK_NAME}/ernie_image.js" in extensions
        async with session.get(f"{comfy.url}/extensions/{PACK_NAME}/ernie_image.js") as response:
            assert response.status == 200 and "registerExtension" in await response.text()
        for node_id in NODE_IDS:
            async with session.get(f"{comfy.url}/extensions/{PACK_NAME}/docs/{node_id}.md") as response:
                assert response.status == 200, f"help page of {node_id} not served"
        templates = await (await session.get(f"{comfy.url}/api/workflow_templates")).json()
        shipped = sorted(p.stem for p in (REPO_ROOT / "example_workflows").glob("*.json"))
        assert sorted(templates[PACK_NAME]) == shipped
        for name in shipped:  # what the template browser fetches for a custom node's template and its card
            async with session.get(f"{comfy.url}/api/workflow_templates/{PACK_NAME}/{name}.json") as response:
                assert response.status == 200 and (await response.json())["nodes"]
            async with session.get(f"{comfy.url}/api/workflow_templates/{PACK_NAME}/{name}.jpg") as response:
                assert response.status == 200 and (await response.read()).startswith(b"\xff\xd8"), name


@pytest.mark.parametrize("path", API_WORKFLOWS, ids=lambda p: p.stem)
async def test_every_api_workflow_runs_headless(comfy: Comfy, path: Path) -> None:
    graph = shrunk(json.loads(path.read_text()))
    fake = None
    if any(n["class_type"] == "ErnieImageRemoteBackend" for n in graph.values()):
        from fake_sglang import FakeSglang

        fake = FakeSglang(model_id="baidu/ERNIE-Image-Turbo")
        fake.start()
        node_of(graph, "ErnieImageRemoteBackend")[1]["inputs"]["server_urls"] = fake.url
    try:
        run = await run_prompt(comfy, graph)
    finally:
        if fake is not None:
            fake.stop()
    assert run.outcome == "execution_success", f"{path.stem}: {run.error}"
    images = saved_images(run)
    assert len(images) == sum(node["class_type"] == "SaveImage" for node in graph.values())  # one image each
    for image in images:
        picture = await view_image(comfy, image)
        assert picture.size == (TEST_SIDE, TEST_SIDE)
    progress = [m for m in run.of_type("progress")]
    assert progress and progress[-1]["value"] == progress[-1]["max"], "no progress reached the UI"
    if fake is not None:
        assert len(fake.generations) == 1
    for node in graph.values():
        if "mask" in node["inputs"] and node["inputs"].get("composite"):  # an inpainting Sampler
            check_pixels_outside_the_mask_are_the_originals(comfy, picture, node["inputs"])


def check_pixels_outside_the_mask_are_the_originals(comfy: Comfy, picture: Any, sampler: dict[str, Any]) -> None:
    """Inpainting with composite on: beyond the grown and feathered mask the output is the input picture (within
    SaveImage's 8-bit rounding), inside it the picture was repainted."""
    import numpy as np
    from PIL import Image

    original = np.asarray(Image.open(comfy.base / "input" / INPUT_IMAGE).convert("RGB"), dtype=np.int16)
    result = np.asarray(picture, dtype=np.int16)
    reach = sampler["mask_grow"] + sampler["mask_feather"]
    left, top, right, bottom = MASK_BOX
    outside = np.ones((TEST_SIDE, TEST_SIDE), dtype=bool)
    outside[max(0, top - reach):bottom + reach, max(0, left - reach):right + reach] = False
    assert np.abs(result - original)[outside].max() <= 1
    assert np.abs(result - original)[top:bottom, left:right].mean() > 1


async def test_view_returns_the_runtimes_own_image_for_the_same_seed(comfy: Comfy) -> None:
    import numpy as np
    import torch

    from ernie_image.runtime.core.host import NullHost
    from ernie_image.runtime.core.request import GenerationRequest
    from ernie_image.runtime.formats.sources import ModelSources
    from ernie_image.runtime.local.options import LoadOptions
    from ernie_image.runtime.local.pipe import LocalPipe

    graph = shrunk(api_workflow("ernie_image_turbo_local"))
    sampler = node_of(graph, "ErnieImageTurboSampler")[1]["inputs"]
    sampler.update(seed=1234, width=320, height=256)
    run = await run_prompt(comfy, graph)
    assert run.outcome == "execution_success", run.error
    served = np.asarray(await view_image(comfy, saved_images(run)[0]))
    assert served.shape == (256, 320, 3)

    sources = ModelSources(dit=comfy.models["ernie-image-turbo.safetensors"],
                           text_encoder=comfy.models["ministral-3-3b.safetensors"],
                           vae=comfy.models["flux2-vae.safetensors"])
    request = GenerationRequest(prompt=sampler["prompt"], width=320, height=256, steps=sampler["steps"],
                                cfg=sampler["cfg"], shift=sampler["shift"], seed=1234, use_pe=sampler["use_pe"])
    reference = LocalPipe.load(sources, LoadOptions(device="cpu")).generate(request, NullHost()).images[0]
    expected = (reference.clamp(0, 1) * 255).round().to(torch.uint8).numpy()
    difference = np.abs(served.astype(int) - expected.astype(int))
    assert difference.max() <= 1, f"ComfyUI's image differs from the runtime's by up to {difference.max()} levels"


async def test_cancel_mid_run_interrupts_and_releases_memory(comfy: Comfy) -> None:
    graph = shrunk(api_workflow("ernie_image_base_prompt_enhancer"))
    sampler_id, sampler = node_of(graph, "ErnieImageSampler")
    sampler["inputs"].update(steps=400, seed=77)

    def second_denoising_step(event: dict[str, Any], previews: int) -> bool:
        data = event.get("data") or {}
        return event["type"] == "progress" and data.get("node") == sampler_id and data.get("max") == 400 and data["value"] >= 2

    run = await run_prompt(comfy, graph, interrupt_when=second_denoising_step)
    assert run.outcome == "execution_interrupted", f"ended with {run.outcome}: {run.error}"
    steps_seen = [m["value"] for m in run.of_type("progress") if m["node"] == sampler_id and m["max"] == 400]
    assert steps_seen and max(steps_seen) <= 3, f"Cancel did not stop within one step: {steps_seen}"
    assert run.previews >= 1, "no latent preview frame reached the UI"
    memory = await get_json(comfy, "/ernie_image/memory")
    local = [p for p in memory["pipes"] if p["kind"] == "local"]
    assert local and not any(p["loaded"] for p in local), f"weights still held after Cancel: {memory}"


@pytest.mark.parametrize("method, seed", [("none", 9101), ("latent2rgb", 9102), ("taesd", 9103)])
async def test_a_prompts_preview_method_decides_whether_the_sampler_previews(comfy: Comfy, method: str,
                                                                             seed: int) -> None:
    """The server runs with --preview-method auto; a prompt brings its own (the editor's setting), which ComfyUI sets
    as the prompt starts: "none" gets no preview picture, any other method the pack's latent-to-RGB one."""
    graph = shrunk(api_workflow("ernie_image_turbo_local"))
    node_of(graph, "ErnieImageTurboSampler")[1]["inputs"]["seed"] = seed  # a new seed: the sampler runs again
    run = await run_prompt(comfy, graph, extra_data={"preview_method": method})
    assert run.outcome == "execution_success", run.error
    assert (run.previews > 0) is (method != "none"), f"{run.previews} preview pictures with method {method}"


async def test_width_1000_is_refused_once_before_sampling_with_a_clear_message(comfy: Comfy) -> None:
    graph = shrunk(api_workflow("ernie_image_turbo_local"))
    sampler_id, sampler = node_of(graph, "ErnieImageTurboSampler")
    sampler["inputs"]["width"] = 1000
    run = await run_prompt(comfy, graph)
    assert run.outcome == "execution_error" and run.error["node_id"] == sampler_id
    assert run.error["exception_message"].strip() == (
        "width 1000 is not allowed: ERNIE-Image needs a multiple of 16 between 256 and 4096; use 1008")
    assert len(run.of_type("execution_error")) == 1
    assert not [m for m in run.of_type("progress") if m.get("node") == sampler_id], "sampling started"


async def test_a_bad_model_file_reaches_the_ui_as_a_clear_error_and_frees_memory(comfy: Comfy) -> None:
    graph = shrunk(api_workflow("ernie_image_turbo_local"))
    loader_id, loader = node_of(graph, "ErnieImageLoader")
    loader["inputs"]["text_encoder"] = "not-a-text-encoder.safetensors"  # a DiT put in text_encoders/
    run = await run_prompt(comfy, graph)
    assert run.outcome == "execution_error"
    message = run.error["exception_message"]
    assert "\n" not in message.strip() and "text" in message.lower(), message
    assert run.error["exception_type"].split(".")[-1] in ("ModelFileError", "InvalidInputError", "ErnieImageError")
    memory = await get_json(comfy, "/ernie_image/memory")
    assert not any(p["loaded"] for p in memory["pipes"]), f"weights still held after the error: {memory}"


async def test_the_prompt_enhancer_in_the_text_encoder_slot_is_refused_in_one_line(comfy: Comfy) -> None:
    graph = shrunk(api_workflow("ernie_image_base_prompt_enhancer"))
    loader_id, loader = node_of(graph, "ErnieImageLoader")
    loader["inputs"].update(text_encoder="ernie-image-prompt-enhancer.safetensors",
                            prompt_enhancer="ministral-3-3b.safetensors")
    run = await run_prompt(comfy, graph)
    assert run.outcome == "execution_error" and run.error["node_id"] == loader_id
    message = run.error["exception_message"].strip()
    assert "\n" not in message and "is the ERNIE-Image prompt enhancer, not the text encoder" in message, message
    assert "give it as the prompt enhancer" in message


async def test_keep_loaded_and_comfyuis_free_button(comfy: Comfy) -> None:
    graph = shrunk(api_workflow("ernie_image_turbo_local"))
    node_of(graph, "ErnieImageTurboSampler")[1]["inputs"]["seed"] = 5
    run = await run_prompt(comfy, graph)
    assert run.outcome == "execution_success", run.error
    memory = await get_json(comfy, "/ernie_image/memory")
    assert any(p["kind"] == "local" and p["loaded"] for p in memory["pipes"]), "keep_loaded did not keep the weights"

    # "Unload models" only reaches ComfyUI's own model list: the pack's weights stay (documented limit).
    status, _ = await post(comfy, "/free", {"unload_models": True})
    assert status == 200
    await free_handled(comfy, graph)
    memory = await get_json(comfy, "/ernie_image/memory")
    assert any(p["loaded"] for p in memory["pipes"])

    # "Free model and node cache" drops the node cache, and with it the Loader's pipe and its weights.
    status, _ = await post(comfy, "/free", {"unload_models": True, "free_memory": True})
    assert status == 200
    await wait_until_async(lambda: no_pipe_alive(comfy), what="the Loader's pipe dropped with the node cache")
    seen: dict[str, Any] = {}
    await wait_until_async(lambda: nothing_of_dropped_pipes_alive(comfy, seen),
                           what=lambda: f"the pipe's models going with it "
                                        f"(held by: {seen.get('orphaned_weights_held_by')})")


async def no_pipe_alive(comfy: Comfy) -> bool:
    return (await get_json(comfy, "/ernie_image/memory"))["live_pipes"] == 0


async def free_handled(comfy: Comfy, graph: dict[str, Any]) -> None:
    """Until ComfyUI has acted on the /free posted before: its prompt worker reads the flags /free sets when it
    wakes, or after a prompt queued before it woke (main.py prompt_worker), so once a second prompt queued after the
    /free has run they have been handled. The prompts are `graph`, just run, again: all of it from ComfyUI's cache,
    so nothing is loaded again (a prompt of other nodes would drop the graph's outputs from the cache)."""
    for _ in range(2):
        run = await run_prompt(comfy, graph)
        assert run.outcome == "execution_success", run.error
        assert sorted(run.of_type("execution_cached")[0]["nodes"]) == sorted(graph), "a node ran again"


async def test_keep_loaded_off_frees_weights_after_the_run(comfy: Comfy) -> None:
    graph = shrunk(api_workflow("ernie_image_turbo_12gb_budget"))
    run = await run_prompt(comfy, graph)
    assert run.outcome == "execution_success", run.error
    plan = [m for m in run.of_type("executed") if m["node"] == node_of(graph, "ErnieImageLoader")[0]]
    assert plan and plan[0]["output"]["text"][0], "the Loader sent no memory plan to the UI"
    memory = await get_json(comfy, "/ernie_image/memory")
    assert memory["pipes"] and not any(p["loaded"] for p in memory["pipes"] if p["kind"] == "local")


def loader_text(run: Any, graph: dict[str, Any]) -> str:
    """The text the Loader showed in this run (a cached Loader's too: ComfyUI sends its cached text again)."""
    loader_id = node_of(graph, "ErnieImageLoader")[0]
    return next(m["output"]["text"][0] for m in run.of_type("executed") if m["node"] == loader_id)


def loader_ran(run: Any, graph: dict[str, Any]) -> bool:
    """Whether ComfyUI ran the Loader in this run rather than taking its pipe from the cache."""
    cached = [node for message in run.of_type("execution_cached") for node in message["nodes"]]
    return node_of(graph, "ErnieImageLoader")[0] not in cached


async def test_a_model_file_replaced_between_prompts_is_loaded_again_and_the_loader_says_what_it_is(
        comfy: Comfy, tmp_path: Path) -> None:
    """The Loader's fingerprint of its files (IS_CHANGED) makes ComfyUI run it again when a file changed, never
    reusing the cached pipe of the old file; the same files keep it cached."""
    import os
    import shutil

    graph = shrunk(api_workflow("ernie_image_turbo_local"))
    dit = comfy.models["ernie-image-turbo.safetensors"]
    original = shutil.copyfile(dit, tmp_path / "turbo.safetensors")
    run = await run_prompt(comfy, graph)
    assert run.outcome == "execution_success", run.error
    again = await run_prompt(comfy, graph)
    assert again.outcome == "execution_success" and not loader_ran(again, graph)  # the same files: cached
    try:
        os.replace(shutil.copyfile(comfy.models["ernie-image.safetensors"], tmp_path / "base.safetensors"), dit)
        run = await run_prompt(comfy, graph)
        assert run.outcome == "execution_success" and loader_ran(run, graph), run.error
        assert loader_text(run, graph).startswith("ERNIE-Image Base, from the file's metadata;"), loader_text(run, graph)
    finally:
        os.replace(original, dit)
    run = await run_prompt(comfy, graph)
    assert run.outcome == "execution_success" and loader_ran(run, graph), run.error
    assert loader_text(run, graph).startswith("ERNIE-Image Turbo, from the file's metadata;"), loader_text(run, graph)


async def test_remote_test_connection_route(comfy: Comfy) -> None:
    from fake_sglang import FakeSglang

    with FakeSglang(model_id="baidu/ERNIE-Image-Turbo") as fake:
        status, body = await post(comfy, "/ernie_image/test_connection", {"server_urls": fake.url})
        assert status == 200 and body["ok"], body
        assert body["servers"][0]["model"] == "baidu/ERNIE-Image-Turbo"
        assert not fake.generations, "Test connection must not generate"
    status, body = await post(comfy, "/ernie_image/test_connection", {"server_urls": fake.url})
    assert status == 200 and not body["ok"] and body["servers"][0]["problems"]
    status, body = await post(comfy, "/ernie_image/test_connection", {"server_urls": fake.url, "api_key_env": "sk-123 secret"})
    assert status == 400 and "API keys are bound to servers in your keys file" in body["error"]
    assert "secret" not in body["error"]


async def test_the_api_key_reaches_the_server_and_never_the_png_history_or_log(comfy: Comfy) -> None:
    from fake_sglang import FakeSglang

    graph = shrunk(api_workflow("ernie_image_remote_sglang"))
    backend = node_of(graph, "ErnieImageRemoteBackend")[1]["inputs"]
    with FakeSglang(model_id="baidu/ERNIE-Image-Turbo", api_key=SECRET_KEY) as fake:
        # the user binds the key to the server in ComfyUI's user directory; the workflow names only its label
        keys = comfy.base / "user" / "ernie_image" / "keys.json"
        keys.parent.mkdir(parents=True, exist_ok=True)
        keys.write_text(json.dumps({"credentials": [{"label": KEY_LABEL, "origin": fake.url, "env": KEY_VARIABLE}]}))
        keys.chmod(0o600)
        backend.update(server_urls=fake.url, credential=KEY_LABEL)
        try:
            run = await run_prompt(comfy, graph)
        finally:
            keys.unlink()
        assert run.outcome == "execution_success", run.error
        assert fake.generations[0].headers.get("Authorization") == f"Bearer {SECRET_KEY}"
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{comfy.url}/view", params={**saved_images(run)[0]}) as response:
            png = await response.read()
    assert png.startswith(b"\x89PNG") and KEY_LABEL.encode() in png, "the PNG should record the credential's label"
    assert SECRET_KEY.encode() not in png
    assert SECRET_KEY not in json.dumps(run.history) + json.dumps(run.messages)
    assert SECRET_KEY not in comfy.log()


async def test_nan_shift_and_text_width_get_one_line_errors_and_the_next_prompt_runs(comfy: Comfy) -> None:
    graph = shrunk(api_workflow("ernie_image_turbo_local"))
    sampler_id, sampler = node_of(graph, "ErnieImageTurboSampler")
    sampler["inputs"]["width"] = "abc"  # ComfyUI's own INT conversion refuses it, once
    status, body = await post(comfy, "/prompt", {"prompt": graph, "client_id": "e2e"})
    assert status == 400
    errors = body["node_errors"][sampler_id]["errors"]
    assert len(errors) == 1 and errors[0]["extra_info"]["input_name"] == "width", errors

    graph = shrunk(api_workflow("ernie_image_turbo_local"))
    node_of(graph, "ErnieImageTurboSampler")[1]["inputs"]["shift"] = float("nan")  # JSON NaN: ComfyUI's min check passes it
    run = await run_prompt(comfy, graph)
    assert run.outcome == "execution_error", run.outcome  # used to run on and succeed
    message = run.error["exception_message"].strip()
    assert "\n" not in message and "shift nan is not allowed" in message, message

    good = await run_prompt(comfy, shrunk(api_workflow("ernie_image_turbo_local")))
    assert good.outcome == "execution_success" and saved_images(good)


async def test_a_bad_lora_strength_is_a_400_when_queued_and_an_old_lora_workflow_still_runs(comfy: Comfy) -> None:
    graph = shrunk(api_workflow("ernie_image_turbo_two_loras"))
    lora_id, lora = node_of(graph, "ErnieImageLoRA")
    lora["inputs"]["strength"] = float("nan")  # JSON NaN: ComfyUI's own min/max check lets it through
    status, body = await post(comfy, "/prompt", {"prompt": graph, "client_id": "e2e"})
    assert status == 400, body
    errors = body["node_errors"][lora_id]["errors"]
    assert len(errors) == 1 and "strength nan is not allowed" in errors[0]["details"], errors

    old = shrunk(api_workflow("ernie_image_turbo_two_loras"))
    for node in old.values():
        node["inputs"].pop("mode", None)  # saved before the LoRA node had its mode widget
    run = await run_prompt(comfy, old)
    assert run.outcome == "execution_success" and saved_images(run), run.outcome
