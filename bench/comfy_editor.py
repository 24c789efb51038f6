"""The pack in ComfyUI's editor, driven in a real browser (not run by CI: it needs ComfyUI and Chromium).

    python bench/comfy_editor.py --url http://127.0.0.1:8188 --chromium /usr/bin/chromium --shots SHOTS_DIR

It runs every check once per renderer (`--renderers classic vue`: the classic LiteGraph canvas and the
"Nodes 2.0" Vue renderer, the frontend's setting `Comfy.VueNodes.Enabled`, set through the server's
settings API before the page loads and put back afterwards) and says which frontend version it drove;
run it once per frontend (ComfyUI's `--front-end-root` serves another one).

Needs `pip install playwright` (the browser is the system's Chromium; Playwright's own download is not used)
and a running ComfyUI with this pack in `custom_nodes/` (`bench/comfy_e2e.py` starts and checks one over the
API). What it checks, printed as PASS/FAIL, with screenshots in SHOTS_DIR to look at:
- the pack's templates appear in the template browser with their thumbnails loaded, each card titled by its
  workflow's title (the registry nodes/shipped.py; the browser takes it from the file name) and not cut;
- every shipped workflow opened from the template browser leaves the frontend nothing missing (the Run button keeps
  its play icon, no issue named); where the frontend has that warning, a core loader naming a missing file shows it;
- every shipped UI workflow (`workflows/<title>.json`) loads with no unknown node type, keeps every widget value
  (a value that no longer fits its widget shifts or resets), converts to the same prompt as its API twin
  in `workflows/api/` (what the editor would queue is what the API tests run), and no node lies over another
  once each is drawn (a screenshot of its widest node at 100 %); on the classic canvas every node opens at its
  saved height and that height is its content's (no empty room at its bottom; a node whose text box takes the
  room past its content may be taller), and in every renderer no widget lies past its node's bottom;
- the T2V workflow, with a prose prompt, a Memory Report added and Denoise at cfg 1 with cfg_batch on,
  queued from the Run button: progress events arrive, it finishes, and the Memory Report, Text Encode's prose
  warning and Denoise's cfg_batch notice show on the nodes (`web/lingbot_text.js`), measured on the element
  the browser shows (its whole text in view, read-only, labelled, not covered); the nodes grew, never
  shrank, the prompt box kept its height, and on the canvas Denoise grew only as far as its content needs; run
  again with a JSON caption, the notices are cleared;
- LingBot Load Video, Extend Video, Caption and the Loader (its attention choices) added to an empty graph show
  the widgets the pack declares (a screenshot to look at);
- LingBot Load Video's upload combo: its list starts with the test pattern, its button opens the file dialog, a
  clip chosen there is uploaded and picked (and shown in the list under Nodes 2.0), and a run reads it (its
  frame count on a Preview Any node); leaves `lingbot_editor_check*.mp4` in the server's input folder;
- with `--rewrite-port`, a Rewrite node asking a canned loopback OpenAI-compatible server shows its result on
  itself;
- LingBot Parallel is found by the node search (double-click on the canvas) and LingBot Loader through the
  canvas menu (Add Node > LingBot-Video); the new nodes show their widgets with the declared defaults (the
  Parallel node's devices, cfg, ulysses, fsdp; the Loader's ffn_chunk and fp8_matmul with every choice the pack offers);
- LingBot Loader (files) and LingBot Memory Report from the node search show their title and every widget label
  in full (the elements under Nodes 2.0; the node's width against the measured text on the classic canvas);
- the UI workflows saved by earlier versions of the pack (`tests/old_workflows/`) load with every saved value on
  its own widget and the widgets added since at their defaults, and queue the values of their API twins;
- with `--parallel DEVICES`, the T2V workflow with a LingBot Parallel node put between Loader and Offload
  (Offload 'none') runs from the Run button (the server must allow those devices: `cpu, cpu` on a --cpu server).
A failed check that a frontend's renderer cannot pass whatever an extension or a workflow does (read in that
frontend's code; `KNOWN_LIMITS`) prints KNOWN with the reason, for that frontend line and renderer only.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from urllib.parse import unquote

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]
RESULTS: list[tuple[bool, str, str]] = []
NOTES = ("preview_text", "LingBot notes")  # the boxes web/lingbot_text.js shows a node's text in (new, old frontends)
RENDERERS = {"classic": False, "vue": True}  # the value of the frontend's setting Comfy.VueNodes.Enabled
VUE_SETTING = "Comfy.VueNodes.Enabled"
PREFIX = ""  # "[frontend renderer] ", put before every check's name


def shipped() -> dict:
    """The shipped workflows' registry (nodes/shipped.py): short name -> title, editor file, API file."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from nodes import shipped

    folder = ROOT / "workflows"
    return {name: (entry.title, shipped.ui_path(folder, name), shipped.api_path(folder, name))
            for name, entry in shipped.SHIPPED.items()}


FRONTEND = ("", "")  # the frontend version and renderer the page runs (set per renderer)

# What a frontend's renderer cannot show whatever an extension or a workflow does, read in its code: a failed check
# with a key here, on that frontend line and renderer, prints KNOWN with the reason instead of FAIL.
KNOWN_LIMITS = {
    ("1.27", "vue", "overlap"):
        "1.27's Nodes 2.0 (a preview in that release) sizes each node from its content and ignores the saved size: "
        "a widget row is a fixed 80 px name column beside a fixed 300 px value box, so every LingBot node comes out "
        "428 px wide (320 px saved) and columns laid out for the saved widths overlap; the newer Nodes 2.0 keeps "
        "the saved width",
    ("1.27", "vue", "preview"):
        "1.27's Nodes 2.0 previews whatever an upload list holds as a file, and offers a node no way to hide it "
        "(newer frontends read `hideOutputImages`), so Load Video's `(test pattern)` shows a broken image there",
    ("1.27", "vue", "labels"):
        "1.27's Nodes 2.0 writes each widget's name (not its label) in a fixed 80 px column and cuts a longer one "
        "with an ellipsis, on every node, whatever the node's width",
}


def known_limit(key: str) -> str | None:
    version, renderer = FRONTEND
    return KNOWN_LIMITS.get((".".join(version.split(".")[:2]), renderer, key))


def record(ok: bool, name: str, detail: str = "", limit: str | None = None) -> bool:
    """One check's result; a failure that `limit` (a KNOWN_LIMITS key) explains for this frontend and
    renderer is printed as KNOWN, with the reason, and not counted as failed."""
    name = PREFIX + name
    reason = None if ok or limit is None else known_limit(limit)
    RESULTS.append((ok or reason is not None, name, detail))
    status = "PASS" if ok else ("KNOWN" if reason else "FAIL")
    if reason:
        KNOWN.append(name)
        detail = f"{detail} ({reason})"
    print(f"{status} {name}{': ' + detail if detail else ''}", flush=True)
    return ok


KNOWN: list[str] = []  # the checks a renderer's known limit explains


LOAD_AND_COMPARE = """async (wf) => {
  await window.app.loadGraphData(wf);
  const graph = window.app.graph;
  const known = window.LiteGraph.registered_node_types;
  const unknown = graph._nodes.filter((n) => !known[n.type]).map((n) => n.type);
  const saved = window.app.graph.serialize();
  const shifted = [];
  for (const node of wf.nodes) {
    const now = saved.nodes.find((n) => n.id === node.id);
    // a node without widgets: no list at all in newer frontends, an empty one in the shipped files
    if (JSON.stringify(now?.widgets_values ?? []) !== JSON.stringify(node.widgets_values ?? []))
      shifted.push({id: node.id, type: node.type, file: node.widgets_values, editor: now?.widgets_values});
  }
  const prompt = (await window.app.graphToPrompt()).output;
  return {unknown, shifted, prompt};
}"""


def same_prompt(editor: dict, api: dict) -> list[str]:
    """Differences between the editor's prompt and the shipped API twin (class and inputs per node id)."""
    diffs = []
    for key in sorted(set(editor) | set(api)):
        a, b = editor.get(key), api.get(key)
        if a is None or b is None:
            diffs.append(f"node {key} only in {'the API file' if a is None else 'the editor'}")
        elif a["class_type"] != b["class_type"] or a["inputs"] != b["inputs"]:
            keys = {k for k in set(a["inputs"]) | set(b["inputs"]) if a["inputs"].get(k) != b["inputs"].get(k)}
            diffs.append(f"node {key} ({b['class_type']}) differs in {sorted(keys)}")
    return diffs


