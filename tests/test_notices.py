"""Saying what runs: weight format and compute dtype per component (log and Memory Report), weight
files that are not used, few-step recipes without their LoRA/student, a real model on the CPU, and
the text nodes show on themselves in the editor."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lingbot_core import notices
from lingbot_core.handle import PipelineHandle
from lingbot_core.placement.door import memory_report

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _fresh_notices(monkeypatch):
    monkeypatch.setattr(notices, "_said", set())


def test_report_and_log_say_the_weight_format_and_compute_dtype(fixtures_root, caplog):
    folder = fixtures_root / "models" / "tiny-dense"
    plain = PipelineHandle.open(folder, device="cpu")
    fp8 = PipelineHandle.open(folder, device="cpu", weights="fp8_e4m3")
    with caplog.at_level(logging.INFO, logger="lingbot_core.weights"):
        plain.shared.get("transformer")
        fp8.shared.get("transformer")
    loaded = [r.getMessage() for r in caplog.records if r.getMessage().startswith("loaded transformer")]
    assert loaded == ["loaded transformer: fp32 weights, computes in fp32",
                      "loaded transformer: fp8_e4m3 + fp32 weights, computes in fp32"]
    plain_row = next(c for c in memory_report(plain).components if c.name == "transformer")
    fp8_row = next(c for c in memory_report(fp8).components if c.name == "transformer")
    assert (plain_row.stored, plain_row.compute) == ("fp32", "fp32")
    assert (fp8_row.stored, fp8_row.compute) == ("fp8_e4m3 + fp32", "fp32")
    assert "[fp8_e4m3 + fp32, computes fp32]" in str(memory_report(fp8))
    assert "transformer: " in memory_report(fp8).one_line() and "computes fp32" in memory_report(fp8).one_line()
    vae = next(c for c in memory_report(plain).components if c.name == "vae")
    assert vae.format == "" and vae.where == "not loaded"


def test_a_weight_file_beside_the_plain_weights_is_named(fixtures_root, tmp_path, caplog):
    source = fixtures_root / "models" / "tiny-dense"
    folder = tmp_path / "ckpt"
    folder.mkdir()
    for entry in source.iterdir():
        if entry.name != "transformer":
            os.symlink(entry, folder / entry.name)
    (folder / "transformer").mkdir()
    for entry in (source / "transformer").iterdir():
        os.symlink(entry, folder / "transformer" / entry.name)
    (folder / "transformer" / "lingbot-q4_0.gguf").write_bytes(b"GGUF")  # never read: only named
    with caplog.at_level(logging.WARNING, logger="lingbot_core.weights"):
        PipelineHandle.open(folder, device="cpu")
    text = caplog.text
    assert "lingbot-q4_0.gguf beside it is NOT used" in text and "diffusion_pytorch_model.safetensors" in text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lingbot_core.weights"):
        PipelineHandle.open(source, device="cpu")
    assert "NOT used" not in caplog.text


def _real(folder="ckpt", student=False, loras=(), variant="moe", has_refiner=True, layout_folder=True):
    source = SimpleNamespace(config_dir=Path(folder) / "transformer" if layout_folder else None)
    info = SimpleNamespace(transformer_config={"hidden_size": 2048}, folder=folder, variant=variant,
                           has_refiner=has_refiner, sources={"transformer": source})
    shared = SimpleNamespace(info=info, transformer_source=("x", "transformer") if student else None)
    from lingbot_core.lora import LoraStack

    return SimpleNamespace(shared=shared, view_states=(LoraStack(tuple(loras)),) if loras else ())


def test_few_step_recipes_without_their_lora_or_student_say_so(caplog):
    with caplog.at_level(logging.WARNING, logger="lingbot_core.notices"):
        dmd = notices.few_step_notice(_real(), "dmd_student", 8, 1.0, 3.0)
        again = notices.few_step_notice(_real(), "dmd_student", 8, 1.0, 3.0)
    assert dmd and "transformer_path" in dmd and "refiner/" in dmd and again == dmd
    assert len([r for r in caplog.records if "dmd_student" in r.getMessage()]) == 1  # logged once, shown each run
    dense = notices.few_step_notice(_real(variant="dense", has_refiner=False), "dmd_student", 8, 1.0, 3.0)
    assert dense and "no dense student is published" in dense
    four = notices.few_step_notice(_real(), "flow_unipc", 4, 1.0)
    assert four and "LightLingBot" in four and "40 steps" in four and notices.STUDENT_RELEASE in four
    assert notices.few_step_notice(_real(student=True), "dmd_student", 8, 1.0, 3.0) is None
    assert notices.few_step_notice(_real(has_refiner=False), "dmd_student", 8, 1.0, 3.0) is None  # the release root
    assert notices.few_step_notice(_real(loras=[object()]), "flow_unipc", 4, 1.0) is None
    assert notices.few_step_notice(_real(), "flow_unipc", 40, 3.0) is None
    tiny = _real()
    tiny.shared.info.transformer_config = {"hidden_size": 32}
    assert notices.few_step_notice(tiny, "dmd_student", 8, 1.0) is None  # the tiny workflows run as shipped


def test_a_student_off_its_recipe_is_told_the_recipe():
    """A declared student (transformer_path) on the base recipe, and dmd_student off its own recipe
    (cfg > 1, other steps or shift), get the recipe on the node; the recipe comes from the sampler."""
    recipe = notices.student_recipe()
    assert recipe["sampler"] == "dmd_student" and recipe["steps"] == 8 and recipe["guidance_scale"] == 1.0
    base = notices.few_step_notice(_real(student=True), "flow_unipc", 40, 3.0, 3.0)
    assert base and "transformer_path" in base and "sampler dmd_student, 8 steps, cfg 1, shift 3" in base
    assert notices.few_step_notice(_real(student=True), "flow_unipc", 8, 3.0, 3.0)  # cfg > 1 alone
    release = _real(has_refiner=False)
    cfg = notices.few_step_notice(release, "dmd_student", 8, 3.0, 3.0)
    assert cfg and "cfg 3" in cfg and "twice" in cfg
    steps = notices.few_step_notice(release, "dmd_student", 40, 1.0, 3.0)
    assert steps and "40 steps" in steps and "8 steps" in steps
    assert notices.few_step_notice(release, "dmd_student", 8, 1.0, 5.0)  # shift off the grid


def test_a_folder_laid_out_like_the_student_release_gets_a_hint_that_says_why():
    """No refiner/ in a MoE folder is the release's layout, not proof: the hint names what it saw,
    and a folder given as single files (no layout) or a base with its refiner gets none."""
    hint = notices.few_step_notice(_real(has_refiner=False), "flow_unipc", 40, 3.0, 3.0)
    assert hint and "without refiner/" in hint and notices.STUDENT_RELEASE in hint and "ignore this" in hint
    assert notices.few_step_notice(_real(has_refiner=False, layout_folder=False), "flow_unipc", 40, 3.0) is None
    assert notices.few_step_notice(_real(has_refiner=True), "flow_unipc", 40, 3.0) is None
    assert notices.few_step_notice(_real(has_refiner=False, variant="dense"), "flow_unipc", 40, 3.0) is None


def test_a_real_model_on_the_cpu_warns_once_with_the_likely_reason(monkeypatch, caplog):
    info = SimpleNamespace(transformer_config={"hidden_size": 2048}, folder="models/lingbot_video/dense")
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with caplog.at_level(logging.WARNING, logger="lingbot_core.notices"):
        first = notices.cpu_notice(info, torch.device("cpu"))
        notices.cpu_notice(info, torch.device("cpu"))
    assert "runs on the CPU" in first and "CUDA 13.0" in first and "driver" in first
    assert "'dense'" in first and "models/lingbot_video" not in first  # the name, never the server's path
    assert len(caplog.records) == 1
    assert notices.cpu_notice(info, torch.device("cuda")) is None
    assert notices.cpu_notice(SimpleNamespace(transformer_config={"hidden_size": 64}, folder="t"), "cpu") is None


def test_text_encode_shows_the_prose_notice_on_the_node(fixtures_root):
    from lingbot_nodes.conditioning import PROSE_NOTICE, LingBotTextEncode

    handle = PipelineHandle.open(fixtures_root / "models" / "tiny-dense", device="cpu")
    out = LingBotTextEncode.execute(handle, "a boat on a canal", encode_negative=False)
    assert out.ui.as_dict() == {"text": (PROSE_NOTICE,)}
    out = LingBotTextEncode.execute(handle, '{"comprehensive_description": {"scene_content_description": "x"}}',
                                    encode_negative=False)
    # nothing to say: the node still sends its (empty) text, which clears the earlier run's notice
    assert out.ui.as_dict() == {"text": ("",)}


def test_the_editor_shows_node_text_for_every_pack_node():
    """web/lingbot_text.js puts a node's `ui` text on the node; it is served (WEB_DIRECTORY) and its
    filter matches every node the pack registers."""
    from lingbot_nodes import NODE_CLASS_MAPPINGS

    init = (ROOT / "__init__.py").read_text()
    folder = re.search(r'WEB_DIRECTORY = "\./(\w+)"', init).group(1)
    script = (ROOT / folder / "lingbot_text.js").read_text()
    prefix = re.search(r'startsWith\("(\w+)"\)', script).group(1)
    assert NODE_CLASS_MAPPINGS and all(name.startswith(prefix) for name in NODE_CLASS_MAPPINGS)
    assert "onExecuted" in script and "message.text" in script
    # the frontend's own text box where it offers one to extensions; no internal module imported (frontends
    # from 1.3x log each import of scripts/widgets.js as a use of an internal module)
    assert "comfyAPI?.textPreviewWidgets" in script
    imports = re.findall(r'^import .* from "([^"]+)";', script, flags=re.M)
    assert imports == ["../../scripts/app.js"]


@pytest.mark.skipif(shutil.which("node") is None, reason="needs Node.js to run the editor script")
def test_a_new_lingbot_node_is_widened_to_its_title_and_labels():
    """web/lingbot_text.js widens a LingBot node when it is created (from the search, the menu) so its title and
    each widget label fit next to its longest choice (up to a limit); wider nodes and other packs' are left alone.
    Run in Node.js with a fake canvas that measures 7 px a character."""
    script = (ROOT / "web" / "lingbot_text.js").read_text()
    script = re.sub(r'^import .*;$', "", script, flags=re.M).replace("app.registerExtension(", "globalThis.ext = (")
    harness = """
