// ERNIE-Image nodes in ComfyUI's editor: resolution presets, text shown on the nodes, Remote "Test connection".
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";

// Nodes with the resolution / width / height widgets (nodes/sampler.py size_inputs).
const HAS_RESOLUTION = new Set(["ErnieImageSampler", "ErnieImageTurboSampler", "ErnieImagePromptEnhancer"]);
const SHOWS_TEXT = new Set(["ErnieImageLoader", "ErnieImageRemoteBackend", "ErnieImageQuantConfig", "ErnieImagePromptEnhancer"]);
const CUSTOM = "custom";
const PRESET = /^(\d+)x(\d+)\b/;

function widget(node, name) {
  return node.widgets?.find((w) => w.name === name);
}

function presetSize(label) {
  const match = PRESET.exec(label ?? "");
  return match ? [Number(match[1]), Number(match[2])] : null;
}

// Picking a preset writes its size into width/height; editing width/height by hand switches to "custom".
function attachResolutionPicker(node) {
  const resolution = widget(node, "resolution");
  const width = widget(node, "width");
  const height = widget(node, "height");
  if (!resolution || !width || !height) return;
  let syncing = false;
  const applyPreset = () => {
    const size = presetSize(resolution.value);
    if (!size) return;
    syncing = true;
    [width.value, height.value] = size;
    syncing = false;
    node.setDirtyCanvas(true, true);
  };
  const onResolution = resolution.callback;
  resolution.callback = function (...args) {
    const result = onResolution?.apply(this, args);
    applyPreset();
    return result;
  };
  for (const side of [width, height]) {
    const onSide = side.callback;
    side.callback = function (...args) {
      const result = onSide?.apply(this, args);
      const size = presetSize(resolution.value);
      if (!syncing && size && (size[0] !== width.value || size[1] !== height.value)) {
        resolution.value = CUSTOM;
      }
      return result;
    };
  }
  // A workflow saved with a preset shows the preset's size once it is loaded.
  requestAnimationFrame(applyPreset);
}

// A read-only text box on the node (a DOM widget: ComfyUI's public way to put HTML on a node).
function textWidget(node, name) {
  let shown = widget(node, name);
  if (!shown) {
    const box = document.createElement("textarea");
    box.readOnly = true;
    box.style.cssText = "width:100%;min-height:4.5em;font:11px monospace;opacity:0.85;resize:none;";
    shown = node.addDOMWidget(name, "ernie_text", box, {
      getValue: () => box.value,
      setValue: (text) => { box.value = text; },
      serialize: false, // display only: never saved into the workflow
    });
    shown.serialize = false;
  }
  return shown;
}

function showText(node, name, text) {
  textWidget(node, name).value = text;
  node.setSize([Math.max(node.size[0], 320), node.computeSize()[1]]);
  node.setDirtyCanvas(true, true);
}

async function testConnection(node) {
  const value = (name) => widget(node, name)?.value ?? "";
  showText(node, "status", "checking the servers...");
  try {
    const response = await api.fetchApi("/ernie_image/test_connection", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify({
        server_urls: value("server_urls"),
        api_key_env: value("api_key_env"),
        api_key_file: value("api_key_file"),
        connect_timeout_s: value("connect_timeout_s"),
      }),
    });
    const result = await response.json();
    showText(node, "status", result.error ? `!! ${result.error}` : result.text);
  } catch (error) {
    showText(node, "status", `!! the check could not run: ${error}`);
  }
}

app.registerExtension({
  name: "ErnieImage.nodes",
  async beforeRegisterNodeDef(nodeType, nodeData) {
    const name = nodeData.name;
    if (HAS_RESOLUTION.has(name)) {
      const onNodeCreated = nodeType.prototype.onNodeCreated;
      nodeType.prototype.onNodeCreated = function () {
        const result = onNodeCreated?.apply(this, arguments);
        attachResolutionPicker(this);
        return result;
      };
    }
    if (name === "ErnieImageRemoteBackend") {
      const onNodeCreated = nodeType.prototype.onNodeCreated;
      nodeType.prototype.onNodeCreated = function () {
        const result = onNodeCreated?.apply(this, arguments);
        // An action, not a setting: kept out of the saved workflow and the queued prompt.
        const button = this.addWidget("button", "Test connection", null, () => testConnection(this), { serialize: false });
        button.serialize = false;
        return result;
      };
    }
    if (SHOWS_TEXT.has(name)) {
      const onExecuted = nodeType.prototype.onExecuted;
      nodeType.prototype.onExecuted = function (message) {
        onExecuted?.apply(this, arguments);
        const text = message?.text;
        if (text?.length) showText(this, name === "ErnieImageLoader" ? "memory_plan" : "status", text.join("\n"));
      };
    }
  },
});
