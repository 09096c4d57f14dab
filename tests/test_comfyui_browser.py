"""The pack in ComfyUI's own editor: the real ComfyUI of test_comfyui_e2e opened in a headless Chromium, its
frontend driven the way a user's clicks drive it (through its `app` object and the nodes' widgets).

Needs what test_comfyui_e2e needs, plus a Chromium (ERNIE_CHROMIUM, or chromium on PATH).
"""
from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest

from cdp_browser import Browser, chromium_binary
from comfyui_server import REPO_ROOT, comfyui_found, free_port, get_json
from test_comfyui_e2e import MAX_TEST_STEPS, NODE_IDS, TEST_SIDE, comfy  # noqa: F401  (the same server)

pytestmark = [
    pytest.mark.comfyui,
    pytest.mark.slow,
    pytest.mark.skipif(not comfyui_found(), reason="needs a real ComfyUI: set ERNIE_COMFYUI_DIR (v0.8.0 tested) and "
                                                   "ERNIE_COMFYUI_PYTHON"),
    pytest.mark.skipif(chromium_binary() is None, reason="needs a Chromium: set ERNIE_CHROMIUM or put chromium on PATH"),
]

UI_WORKFLOWS = sorted((REPO_ROOT / "example_workflows").glob("*.json"))
APP = "(window.app ?? window.comfyAPI?.app?.app)"
EDITOR_TIMEOUT_S = 120
RUN_TIMEOUT_S = 300


@pytest.fixture
async def page(comfy):  # noqa: F811
    async with Browser(chromium_binary()) as browser:
        await browser.open(comfy.url)
        # node types are registered once the frontend has read /object_info: core KSampler marks the end
        await browser.wait_for(f"{APP}?.graph && window.LiteGraph?.registered_node_types?.KSampler", EDITOR_TIMEOUT_S,
                               "ComfyUI's editor with its nodes")
        yield browser
        own_errors = [error for error in browser.errors if "ernie" in error.lower()]
        assert not own_errors, own_errors


async def load_workflow(page: Browser, path: Path) -> None:
    await page.evaluate(f"{APP}.loadGraphData({path.read_text()}).then(() => true)")


async def add_node(page: Browser, node_type: str) -> None:
    """A new node of `node_type` in the graph, as the node library's click adds it, kept in window.testNode."""
    await page.evaluate(f"(() => {{ const node = LiteGraph.createNode({json.dumps(node_type)}); "
                        f"{APP}.graph.add(node); window.testNode = node; return true; }})()")


def set_widget(name: str, value) -> str:
    """JavaScript: set testNode's widget `name` as the editor does on an edit (value, then its callback)."""
    return (f"(() => {{ const w = testNode.widgets.find((w) => w.name === {json.dumps(name)}); "
            f"w.value = {json.dumps(value)}; w.callback?.(w.value); return true; }})()")


def widget_value(name: str) -> str:
    return f"testNode.widgets.find((w) => w.name === {json.dumps(name)}).value"


async def test_the_editor_loads_the_packs_extension_and_every_node(page: Browser) -> None:
    extensions = await page.evaluate(f"{APP}.extensions.map((e) => e.name)")
    assert "ErnieImage.nodes" in extensions
    registered = await page.evaluate("Object.keys(LiteGraph.registered_node_types)")
    assert set(NODE_IDS) <= set(registered)


@pytest.mark.parametrize("path", UI_WORKFLOWS, ids=lambda path: path.stem)
async def test_each_example_workflow_loads_whole_and_queues_as_its_api_copy(page: Browser, path: Path,
                                                                            comfy) -> None:  # noqa: F811
    await load_workflow(page, path)
    missing = await page.evaluate(f"{APP}.graph._nodes.filter((n) => !LiteGraph.registered_node_types[n.type])"
                                  ".map((n) => n.type)")
    assert missing == []
    queued = await page.evaluate(f"{APP}.graphToPrompt().then((p) => p.output)")
    shipped = json.loads((REPO_ROOT / "workflows" / "api" / path.name).read_text())
    info = await get_json(comfy, "/object_info")
    assert differences(queued, shipped, info) == []


def differences(queued: dict, shipped: dict, info: dict) -> list[tuple]:
    """(node, input, as queued, as shipped) wherever they differ, over the inputs each node declares (the frontend
    also sends values of display-only widgets, such as Preview Any's, which the server ignores)."""
    found = [(key, "class_type", (queued.get(key) or {}).get("class_type"), node["class_type"])
             for key, node in shipped.items() if (queued.get(key) or {}).get("class_type") != node["class_type"]]
    found += [(key, "node", queued[key]["class_type"], None) for key in queued.keys() - shipped.keys()]
    for key in queued.keys() & shipped.keys():
        declared = info[shipped[key]["class_type"]]["input"]
        names = set(declared.get("required", {})) | set(declared.get("optional", {}))
        for name in sorted(names | set(shipped[key]["inputs"])):
            ours, theirs = queued[key]["inputs"].get(name), shipped[key]["inputs"].get(name)
            if ours != theirs:
                found.append((key, name, ours, theirs))
    return found


async def test_a_preset_writes_its_size_and_a_hand_edit_switches_to_custom(page: Browser) -> None:
    await add_node(page, "ErnieImageTurboSampler")
    presets = await page.evaluate("testNode.widgets.find((w) => w.name === 'resolution').options.values")
    wide = next(label for label in presets if label[0].isdigit() and label.split("x")[0] != label.split("x")[1][:4])
    width, height = (int(side) for side in wide.split(" ")[0].split("x"))
    await page.evaluate(set_widget("resolution", wide))
    assert await page.evaluate(f"[{widget_value('width')}, {widget_value('height')}]") == [width, height]
    await page.evaluate(set_widget("width", width - 16))
    assert await page.evaluate(widget_value("resolution")) == "custom"
    assert await page.evaluate(f"[{widget_value('width')}, {widget_value('height')}]") == [width - 16, height]


