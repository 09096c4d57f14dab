// ERNIE-Image nodes in ComfyUI's editor: resolution presets, text shown on the nodes, Remote "Test connection".
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";

// Nodes with the resolution / width / height widgets (nodes/sampler.py size_inputs).
const HAS_RESOLUTION = new Set(["ErnieImageSampler", "ErnieImageTurboSampler", "ErnieImagePromptEnhancer"]);
const SHOWS_TEXT = new Set(["ErnieImageLoader", "ErnieImageRemoteBackend", "ErnieImageQuantConfig", "ErnieImagePromptEnhancer"]);
// Nodes that show text only when a run has a notice (a Turbo model under the base Sampler): their box is added
// with the first notice, so a Sampler keeps its usual size until there is something to say.
const SHOWS_NOTICES = new Set(["ErnieImageSampler", "ErnieImageTurboSampler"]);
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

// What each node shows after a run, in a read-only text box of fixed height (lines of 11px monospace) added when
// the node is made: the node's size never changes when text arrives, and longer text scrolls inside the box.
const TEXT_BOX_LINES = {
  ErnieImageLoader: 9, // the memory plan: a title line and one line per phase
  ErnieImageRemoteBackend: 6, // two servers with a problem line each, or one line per server
  ErnieImageQuantConfig: 3,
  ErnieImagePromptEnhancer: 4,
  ErnieImageSampler: 4,
  ErnieImageTurboSampler: 4,
};
const LINE_PX = 14;
const TEXT_NAME = { ErnieImageLoader: "memory_plan" };

function textBoxHeight(nodeName) {
  return TEXT_BOX_LINES[nodeName] * LINE_PX + 10;
}

// A DOM widget (ComfyUI's public way to put HTML on a node) whose min and max height are the same.
function addTextBox(node, nodeName) {
  const name = TEXT_NAME[nodeName] ?? "status";
  if (widget(node, name)) return widget(node, name);
  const height = textBoxHeight(nodeName);
  const box = document.createElement("textarea");
  box.readOnly = true;
  box.placeholder = nodeName === "ErnieImageLoader" ? "memory plan (after a run)" : "status (after a run)";
  box.style.cssText = `width:100%;height:${height}px;box-sizing:border-box;font:11px/${LINE_PX}px monospace;` +
    "opacity:0.85;resize:none;overflow:auto;" +
    // the plan is a table (columns kept, scrolls sideways); statuses and errors wrap
    (nodeName === "ErnieImageLoader" ? "white-space:pre;" : "white-space:pre-wrap;");
  const shown = node.addDOMWidget(name, "ernie_text", box, {
    getValue: () => box.value,
    setValue: (text) => { box.value = text; },
    getMinHeight: () => height,
    getMaxHeight: () => height,
    serialize: false, // display only: never saved into the workflow
  });
  shown.serialize = false;
  return shown;
}

function showText(node, nodeName, text) {
  addTextBox(node, nodeName).value = text;
  node.setDirtyCanvas(true, true);
}

async function testConnection(node) {
  const value = (name) => widget(node, name)?.value ?? "";
  showText(node, "ErnieImageRemoteBackend", "checking the servers...");
  try {
    const response = await api.fetchApi("/ernie_image/test_connection", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify({
        server_urls: value("server_urls"),
        credential: value("credential"),
        connect_timeout_s: value("connect_timeout_s"),
      }),
    });
    const result = await response.json();
    showText(node, "ErnieImageRemoteBackend", result.error ? `!! ${result.error}` : result.text);
  } catch (error) {
    showText(node, "ErnieImageRemoteBackend", `!! the check could not run: ${error}`);
  }
}

// Workflows saved before API keys were bound on the user's machine kept, per node, where a key was read from (any
// variable or file the workflow named). Their widget values are laid out as the new widgets by name; a key source
// they named becomes the credential label, which runs only if the user's keys file has a credential of that label
// bound to that very server (else the run stops with one line saying how to bind one).
const LEGACY_LAYOUTS = {
  ErnieImageRemoteBackend: {
    names: ["server_urls", "connect_timeout_s", "read_timeout_s", "api_key_env", "api_key_file", "pe_url", "pe_model",
      "pe_api_key_env", "pe_api_key_file", "wait_for_servers_s", "resend_unanswered"],
    // the current layout has 9 values, of which the 8th is a number (wait_for_servers_s)
    isLegacy: (values) => values.length !== 9 || typeof values[7] === "string",
  },
  ErnieImagePromptEnhancer: {
    names: ["prompt", "resolution", "width", "height", "seed", "control_after_generate", "temperature", "top_p",
      "max_new_tokens", "pe_url", "pe_model", "pe_api_key_env", "pe_api_key_file"],
    isLegacy: (values) => values.length === 13,
  },
};

function migrateKeyWidgets(node, layout, values) {
  if (!Array.isArray(values) || !layout.isLegacy(values)) return;
  const saved = Object.fromEntries(layout.names.slice(0, values.length).map((name, i) => [name, values[i]]));
  for (const shown of node.widgets ?? []) {
    if (shown.name in saved) shown.value = saved[shown.name];
  }
  const credential = widget(node, "credential");
  if (credential) credential.value = String(saved.api_key_env || saved.api_key_file || "");
  const peCredential = widget(node, "pe_credential");
  if (peCredential) peCredential.value = String(saved.pe_api_key_env || saved.pe_api_key_file || "");
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
    if (LEGACY_LAYOUTS[name]) {
      const onConfigure = nodeType.prototype.onConfigure;
      nodeType.prototype.onConfigure = function (info) {
        const result = onConfigure?.apply(this, arguments);
        migrateKeyWidgets(this, LEGACY_LAYOUTS[name], info?.widgets_values);
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
      // Added last, after the button, so the saved widget values keep their positions.
      const onNodeCreated = nodeType.prototype.onNodeCreated;
      nodeType.prototype.onNodeCreated = function () {
        const result = onNodeCreated?.apply(this, arguments);
        addTextBox(this, name);
        return result;
      };
      const onExecuted = nodeType.prototype.onExecuted;
      nodeType.prototype.onExecuted = function (message) {
        onExecuted?.apply(this, arguments);
        const text = message?.text;
        if (text?.length) showText(this, name, text.join("\n"));
      };
    }
    if (SHOWS_NOTICES.has(name)) {
      const onExecuted = nodeType.prototype.onExecuted;
      nodeType.prototype.onExecuted = function (message) {
        onExecuted?.apply(this, arguments);
        const text = (message?.text ?? []).join("\n");
        // A run without notices clears an earlier run's notice, and adds no box.
        if (text || widget(this, "status")) showText(this, name, text);
      };
    }
  },
});
