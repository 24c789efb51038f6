// Shows the text a LingBot node returns with its result (its `ui` text: the Memory Report, the fit check,
// a notice such as a prose prompt) on the node, read-only. ComfyUI sends a node's `ui` text to the
// editor, but the frontend puts it on a node only for its own text nodes (Preview Any, Save Text); this
// asks it to do the same for ours:
// - frontends that offer their text preview to extensions (`window.comfyAPI.textPreviewWidgets`, the box
//   Preview Any shows, in the classic and the Nodes 2.0 renderer) get that box;
// - older ones (1.27) a read-only multiline text box, through `window.comfyAPI.widgets`, made with the node
//   (hidden on the canvas while empty): 1.27's Nodes 2.0 renderer reads a node's widgets once, when the node
//   is added to the graph, and never draws a widget added later.
// Every run of a LingBot node sends its text, empty when it has nothing to say, so a notice of an earlier
// run is cleared. The box only ever grows its node: the user's widgets keep the height they had.
// Load Video's and Load Image's upload lists: the test pattern is not previewed as a missing file, and on
// 1.27's Nodes 2.0 the file an upload picks is drawn (below).
import { app } from "../../scripts/app.js";

const LABEL = "LingBot notes";
const OLD_BOX = LABEL; // the read-only box on frontends without a text preview for extensions (its name is
// the placeholder 1.27's Nodes 2.0 shows in it while empty)
// The nodes whose runs send text (the Python nodes returning `notices.on_node`): on frontends without a
// text preview for extensions they get their box when they are made.
const TEXT_NODES = new Set(["LingBotLoader", "LingBotOffload", "LingBotMemoryReport", "LingBotLoRA",
  "LingBotTextEncode", "LingBotRewrite", "LingBotDenoise", "LingBotRefine"]);
const WIDTH = 320; // a narrower node showing text is widened to this (wider would overlap the shipped layouts)
const MAX_ROWS = 24; // past this the box scrolls
const VUE_ROWS_PX = 24; // what Nodes 2.0 gives each added widget row beyond what the canvas counts (measured)

// A LingBot node added to the graph (from the search, the menu, a paste) starts wide enough for its title
// (with the badges the frontend draws beside it) and for each widget's label next to a part of its value
// or of its list's longest choice. Widths are measured with the canvas' own
// fonts; a node loaded from a workflow gets its saved size afterwards, so only new nodes change.
const VALUE_PX = 360; // a value up to this wide is kept in view in full (the classic canvas of 1.5x frontends
// hides a label whenever its value does not fit whole); a longer file name is cut and may hide its label
const MAX_NEW_WIDTH = 560; // a new node is never made wider than this
const TITLE_PAD = 90; // the title's left inset (its collapse dot) and the room the frontend keeps at its right
const WIDGET_PAD = 100; // a widget's margins, the gap between label and value, a combo's two arrows
const BADGE_PAD = 20; // a badge's own padding and the gap before it

let measurer = null;
function textPx(text, font) {
  measurer ??= document.createElement("canvas").getContext("2d");
  if (!measurer) return String(text ?? "").length * 8;
  measurer.font = font;
  return measurer.measureText(String(text ?? "")).width;
}

function badgeTexts(node) {
  return (node.badges ?? []).map((b) => (typeof b === "function" ? b() : b)?.text).filter((t) => t);
}

// The width a new node needs for its title and its widgets' labels.
function fitWidth(node) {
  const LG = window.LiteGraph ?? {};
  const family = LG.NODE_FONT ?? "Arial";
  const titleFont = `${LG.NODE_TEXT_SIZE ?? 14}px ${family}`;
  const widgetFont = `${LG.NODE_SUBTEXT_SIZE ?? 12}px ${family}`;
  const badges = badgeTexts(node).reduce((sum, t) => sum + textPx(t, widgetFont) + BADGE_PAD, 0);
  let need = textPx(node.title, titleFont) + TITLE_PAD + badges;
  for (const w of node.widgets ?? []) {
    if (w.type === "converted-widget" || w.hidden) continue;
    // a list's longest choice (a file name the user may pick), else the value it holds
    const choices = Array.isArray(w.options?.values) ? w.options.values : [w.value];
    const value = Math.max(0, ...choices.filter((c) => typeof c === "string" || typeof c === "number")
      .map((c) => textPx(c, widgetFont)));
    const label = textPx(w.label ?? w.name, widgetFont);
    need = Math.max(need, label + Math.min(VALUE_PX, value) + WIDGET_PAD);
  }
  return Math.min(MAX_NEW_WIDTH, Math.ceil(need));
}

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