OPEN_DIALOGS = """() => [...document.querySelectorAll('.p-dialog-mask, [role=dialog]')]
  .filter((el) => { const r = el.getBoundingClientRect(); return r.width > 0 && r.height > 0; }).length"""


def dismiss_dialogs(page) -> bool:
    """Closes what a dialog the frontend shows (1.27's masks, the newer template browser with none): True
    when none is left."""
    for _ in range(4):
        if page.evaluate(OPEN_DIALOGS) == 0:
            return True
        page.keyboard.press("Escape")
        page.wait_for_timeout(400)
    return page.evaluate(OPEN_DIALOGS) == 0


def check_templates(page, shots: Path, pack: str) -> None:
    seen: dict[str, int] = {}

    def on_response(response) -> None:
        if f"/workflow_templates/{pack}/" in response.url and response.url.endswith(".jpg"):
            seen[unquote(response.url.rsplit("/", 1)[-1][:-4])] = response.status

    page.on("response", on_response)
    page.get_by_role("button", name="Templates").first.click()
    page.wait_for_timeout(1500)
    entry = page.get_by_text(pack, exact=True).first
    if not record(entry.count() > 0, f"the template browser lists {pack}"):
        page.screenshot(path=str(shots / "templates.png"))
        return
    entry.scroll_into_view_if_needed()
    entry.click()
    page.wait_for_timeout(3000)
    page.screenshot(path=str(shots / "templates.png"))
    page.mouse.move(800, 600)
    for _ in range(6):  # the cards load their thumbnails as they scroll into view
        page.mouse.wheel(0, 600)
        page.wait_for_timeout(700)
    shown = page.evaluate("""() => [...document.querySelectorAll('img')]
        .filter((i) => i.src.startsWith('blob:') && i.complete && i.naturalWidth > 0).length""")
    names = sorted(title for title, _ui, _api in shipped().values())
    fetched = sorted(name for name, status in seen.items() if status == 200)
    record(fetched == names and shown > 0,
           "every shipped workflow's thumbnail is fetched and shown in the template browser",
           f"{len(fetched)} of {len(names)} fetched, {shown} images shown" +
           ("" if fetched == names else f"; missing {sorted(set(names) - set(fetched))}"))
    # the cards' titles as shown (h3), each whole on its line (not cut by the card's ellipsis)
    cards = page.evaluate("""() => [...document.querySelectorAll('[role=dialog] h3, .p-dialog h3')]
        .filter((h) => h.getBoundingClientRect().width > 0)
        .map((h) => ({text: h.textContent.trim(), cut: h.scrollWidth > h.clientWidth + 1
                                                       || h.scrollHeight > h.clientHeight + 1}))""")
    titled = sorted(c["text"] for c in cards if c["text"] in names)
    cut = sorted(c["text"] for c in cards if c["text"] in names and c["cut"])
    record(titled == names and not cut, "the template browser titles every shipped workflow by its title, whole",
           f"{len(titled)} of {len(names)} titles shown" + (f"; cut: {cut}" if cut else "") +
           ("" if titled == names else f"; missing {sorted(set(names) - set(titled))}"))
    page.remove_listener("response", on_response)
    record(dismiss_dialogs(page), "the template browser closes (Escape)")


# What the frontend shows when a workflow lacks something it needs to run (1.5x: a model file, a node type, an
# input file): the Run button's icon turns into a warning triangle and a toast or the side panel names the
# issue. `icon`: "warning" or "ok", null where the frontend has no such icon (1.27 shows none of this); `lines`:
# the visible lines that name an issue.
MISSING_SIGNS = """() => {
  const icon = document.querySelector('[data-testid=queue-button-icon]');
  const lines = [...document.querySelectorAll('body *')]
    .filter((e) => e.children.length === 0 && e.getBoundingClientRect().width > 0)
    .map((e) => e.textContent.trim()).filter((t) => /issues? found|is missing a required|input missing/i.test(t));
  return {icon: icon ? (String(icon.className).includes('triangle-alert') ? 'warning' : 'ok') : null,
          lines: [...new Set(lines)].slice(0, 6)};
}"""

# A core Load Diffusion Model naming a file no server has: what the frontend does for a missing model file.
MISSING_MODEL_GRAPH = {
    "last_node_id": 1, "last_link_id": 0, "links": [], "groups": [], "config": {}, "extra": {}, "version": 0.4,
    "nodes": [{"id": 1, "type": "UNETLoader", "pos": [100, 100], "size": [320, 100], "flags": {}, "order": 0,
               "mode": 0, "inputs": [], "outputs": [{"name": "MODEL", "type": "MODEL", "links": None}],
               "properties": {}, "widgets_values": ["lingbot_editor_check_missing.safetensors", "default"]}],
}

GRAPH_TYPES = "() => window.app.graph._nodes.map((n) => n.type).sort()"


def open_template(page, pack: str, title: str, types: list[str]) -> bool:
    """Opens a shipped workflow as a user does: the template browser, the pack's entry, the card; True once the
    graph holds the workflow's nodes."""
    page.get_by_role("button", name="Templates").first.click()
    page.wait_for_timeout(1200)
    dialog = page.locator("[role=dialog], .p-dialog")  # the page's own nodes carry the pack's name as a badge
    dialog.get_by_text(pack, exact=True).first.click()
    page.wait_for_timeout(800)
    card = dialog.get_by_text(title, exact=True).first
    page.mouse.move(800, 600)
    for _ in range(8):  # a browser that adds cards as its grid scrolls (1.27) shows the last ones only then
        if card.count() and card.is_visible():
            break
        page.mouse.wheel(0, 800)
        page.wait_for_timeout(500)
    card.scroll_into_view_if_needed(timeout=5000)
    card.click(timeout=5000)
    end = time.time() + 20
    while time.time() < end:
        if page.evaluate(GRAPH_TYPES) == types:
            return True
        page.wait_for_timeout(300)
    return False


def check_template_warnings(page, shots: Path, pack: str) -> None:
    """Every shipped workflow opened from the template browser: the frontend finds nothing missing (the Run
    button keeps its play icon, no issue is named, no dialog stays open). First, where the frontend has the
    warning, that the check sees it: a core Load Diffusion Model naming a file the server lacks."""
    page.evaluate("(wf) => window.app.loadGraphData(wf)", MISSING_MODEL_GRAPH)
    page.wait_for_timeout(2500)
    sensor = page.evaluate(MISSING_SIGNS)
    if sensor["icon"] is not None:
        page.screenshot(path=str(shots / "missing_model_core.png"))
        record(sensor["icon"] == "warning" and bool(sensor["lines"]),
               "a core Load Diffusion Model naming a missing file makes the frontend warn (the check sees it)",
               f"Run icon {sensor['icon']}, {sensor['lines']}")
    warned = []
    for title, path, _api in sorted(shipped().values()):
        types = sorted(n["type"] for n in json.loads(path.read_text())["nodes"])
        try:
            opened = open_template(page, pack, title, types)
        except Exception as exc:  # noqa: BLE001 - reported as the check's detail
            opened, signs = False, {"icon": None, "lines": [str(exc).splitlines()[0][:200]]}
        if opened:
            page.wait_for_timeout(1500)  # the frontend's look for missing files answers after the load
            signs = page.evaluate(MISSING_SIGNS)
            dialogs = page.evaluate(OPEN_DIALOGS)
        if not opened or signs["icon"] == "warning" or signs["lines"] or dialogs:
            warned.append(f"{title}: opened {opened}, Run icon {signs['icon']}, {signs['lines']}, "
                          f"{dialogs if opened else '?'} dialog(s)")
            page.screenshot(path=str(shots / f"template_open_{path.stem}.png"))
        dismiss_dialogs(page)
    record(not warned, "every shipped workflow opened from the template browser: nothing missing, no warning",
           "; ".join(warned)[:1000])


# The loaded graph panned across at 85 % (full detail in every renderer), so that each node is drawn once; after
# the frontend's own fit of a loaded graph to the view (a wide one at 40 % or less: titles only under Nodes 2.0).
SHOW_ALL = """async () => {
  await new Promise((r) => setTimeout(r, 600));
  const c = window.app.canvas, nodes = window.app.graph._nodes;
  const left = Math.min(...nodes.map((n) => n.pos[0])), right = Math.max(...nodes.map((n) => n.pos[0] + n.size[0]));
  const top = Math.min(...nodes.map((n) => n.pos[1]));
  for (let x = left - 40; x < right; x += 1200) {
    c.ds.scale = 0.85;
    c.ds.offset = [-x, -top + 80];
    c.setDirty(true, true);
    await new Promise((r) => setTimeout(r, 900));
  }
}"""

