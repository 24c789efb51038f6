// Shows the text a LingBot node sends with its result (the Memory Report, the fit check, warnings
// such as a prose prompt) in a read-only box on the node itself. ComfyUI delivers a node's `ui`
// text to the editor, but only nodes with their own display code show it; this is ours.
import { app } from "../../scripts/app.js";
import { ComfyWidgets } from "../../scripts/widgets.js";

const BOX = "lingbot_notes";
const WIDTH = 320; // a narrower node is widened to this (wider would overlap the shipped layouts)
const LINE_PX = 12; // the text box's line height (rows are counted at ~6.6 px per character, a little wide)
const MAX_ROWS = 24; // past this the box scrolls

// Rows the text takes in a box `width` pixels wide, wrapped lines counted.
function rows(text, width) {
  const perLine = Math.max(20, Math.floor((width - 30) / 6.6));
  return text.split("\n").reduce((n, line) => n + Math.max(1, Math.ceil(line.length / perLine)), 0);
}

function showText(node, lines) {
  let box = node.widgets?.find((w) => w.name === BOX);
  if (!box) {
    box = ComfyWidgets.STRING(node, BOX, ["STRING", { multiline: true }], app).widget;
    if (box.inputEl) {
      box.inputEl.readOnly = true;
      box.inputEl.style.opacity = 0.85;
    }
    box.serialize = false; // shown, never saved into the workflow's widget values ...
    box.options = {
      ...(box.options || {}),
      serialize: false, // ... nor sent as an input
      // tall enough to show the whole text (the frontend's default is two or three lines, which cut
      // a Memory Report or a warning off mid-sentence)
      getMinHeight: () => Math.min(MAX_ROWS, rows(String(box.value ?? ""), node.size[0])) * LINE_PX + 16,
    };
  }
  box.value = lines.join("\n");
  node.setSize?.([Math.max(node.size[0], WIDTH), node.computeSize()[1]]);
  node.setDirtyCanvas?.(true, true);
}

app.registerExtension({
  name: "lingbot.NodeText",
  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (!nodeData?.name?.startsWith("LingBot")) return;
    const previous = nodeType.prototype.onExecuted;
    nodeType.prototype.onExecuted = function (message) {
      previous?.apply(this, arguments);
      const text = message?.text;
      if (text && text.length) showText(this, Array.isArray(text) ? text.map(String) : [String(text)]);
    };
  },
});