globalThis.window = {LiteGraph: {NODE_FONT: "Arial", NODE_TEXT_SIZE: 14, NODE_SUBTEXT_SIZE: 12}};
globalThis.document = {createElement: () => ({getContext: () => ({measureText: (t) => ({width: 7 * t.length})})})};
const app = {};
/* the script */
const make = (type, title, widgets, width) => ({comfyClass: type, title, widgets, size: [width, 100],
  setSize(s) { this.size = s; }});
const file = "a".repeat(40);
const report = make("LingBotMemoryReport", "LingBot Memory Report", [], 197);
const files = make("LingBotLoaderFiles", "Loader", [{name: "text_encoder", value: "(from checkpoint)",
  options: {values: ["(from checkpoint)", file]}}], 270);
const wide = make("LingBotLoaderFiles", "Loader", [], 900);
const other = make("KSampler", "A very long title of another pack's node here", [], 100);
for (const n of [report, files, wide, other]) globalThis.ext.nodeCreated(n);
console.log(JSON.stringify([report.size[0], files.size[0], wide.size[0], other.size[0]]));
""".replace("/* the script */", script)
    out = subprocess.run(["node", "--input-type=module", "-e", harness], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    report, files, wide, other = json.loads(out.stdout)
    assert report >= 7 * len("LingBot Memory Report") + 40  # the title and the node's insets
    assert files >= 7 * (len("text_encoder") + 40) + 40  # the label beside the whole file name
    assert (wide, other) == (900, 100)


def _text_nodes_in_script(script: str) -> set[str]:
    block = re.search(r"const TEXT_NODES = new Set\(\[(.*?)\]\);", script, flags=re.S).group(1)
    return set(re.findall(r'"(\w+)"', block))


def test_the_nodes_that_get_a_box_when_made_are_the_nodes_whose_runs_send_text():
    """On frontends without a text preview for extensions (1.27) web/lingbot_text.js makes the notes box with
    the node, for the node types whose runs send text: every class whose `execute` returns `on_node(...)`."""
    import inspect

    from lingbot_nodes import NODE_CLASS_MAPPINGS

    script = (ROOT / "web" / "lingbot_text.js").read_text()
    senders = {name for name, cls in NODE_CLASS_MAPPINGS.items() if "on_node(" in inspect.getsource(cls.execute)}
    assert senders and _text_nodes_in_script(script) == senders


@pytest.mark.skipif(shutil.which("node") is None, reason="needs Node.js to run the editor script")
def test_on_an_old_frontend_the_notes_box_is_made_with_the_node_and_updated_in_both_renderers():
    """Frontend 1.27 (no text preview for extensions): the box is made when the node is (its Nodes 2.0 renderer
    draws no widget added later), hidden and taking no room on the canvas while empty, read-only, never saved;
    a run's text shows it and is passed through the widget's callback (how that renderer hears of a value);
    an empty text empties and hides it again, the node keeping its size. Under Nodes 2.0, a box the page still
    shows with the old text gets its node folded and unfolded (drawn anew), as does a Load Video whose list does
    not show the file an upload picked (one that shows it is left alone; the list of files 1.27's upload passes
    is followed by the file itself); its preview is hidden while the list holds the test pattern (no file to
    show: newer frontends showed "Video failed to load"). Run in Node.js with fakes."""
    script = (ROOT / "web" / "lingbot_text.js").read_text()
    script = re.sub(r'^import .*;$', "", script, flags=re.M).replace("app.registerExtension(", "globalThis.ext = (")
    harness = """