# Pairs of nodes whose boxes (title bar included) overlap, with the overlap's width.
OVERLAPS = """() => {
  const T = window.LiteGraph.NODE_TITLE_HEIGHT, nodes = window.app.graph._nodes, out = [];
  const box = (n) => [n.pos[0], n.pos[1] - T, n.pos[0] + n.size[0], n.pos[1] + n.size[1]];
  for (const a of nodes) for (const b of nodes) {
    if (a.id >= b.id) continue;
    const [ax, ay, ax2, ay2] = box(a), [bx, by, bx2, by2] = box(b);
    const w = Math.min(ax2, bx2) - Math.max(ax, bx), h = Math.min(ay2, by2) - Math.max(ay, by);
    if (w > 1 && h > 1) out.push(`${a.title} (${Math.round(a.size[0])} px wide) and ${b.title}: ${Math.round(w)} px`);
  }
  return out;
}"""


# Each saved node of a loaded workflow on the classic canvas: its height now (the saved one unless the canvas grew
# it), what its content needs (the canvas' own computeSize), whether a widget takes the room past the content (a
# text box of no fixed height: its boxes share it), and the widgets drawn past its bottom.
CANVAS_FIT = """(saved) => {
  const LG = window.LiteGraph, out = [];
  const shares = (node, w) => {
    if (w.hidden || typeof w.computeLayoutSize !== 'function') return false;
    const s = w.computeLayoutSize(node);
    return !!s && (s.maxHeight == null || s.maxHeight > (s.minHeight ?? 0));
  };
  for (const node of window.app.graph._nodes) {
    if (!(String(node.id) in saved)) continue;
    const shown = (node.widgets ?? []).filter((w) => !w.hidden && w.y != null);
    const outside = shown.filter((w) => w.y + (w.computedHeight ?? LG.NODE_WIDGET_HEIGHT + 4) > node.size[1] + 1)
      .map((w) => `${w.name} (${Math.round(w.y + (w.computedHeight ?? 0))} px)`);
    out.push({title: node.title, saved: saved[String(node.id)], height: Math.round(node.size[1]),
              content: Math.round(node.computeSize()[1]), shares: (node.widgets ?? []).some((w) => shares(node, w)),
              outside});
  }
  return out;
}"""

# Under Nodes 2.0 (elements): the widgets of a node's element that reach past its bottom; null when the node has no
# element in view.
ELEMENT_FIT = """(id) => {
  const el = [...document.querySelectorAll(`.lg-node[data-node-id="${id}"]`)]
    .find((e) => e.getBoundingClientRect().width > 2);
  if (!el) return null;
  const r = el.getBoundingClientRect();
  return [...el.querySelectorAll('.lg-node-widget, .lg-widget-container')].filter((w) => {
    const b = w.getBoundingClientRect();
    return b.height > 0 && (b.bottom > r.bottom + 1 || b.top < r.top - 1);
  }).map((w) => w.dataset.widgetName || (w.textContent || '').trim().slice(0, 24));
}"""

SPARE_PX = 8  # the widgets' margin, which 1.27's canvas counts for Memory Report's hidden notes box and 1.5x's not


def loose_heights(nodes: list[dict]) -> list[str]:
    """The nodes (CANVAS_FIT's rows) that did not open at their saved height (the canvas grew them: saved too
    short), are saved shorter than their content, or, where no text box takes the room past the content, are
    saved more than SPARE_PX taller than it (empty room at the bottom)."""
    return [f"{n['title']}: saved {n['saved']} px, now {n['height']}, content {n['content']}" for n in nodes
            if n["height"] != n["saved"] or n["saved"] < n["content"]
            or (not n["shares"] and n["saved"] - n["content"] > SPARE_PX)]


def check_heights(page, wf: dict, name: str) -> None:
    """The loaded workflow's nodes open at their saved height, none with empty room under its widgets on the
    classic canvas (saved within SPARE_PX of its content, or at least its content where a text box takes the
    room past it), and none with a widget drawn past its bottom (canvas or elements)."""
    saved = {str(n["id"]): n["size"][1] for n in wf["nodes"] if n["type"] != "Note"}
    if FRONTEND[1] == "classic":
        nodes = page.evaluate(CANVAS_FIT, saved)
        loose = loose_heights(nodes)
        record(len(nodes) == len(saved) and not loose,
               f"{name}: every node opens at its saved height, as tall as its content needs (no empty room)",
               f"{len(nodes)} of {len(saved)} nodes found; " + "; ".join(loose)[:800])
        outside = [f"{n['title']}: {', '.join(n['outside'])} past {n['height']} px" for n in nodes if n["outside"]]
    else:
        outside = []
        for node_id in saved:
            page.evaluate(FOCUS, int(node_id))
            page.wait_for_timeout(300)
            past = page.evaluate(ELEMENT_FIT, node_id)
            if past is None or past:
                outside.append(f"node {node_id}: " + ("not drawn" if past is None else ", ".join(past)))
    record(not outside, f"{name}: no widget lies outside its node", "; ".join(outside)[:800])


def check_workflows(page, shots: Path) -> None:
    for _title, path, api_path in sorted(shipped().values()):
        wf = json.loads(path.read_text())
        out = page.evaluate(LOAD_AND_COMPARE, wf)
        page.wait_for_timeout(500)
        dismiss_dialogs(page)
        page.screenshot(path=str(shots / f"{path.stem}.png"))
        record(not out["unknown"], f"{path.name}: every node type is known", str(out["unknown"]))
        record(not out["shifted"], f"{path.name}: every widget keeps its value", json.dumps(out["shifted"])[:800])
        api = json.loads(api_path.read_text())
        diffs = same_prompt(out["prompt"], api)
        record(not diffs, f"{path.name}: the editor queues the same prompt as workflows/api/{api_path.name}",
               "; ".join(diffs)[:800])
        page.evaluate(SHOW_ALL)  # every node drawn once at full detail (a renderer that sizes nodes then knows them)
        overlaps = page.evaluate(OVERLAPS)
        record(not overlaps, f"{path.name}: no node lies over another", "; ".join(overlaps)[:600], limit="overlap")
        check_heights(page, wf, path.name)
        widest = max((n for n in wf["nodes"] if n["type"] != "Note"), key=lambda n: n["size"][0])
        focus_shot(page, widest["id"], shots / f"{path.stem}_widest.png")  # at 100 %, to look at


# A widget value set as the user's edit sets it: the value, then the widget's callback (1.27's Nodes 2.0 draws
# a value it hears of that way, and a value set alone only once the node is drawn anew).
SET_WIDGET = """const setWidget = (node, name, value) => {
  const w = node.widgets.find((x) => x.name === name);
  w.value = value;
  w.callback?.(value, window.app.canvas, node);
};"""

ADD_NODES = """(nonce) => {
  /* setWidget */
  const g = window.app.graph;
  const byType = (t) => g._nodes.find((n) => n.type === t);
  const offload = byType('LingBotOffload'), decode = byType('LingBotDecode'), text = byType('LingBotTextEncode');
  const denoise = byType('LingBotDenoise');
  // prose (the warning), new each time so that ComfyUI's cache does not skip the run
  setWidget(text, 'prompt', 'a red paper boat drifts down a canal at dawn, take ' + nonce);
  // cfg_batch asked for at cfg 1: Denoise says it does nothing (once per server), beside its step previews
  setWidget(denoise, 'cfg', 1.0);
  setWidget(denoise, 'cfg_batch', 'on');
  const report = window.LiteGraph.createNode('LingBotMemoryReport');
  // in free room right of the last column (a renderer may draw nodes wider than saved: 200 px to spare)
  report.pos = [Math.max(...g._nodes.map((n) => n.pos[0] + n.size[0])) + 200, decode.pos[1]];
  g.add(report);
  offload.connect(0, report, 0);
  decode.connect(0, report, 1);
  g.setDirtyCanvas(true, true);
  return {report: report.id, text: text.id, denoise: denoise.id};
}""".replace("/* setWidget */", SET_WIDGET)

CAPTION_AGAIN = """([text, denoise, caption]) => {
  /* setWidget */
  const g = window.app.graph;
  setWidget(g.getNodeById(text), 'prompt', caption);
  setWidget(g.getNodeById(denoise), 'cfg_batch', 'off');
}""".replace("/* setWidget */", SET_WIDGET)

