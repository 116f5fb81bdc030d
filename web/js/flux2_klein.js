// Klein frontend extension (FLUX.2 Klein and FLUX 3 Image Klein nodes): live prompt token count, width/height snapped to 16, one colour family.
// Served at /extensions/<pack folder>/js/flux2_klein.js, hence the three "../" to reach ComfyUI's scripts.
import { app } from "../../../scripts/app.js";
import { api } from "../../../scripts/api.js";
import { approxTokenCount, snapTo16, tokenLabel, MAX_TOKENS, TEMPLATE_TOKENS } from "./flux2_klein_tokens.js";

const PREFIX = "Flux2Klein";                       // every node id of this pack starts with this
const FAMILY = { color: "#3a3f6b", bgcolor: "#262a4d" };
const TEXT_WIDGETS = ["text", "prompt"];
const ENCODER_INPUT = "text_encoder";              // Prompt Encode's (and the LoRA node's) text encoder socket
const ENCODER_WIDGET = "text_encoder_name";        // the text encoder loader's file
const SIZE_WIDGETS = ["width", "height"];
// Exact counts: POST {text, text_encoder} -> {count, limit}, served when the server announces the feature flag
// below; text_encoder is the file the prompt's loader holds (its template and limit: FLUX.2's or FLUX 3's).
const TOKENS_ROUTE = "/flux2_klein/tokens";
const TOKENS_FEATURE = "flux2_klein_tokens";
// Workflows saved before the scheduler's width and height became sockets hold five widget values,
// [steps, width, height, schedule, rho]; it now has three widgets: the size values are dropped on load.
const SCHEDULER = "Flux2KleinScheduler";
const OLD_SCHEDULER_VALUES = ["number", "number", "number", "string", "number"];

// The exact templated token count and the encoder's limit from the server, or null (no such route on this
// server, or it failed).
async function serverCount(text, encoder) {
  if (!api.serverSupportsFeature?.(TOKENS_FEATURE)) return null;
  try {
    const response = await api.fetchApi(TOKENS_ROUTE, {
      method: "POST", headers: { "Content-Type": "application/json" },
      body: JSON.stringify(encoder ? { text, text_encoder: encoder } : { text }),
    });
    return response.ok ? await response.json() : null;
  } catch {
    return null;
  }
}

// The text encoder file the node's prompt is encoded with: up its text_encoder input (through LoRA nodes) to the
// loader's widget; null when nothing is connected.
function encoderFile(node) {
  let current = node;
  for (let hops = 0; current && hops < 16; hops++) {
    const widget = current.widgets?.find((w) => w.name === ENCODER_WIDGET);
    if (widget) return String(widget.value ?? "");
    const input = current.inputs?.find((i) => i.name === ENCODER_INPUT);
    // the node's own graph (a subgraph's inside one); never app.graph, which newer frontends refuse to hand out
    // before the app is set up, and a node not yet in a graph has no links anyway
    const graph = current.graph;
    const link = input?.link == null ? null : graph?.getLink?.(input.link) ?? graph?.links?.[input.link];
    current = link ? graph.getNodeById(link.origin_id) : null;
  }
  return null;
}

function snapSizeWidgets(node) {
  for (const widget of node.widgets ?? []) {
    if (!SIZE_WIDGETS.includes(widget.name) || widget.type !== "number") continue;
    widget.options.step2 = 16;                     // arrows and drags move by 16
    widget.options.step = 160;                     // litegraph's legacy step is 10x the increment
    const original = widget.callback;
    widget.callback = function (value, ...rest) {
      widget.value = snapTo16(value, widget.options.min, widget.options.max);
      return original?.call(this, widget.value, ...rest);
    };
  }
}

