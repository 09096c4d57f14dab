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
// The Samplers' inputs that decide the output size when linked (nodes/image_inputs.py): the size widgets then
// have no effect and are shown disabled, as ComfyUI shows a widget whose input is linked.
const SIZE_FROM_INPUTS = ["image", "latent"];
const SIZE_WIDGETS = ["resolution", "width", "height"];
// The least height of the Samplers' prompt boxes (10 px text: about eight lines): a latent preview, a progress
// line or a notice box added during a run then grows the node instead of squeezing the prompt to two lines.
const PROMPT_MIN_HEIGHT = { prompt: 120, negative_prompt: 64 };
const SAMPLERS = new Set(["ErnieImageSampler", "ErnieImageTurboSampler"]);

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

function sizeFromInput(node) {
  return SIZE_FROM_INPUTS.some((name) => node.inputs?.find((input) => input.name === name)?.link != null);
}

// resolution/width/height greyed out (and not editable) while an image or latent input decides the size.
function showSizeWidgetsState(node) {
  const decided = sizeFromInput(node);
  for (const name of SIZE_WIDGETS) {
    const shown = widget(node, name);
    if (shown && Boolean(shown.disabled) !== decided) shown.disabled = decided;
  }
  node.setDirtyCanvas?.(true, true);
}