LISTEN = """() => {
  window.__lingbot = {progress: [], done: null};
  const api = window.app.api;
  api.addEventListener('progress', (e) => window.__lingbot.progress.push([e.detail.node, e.detail.value, e.detail.max]));
  api.addEventListener('execution_success', () => { window.__lingbot.done = 'success'; });
  api.addEventListener('execution_error', (e) => { window.__lingbot.done = 'error: ' + e.detail.exception_message; });
  api.addEventListener('execution_interrupted', () => { window.__lingbot.done = 'interrupted'; });
}"""

FOCUS = """(id) => {
  const canvas = window.app.canvas, node = window.app.graph.getNodeById(id);
  canvas.ds.scale = 1.0;
  canvas.centerOnNode(node);
  canvas.setDirty(true, true);
}"""

# Where on the page the middle of a node's title bar is (to click it, as a user picks the node to read it): the
# node's element under Nodes 2.0, else the canvas' own conversion; null when that is not inside the canvas.
TITLE_POINT = """(id) => {
  const canvas = window.app.canvas, node = window.app.graph.getNodeById(id);
  const r = window.app.canvasEl.getBoundingClientRect();
  const el = [...document.querySelectorAll(`[data-node-id="${id}"]`)].find((e) => e.getBoundingClientRect().width > 2);
  let x, y;
  if (el) {
    const b = el.getBoundingClientRect();
    [x, y] = [b.left + b.width / 2, b.top + 16];
  } else {
    const [ox, oy] = canvas.ds.convertCanvasToOffset([node.pos[0] + node.size[0] / 2,
                                                      node.pos[1] - window.LiteGraph.NODE_TITLE_HEIGHT / 2]);
    [x, y] = [r.left + ox, r.top + oy];
  }
  return x > r.left + 80 && x < r.right - 80 && y > r.top + 80 && y < r.bottom - 40 ? {x, y} : null;
}"""

# What the browser shows of a node's text: the element in view that holds it (a hidden or zero-size one, such
# as the textarea a renderer keeps but does not show, does not count), whether all of it is in view
# (nothing scrolled off or cut: it and its clipping ancestors), read-only, its label, and whether something
# else covers it (the element found at points inside it is not it nor inside it).
NODE_TEXT = """([id, names]) => {
  const node = window.app.graph.getNodeById(id);
  const box = node?.widgets?.find((w) => names.includes(w.name));
  if (!box) return {text: null, size: node ? [...node.size] : null};
  const text = String(box.value ?? '');
  const out = {text, label: box.label ?? box.name, widget: box.name, size: [...node.size]};
  if (!text) return {...out, shown: null};
  const first = text.split('\\n')[0].slice(0, 30);
  const seen = (el) => {
    const r = el.getBoundingClientRect(), st = getComputedStyle(el);
    return r.width > 2 && r.height > 2 && st.visibility !== 'hidden' && st.display !== 'none' && +st.opacity > 0;
  };
  const holds = (el) => (el.tagName === 'TEXTAREA' ? el.value : el.textContent || '').includes(first);
  const all = [...document.querySelectorAll('textarea, div, span, p, pre')].filter((el) => holds(el) && seen(el));
  const inner = all.filter((el) => !all.some((o) => o !== el && el.contains(o)));
  if (!inner.length) return {...out, shown: false};
  const el = inner[inner.length - 1];
  let clipped = false, up = el;
  for (let i = 0; up && i < 6 && !clipped; i++, up = up.parentElement) {
    const st = getComputedStyle(up);
    const clips = up === el || st.overflowY !== 'visible';
    if (clips && up.scrollHeight > up.clientHeight + 2)
      clipped = `${up.tagName.toLowerCase()}.${String(up.className).split(' ')[0]} (level ${i}): ` +
                `${up.scrollHeight} px of text in ${up.clientHeight} px`;
  }
  const r = el.getBoundingClientRect();
  const covered = [[0.5, 0.2], [0.5, 0.5], [0.5, 0.8], [0.2, 0.5], [0.8, 0.5]].some(([fx, fy]) => {
    const at = document.elementFromPoint(r.left + r.width * fx, r.top + r.height * fy);
    return at && at !== el && !el.contains(at) && !at.contains(el);
  });
  const readOnly = el.tagName === 'TEXTAREA' ? (el.readOnly || el.disabled) : !el.isContentEditable;
  return {...out, shown: true, clipped, covered, readOnly, rect: [r.left, r.top, r.width, r.height]};
}"""

# Visible height of a node's widget box (the prompt's textarea), for "the notice never shrinks it".
BOX_HEIGHT = """([id, name]) => {
  const node = window.app.graph.getNodeById(id);
  const w = node?.widgets?.find((x) => x.name === name);
  const value = String(w?.value ?? '').slice(0, 20);
  const areas = [...document.querySelectorAll('textarea')].filter((t) => t.value.startsWith(value) && value &&
    t.getBoundingClientRect().height > 2 && getComputedStyle(t).visibility !== 'hidden');
  return areas.length ? Math.round(areas[0].getBoundingClientRect().height / window.app.canvas.ds.scale) : null;
}"""


# A node's height on the canvas against what its content needs (the canvas' own computeSize), and the room left
# below its last shown widget.
NODE_ROOM = """(id) => {
  const node = window.app.graph.getNodeById(id);
  const shown = (node.widgets ?? []).filter((w) => !w.hidden);
  const last = shown[shown.length - 1];
  const top = last ? (last.last_y ?? last.y ?? 0) : 0;
  const tall = last ? (last.computedHeight ?? last.computeSize?.(node.size[0])?.[1] ?? window.LiteGraph.NODE_WIDGET_HEIGHT) : 0;
  return {height: Math.round(node.size[1]), content: Math.round(node.computeSize()[1]),
          below: last ? Math.round(node.size[1] - top - tall) : null};
}"""


def queue_and_wait(page, shots: Path, tag: str, timeout: float) -> dict:
    """Click Run, screenshot while progress arrives, wait for the end; what the listeners saw."""
    page.evaluate(LISTEN)
    page.get_by_role("button", name="Run", exact=True).first.click()  # not "Runs on ..."
    end = time.time() + timeout
    shot = 0
    while time.time() < end:
        done = page.evaluate("window.__lingbot.done")
        if done:
            break
        if shot < 3 and page.evaluate("window.__lingbot.progress.length") > 0:
            page.screenshot(path=str(shots / f"{tag}_running_{shot}.png"))
            shot += 1
        page.wait_for_timeout(1000)
    page.wait_for_timeout(1500)
    page.screenshot(path=str(shots / f"{tag}_done.png"))
    return page.evaluate("window.__lingbot")


def node_text(page, shots: Path, node_id: int, shot: str) -> dict:
    """The node in the middle of the view, picked (a click on its title brings it in front of its neighbours,
    as a user does to read it), and what NODE_TEXT finds of its text."""
    page.evaluate(FOCUS, node_id)
    page.wait_for_timeout(600)
    at = page.evaluate(TITLE_POINT, node_id)
    if at:
        page.mouse.click(at["x"], at["y"])
        page.wait_for_timeout(600)
    page.screenshot(path=str(shots / shot))
    return page.evaluate(NODE_TEXT, [node_id, list(NOTES)])