// Whether a widget other than the notes box takes a share of the node's room beyond its smallest height (a
// text box of no fixed height, such as Text Encode's prompt; an image preview): the frontend gives such
// widgets whatever room the node has past its content.
function sharesRoom(node, box) {
  return (node.widgets ?? []).some((w) => {
    if (w === box || w.hidden || typeof w.computeLayoutSize !== "function") return false;
    const size = w.computeLayoutSize(node);
    return !!size && (size.maxHeight == null || size.maxHeight > (size.minHeight ?? 0));
  });
}

// The node grows by what the change of its box added to its smallest height, so the widgets above keep
// the height the user saw (both renderers share a node's height among its text boxes); it never shrinks.
// On the canvas, a node where nothing else takes a share of its room (Denoise) first fills the room it had
// below its widgets (a shipped node is saved taller than the canvas draws it) and grows only past that.
// A node narrower than WIDTH that shows text is widened to it.
function grow(node, before, text, added, box) {
  if (text && node.size[0] < WIDTH) node.setSize?.([WIDTH, node.size[1]]); // first: the box's height needs it
  const fits = node.computeSize?.() ?? node.size;
  const width = Math.max(node.size[0], fits[0]);
  const vue = !!window.LiteGraph?.vueNodesMode;
  // Nodes 2.0 gives a row more room than the canvas' sizes count (its gaps, its taller switch)
  const rows = added && vue ? VUE_ROWS_PX * added : 0;
  const spare = vue || sharesRoom(node, box) ? 0 : Math.max(0, node.size[1] - before);
  const height = Math.max(node.size[1] + Math.max(0, fits[1] - before - spare) + rows, fits[1]);
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
  grow(node, before, text, (node.widgets?.length ?? 0) - widgets, box);
}

function hostPreview() {
  const preview = window.comfyAPI?.textPreviewWidgets;
  return preview?.addTextPreviewWidgets && preview?.updateTextPreviewWidgets ? preview : null;
}

// The read-only box of frontends without a text preview for extensions, empty and hidden (on the canvas).
function makeOldBox(node) {
  const make = window.comfyAPI?.widgets?.ComfyWidgets;
  if (!make?.STRING) return null;
  const box = make.STRING(node, OLD_BOX, ["STRING", { multiline: true }], app).widget;
  box.label = LABEL;
  box.serialize = false; // shown, never saved into the workflow's widget values ...
  box.hidden = true; // no room on the canvas until there is text (Nodes 2.0 of 1.27 shows it, empty)
  box.options = {
    ...(box.options || {}),
    serialize: false, // ... nor sent as an input
    read_only: true,
    // 1.27's Nodes 2.0 passes a text box's options on to its textarea: read-only, as tall as its text
    readonly: true,
    autoResize: true,
    // as tall as its text and no share of the node's rest; no room at all while hidden (the canvas of 1.27
    // lays out hidden text boxes too)
    getMinHeight: () => (box.hidden ? 0 : fitHeight(box.value, node.size[0], 6.6, 12, 36)),
    getMaxHeight: () => (box.hidden ? 0 : fitHeight(box.value, node.size[0], 6.6, 12, 36)),
  };
  const el = box.element ?? box.inputEl;
  if (el) {
    el.readOnly = true;
    el.placeholder = LABEL;
    el.style.opacity = 0.85;
  }
  return box;
}