const shown = [], labels = [];  // the textareas and list labels the fake page shows in the node
globalThis.window = {LiteGraph: {NODE_FONT: "Arial", NODE_TEXT_SIZE: 14, NODE_SUBTEXT_SIZE: 12}, comfyAPI: {widgets: {
  ComfyWidgets: {STRING: (node, name) => {
    const widget = {name, value: "", options: {}, inputEl: {style: {}}, type: "customtext"};
    node.widgets.push(widget);
    return {widget};
  }}}}};
globalThis.document = {createElement: () => ({getContext: () => ({measureText: (t) => ({width: 7 * t.length})})}),
  querySelectorAll: () => [{querySelectorAll: (sel) => (sel === "textarea" ? shown : labels)}]};
const app = {};
/* the script */
const calls = [];
// Text Encode's prompt: a text box of no fixed height, which takes a share of the node's room
const prompt = () => ({name: "prompt", type: "customtext", computeLayoutSize: () => ({minHeight: 60})});
const notes = (node) => node.widgets.find((w) => w.name === "LingBot notes");
const make = (type) => {
  const node = {comfyClass: type, title: type, id: 7, graph: {}, flags: {}, size: [400, 300], widgets: [prompt()],
    setSize(s) { this.size = s; }, computeSize() { return [300, 100 + (notes(this).hidden ? 0 : 60)]; },
    setDirtyCanvas() {}, collapse() { this.flags.collapsed = !this.flags.collapsed; calls.push("collapse"); }};
  globalThis.ext.nodeCreated(node);
  return node;
};
const proto = {};
await globalThis.ext.beforeRegisterNodeDef({prototype: proto}, {name: "LingBotTextEncode"});
const other = make("LingBotCaption");
const node = make("LingBotTextEncode");
const box = notes(node);
const made = {other: other.widgets.length - 1, name: box.name, label: box.label, hidden: box.hidden,
  serialize: box.serialize, sent: box.options.serialize, readOnly: box.inputEl.readOnly, attr: box.options.readonly,
  room: box.options.getMinHeight()};
