// Shows the text a LingBot node returns with its result (its `ui` text: the Memory Report, the fit check,
// a notice such as a prose prompt) on the node, read-only. ComfyUI sends a node's `ui` text to the
// editor, but the frontend puts it on a node only for its own text nodes (Preview Any, Save Text); this
// asks it to do the same for ours:
// - frontends that offer their text preview to extensions (`window.comfyAPI.textPreviewWidgets`, the box
//   Preview Any shows, in the classic and the Nodes 2.0 renderer) get that box;
// - older ones (1.27) a read-only multiline text box, through `window.comfyAPI.widgets`.
// Every run of a LingBot node sends its text, empty when it has nothing to say, so a notice of an earlier
// run is cleared. The box only ever grows its node: the user's widgets keep the height they had.
import { app } from "../../scripts/app.js";

const LABEL = "LingBot notes";
const OLD_BOX = "lingbot_notes"; // the read-only box on frontends without a text preview for extensions
const WIDTH = 320; // a narrower node showing text is widened to this (wider would overlap the shipped layouts)
const MAX_ROWS = 24; // past this the box scrolls
const VUE_ROWS_PX = 24; // what Nodes 2.0 gives each added widget row beyond what the canvas counts (measured)

function joined(text) {
  return (Array.isArray(text) ? text : [text]).filter((t) => t != null).map(String).join("\n");
}

// The height a box needs for `text` at the node's width: rows counted with wrapped lines (at `charPx`
// a character, a little wide), `linePx` each, up to MAX_ROWS, plus the box's padding.
function fitHeight(text, width, charPx, linePx, padPx) {
  const perLine = Math.max(20, Math.floor((width - 40) / charPx));
  const rows = String(text ?? "").split("\n").reduce((n, line) => n + Math.max(1, Math.ceil(line.length / perLine)), 0);
  return Math.min(MAX_ROWS, rows) * linePx + padPx;
}

// The node's smallest height (its widgets at their smallest), to see what a change of its box adds.
function minHeight(node) {
  return node.computeSize?.()[1] ?? node.size[1];
}

// The node grows by what the change of its box added to its smallest height, so the widgets above keep
// the height the user saw (both renderers share a node's height among its text boxes); it never shrinks.
// A node narrower than WIDTH that shows text is widened to it.
function grow(node, before, text, added) {
  if (text && node.size[0] < WIDTH) node.setSize?.([WIDTH, node.size[1]]); // first: the box's height needs it
  const fits = node.computeSize?.() ?? node.size;
  const width = Math.max(node.size[0], fits[0]);
  // Nodes 2.0 gives a row more room than the canvas' sizes count (its gaps, its taller switch)
  const rows = added && window.LiteGraph?.vueNodesMode ? VUE_ROWS_PX * added : 0;
  const height = Math.max(node.size[1] + Math.max(0, fits[1] - before) + rows, fits[1]);
  if (width !== node.size[0] || height !== node.size[1]) node.setSize?.([width, height]);
  node.setDirtyCanvas?.(true, true);
}

function hostBox(node, preview, text) {
  const before = minHeight(node);
  const widgets = node.widgets?.length ?? 0;
  let box = node.widgets?.find((w) => w.name === "preview_text");
  if (!box) {
    if (!text) return; // nothing to say and no box yet: add none
    preview.addTextPreviewWidgets(node);
    box = node.widgets?.find((w) => w.name === "preview_text");
    if (!box) return;
    box.label = LABEL;
    const mode = node.widgets?.find((w) => w.name === "preview_mode"); // its Plain text / Markdown switch
    if (mode) mode.label = "notes as";
    // the frontend's box is three lines high whatever it holds: as tall as the text instead, up to the
    // box's own limit (200 px of text, then it scrolls)
    const fit = () => Math.min(240, fitHeight(box.value, node.size[0], 7, 16, 36));
    box.options = { ...(box.options || {}), getMinHeight: fit, getMaxHeight: fit }; // no share of the rest
  }
  preview.updateTextPreviewWidgets(node, { text: [text] });
  grow(node, before, text, (node.widgets?.length ?? 0) - widgets);
}

function oldBox(node, text) {
  const before = minHeight(node);
  const widgets = node.widgets?.length ?? 0;
  let box = node.widgets?.find((w) => w.name === OLD_BOX);
  if (!box) {
    const make = window.comfyAPI?.widgets?.ComfyWidgets;
    if (!text || !make?.STRING) return;
    box = make.STRING(node, OLD_BOX, ["STRING", { multiline: true }], app).widget;
    box.label = LABEL;
    box.serialize = false; // shown, never saved into the workflow's widget values ...
    box.options = {
      ...(box.options || {}),
      serialize: false, // ... nor sent as an input
      read_only: true,
      getMinHeight: () => fitHeight(box.value, node.size[0], 6.6, 12, 36),
      getMaxHeight: () => fitHeight(box.value, node.size[0], 6.6, 12, 36), // no share of the node's rest
    };
    const el = box.element ?? box.inputEl;
    if (el) {
      el.readOnly = true;
      el.placeholder = LABEL;
      el.style.opacity = 0.85;
    }
  }
  box.value = text;
  grow(node, before, text, (node.widgets?.length ?? 0) - widgets);
}

app.registerExtension({
  name: "lingbot.NodeText",
  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (!nodeData?.name?.startsWith("LingBot")) return;
    const previous = nodeType.prototype.onExecuted;
    nodeType.prototype.onExecuted = function (message) {
      previous?.apply(this, arguments);
      if (!message || !("text" in message)) return;
      const text = joined(message.text);
      const preview = window.comfyAPI?.textPreviewWidgets;
      if (preview?.addTextPreviewWidgets && preview?.updateTextPreviewWidgets) hostBox(this, preview, text);
      else oldBox(this, text);
    };
  },
});