def check_run(page, shots: Path, timeout: float) -> None:
    wf = json.loads(shipped()["lingbot_t2v_dense"][1].read_text())
    page.evaluate(LOAD_AND_COMPARE, wf)
    dismiss_dialogs(page)
    ids = page.evaluate(ADD_NODES, int(time.time()))
    page.evaluate(FOCUS, ids["text"])
    page.wait_for_timeout(800)
    before = {"size": page.evaluate("(id) => [...window.app.graph.getNodeById(id).size]", ids["text"]),
              "prompt": page.evaluate(BOX_HEIGHT, [ids["text"], "prompt"]),
              "denoise": page.evaluate(NODE_ROOM, ids["denoise"])}
    state = queue_and_wait(page, shots, "t2v", timeout)
    record(state["done"] == "success", "T2V queued from the Run button finishes", str(state["done"]))
    nodes = {str(n) for n, _, _ in state["progress"]}
    record(len(state["progress"]) > 1, "progress events arrive while it runs",
           f"{len(state['progress'])} events from nodes {sorted(nodes)}")
    texts = {name: node_text(page, shots, ids[name], f"t2v_{name}_node.png") for name in ("report", "text", "denoise")}
    after_prompt = page.evaluate(BOX_HEIGHT, [ids["text"], "prompt"])
    for name, what, must in (("report", "Memory Report shows its text on the node", "LingBot memory"),
                             ("text", "Text Encode shows the prose warning on the node", "prose"),
                             ("denoise", "Denoise shows its cfg_batch notice on the node", "cfg_batch")):
        got = texts[name]
        text = got["text"] or ""
        record(must in text and got.get("shown") is True, what,
               (text.splitlines()[0] if text else "no text box") + f" (shown: {got.get('shown')})")
        who = what.split(" shows")[0]
        record(got.get("shown") is True and got.get("clipped") is False and got.get("covered") is False,
               f"{who}: the whole text is in view in its box, nothing over it",
               f"clipped: {got.get('clipped')}, covered: {got.get('covered')}, box {got.get('rect')}")
        record(got.get("readOnly") is True and got.get("label") == "LingBot notes",
               f"{who}: the box is read-only and labelled 'LingBot notes'",
               f"read-only: {got.get('readOnly')}, label: {got.get('label')!r}")
    if FRONTEND[1] == "classic":
        # Denoise's notes box is the only widget that grows it: the box first takes the room the node had below
        # its widgets (the shipped node is saved taller than the canvas draws it), then the node grows only as far
        # as its content needs. (Nodes 2.0 draws its rows taller than computeSize counts and fills the node.)
        room = page.evaluate(NODE_ROOM, ids["denoise"])
        was = before["denoise"]
        record(room["height"] <= max(was["height"], room["content"]) + 2,
               "the notice grows Denoise only as far as its content needs (no empty room under its box)",
               f"node {was['height']} px ({was['below']} px below its widgets) -> {room['height']} px, content "
               f"{room['content']} px, {room['below']} px below the notes box")
    size = texts["text"]["size"]
    record(size[0] >= before["size"][0] and size[1] >= before["size"][1]
           and (after_prompt or 0) >= (before["prompt"] or 1) - 1,
           "the notice grows Text Encode, never shrinks it or its prompt box",
           f"node {before['size']} -> {size}, prompt box {before['prompt']} -> {after_prompt} px")

    # the same graph with the shipped JSON caption (new words, so it runs) and cfg_batch off: nothing to say
    api = json.loads(shipped()["lingbot_t2v_dense"][2].read_text())
    caption = next(n["inputs"]["prompt"] for n in api.values() if n["class_type"] == "LingBotTextEncode")
    page.evaluate(CAPTION_AGAIN, [ids["text"], ids["denoise"], caption.replace("at dawn", f"at dawn, take {int(time.time())}")])
    state = queue_and_wait(page, shots, "t2v_caption", timeout)
    again = {name: node_text(page, shots, ids[name], f"t2v_caption_{name}_node.png") for name in ("text", "denoise")}
    record(state["done"] == "success" and again["text"]["text"] == "" and again["denoise"]["text"] == "",
           "run again with a JSON caption: Text Encode's and Denoise's notices are cleared",
           f"{state['done']}; Text Encode: {again['text']['text']!r}, Denoise: {again['denoise']['text']!r}")
    size_again = again["text"]["size"]
    record(size_again[1] >= size[1], "the cleared box leaves Text Encode's size as it was",
           f"{size} -> {size_again}")


REWRITE_GRAPH = """(endpoint) => {
  const g = window.app.graph;
  g.clear();
  const rewrite = window.LiteGraph.createNode('LingBotRewrite');
  rewrite.pos = [100, 100];
  g.add(rewrite);
  rewrite.widgets.find((w) => w.name === 'prompt').value = 'a paper boat on a canal';
  rewrite.widgets.find((w) => w.name === 'endpoint').value = endpoint;
  rewrite.widgets.find((w) => w.name === 'expand_model').value = 'canned';
  const preview = window.LiteGraph.createNode('PreviewAny');
  preview.pos = [700, 100];
  g.add(preview);
  rewrite.connect(0, preview, 0);
  g.setDirtyCanvas(true, true);
  return rewrite.id;
}"""


def fake_chat_server(port: int):
    """A loopback OpenAI-compatible server: stage 1 gets prose, stage 2 a valid caption (canned)."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    sys.path.insert(0, str(ROOT))
    from lingbot_core.caption_schema import CAMERA_DEFAULTS, timestamp

    caption = {"caption": {
        "comprehensive_description": {"scene_content_description": "A canal at dawn, mist over the water.",
                                      "camera_movement_description": "The camera tracks right."},
        "camera_info": dict(CAMERA_DEFAULTS), "world_knowledge": [],
        "prominent_elements": [{"name": "paper boat", "description": "A small red paper boat.",
                                "actions": [{"timestamp": timestamp(0, 5.0), "action": "drifts forward"}]}]},
        "duration": 5.0}
    calls = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_POST(self):  # noqa: N802 - http.server's name
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            calls.append(self.path)
            text = "A small red paper boat drifts along a misty canal at dawn." if len(calls) % 2 else \
                json.dumps(caption)
            data = json.dumps({"choices": [{"message": {"role": "assistant", "content": text}}],
                               "usage": {"completion_tokens": 9}}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd


def check_rewrite(page, shots: Path, port: int, timeout: float) -> None:
    httpd = fake_chat_server(port)
    try:
        node = page.evaluate(REWRITE_GRAPH, f"http://127.0.0.1:{port}/v1")
        state = queue_and_wait(page, shots, "rewrite", timeout)
        page.evaluate(FOCUS, node)
        page.wait_for_timeout(800)
        page.screenshot(path=str(shots / "rewrite_node.png"))
        text = page.evaluate(NODE_TEXT, [node, list(NOTES)])["text"]
        record(state["done"] == "success" and bool(text) and "caption" in text,
               "Rewrite (endpoint) shows its result on the node", (text or str(state["done"]))[:160])
    finally:
        httpd.shutdown()


OLD_WORKFLOWS = ROOT / "tests" / "old_workflows"

NODE_STATE = """(type) => {
  const nodes = window.app.graph._nodes.filter((n) => n.type === type);
  const node = nodes[nodes.length - 1];
  if (!node) return null;
  return {id: node.id, count: nodes.length,
          widgets: (node.widgets || []).map((w) => ({name: w.name, value: w.value, type: w.type,
                                                     options: w.options?.values ?? null}))};
}"""

CANVAS_POINT = """() => {
  const r = window.app.canvasEl.getBoundingClientRect();
  return {x: r.left + r.width * 0.4, y: r.top + r.height * 0.4};
}"""


def declared(class_type: str) -> dict:
    """The class's widget inputs as the pack declares them (name -> default and, for a combo, its choices;
    for an upload combo only its fixed first choices, the rest being the server's files), from its own registry
    (`nodes/` loaded as `lingbot_nodes`, as the API check does)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from bench.comfy_e2e import pack_nodes
    from lingbot_core.workflow.nodeinfo import NodeClassInfo

    info = NodeClassInfo(class_type, pack_nodes()[class_type])
    return {s.name: (s.options.get("default"), s.combo_options[:1] if s.has_upload_widget else s.combo_options)
            for s in info.visible_inputs() if s.is_widget}


def offers(shown: list | None, choices: list, upload: bool) -> bool:
    """Whether a combo shows the declared choices (an upload combo: first, the server's files after them)."""
    return shown == choices if not upload else (shown or [])[:len(choices)] == choices


def widgets_match(state: dict | None, class_type: str) -> list[str]:
    """How the editor's widgets of a new `class_type` node differ from the declaration (names, order,
    defaults, combo choices); empty when they match."""
    if state is None:
        return ["no such node in the graph"]
    want = declared(class_type)
    uploads = {w["name"] for w in state["widgets"] if w.get("type") == "combo"
               and any(x.get("type") == "button" for x in state["widgets"])}  # a combo on a node with an upload button
    # the frontend's own widgets beside the declared ones: a seed's control, an upload combo's button, the notes box
    shown = [w for w in state["widgets"] if w["name"] in want
             or not (w["name"].startswith("control") or w.get("type") == "button" or w["name"] in NOTES)]
    problems = []
    if [w["name"] for w in shown] != list(want):
        problems.append(f"widgets {[w['name'] for w in shown]} != declared {list(want)}")
    for w in shown:
        default, choices = want.get(w["name"], (None, None))
        if w["name"] in want and w["value"] != default:
            problems.append(f"{w['name']} shows {w['value']!r}, declared default {default!r}")
        upload = w["name"] in uploads
        if choices is not None and not offers(w["options"], choices, upload):
            problems.append(f"{w['name']} offers {w['options']}, declared {choices}")
    return problems