async def test_a_workflow_queued_from_the_editor_runs_and_the_loader_shows_its_memory_plan(page: Browser,
                                                                                      comfy) -> None:  # noqa: F811
    await load_workflow(page, REPO_ROOT / "example_workflows" / "ernie_image_turbo_local.json")
    await page.evaluate(f"""(() => {{
        for (const node of {APP}.graph._nodes.filter((n) => n.type === "ErnieImageTurboSampler")) {{
            const set = (name, value) => {{ node.widgets.find((w) => w.name === name).value = value; }};
            set("resolution", "custom"); set("width", {TEST_SIDE}); set("height", {TEST_SIDE});
            set("steps", {MAX_TEST_STEPS});
        }}
        return true;
    }})()""")
    before = set(await get_json(comfy, "/history"))
    await page.evaluate(f"{APP}.queuePrompt(0, 1).then(() => true)")
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while not (entries := {key: value for key, value in (await get_json(comfy, "/history")).items()
                           if key not in before and value.get("status", {}).get("completed")}):
        assert time.monotonic() < deadline, "the queued workflow did not finish"
        await asyncio.sleep(1)
    (entry,) = entries.values()
    images = [image for output in entry["outputs"].values() for image in output.get("images", [])]
    assert len(images) == 1 and images[0]["type"] == "output"
    plan = await page.wait_for(f"{APP}.graph._nodes.find((n) => n.type === 'ErnieImageLoader')"
                               ".widgets.find((w) => w.name === 'memory_plan').value", 30, "the loader's memory plan")
    assert "plan" in plan.lower() and len(plan.splitlines()) >= 2


async def press_test_connection(page: Browser, server_urls: str) -> str:
    """A new Remote Backend with `server_urls`, its Test connection button pressed: the answer on the node."""
    await add_node(page, "ErnieImageRemoteBackend")
    await page.evaluate(set_widget("server_urls", server_urls))
    await page.evaluate(set_widget("connect_timeout_s", 1.0))
    await page.evaluate("testNode.widgets.find((w) => w.name === 'Test connection').callback(); true")
    return await page.wait_for("(() => { const v = testNode.widgets.find((w) => w.name === 'status').value; "
                               "return v && !v.startsWith('checking') ? v : null; })()", 30, "the check's answer")


async def test_test_connection_to_a_dead_server_says_it_refused_on_the_node(page: Browser) -> None:
    port = free_port()
    status = await press_test_connection(page, f"http://127.0.0.1:{port}")
    assert f"127.0.0.1:{port}" in status and "refused" in status and len(status.splitlines()) <= 6


async def test_test_connection_refuses_a_password_in_the_url_and_never_shows_it(page: Browser) -> None:
    password = "s3cret-" + str(free_port())
    status = await press_test_connection(page, f"http://user:{password}@127.0.0.1:{free_port()}")
    assert password not in status and "user:" not in status
    assert "holds a user name or password" in status


def saved_by_an_earlier_version(path: Path, key_values: dict[str, list]) -> dict:
    """The shipped UI workflow as an earlier version saved it: its key-source widgets (api_key_env, api_key_file,
    pe_api_key_env, pe_api_key_file) back in their old places, holding `key_values[node type]`."""
    graph = json.loads(path.read_text())
    for node in graph["nodes"]:
        if node["type"] == "ErnieImageRemoteBackend":
            u, c, r, _, pe_url, pe_model, _, wait, resend = node["widgets_values"]
            env, file, pe_env, pe_file = key_values[node["type"]]
            node["widgets_values"] = [u, c, r, env, file, pe_url, pe_model, pe_env, pe_file, wait, resend]
        if node["type"] == "ErnieImagePromptEnhancer":
            node["widgets_values"] = node["widgets_values"][:11] + key_values[node["type"]]
    return graph


@pytest.mark.parametrize("name, key_values, expected", [
    ("ernie_image_remote_sglang", {"ErnieImageRemoteBackend": ["SGLANG_API_KEY", "", "", "/home/me/pe.key"]},
     {"credential": "SGLANG_API_KEY", "pe_credential": "/home/me/pe.key"}),
    ("ernie_image_remote_sglang", {"ErnieImageRemoteBackend": ["", "", "", ""]}, {"credential": "", "pe_credential": ""}),
    ("ernie_image_base_prompt_enhancer", {"ErnieImagePromptEnhancer": ["PE_KEY", ""]}, {"pe_credential": "PE_KEY"}),
])
async def test_an_earlier_versions_key_widgets_load_into_the_credential_and_the_rest_stays_in_place(
        page: Browser, comfy, name: str, key_values: dict, expected: dict) -> None:  # noqa: F811
    """The key source an old workflow named becomes the credential label (it then runs only if the user's keys
    file binds that label to that server); every other widget keeps its value, and no key source is queued."""
    old = saved_by_an_earlier_version(REPO_ROOT / "example_workflows" / f"{name}.json", key_values)
    await page.evaluate(f"{APP}.loadGraphData({json.dumps(old)}).then(() => true)")
    queued = await page.evaluate(f"{APP}.graphToPrompt().then((p) => p.output)")
    shipped = json.loads((REPO_ROOT / "workflows" / "api" / f"{name}.json").read_text())
    for key, node in shipped.items():
        for field, value in expected.items():
            if field in node["inputs"]:
                node["inputs"][field] = value
    info = await get_json(comfy, "/object_info")
    assert differences(queued, shipped, info) == []
    assert not any(name.startswith(("api_key", "pe_api_key")) for node in queued.values() for name in node["inputs"])