box.callback = (v) => calls.push("callback:" + v);
proto.onExecuted.call(node, {text: ["The prompt is plain prose"]});
const said = {value: box.value, hidden: box.hidden, size: [...node.size], room: box.options.getMinHeight() > 0};
proto.onExecuted.call(node, {text: [""]});
const cleared = {value: box.value, hidden: box.hidden, size: [...node.size]};
window.LiteGraph.vueNodesMode = true;
shown.push({placeholder: "LingBot notes", value: ""});
proto.onExecuted.call(node, {text: ["again"]});
await new Promise((r) => setTimeout(r, 20));
// an upload combo (Load Video): the file an upload picks, not drawn yet, is drawn; one already drawn is left
const video = {comfyClass: "LingBotLoadVideo", title: "v", id: 8, graph: {}, flags: {}, size: [400, 300],
  widgets: [{name: "path", type: "combo", value: "(test pattern)", options: {values: ["(test pattern)"]}},
            {name: "upload", type: "button", value: "image"}],
  setSize(s) { this.size = s; }, collapse() { this.flags.collapsed = !this.flags.collapsed; calls.push("fold"); }};
globalThis.ext.nodeCreated(video);
const path = video.widgets[0];
const previews = [video.hideOutputImages];  // the test pattern: no file to preview
labels.push({textContent: "(test pattern)"});
path.value = "clip.mp4";
previews.push(video.hideOutputImages);
path.callback("clip.mp4");
await new Promise((r) => setTimeout(r, 20));
labels[0].textContent = "clip.mp4";
path.callback("clip.mp4");
await new Promise((r) => setTimeout(r, 20));
// 1.27's upload passes the list of uploaded files: the file the widget holds is passed again, then drawn
path.value = "b.mp4";
path.callback(["b.mp4"]);
await new Promise((r) => setTimeout(r, 40));
console.log(JSON.stringify({made, said, cleared, calls, collapsed: node.flags.collapsed, video: video.flags.collapsed,
  previews}));