function trackTokens(node) {
  const widget = node.widgets?.find((w) => TEXT_WIDGETS.includes(w.name));
  if (!widget) return;
  let timer = null;
  const update = () => {
    const text = String(widget.value ?? "");
    const encoder = encoderFile(node);
    const known = node.flux2Tokens;
    if (known?.text === text && known?.encoder === encoder) return;
    const limit = known?.encoder === encoder ? known.limit : MAX_TOKENS;   // the last limit this encoder had
    const count = approxTokenCount(text) + TEMPLATE_TOKENS;
    node.flux2Tokens = { text, encoder, limit, count, exact: false, label: tokenLabel(count, false, limit),
                         over: count > limit };
    if (node.graph) node.setDirtyCanvas?.(true, false);
    clearTimeout(timer);
    timer = setTimeout(async () => {             // ask the server once typing pauses
      const answer = await serverCount(text, encoder);
      if (answer == null || node.flux2Tokens?.text !== text || node.flux2Tokens?.encoder !== encoder) return;
      const { count: exact, limit: exactLimit } = answer;
      node.flux2Tokens = { text, encoder, limit: exactLimit, count: exact, exact: true,
                           label: tokenLabel(exact, true, exactLimit), over: exact > exactLimit };
      if (node.graph) node.setDirtyCanvas?.(true, false);
    }, 300);
  };
  widget.inputEl?.addEventListener("input", update);   // the multiline textarea
  const original = widget.callback;
  widget.callback = function (...args) {
    const result = original?.apply(this, args);
    update();
    return result;
  };
  node.flux2UpdateTokens = update;
  // a node the frontend makes before its graph exists (while it registers the node types) counts once it is drawn
  // or configured: nothing here may reach for the app's graph before the app has one
  if (node.graph) update();
}

function schedulerValues(values) {
  const old = values?.length === OLD_SCHEDULER_VALUES.length
    && values.every((value, i) => typeof value === OLD_SCHEDULER_VALUES[i]);
  return old ? [values[0], values[3], values[4]] : values;
}

function drawTokens(node, ctx) {
  const info = node.flux2Tokens;
  if (!info || node.flags?.collapsed) return;
  if (info.encoder !== encoderFile(node)) node.flux2UpdateTokens?.();   // another encoder connected or picked
  ctx.save();
  ctx.font = "12px sans-serif";
  ctx.textAlign = "right";
  ctx.fillStyle = info.over ? "#ff6b6b" : "#a8b0d8";
  // in the title bar, right-aligned: the prompt's text box covers the whole body of the node
  const titleHeight = globalThis.LiteGraph?.NODE_TITLE_HEIGHT ?? 30;
  ctx.fillText((info.over ? "⚠ " : "") + info.label, node.size[0] - 10, -titleHeight / 2 + 4);
  ctx.restore();
}

app.registerExtension({
  name: "flux2_klein.ui",

  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (!nodeData.name?.startsWith(PREFIX)) return;
    const onNodeCreated = nodeType.prototype.onNodeCreated;
    nodeType.prototype.onNodeCreated = function (...args) {
      const result = onNodeCreated?.apply(this, args);
      this.color = FAMILY.color;
      this.bgcolor = FAMILY.bgcolor;
      snapSizeWidgets(this);
      trackTokens(this);
      return result;
    };
    if (nodeData.name === SCHEDULER) {
      const configure = nodeType.prototype.configure;
      nodeType.prototype.configure = function (info, ...args) {
        return configure.call(this, { ...info, widgets_values: schedulerValues(info.widgets_values) }, ...args);
      };
    }
    const onAdded = nodeType.prototype.onAdded;
    nodeType.prototype.onAdded = function (...args) {       // now in a graph: the first count
      const result = onAdded?.apply(this, args);
      this.flux2UpdateTokens?.();
      return result;
    };
    const onConfigure = nodeType.prototype.onConfigure;
    nodeType.prototype.onConfigure = function (...args) {   // a loaded workflow sets widget values afterwards
      const result = onConfigure?.apply(this, args);
      this.flux2UpdateTokens?.();
      return result;
    };
    const onDrawForeground = nodeType.prototype.onDrawForeground;
    nodeType.prototype.onDrawForeground = function (ctx, ...args) {
      const result = onDrawForeground?.call(this, ctx, ...args);
      this.flux2UpdateTokens?.();                   // catches values set without an event
      drawTokens(this, ctx);
      return result;
    };
  },

  async setup() {
    window.__FLUX2_KLEIN_LOADED__ = true;          // the browser tests wait for this
  },
});