def focus_shot(page, node_id: int, path: Path) -> None:
    page.evaluate(FOCUS, node_id)
    page.wait_for_timeout(800)
    page.screenshot(path=str(path))


def open_search(page, at: dict) -> bool:
    """Double-clicks the empty canvas until the node search has the keyboard (an input has the focus); a
    name typed to the canvas itself would run its shortcuts ('f' hides the menus in 1.27)."""
    for _ in range(3):
        page.evaluate("() => document.activeElement?.blur?.()")  # no focus left from an earlier step
        page.mouse.dblclick(at["x"], at["y"])
        for _ in range(10):
            page.wait_for_timeout(300)
            if page.evaluate("() => document.activeElement?.tagName === 'INPUT'"):
                page.wait_for_timeout(300)
                return True
        page.keyboard.press("Escape")
    return False


def check_new_nodes(page, shots: Path) -> None:
    """LingBot Parallel from the node search, LingBot Loader from the canvas menu, on an empty graph."""
    page.evaluate("() => { window.app.graph.clear(); window.app.canvas.setDirty(true, true); }")
    page.wait_for_timeout(500)
    at = page.evaluate(CANVAS_POINT)
    if not open_search(page, at):
        record(False, "the node search opens (double-click on the canvas)")
        return
    page.keyboard.type("LingBot Parallel", delay=40)
    page.wait_for_timeout(1500)
    page.screenshot(path=str(shots / "search_lingbot_parallel.png"))
    page.keyboard.press("Enter")
    page.wait_for_timeout(1000)
    # newer frontends hold a node from the search at the pointer until a click: place it away from where the
    # canvas menu is opened next (on older ones this is a click on the empty canvas)
    page.mouse.move(at["x"] - 300, at["y"] - 200)
    page.wait_for_timeout(300)
    page.mouse.click(at["x"] - 300, at["y"] - 200)
    page.wait_for_timeout(500)
    state = page.evaluate(NODE_STATE, "LingBotParallel")
    record(state is not None, "the node search finds LingBot Parallel and adds it", str(state and state["widgets"]))
    problems = widgets_match(state, "LingBotParallel")
    record(state is not None and not problems,
           "LingBot Parallel shows its widgets (devices, cfg, ulysses) with the declared defaults",
           "; ".join(problems) or ", ".join(f"{w['name']}={w['value']!r}" for w in state["widgets"]))
    if state is not None:
        focus_shot(page, state["id"], shots / "parallel_node.png")

    page.mouse.click(at["x"] + 420, at["y"] + 40, button="right")
    page.wait_for_timeout(600)
    try:
        for label in ("Add Node", "LingBot-Video", "LingBot Loader"):
            page.locator(".litemenu-entry", has_text=label).filter(
                has_not_text="(files)" if label == "LingBot Loader" else "\u0000").first.click(timeout=5000)
            page.wait_for_timeout(500)
    except Exception as exc:  # noqa: BLE001 - reported as the check's detail
        page.screenshot(path=str(shots / "menu_add_loader.png"))
        record(False, "the canvas menu adds LingBot Loader (Add Node > LingBot-Video)", str(exc)[:300])
        return
    state = page.evaluate(NODE_STATE, "LingBotLoader")
    problems = widgets_match(state, "LingBotLoader")
    chunk = next((w for w in (state or {}).get("widgets", []) if w["name"] == "ffn_chunk"), None)
    record(state is not None, "the canvas menu adds LingBot Loader (Add Node > LingBot-Video)")
    record(state is not None and not problems and chunk is not None and chunk["value"] == "auto",
           "LingBot Loader shows its widgets in the declared order at the declared defaults (ffn_chunk auto)",
           "; ".join(problems) or (f"ffn_chunk={chunk['value']!r} of {chunk['options']}" if chunk else "no ffn_chunk"))
    if state is not None:
        focus_shot(page, state["id"], shots / "loader_node_ffn_chunk.png")


WIDE_NODES = (("LingBotLoaderFiles", "LingBot Loader (files)"), ("LingBotMemoryReport", "LingBot Memory Report"))

# What the page shows of a node's title and widget labels: under Nodes 2.0 the elements themselves (cut when
# an element's text is wider than its box or its box runs past the node's); on the classic canvas, the node's
# width against the text measured in the canvas' fonts: the title plus badges plus 80 px (its dot and the room
# 1.58 keeps at its right, seen cutting a title); a label plus its value (up to 360 px: the classic canvas of
# 1.5x hides a label whenever the value does not fit whole) plus 84 px of margins, arrows and gaps. Every list is
# first set to its longest choice.
LONGEST_CHOICES = """(id) => {
  const node = window.app.graph.getNodeById(id);
  for (const w of node.widgets || []) {
    const choices = Array.isArray(w.options?.values) ? w.options.values.map(String) : [];
    if (choices.length) w.value = choices.reduce((a, b) => (b.length > a.length ? b : a));
  }
  node.setDirtyCanvas?.(true, true);
}"""

TEXT_FITS = """([id, notes]) => {
  const node = window.app.graph.getNodeById(id);
  const LG = window.LiteGraph;
  const el = document.querySelector(`[data-node-id="${id}"]`);
  // the pack's notes box is measured by the run's checks (on 1.27 an empty box the canvas hides)
  const widgets = (node.widgets || []).filter((w) => !notes.includes(w.name));
  const texts = [node.title, ...widgets.map((w) => w.label ?? w.name)];
  const cut = [];
  if (el && el.offsetParent !== null) {
    const box = el.getBoundingClientRect();
    for (const text of texts) {
      const found = [...el.querySelectorAll("*")].filter((e) => e.children.length === 0
        && e.textContent.trim() === text && e.offsetParent !== null);
      if (!found.length) { cut.push(`${text} (not shown)`); continue; }
      if (!found.some((e) => e.scrollWidth <= e.clientWidth + 1 && e.getBoundingClientRect().right <= box.right + 1))
        cut.push(text);
    }
    return {renderer: "vue", width: Math.round(box.width), size: node.size[0], cut};
  }
  const ctx = document.createElement("canvas").getContext("2d");
  const px = (t, size) => { ctx.font = `${size}px ${LG.NODE_FONT || "Arial"}`; return ctx.measureText(String(t)).width; };
  const badges = (node.badges || []).map((b) => (typeof b === "function" ? b() : b)?.text).filter((t) => t)
    .reduce((sum, t) => sum + px(t, LG.NODE_SUBTEXT_SIZE || 12) + 12, 0);
  if (px(node.title, LG.NODE_TEXT_SIZE || 14) + badges + 80 > node.size[0]) cut.push(node.title);
  for (const w of widgets) {
    const value = Math.min(360, typeof w.value === "string" ? px(w.value, LG.NODE_SUBTEXT_SIZE || 12) : 0);
    if (px(w.label ?? w.name, LG.NODE_SUBTEXT_SIZE || 12) + value + 84 > node.size[0]) cut.push(w.label ?? w.name);
  }
  return {renderer: "classic", width: Math.round(node.size[0]), size: node.size[0], cut};
}"""


def check_new_node_widths(page, shots: Path) -> None:
    """LingBot Loader (files) and LingBot Memory Report from the node search: their title and every widget
    label in view (not cut, not hidden behind a long file name)."""
    for class_type, title in WIDE_NODES:
        page.evaluate("() => { window.app.graph.clear(); window.app.canvas.setDirty(true, true); }")
        page.wait_for_timeout(500)
        at = page.evaluate(CANVAS_POINT)
        if not open_search(page, at):
            record(False, f"the node search opens to add {title} (double-click on the canvas)")
            continue
        page.keyboard.type(title, delay=40)
        page.wait_for_timeout(1500)
        page.keyboard.press("Enter")
        page.wait_for_timeout(1000)
        page.mouse.click(at["x"] - 300, at["y"] - 200)
        page.wait_for_timeout(800)
        state = page.evaluate(NODE_STATE, class_type)
        if state is None:
            record(False, f"the node search adds {title}")
            continue
        page.evaluate(LONGEST_CHOICES, state["id"])  # a long file name picked on every list
        focus_shot(page, state["id"], shots / f"width_{class_type}.png")
        fits = page.evaluate(TEXT_FITS, [state["id"], list(NOTES)])
        record(not fits["cut"], f"{title} from the search shows its title and widget labels in full",
               f"{fits['renderer']}: node {fits['width']} px wide" + (f"; cut: {fits['cut']}" if fits["cut"] else ""),
               limit=None if any(str(c).startswith(title) for c in fits["cut"]) else "labels")  # widget names only