""".replace("/* the script */", script)
    out = subprocess.run(["node", "--input-type=module", "-e", harness], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["made"] == {"other": 0, "name": "LingBot notes", "label": "LingBot notes", "hidden": True,
                           "serialize": False, "sent": False, "readOnly": True, "attr": True, "room": 0}
    assert got["said"]["value"] == "The prompt is plain prose" and got["said"]["hidden"] is False
    assert got["said"]["room"] and got["said"]["size"][1] >= 300 + 60  # grown by what the box adds (the prompt
    # box shares the node's room: it keeps its height)
    assert got["cleared"] == {"value": "", "hidden": True, "size": got["said"]["size"]}  # never shrunk
    assert got["calls"] == ["callback:The prompt is plain prose", "callback:", "callback:again", "collapse", "collapse",
                            "fold", "fold", "fold", "fold"]
    assert got["collapsed"] is False and got["video"] is False
    assert got["previews"] == [True, False]  # the test pattern hides the node's preview, a file shows it


@pytest.mark.skipif(shutil.which("node") is None, reason="needs Node.js to run the editor script")
def test_on_the_canvas_a_node_that_only_the_notes_box_grows_fills_its_spare_room_first():
    """A node where no other widget takes a share of its room (Denoise: the shipped node is saved taller than
    the canvas draws its widgets) gets its notes box in the room below its widgets and grows only past that
    (it showed ~100 px of empty room under the box on the classic canvas); a node already at its content's
    height grows by the box; never shrinks. Under Nodes 2.0 the node grows by the box as before (that renderer
    draws rows taller than computeSize counts). Both the old frontends' box (1.27) and the frontend's own text
    preview (1.5x). Run in Node.js with fakes: the node's content is 100 px, the box adds 60 (the preview 60
    and its switch 20)."""
    script = (ROOT / "web" / "lingbot_text.js").read_text()
    script = re.sub(r'^import .*;$', "", script, flags=re.M).replace("app.registerExtension(", "globalThis.ext = (")
    harness = """
