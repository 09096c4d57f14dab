"""The pack in ComfyUI's own editor: the real ComfyUI of test_comfyui_e2e opened in a headless Chromium, its
frontend driven the way a user's clicks drive it (through its `app` object and the nodes' widgets).

Needs what test_comfyui_e2e needs, plus a Chromium (ERNIE_CHROMIUM, or chromium on PATH).
"""
from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

import pytest

from cdp_browser import Browser, chromium_binary
from comfyui_server import PACK_NAME, REPO_ROOT, comfyui_found, free_port, get_json
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
        # node types are registered once the frontend has read /object_info: core KSampler marks the end; the
        # frontend's own nodes (Note) come later in newer editors (1.58): a workflow loaded before them would
        # hold a placeholder that graphToPrompt queues as a node without a class_type
        await browser.wait_for(f"{APP}?.graph && window.LiteGraph?.registered_node_types?.KSampler && "
                               "LiteGraph.registered_node_types.Note && "
                               f"{APP}.extensions?.some((e) => e.name === 'ErnieImage.nodes')", EDITOR_TIMEOUT_S,
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
    entry = await run_in_editor(page, comfy, REPO_ROOT / "example_workflows" / "ernie_image_turbo_local.json")
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


# ------------------------------------------------------------------------------------ how the editor shows them
# ERNIE_SCREENSHOTS: a folder for what these tests saw (one PNG per check), to look at.
SCREENSHOTS = Path(os.environ["ERNIE_SCREENSHOTS"]) if os.environ.get("ERNIE_SCREENSHOTS") else None
MIN_NOTE_TEXT_PX = 11  # a Note's text on screen at its template's saved zoom
PROMPT_MIN_HEIGHT = 120  # web/ernie_image.js: the Samplers' prompt box, in graph units (margins included)
NOTE_FONT = "ErnieImage.font_px"


async def look(page: Browser, name: str) -> None:
    if SCREENSHOTS is not None:
        await page.screenshot(SCREENSHOTS / f"{name}.png")


def templates_store() -> str:
    return ("document.getElementById('vue-app')?.__vue_app__?.config.globalProperties.$pinia"
            "?._s.get('workflowTemplates')")


async def template_index(page: Browser) -> list[dict]:
    """web/ernie_image.js's TEMPLATE_INDEX (ComfyUI's index.json schema), as the editor loaded it."""
    return await page.evaluate(f"import('/extensions/{PACK_NAME}/ernie_image.js').then((m) => m.TEMPLATE_INDEX)")


async def test_the_template_index_describes_every_template_and_nothing_else(page: Browser) -> None:
    (category,) = await template_index(page)
    names = [template["name"] for template in category["templates"]]
    assert sorted(names) == [path.stem for path in UI_WORKFLOWS]
    for template in category["templates"]:
        assert template["title"] and template["title"] != template["name"]
        # the frontend shows a description with '-' and '_' turned into spaces
        assert len(template["description"]) > 40 and not set("-_") & set(template["description"])
        assert template["mediaType"] == "image" and template["mediaSubtype"] == "jpg"  # <name>.jpg, beside it
        assert set(template) <= {"name", "title", "description", "mediaType", "mediaSubtype", "tags", "models"}


async def test_the_template_browser_shows_each_templates_title_and_description(page: Browser, comfy) -> None:  # noqa: F811
    """ComfyUI lists a pack's templates by file name; the pack's index gives them their titles and descriptions,
    as ComfyUI's own index.json gives its templates theirs."""
    (category,) = await template_index(page)
    listed = await get_json(comfy, "/workflow_templates")
    assert sorted(listed[PACK_NAME]) == sorted(template["name"] for template in category["templates"])
    shown = await page.wait_for(
        f"(() => {{ const all = ({templates_store()})?.enhancedTemplates?.filter((t) => t.sourceModule === "
        f"{json.dumps(PACK_NAME)}) ?? []; return all.length && all.every((t) => t.title !== t.name) && "
        "all.map((t) => ({name: t.name, title: t.title, description: t.description})); })()",
        EDITOR_TIMEOUT_S, "the templates with their titles")
    assert sorted(shown, key=lambda t: t["name"]) == sorted(
        ({"name": t["name"], "title": t["title"], "description": t["description"]} for t in category["templates"]),
        key=lambda t: t["name"])
    await page.evaluate(f"{APP}.extensionManager.command.execute('Comfy.BrowseTemplates').then(() => true)")
    await page.wait_for(f"""(async () => {{
        const entry = [...document.querySelectorAll('span,div,a,button,li')]
            .find((e) => e.textContent.trim() === {json.dumps(PACK_NAME)} && e.childElementCount <= 2);
        entry?.click();
        return entry && document.body.innerText.includes({json.dumps(category["templates"][0]["title"])});
    }})()""", 60, "the pack's templates in the template browser")
    text = await page.evaluate("document.body.innerText")
    await look(page, "template_browser")
    assert all(template["title"] in text for template in category["templates"])
    assert not any(name in text for name in listed[PACK_NAME])  # no file name shown as a title


# JavaScript: a node's box in graph units, its title bar included ([left, top, right, bottom])
NODE_BOX = ("((node) => [node.pos[0], node.pos[1] - LiteGraph.NODE_TITLE_HEIGHT, node.pos[0] + node.size[0], "
            "node.pos[1] + node.size[1]])")
MEASURE_VIEW = """(() => {
    const app = APP, canvas = app.canvas.canvas, box = canvas.getBoundingClientRect();
    const [ox, oy] = app.canvas.ds.offset, scale = app.canvas.ds.scale;
    const screen = (x, y) => [box.left + (x + ox) * scale, box.top + (y + oy) * scale];
    // where the canvas shows: what is free of the sidebar and the tab bar, found from the middle of each side
    const shows = (x, y) => document.elementFromPoint(x, y) === canvas;
    let left = 0; while (left < box.width / 2 && !shows(left, box.height / 2)) left++;
    let top = 0; while (top < box.height / 2 && !shows(box.width / 2, top)) top++;
    const nodes = app.graph._nodes.map((node) => {
        const [gx0, gy0, gx1, gy1] = NODE_BOX(node);
        const [x0, y0] = screen(gx0, gy0), [x1, y1] = screen(gx1, gy1);
        // points along the node's edge that a floating panel (minimap, toolbar) would cover
        const covered = [];
        for (let t = 0.05; t < 1; t += 0.1) {
            for (const [x, y] of [[x0 + (x1 - x0) * t, y0 + 1], [x0 + (x1 - x0) * t, y1 - 1], [x0 + 1, y0 + (y1 - y0) * t],
                                  [x1 - 1, y0 + (y1 - y0) * t]]) {
                const hit = document.elementFromPoint(x, y);
                if (hit && hit !== canvas && !hit.closest('.dom-widget, [class*="dom-widget"]'))
                    covered.push(hit.className?.toString?.() || hit.tagName);
            }
        }
        return {id: String(node.id), type: node.type, box: [x0, y0, x1, y1], covered};
    });
    const notes = app.graph._nodes.filter((n) => n.type === "Note" || n.type === "MarkdownNote").map((node) => {
        const element = node.widgets[0].element ?? node.widgets[0].inputEl;
        const rect = element.getBoundingClientRect();
        return {id: String(node.id), px: parseFloat(getComputedStyle(element).fontSize) * rect.width / element.offsetWidth,
                hidden: element.scrollHeight - element.clientHeight};
    });
    return {scale, area: [left, top, box.right, box.bottom], nodes, notes};
})()"""


@pytest.mark.parametrize("path", UI_WORKFLOWS, ids=lambda path: path.stem)
async def test_each_template_opens_with_its_whole_graph_in_view_and_its_notes_readable(page: Browser,
                                                                                      path: Path) -> None:
    """In a 1600x1000 window, at the zoom and place the template was saved with: every node inside the canvas
    (clear of the sidebar, the tab bar, the toolbars and the minimap), the Notes' text at 11 px or more, all of
    it shown without scrolling."""
    await load_workflow(page, path)
    await asyncio.sleep(1)  # the DOM widgets are placed on the next frames
    view = await page.evaluate(MEASURE_VIEW.replace("APP", APP).replace("NODE_BOX", NODE_BOX))
    await look(page, f"opened_{path.stem}")
    left, top, right, bottom = view["area"]
    outside = [(n["id"], n["type"], [round(v) for v in n["box"]]) for n in view["nodes"]
               if n["box"][0] < left or n["box"][1] < top or n["box"][2] > right or n["box"][3] > bottom]
    assert outside == [], f"not in view ({view['area']}, zoom {view['scale']})"
    assert [(n["id"], n["type"], n["covered"]) for n in view["nodes"] if n["covered"]] == []
    assert view["notes"], "no Note"
    for note in view["notes"]:
        assert note["px"] >= MIN_NOTE_TEXT_PX, f"Note {note['id']} reads at {note['px']:.1f} px"
        assert note["hidden"] <= 1, f"Note {note['id']} hides {note['hidden']} px of its text"


def test_every_templates_notes_name_a_font_that_reads_at_11_px_at_its_saved_zoom() -> None:
    for path in UI_WORKFLOWS:
        ui = json.loads(path.read_text())
        for node in ui["nodes"]:
            if node["type"] in ("Note", "MarkdownNote"):
                assert node["properties"][NOTE_FONT] * ui["extra"]["ds"]["scale"] >= MIN_NOTE_TEXT_PX, path.name


async def run_in_editor(page: Browser, comfy, path: Path, server_urls: str = "") -> dict:  # noqa: F811
    """`path` loaded, shrunk for the CPU (as test_a_workflow_queued... does), queued from the editor; its history."""
    await load_workflow(page, path)
    await page.evaluate(f"""(() => {{
        for (const node of {APP}.graph._nodes) {{
            const set = (name, value) => {{ const w = node.widgets?.find((w) => w.name === name); if (w) w.value = value; }};
            if (/Sampler$/.test(node.type)) {{
                set("resolution", "custom"); set("width", {TEST_SIDE}); set("height", {TEST_SIDE});
                set("steps", Math.min(node.widgets.find((w) => w.name === "steps").value, {MAX_TEST_STEPS}));
            }}
            if (node.type === "ImageScale") {{ set("width", {TEST_SIDE}); set("height", {TEST_SIDE}); }}
            if (node.type === "ErnieImageRemoteBackend") set("server_urls", {json.dumps(server_urls)});
        }}
        return true;
    }})()""")
    before = set(await get_json(comfy, "/history"))
    await page.evaluate(f"{APP}.queuePrompt(0, 1).then(() => true)")
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while not (entries := {key: value for key, value in (await get_json(comfy, "/history")).items()
                           if key not in before and value.get("status", {}).get("completed")}):
        assert time.monotonic() < deadline, f"{path.stem} did not finish"
        await asyncio.sleep(1)
    await asyncio.sleep(2)  # the last messages reach the editor and it draws them
    (entry,) = entries.values()
    return entry


MEASURE_NODES = """(() => {
    const app = APP, nodes = app.graph._nodes, box = NODE_BOX;
    const canvas = app.canvas.canvas.getBoundingClientRect(), [ox, oy] = app.canvas.ds.offset, scale = app.canvas.ds.scale;
    const graph = (rect) => [(rect.left - canvas.left) / scale - ox, (rect.top - canvas.top) / scale - oy,
                             (rect.right - canvas.left) / scale - ox, (rect.bottom - canvas.top) / scale - oy];
    return nodes.map((node) => ({
        id: String(node.id), type: node.type, box: box(node),
        // the HTML a node shows (text boxes, prompts), where it is on the canvas
        widgets: (node.widgets ?? []).filter((w) => w.element && w.element.isConnected && w.element.offsetParent)
            .map((w) => ({name: w.name, box: graph(w.element.getBoundingClientRect()),
                          height: w.element.getBoundingClientRect().height / scale})),
    }));
})()"""


def overlaps(a: list[float], b: list[float], slack: float = 1.0) -> bool:
    return a[0] + slack < b[2] and b[0] + slack < a[2] and a[1] + slack < b[3] and b[1] + slack < a[3]


def inside(inner: list[float], outer: list[float], slack: float = 1.0) -> bool:
    return (inner[0] >= outer[0] - slack and inner[1] >= outer[1] - slack and inner[2] <= outer[2] + slack
            and inner[3] <= outer[3] + slack)


@pytest.mark.parametrize("name", ["ernie_image_remote_sglang", "ernie_image_turbo_img2img", "ernie_image_turbo_hires_fix"])
async def test_after_a_run_no_node_covers_another_and_the_prompt_keeps_its_height(page: Browser, comfy,  # noqa: F811
                                                                                  name: str) -> None:
    """What a run adds (the latent preview, the progress line, the servers' and the Samplers' text) grows a node
    into free canvas: no node (title bar included) covers another, each node's text boxes stay inside it, and
    the Samplers' prompt boxes keep their height."""
    from fake_sglang import FakeSglang

    with FakeSglang(model_id="baidu/ERNIE-Image-Turbo") as fake:
        await run_in_editor(page, comfy, REPO_ROOT / "example_workflows" / f"{name}.json", server_urls=fake.url)
    nodes = await page.evaluate(MEASURE_NODES.replace("APP", APP).replace("NODE_BOX", NODE_BOX))
    await look(page, f"after_a_run_{name}")
    covering = [(a["id"], a["type"], b["id"], b["type"]) for i, a in enumerate(nodes) for b in nodes[i + 1:]
                if overlaps(a["box"], b["box"])]
    assert covering == []
    outside = [(n["id"], n["type"], w["name"]) for n in nodes for w in n["widgets"] if not inside(w["box"], n["box"])]
    assert outside == []
    for node in nodes:
        for shown in node["widgets"]:
            if node["type"].endswith("Sampler") and shown["name"] == "prompt":
                assert shown["height"] >= PROMPT_MIN_HEIGHT - 2 * 10 - 2, (node["id"], shown)


def size_widgets_disabled() -> str:
    return "['resolution', 'width', 'height'].map((n) => Boolean(testNode.widgets.find((w) => w.name === n).disabled))"


async def test_the_size_widgets_are_greyed_out_while_an_image_or_latent_decides_the_size(page: Browser) -> None:
    await add_node(page, "ErnieImageTurboSampler")
    assert await page.evaluate(size_widgets_disabled()) == [False] * 3
    await page.evaluate(f"""(() => {{
        const image = LiteGraph.createNode("LoadImage"); {APP}.graph.add(image); window.testImage = image;
        image.connect(0, testNode, testNode.inputs.findIndex((i) => i.name === "image")); return true; }})()""")
    assert await page.evaluate(size_widgets_disabled()) == [True] * 3
    await page.evaluate("testNode.disconnectInput(testNode.inputs.findIndex((i) => i.name === 'image')); true")
    assert await page.evaluate(size_widgets_disabled()) == [False] * 3
    await page.evaluate(f"""(() => {{
        const latent = LiteGraph.createNode("EmptyLatentImage"); {APP}.graph.add(latent);
        latent.connect(0, testNode, testNode.inputs.findIndex((i) => i.name === "latent")); return true; }})()""")
    assert await page.evaluate(size_widgets_disabled()) == [True] * 3
    # the queued prompt is the same whatever the widgets show
    queued = await page.evaluate(f"{APP}.graphToPrompt().then((p) => p.output[String(testNode.id)].inputs)")
    assert {"resolution", "width", "height"} <= set(queued)


@pytest.mark.parametrize("name, disabled", [("ernie_image_turbo_img2img", {"3": True}),
                                            ("ernie_image_turbo_hires_fix", {"2": False, "4": True}),
                                            ("ernie_image_turbo_local", {"2": False})])
async def test_a_loaded_template_greys_out_the_size_widgets_its_image_inputs_decide(page: Browser, name: str,
                                                                                   disabled: dict) -> None:
    await load_workflow(page, REPO_ROOT / "example_workflows" / f"{name}.json")
    await asyncio.sleep(0.5)
    shown = await page.evaluate(f"""Object.fromEntries({APP}.graph._nodes.filter((n) => /Sampler$/.test(n.type))
        .map((n) => [String(n.id), ['resolution', 'width', 'height'].every((w) => n.widgets.find((x) => x.name === w).disabled)]))""")
    await look(page, f"size_widgets_{name}")
    assert shown == disabled