function keepPromptsUsable(node) {
  for (const [name, height] of Object.entries(PROMPT_MIN_HEIGHT)) {
    const prompt = widget(node, name);
    // a prompt fed by a link (e.g. the Prompt Enhancer's) is not typed into: ComfyUI's own least height then
    const linked = () => node.inputs?.find((input) => input.name === name)?.link != null;
    if (prompt?.options) prompt.options.getMinHeight = () => (linked() ? undefined : height);
  }
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
const DOM_WIDGET_MARGIN = 10; // ComfyUI's default margin around a DOM widget (BaseDOMWidgetImpl.DEFAULT_MARGIN)
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
  // The box fills the space ComfyUI gives the widget: its height less the widget's margin above and below (a
  // fixed CSS height would overflow the node's bottom edge by the two margins).
  box.style.cssText = `width:100%;height:100%;box-sizing:border-box;font:11px/${LINE_PX}px monospace;` +
    "opacity:0.85;resize:none;overflow:auto;" +
    // the plan is a table (columns kept, scrolls sideways); statuses and errors wrap
    (nodeName === "ErnieImageLoader" ? "white-space:pre;" : "white-space:pre-wrap;");
  let shown = null;
  shown = node.addDOMWidget(name, "ernie_text", box, {
    getValue: () => box.value,
    setValue: (text) => { box.value = text; },
    getMinHeight: () => height + 2 * (shown?.margin ?? DOM_WIDGET_MARGIN),
    getMaxHeight: () => height + 2 * (shown?.margin ?? DOM_WIDGET_MARGIN),
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

// The saved values laid out as the node's current widgets, or null for a workflow in the current layout. Given to
// configure() itself: newer editors (1.58) apply widget values after onConfigure, which would undo a late fix.
function currentLayoutValues(node, layout, values) {
  if (!Array.isArray(values) || !layout.isLegacy(values)) return null;
  const saved = Object.fromEntries(layout.names.slice(0, values.length).map((name, i) => [name, values[i]]));
  const credentials = {
    credential: String(saved.api_key_env || saved.api_key_file || ""),
    pe_credential: String(saved.pe_api_key_env || saved.pe_api_key_file || ""),
  };
  // the workflow keeps every widget's value but those marked serialize: false (control_after_generate is kept:
  // its options.serialize only keeps it out of the queued prompt)
  return (node.widgets ?? []).filter((shown) => shown.serialize !== false)
    .map((shown) => (shown.name in credentials ? credentials[shown.name]
      : shown.name in saved ? saved[shown.name] : shown.value));
}

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

// Notes in this pack's templates are ComfyUI's Note; one whose properties name a font size (NOTE_FONT)
// shows its text at that size, so it reads at 11 px or more at the template's saved zoom (ComfyUI's note text is
// 10 px at zoom 1 whatever the zoom it was saved at). A note without the property is left as ComfyUI shows it.
const NOTE_FONT = "ErnieImage.font_px";
const NOTE_TYPES = new Set(["MarkdownNote", "Note"]);

function showNoteFont(node) {
  const px = Number(node.properties?.[NOTE_FONT]);
  if (!NOTE_TYPES.has(node.type) || !(px >= 6 && px <= 48)) return;
  for (const shown of node.widgets ?? []) {
    const element = shown.element ?? shown.inputEl;
    element?.style?.setProperty("--comfy-textarea-font-size", `${px}px`);
  }
}

// ComfyUI's template browser lists a custom node pack's templates by file name only (GET /workflow_templates
// gives names; the frontend makes each {name, title: name, description: name}). ComfyUI's own templates get
// their title, description, tags and models from an index.json; this pack's index, in the same schema, is
// TEMPLATE_INDEX below, and its entries are given to the browser's list of this pack's templates. (The frontend
// shows a description with '-' and '_' turned into spaces: the descriptions use neither.)
export const TEMPLATE_INDEX = [
  {
    "moduleName": "ernie_image",
    "title": "ERNIE-Image",
    "type": "image",
    "templates": [
      {
        "name": "ernie_image_turbo_local",
        "title": "ERNIE-Image Turbo Text to Image",
        "mediaType": "image",
        "mediaSubtype": "jpg",
        "description": "Text to image with the Turbo model in 8 steps. The Loader fits the model to your GPU: DiT blocks that do not fit stream from system RAM.",
        "tags": [
          "Text to Image",
          "Image"
        ],
        "models": [
          "ERNIE-Image-Turbo"
        ]
      },
      {
        "name": "ernie_image_turbo_12gb_budget",
        "title": "ERNIE-Image Turbo on a 12 GB GPU",
        "mediaType": "image",
        "mediaSubtype": "jpg",
        "description": "The 15 GB bf16 Turbo on a 12 GB card: the Loader plans every phase within the budget and streams DiT blocks from RAM; fp8 is picked on GPUs that run it fast.",
        "tags": [
          "Text to Image",
          "Image",
          "Low VRAM"
        ],
        "models": [
          "ERNIE-Image-Turbo"
        ]
      },
      {
        "name": "ernie_image_turbo_gguf",
        "title": "ERNIE-Image Turbo GGUF",
        "mediaType": "image",
        "mediaSubtype": "jpg",
        "description": "Text to image from a GGUF quantised Turbo (Q2 to Q8, about 5 GB at Q4), dequantised layer by layer on the GPU. No other custom nodes needed.",
        "tags": [
          "Text to Image",
          "Image",
          "GGUF",
          "Low VRAM"
        ],
        "models": [
          "ERNIE-Image-Turbo"
        ]
      },
      {
        "name": "ernie_image_turbo_hires_fix",
        "title": "ERNIE-Image Turbo Hires Fix",
        "mediaType": "image",
        "mediaSubtype": "jpg",
        "description": "Generate at 1024x1024, upscale to 2048x2048 and refine it with a second Turbo pass at denoise 0.4, inside a 12 GiB budget.",
        "tags": [
          "Text to Image",
          "Image",
          "Upscale"
        ],
        "models": [
          "ERNIE-Image-Turbo"
        ]
      },
      {
        "name": "ernie_image_turbo_img2img",
        "title": "ERNIE-Image Turbo Image to Image",
        "mediaType": "image",
        "mediaSubtype": "jpg",
        "description": "Redraw a picture from a prompt at denoise 0.6: lower keeps more of it. The picture decides the output size.",
        "tags": [
          "Image to Image",
          "Image"
        ],
        "models": [
          "ERNIE-Image-Turbo"
        ]
      },
      {
        "name": "ernie_image_turbo_inpaint",
        "title": "ERNIE-Image Turbo Inpainting",
        "mediaType": "image",
        "mediaSubtype": "jpg",
        "description": "Repaint the area you paint in Load Image's mask editor; outside the mask the original pixels are kept exactly.",
        "tags": [
          "Inpainting",
          "Image Edit",
          "Image"
        ],
        "models": [
          "ERNIE-Image-Turbo"
        ]
      },
      {
        "name": "ernie_image_turbo_two_loras",
        "title": "ERNIE-Image Turbo with Two LoRAs",
        "mediaType": "image",
        "mediaSubtype": "jpg",
        "description": "Stack two LoRAs (from the usual trainers, LyCORIS LoKr and LoHa too) on Turbo; changing a LoRA or its strength does not reload the model.",
        "tags": [
          "Text to Image",
          "Image",
          "LoRA"
        ],
        "models": [
          "ERNIE-Image-Turbo"
        ]
      },
      {
        "name": "ernie_image_base_prompt_enhancer",
        "title": "ERNIE-Image with Prompt Enhancer",
        "mediaType": "image",
        "mediaSubtype": "jpg",
        "description": "The base model at Baidu's settings (50 steps, CFG 4), its prompt first rewritten by the model's own prompt enhancer; the rewritten prompt is shown in the editor.",
        "tags": [
          "Text to Image",
          "Image",
          "LLM"
        ],
        "models": [
          "ERNIE-Image"
        ]
      },
      {
        "name": "ernie_image_base_step_cache",
        "title": "ERNIE-Image with Step Cache",
        "mediaType": "image",
        "mediaSubtype": "jpg",
        "description": "The base model with the Step Cache node beside the same seed without it: fewer DiT steps computed, and the two pictures side by side to judge the cache on your own weights.",
        "tags": [
          "Text to Image",
          "Image"
        ],
        "models": [
          "ERNIE-Image"
        ]
      },
      {
        "name": "ernie_image_remote_sglang",
        "title": "ERNIE-Image Turbo via SGLang",
        "mediaType": "image",
        "mediaSubtype": "jpg",
        "description": "No model files on this machine: one or more SGLang diffusion servers make the images, share a batch and fail over. Test connection checks them.",
        "tags": [
          "Text to Image",
          "Image",
          "Remote"
        ],
        "models": [
          "ERNIE-Image-Turbo"
        ]
      }
    ]
  }
];
const PACK_FOLDER = decodeURIComponent(new URL(import.meta.url).pathname.split("/").slice(-2)[0]);

function templatesStore() {
  const root = document.getElementById("vue-app") ?? document.querySelector("[data-v-app]");
  return root?.__vue_app__?.config?.globalProperties?.$pinia?._s?.get("workflowTemplates") ?? null;
}

function describeTemplate(template, known, module) {
  const info = known.get(template?.name);
  if (!info || module !== PACK_FOLDER || template.title === info.title) return;
  Object.assign(template, {
    title: info.title,
    description: info.description,
    tags: info.tags ?? [],
    models: info.models ?? [],
    searchableText: [info.title, info.description, ...(info.tags ?? []), ...(info.models ?? []), module].join(" "),
  });
}

function describeTemplates(store, known) {
  for (const template of store.enhancedTemplates ?? []) describeTemplate(template, known, template.sourceModule);
  for (const group of store.groupedTemplates ?? []) {
    for (const module of group.modules ?? []) {
      for (const template of module.templates ?? []) {
        describeTemplate(template, known, template.sourceModule ?? module.moduleName);
      }
    }
  }
}

async function giveTemplatesTheirTitles() {
  let store = templatesStore();
  for (let tries = 0; !store && tries < 50; tries++) {
    await new Promise((resolve) => setTimeout(resolve, 200));
    store = templatesStore();
  }
  if (!store?.loadWorkflowTemplates) return; // another frontend: its template browser keeps the file names
  const known = new Map(TEMPLATE_INDEX.flatMap((category) => category.templates).map((t) => [t.name, t]));
  const describe = () => describeTemplates(store, known);
  // The list is rebuilt when the templates are (re)loaded, e.g. for another language: describe each new list.
  store.$onAction?.(({ name, after }) => { if (name === "loadWorkflowTemplates") after(describe); });
  store.$subscribe?.(describe);
  await store.loadWorkflowTemplates(); // loaded now, so the browser never shows a list not yet described
  describe();
}

app.registerExtension({
  name: "ErnieImage.nodes",
  async setup() {
    giveTemplatesTheirTitles().catch((error) => console.warn("ERNIE-Image: template titles not shown:", error));
  },
  loadedGraphNode(node) {
    showNoteFont(node);
  },
  nodeCreated(node) {
    requestAnimationFrame(() => showNoteFont(node)); // a pasted or duplicated note keeps its size
  },
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
    if (SAMPLERS.has(name)) {
      const onNodeCreated = nodeType.prototype.onNodeCreated;
      nodeType.prototype.onNodeCreated = function () {
        const result = onNodeCreated?.apply(this, arguments);
        keepPromptsUsable(this);
        return result;
      };
      const onConnectionsChange = nodeType.prototype.onConnectionsChange;
      nodeType.prototype.onConnectionsChange = function () {
        const result = onConnectionsChange?.apply(this, arguments);
        showSizeWidgetsState(this);
        return result;
      };
      const onConfigure = nodeType.prototype.onConfigure;
      nodeType.prototype.onConfigure = function () {
        const result = onConfigure?.apply(this, arguments);
        showSizeWidgetsState(this); // a loaded workflow's links
        return result;
      };
    }
    if (LEGACY_LAYOUTS[name]) {
      const configure = nodeType.prototype.configure;
      nodeType.prototype.configure = function (info) {
        const values = currentLayoutValues(this, LEGACY_LAYOUTS[name], info?.widgets_values);
        return configure.call(this, values ? { ...info, widgets_values: values } : info);
      };
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