const STRING = (node, name) => {
  const widget = {name, value: "", options: {}, inputEl: {style: {}}, type: "customtext"};
  node.widgets.push(widget);
  return {widget};
};
const preview = {
  addTextPreviewWidgets(node) {
    node.widgets.push({name: "preview_text", value: "", options: {}}, {name: "preview_mode", value: false});
  },
  updateTextPreviewWidgets(node, {text}) { node.widgets.find((w) => w.name === "preview_text").value = text[0]; },
};
globalThis.window = {LiteGraph: {}, comfyAPI: {widgets: {ComfyWidgets: {STRING}}}};
globalThis.document = {createElement: () => ({getContext: () => null}), querySelectorAll: () => []};
const app = {};
/* the script */
const proto = {};
await globalThis.ext.beforeRegisterNodeDef({prototype: proto}, {name: "LingBotDenoise"});
const adds = (w) => (w.name === "LingBot notes" ? (w.hidden ? 0 : 60)
  : w.name === "preview_text" ? 60 : w.name === "preview_mode" ? 20 : 0);
const make = (height) => {
  const node = {comfyClass: "LingBotDenoise", title: "Denoise", id: 4, graph: {}, flags: {}, size: [320, height],
    widgets: [{name: "denoise", type: "number", value: 1}], setSize(s) { this.size = s; }, setDirtyCanvas() {},
    computeSize() { return [300, 100 + this.widgets.reduce((sum, w) => sum + adds(w), 0)]; }};
  globalThis.ext.nodeCreated(node);
  return node;
};
const run = (node, text) => { proto.onExecuted.call(node, {text: [text]}); return node.size[1]; };
const heights = (vue) => {
  window.LiteGraph.vueNodesMode = vue;
  const roomy = make(200), tight = make(100);
  return {roomy: [run(roomy, "cfg_batch does nothing"), run(roomy, ""), run(roomy, "again")],
          tight: [run(tight, "cfg_batch does nothing"), run(tight, "again")]};
};
const old = heights(false);
window.comfyAPI.textPreviewWidgets = preview;
console.log(JSON.stringify({old, host: heights(false), vue: heights(true)}));
""".replace("/* the script */", script)
    out = subprocess.run(["node", "--input-type=module", "-e", harness], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["old"] == {"roomy": [200, 200, 200], "tight": [160, 160]}  # 1.27: the box in the spare 100 px
    assert got["host"] == {"roomy": [200, 200, 200], "tight": [180, 180]}  # 1.5x canvas: box and switch (80)
    vue = got["vue"]  # Nodes 2.0 (1.5x): as before, the node grows by the box, its switch and an allowance a row
    assert vue["roomy"][0] >= 200 + 80 and vue["roomy"] == [vue["roomy"][0]] * 3
    assert vue["tight"][0] >= 100 + 80 and vue["tight"] == [vue["tight"][0]] * 2


def test_the_editor_script_knows_the_test_pattern_choice():
    """web/lingbot_text.js hides Load Video's / Load Image's preview for the list's test pattern entry."""
    from lingbot_nodes.image_input import TEST_PATTERN

    script = (ROOT / "web" / "lingbot_text.js").read_text()
    assert re.search(r'^const TEST_PATTERN = "([^"]+)";', script, flags=re.M).group(1) == TEST_PATTERN