GALLERY = ("LingBotLoadVideo", "LingBotExtendVideo", "LingBotCaption", "LingBotLoader", "LingBotDenoise")

PLACE_NODES = """(types) => {
  const g = window.app.graph;
  g.clear();
  const placed = {};
  types.forEach((t, i) => {
    const n = window.LiteGraph.createNode(t);
    n.pos = [60 + (i % 3) * 460, 60 + Math.floor(i / 3) * 640];
    g.add(n);
    placed[t] = {id: n.id, inputs: (n.inputs || []).map((s) => s.name),
                 widgets: (n.widgets || []).map((w) => ({name: w.name, value: w.value, type: w.type,
                                                         options: w.options?.values ?? null}))};
  });
  g.setDirtyCanvas(true, true);
  return placed;
}"""


# A new blank workflow, as a user starts one (1.58's Nodes 2.0 kept drawing a cleared graph's node of the same id
# for a node added after `graph.clear()`: the Loader's missing preview settings on a new Load Video).
NEW_GRAPH = """async () => {
  try { await window.app.extensionManager?.command?.execute?.('Comfy.NewBlankWorkflow'); } catch (e) { /* older */ }
  window.app.graph.clear();
}"""


def check_node_gallery(page, shots: Path) -> None:
    """The nodes added last (Load Video, Extend Video, Caption's image value lists, the Loader's `sparse`
    attention, Denoise's `video` and `denoise`) on an empty graph, as a user adds them."""
    page.evaluate(NEW_GRAPH)
    page.wait_for_timeout(800)
    placed = page.evaluate(PLACE_NODES, list(GALLERY))
    for class_type in GALLERY:
        state = placed.get(class_type)
        problems = widgets_match(state, class_type)
        record(not problems, f"{class_type} shows the widgets the pack declares, at their defaults, with its choices",
               "; ".join(problems)[:600])
        if state is not None:
            focus_shot(page, state["id"], shots / f"node_{class_type}.png")
    denoise = placed.get("LingBotDenoise") or {"inputs": [], "widgets": []}
    record("video" in denoise["inputs"] and any(w["name"] == "denoise" for w in denoise["widgets"]),
           "Denoise has its video input and its denoise widget", f"inputs {denoise['inputs']}")
    attention = next((w for w in (placed.get("LingBotLoader") or {}).get("widgets", []) if w["name"] == "attention"),
                     None)
    record(attention is not None and "sparse" in (attention["options"] or []),
           "the Loader's attention offers sparse", str(attention and attention["options"]))
    page.evaluate("() => { const c = window.app.canvas; c.ds.scale = 0.7; c.ds.offset = [40, 40]; "
                  "c.setDirty(true, true); }")
    page.wait_for_timeout(800)
    page.screenshot(path=str(shots / "node_gallery.png"))


UPLOAD_GRAPH = """() => {
  const g = window.app.graph;
  g.clear();
  const video = window.LiteGraph.createNode('LingBotLoadVideo');
  video.pos = [100, 100];
  g.add(video);
  const frames = video.widgets.find((w) => w.name === 'frame_count');
  frames.value = 0;  // every frame of the clip
  frames.callback?.(0, window.app.canvas, video);
  const preview = window.LiteGraph.createNode('PreviewAny');
  preview.pos = [700, 100];
  g.add(preview);
  video.connect(1, preview, 0);  // frame_count
  g.setDirtyCanvas(true, true);
  const path = video.widgets.find((w) => w.name === 'path');
  const button = video.widgets.find((w) => w.type === 'button');
  return {id: video.id, preview: preview.id, first: path.options?.values?.[0] ?? null,
          after: button ? video.widgets.map((w) => w.name).slice(-1)[0] : null, label: button?.label ?? null};
}"""

PRESS_UPLOAD = """(id) => {
  const node = window.app.graph.getNodeById(id);
  const button = node.widgets.find((w) => w.type === 'button');
  button.callback?.(button.value, window.app.canvas, node);  // what a click on the button does
}"""

UPLOADED = """(id) => {
  const w = window.app.graph.getNodeById(id).widgets.find((x) => x.name === 'path');
  return {value: w.value, listed: (w.options?.values ?? []).includes(w.value)};
}"""

# Whether the node's element shows `name` in one of its lists (null: the node has no element, a canvas draws it).
SHOWS_FILE = """([id, name]) => {
  const el = [...document.querySelectorAll(`[data-node-id="${id}"]`)].find((e) => e.getBoundingClientRect().width > 2);
  if (!el) return null;
  return [...el.querySelectorAll('*')].some((e) => e.children.length === 0 && e.textContent.trim() === name);
}"""

# What of a node's element says a preview failed (an error line, an image that did not load); null: no element.
BROKEN_PREVIEW = """(id) => {
  const el = [...document.querySelectorAll(`[data-node-id="${id}"]`)].find((e) => e.getBoundingClientRect().width > 2);
  if (!el) return null;
  const text = (el.innerText || '').match(/[^\\n]*(failed to load|error loading)[^\\n]*/i);
  const image = [...el.querySelectorAll('img')].some((i) => i.complete && i.naturalWidth === 0);
  return text ? text[0].trim().slice(0, 80) : (image ? 'an image that did not load' : false);  // one line of it
}"""

CLIP_FRAMES = 5


def check_video_upload(page, shots: Path, timeout: float) -> None:
    """LingBot Load Video's upload combo as a user uses it: the button opens the file dialog, the chosen clip
    is uploaded into ComfyUI's input folder and picked in the list, and a run reads it (its frame count shown
    by a Preview Any node). Leaves `lingbot_editor_check.mp4` in the server's input folder."""
    import tempfile

    import torch

    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from lingbot_core.video import save_mp4

    page.evaluate(NEW_GRAPH)
    page.wait_for_timeout(800)
    placed = page.evaluate(UPLOAD_GRAPH)
    record(placed["first"] == "(test pattern)" and placed["after"] is not None,
           "LingBot Load Video shows its file list ((test pattern) first) and an upload button",
           f"first choice {placed['first']!r}, button {placed['label']!r}")
    if placed["after"] is None:
        return
    focus_shot(page, placed["id"], shots / "load_video_upload_before.png")
    broken = page.evaluate(BROKEN_PREVIEW, placed["id"])
    if broken is not None:  # a renderer of elements (Nodes 2.0)
        record(not broken, "a new Load Video (the test pattern) shows no failed preview", str(broken), limit="preview")
    with tempfile.TemporaryDirectory() as folder:
        clip = save_mp4(torch.rand(CLIP_FRAMES, 32, 32, 3), Path(folder) / "lingbot_editor_check.mp4")
        try:
            with page.expect_file_chooser(timeout=10_000) as chooser:
                page.evaluate(PRESS_UPLOAD, placed["id"])
            with page.expect_response(lambda r: "/upload/image" in r.url, timeout=30_000) as answer:
                chooser.value.set_files(str(clip))
            name = answer.value.json()["name"]  # the server's name for it ("... (1).mp4" when taken)
        except Exception as exc:  # noqa: BLE001 - reported as the check's detail
            record(False, "Load Video's upload button opens a file dialog and uploads the clip", str(exc)[:300])
            return
        end = time.time() + 30  # newer frontends show the local name first, then the server's
        got = page.evaluate(UPLOADED, placed["id"])
        while time.time() < end and got["value"] != name:
            page.wait_for_timeout(500)
            got = page.evaluate(UPLOADED, placed["id"])
    focus_shot(page, placed["id"], shots / "load_video_upload_after.png")
    record(got["value"] == name and got["listed"],
           "a clip uploaded with Load Video's button is picked in its list", f"uploaded as {name!r}: {got}")
    drawn = page.evaluate(SHOWS_FILE, [placed["id"], got["value"]])
    if drawn is not None:  # a renderer of elements (Nodes 2.0); the canvas draws its lists itself
        record(drawn, "the node shows the uploaded clip's name in its list", f"{got['value']!r} shown: {drawn}")
    state = queue_and_wait(page, shots, "load_video_upload", timeout)
    shown = page.evaluate(NODE_TEXT, [placed["preview"], ["preview", "preview_text"]])
    record(state["done"] == "success" and str(shown.get("text") or "").strip() == str(CLIP_FRAMES),
           f"a run reads the uploaded clip (Preview Any shows its {CLIP_FRAMES} frames)",
           f"{state['done']}; shown {shown.get('text')!r}")
    focus_shot(page, placed["id"], shots / "load_video_upload_run.png")


