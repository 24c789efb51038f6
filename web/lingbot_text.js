// Shows the text a LingBot node sends with its result (the Memory Report, the fit check, warnings
// such as a prose prompt) in a read-only box on the node itself. ComfyUI delivers a node's `ui`
// text to the editor, but only nodes with their own display code show it; this is ours.
import { app } from "../../scripts/app.js";
import { ComfyWidgets } from "../../scripts/widgets.js";

const BOX = "lingbot_notes";

function showText(node, lines) {
  let box = node.widgets?.find((w) => w.name === BOX);
  if (!box) {
    box = ComfyWidgets.STRING(node, BOX, ["STRING", { multiline: true }], app).widget;
    if (box.inputEl) {
      box.inputEl.readOnly = true;
      box.inputEl.style.opacity = 0.85;
    }
    box.serialize = false; // shown, never saved into the workflow's widget values ...
    box.options = { ...(box.options || {}), serialize: false }; // ... nor sent as an input
  }
  box.value = lines.join("\n");
  node.setSize?.([Math.max(node.size[0], 320), node.computeSize()[1]]);
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