// 1.27's Nodes 2.0 learns a widget's new value through the widget's callback, but draws a widget's value only
// when it draws the node's body: a value set by code (a run's text, the file an upload picked) is not shown.
// When the node's element does not show it after the renderer's update (`shows`, given the element), the node
// is folded and unfolded, which draws it anew. Newer renderers show the value at once: nothing is done there.
function redrawIfStale(node, shows) {
  if (!window.LiteGraph?.vueNodesMode) return;
  setTimeout(() => {
    const el = [...document.querySelectorAll(`[data-node-id="${node.id}"]`)].find((e) => e.querySelectorAll
      && !e.parentElement?.closest?.(`[data-node-id="${node.id}"]`)); // the node's own element, not a part of it
    if (!el || shows(el) || node.flags?.collapsed || !node.graph) return;
    node.collapse?.(true);
    setTimeout(() => node.flags?.collapsed && node.collapse?.(true), 0);
  }, 0);
}

// The notes box (found by its placeholder) holds `text`; true when the page shows no such box.
function showsText(text) {
  return (el) => {
    const box = [...el.querySelectorAll("textarea")].find((t) => t.placeholder === OLD_BOX);
    return !box || box.value === text;
  };
}

// A list (the frontend's select) shows `value`; true when the page shows no list.
function showsChoice(value) {
  return (el) => {
    const labels = [...el.querySelectorAll(".p-select-label")];
    return !labels.length || labels.some((l) => l.textContent.trim() === String(value));
  };
}

// The first choice of Load Video's and Load Image's file lists (nodes/image_input.py): no file, so nothing to
// preview.
const TEST_PATTERN = "(test pattern)";

// A node with an upload button (Load Video, Load Image): the file the upload picks is drawn on 1.27's Nodes 2.0.
// The upload there passes the list of uploaded files to the callback, which that renderer keeps as the value it
// draws (no choice matches a list): the file the widget now holds is passed once more, as a choice is.
// Newer frontends preview the chosen file under Nodes 2.0 and showed "Video failed to load" for the test
// pattern (no such file): the node's previews are hidden while its list holds the test pattern or nothing.
function watchUploads(node) {
  if (!node.widgets?.some((w) => w.type === "button")) return;
  const lists = node.widgets.filter((x) => x.type === "combo");
  Object.defineProperty(node, "hideOutputImages", {
    configurable: true,
    get: () => lists.some((w) => !w.value || w.value === TEST_PATTERN),
    set: () => {},
  });
  for (const w of lists) {
    const previous = w.callback;
    w.callback = function (value) {
      const out = previous?.apply(this, arguments);
      if (window.LiteGraph?.vueNodesMode && Array.isArray(value) && typeof w.value === "string") {
        setTimeout(() => w.callback?.(w.value), 0);
      } else redrawIfStale(node, showsChoice(w.value));
      return out;
    };
  }
}

function oldBox(node, text) {
  const vue = !!window.LiteGraph?.vueNodesMode; // that renderer sizes a node from what it holds
  const before = vue ? 0 : minHeight(node);
  let box = node.widgets?.find((w) => w.name === OLD_BOX);
  if (!box) {
    if (!text) return;
    box = makeOldBox(node);
    if (!box) return;
  }
  box.value = text;
  box.hidden = !text;
  box.callback?.(text); // how Nodes 2.0 (1.27) hears of it; the box has no callback of its own
  if (vue) redrawIfStale(node, showsText(text));
  else grow(node, before, text, 0, box);
}

app.registerExtension({
  name: "lingbot.NodeText",
  nodeCreated(node) {
    if (!node?.comfyClass?.startsWith?.("LingBot") || !node.size) return;
    const width = fitWidth(node);
    if (width > node.size[0]) node.setSize?.([width, node.size[1]]);
    if (TEXT_NODES.has(node.comfyClass) && !hostPreview()) makeOldBox(node);
    watchUploads(node);
  },
  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (!nodeData?.name?.startsWith("LingBot")) return;
    const previous = nodeType.prototype.onExecuted;
    nodeType.prototype.onExecuted = function (message) {
      previous?.apply(this, arguments);
      if (!message || !("text" in message)) return;
      const text = joined(message.text);
      const preview = hostPreview();
      if (preview) hostBox(this, preview, text);
      else oldBox(this, text);
    };
  },
});