def check_old_workflows(page, shots: Path) -> None:
    """Files the pack shipped before widgets were added: every saved value stays on its widget (the saved
    list is a prefix of what the editor now holds), the added widgets hold their declared defaults, and
    the editor queues the old API twin's values plus those defaults."""
    for path in sorted(p for p in OLD_WORKFLOWS.glob("*.json") if not p.name.endswith(".api.json")):
        wf = json.loads(path.read_text())
        out = page.evaluate(LOAD_AND_COMPARE, wf)
        page.wait_for_timeout(500)
        dismiss_dialogs(page)
        record(not out["unknown"], f"old {path.name}: every node type is known", str(out["unknown"]))
        moved = [s for s in out["shifted"] if s["editor"] is None or s["editor"][:len(s["file"])] != s["file"]]
        record(not moved, f"old {path.name}: every saved widget value stays in place", json.dumps(moved)[:800])
        then = json.loads(path.with_suffix(".api.json").read_text())
        problems = []
        for nid, node in then.items():
            now = out["prompt"].get(nid, {}).get("inputs", {})
            problems += [f"{node['class_type']}.{k}: {now.get(k)!r} != saved {v!r}"
                         for k, v in node["inputs"].items() if now.get(k) != v]
            want = declared(node["class_type"])
            problems += [f"{node['class_type']}.{k} (added since): {now.get(k)!r} != default {want[k][0]!r}"
                         for k in set(now) - set(node["inputs"]) if k in want and now.get(k) != want[k][0]]
        record(not problems, f"old {path.name}: the editor queues the saved values, the added widgets at defaults",
               "; ".join(problems)[:800])
        loader = next(n for n in wf["nodes"] if n["type"] in ("LingBotLoader", "LingBotLoaderFiles"))
        focus_shot(page, loader["id"], shots / f"old_{path.stem}_loader.png")


PARALLEL_GRAPH = """([devices, nonce]) => {
  const g = window.app.graph;
  const byType = (t) => g._nodes.find((n) => n.type === t);
  const loader = byType('LingBotLoader'), offload = byType('LingBotOffload'), text = byType('LingBotTextEncode');
  const par = window.LiteGraph.createNode('LingBotParallel');
  par.pos = [loader.pos[0], loader.pos[1] + 420];
  g.add(par);
  loader.connect(0, par, 0);
  par.connect(0, offload, 0);
  par.widgets.find((w) => w.name === 'devices').value = devices;
  par.widgets.find((w) => w.name === 'cfg').value = '2';
  offload.widgets.find((w) => w.name === 'mode').value = 'none';
  text.widgets.find((w) => w.name === 'prompt').value = text.widgets.find((w) => w.name === 'prompt').value
    .replace('at dawn', 'at dawn, take ' + nonce);
  g.setDirtyCanvas(true, true);
  return par.id;
}"""


def check_parallel_run(page, shots: Path, devices: str, timeout: float) -> None:
    page.evaluate(LOAD_AND_COMPARE, json.loads(shipped()["lingbot_t2v_dense"][1].read_text()))
    dismiss_dialogs(page)
    node = page.evaluate(PARALLEL_GRAPH, [devices, int(time.time())])
    state = queue_and_wait(page, shots, "parallel", timeout)
    focus_shot(page, node, shots / "parallel_after_run.png")
    record(state["done"] == "success", f"T2V with LingBot Parallel ({devices}, cfg 2) queued from the Run button "
                                       "finishes", str(state["done"]))


PACK_CONSOLE = ("lingbot", "scripts/widgets.js", "inputEl is deprecated")  # what the pack's script caused


def renderer_setting(url: str, value: bool | None = None):
    """The frontend's Nodes 2.0 setting on the server (set first when `value` is given)."""
    import urllib.request

    address = f"{url.rstrip('/')}/api/settings/{VUE_SETTING}"
    if value is not None:
        urllib.request.urlopen(urllib.request.Request(address, data=json.dumps(value).encode(), method="POST"),
                               timeout=30).read()
    with urllib.request.urlopen(address, timeout=30) as answer:
        return json.loads(answer.read() or b"null")


def run_renderer(browser, args, renderer: str) -> str | None:
    """Every check in one renderer, on a fresh page; the frontend version the page reports."""
    global PREFIX, FRONTEND
    renderer_setting(args.url, RENDERERS[renderer])
    shots = args.shots / renderer
    shots.mkdir(parents=True, exist_ok=True)
    page = browser.new_context(viewport={"width": 1600, "height": 1000}).new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("console", lambda m: errors.append(f"{m.type}: {m.text} ({m.location.get('url', '')})")
            if m.type in ("warning", "error") else None)
    page.goto(args.url, timeout=120_000)
    page.wait_for_function("window.app && window.app.graph && window.app.api", timeout=120_000)
    page.wait_for_timeout(2000)
    version = page.evaluate("window.__COMFYUI_FRONTEND_VERSION__ || null")
    vue = page.evaluate(f"() => window.app.extensionManager?.setting?.get?.('{VUE_SETTING}') "
                        f"?? window.app.ui?.settings?.getSettingValue?.('{VUE_SETTING}') ?? null")
    PREFIX = f"[{version} {renderer}] "
    FRONTEND = (str(version), renderer)
    print(f"frontend {version}, renderer {renderer} ({VUE_SETTING} = {vue})", flush=True)
    record(vue == RENDERERS[renderer], f"the page runs the {renderer} renderer", f"{VUE_SETTING} = {vue}")
    dismiss_dialogs(page)
    check_templates(page, shots, args.pack)
    check_template_warnings(page, shots, args.pack)
    check_workflows(page, shots)
    check_run(page, shots, args.timeout)
    check_node_gallery(page, shots)
    check_video_upload(page, shots, args.timeout)
    check_new_nodes(page, shots)
    check_new_node_widths(page, shots)
    check_old_workflows(page, shots)
    if args.parallel:
        check_parallel_run(page, shots, args.parallel, args.timeout)
    if args.rewrite_port:
        check_rewrite(page, shots, args.rewrite_port, args.timeout)
    ours = [e for e in errors if any(mark in e for mark in PACK_CONSOLE)]
    record(not ours, "no page error or console warning from the pack's script", "; ".join(ours)[:400])
    page.context.close()
    return version


def main(argv: list[str] | None = None) -> int:
    from playwright.sync_api import sync_playwright

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8188")
    parser.add_argument("--chromium", default="/usr/bin/chromium")
    parser.add_argument("--pack", default="lingbot-nodes", help="the pack's folder name in custom_nodes/")
    parser.add_argument("--shots", type=Path, required=True, help="a folder for the screenshots")
    parser.add_argument("--timeout", type=float, default=600, help="seconds the queued run may take")
    parser.add_argument("--parallel", nargs="?", const="cpu, cpu", default=None, metavar="DEVICES",
                        help="also run the T2V workflow through LingBot Parallel on DEVICES (default 'cpu, cpu')")
    parser.add_argument("--rewrite-port", type=int, default=0,
                        help="run the Rewrite check against a canned endpoint on this loopback port (start ComfyUI "
                             "with LINGBOT_REWRITE_ENDPOINTS=http://127.0.0.1:PORT/v1)")
    parser.add_argument("--renderers", nargs="+", choices=list(RENDERERS), default=list(RENDERERS),
                        help="the renderers to run every check in (default: both)")
    args = parser.parse_args(argv)
    args.shots.mkdir(parents=True, exist_ok=True)
    saved = renderer_setting(args.url)
    covered = []
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=args.chromium, args=CHROMIUM_FLAGS)
            for renderer in args.renderers:
                start = len(RESULTS)
                version = run_renderer(browser, args, renderer)
                failed = sum(not ok for ok, _, _ in RESULTS[start:])
                known = sum(name.startswith(PREFIX) for name in KNOWN)
                covered.append(f"frontend {version} {renderer}: {len(RESULTS) - start - failed - known} of "
                               f"{len(RESULTS) - start} passed" + (f", {known} a known limit of that renderer "
                                                                   "(KNOWN above)" if known else ""))
            browser.close()
    finally:
        renderer_setting(args.url, bool(saved))
    failed = [name for ok, name, _ in RESULTS if not ok]
    for line in covered:
        print(f"covered: {line}")
    print(f"{len(RESULTS) - len(failed) - len(KNOWN)} passed, {len(KNOWN)} known limits, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
