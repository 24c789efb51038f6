"""The shipped workflows: structure, widget values, UI -> API conversion, and that they are current."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lingbot_core.workflow import Engine, load_workflow, ui_to_api
from lingbot_nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS
from workflows import build

ROOT = Path(__file__).resolve().parents[1] / "workflows"
UI_FILES = sorted(ROOT.glob("*.json"))  # named by their template titles (build.WORKFLOWS)
EXPECTED = {"lingbot_t2v_dense", "lingbot_t2i_dense", "lingbot_ti2v_dense", "lingbot_t2v_moe_refine",
            "lingbot_t2v_dense_dmd8", "lingbot_t2v_moe_lightlingbot4", "lingbot_t2v_dense_files",
            "lingbot_t2v_moe_gguf_lightlingbot4", "lingbot_t2v_dense_rewrite", "lingbot_ti2v_dense_rewrite",
            "lingbot_t2v_moe_dmd8", "lingbot_ti2v_moe_dmd8", "lingbot_t2v_moe_gguf_refine", "lingbot_v2v_dense",
            "lingbot_extend_dense"}


def test_every_shipped_workflow_has_both_formats():
    assert set(build.WORKFLOWS) == EXPECTED
    assert {p.name for p in UI_FILES} == {f"{spec['title']}.json" for spec in build.WORKFLOWS.values()}
    assert {p.stem for p in (ROOT / "api").glob("*.json")} == EXPECTED


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_ui_file_converts_to_exactly_the_shipped_api_file(name):
    ui = json.loads(build.ui_path(name).read_text())
    api = json.loads(build.api_path(name).read_text())
    assert ui_to_api(ui, NODE_CLASS_MAPPINGS, display_names=NODE_DISPLAY_NAME_MAPPINGS) == api


class _UploadBeforeOptional:
    """An upload button on a node with a seed after it and optional widgets after the required ones: the
    frontend saves the button's value after the last required widget, before the optional ones."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"path": (["a.png", "b.png"], {"image_upload": True}),
                             "seed": ("INT", {"default": 0, "control_after_generate": True}),
                             "count": ("INT", {"default": 1})},
                "optional": {"strength": ("FLOAT", {"default": 0.5}), "label": ("STRING", {"default": "x"})}}

    RETURN_TYPES = ("IMAGE",)
    FUNCTION = "run"


def test_writer_and_reader_share_the_saved_widget_layout(monkeypatch):
    """build.py writes an upload node's widgets_values where the converter reads them: the editor file it
    writes converts back to the API node it writes, and the upload value sits after the last required widget."""
    from lingbot_core.workflow.convert import UPLOAD_VALUE

    monkeypatch.setitem(build.NODE_CLASS_MAPPINGS, "UploadBeforeOptional", _UploadBeforeOptional)
    widgets = dict(path="b.png", seed=7, count=3, strength=0.25, label="y")
    nodes = [(1, "UploadBeforeOptional", "Upload", widgets, {})]
    ui = build.to_ui(nodes, "note")
    saved = next(n for n in ui["nodes"] if n["id"] == 1)["widgets_values"]
    assert saved == ["b.png", 7, build.SEED_CONTROL, 3, UPLOAD_VALUE, 0.25, "y"]
    registry = {"UploadBeforeOptional": _UploadBeforeOptional}
    assert ui_to_api(ui, registry) == build.to_api(nodes)


# Characters a file name cannot hold on Windows, macOS or Linux, or that a URL path would change
FILE_NAME_FORBIDDEN = set('<>:"/\\|?*#%') | {chr(c) for c in range(32)}
TITLE_MAX = 36  # what frontend 1.5x's one-line card title shows whole at a 1600 px wide window


def test_template_titles_are_distinct_file_names_with_their_thumbnails():
    """ComfyUI's template browser titles a pack's template by its file name (frontends 1.27 and 1.5x read
    nothing else), so each editor file is named by its title: a title is a short, distinct, portable file
    name saying the task first ("Text to video · ..."), and its thumbnail sits beside it, drawn from it."""
    titles = [spec["title"] for spec in build.WORKFLOWS.values()]
    assert len(set(titles)) == len(titles) and len({t.casefold() for t in titles}) == len(titles)
    for title in titles:
        assert not FILE_NAME_FORBIDDEN & set(title) and title == title.strip() and not title.endswith("."), title
        assert len(title) <= TITLE_MAX and " · " in title and not title.startswith("lingbot"), title
    for name in build.WORKFLOWS:
        assert build.ui_path(name).is_file() and build.thumbnail_path(name).is_file(), name
        assert build.thumbnail_path(name).stem == build.ui_path(name).stem == build.WORKFLOWS[name]["title"]
    assert build.stale_thumbnails() == []  # redraw: python workflows/build.py


def test_one_registry_names_the_shipped_workflows_for_the_builder_the_cli_and_the_editor_check():
    """`nodes/shipped.py` is the one list: the builder's specs are its entries, every alias the CLI takes
    and every title reach the same API file, and the editor check pairs the same files."""
    import sys

    from lingbot_nodes import shipped
    from lingbot_nodes.cli import resolve_workflow

    assert set(build.WORKFLOWS) == set(shipped.SHIPPED)
    for name, entry in shipped.SHIPPED.items():
        assert build.WORKFLOWS[name]["title"] == entry.title and build.api_path(name).is_file()
        assert resolve_workflow(name) == build.api_path(name)
        for alias in entry.aliases:
            assert resolve_workflow(alias) == build.api_path(name), alias
    sys.path.insert(0, str(ROOT.parent))
    from bench.comfy_editor import shipped as editor_pairs

    assert editor_pairs() == {name: (entry.title, build.ui_path(name), build.api_path(name))
                              for name, entry in shipped.SHIPPED.items()}


@pytest.mark.parametrize("path", UI_FILES, ids=lambda p: p.stem)
def test_ui_file_structure(path):
    ui = json.loads(path.read_text())
    nodes = {n["id"]: n for n in ui["nodes"]}
    for node in nodes.values():
        assert node["type"] in NODE_CLASS_MAPPINGS or node["type"] == "Note", node["type"]
    assert any(n["type"] == "Note" and n["widgets_values"][0] for n in nodes.values()), "a short note"
    assert ui["groups"], "a group"
    assert ui["last_link_id"] == max(link[0] for link in ui["links"])
    for link_id, src, src_slot, dst, dst_slot, kind in ui["links"]:
        out = nodes[src]["outputs"][src_slot]
        inp = nodes[dst]["inputs"][dst_slot]
        assert link_id in out["links"] and inp["link"] == link_id
        assert out["type"] == kind and (kind in inp["type"].split(",") or "*" in (kind, inp["type"]))  # "A,B": a multi-type input
    for node in nodes.values():
        for out in node.get("outputs", []):
            for link_id in out["links"]:
                assert any(link[0] == link_id for link in ui["links"])


@pytest.mark.parametrize("path", [*UI_FILES, *sorted((ROOT / "api").glob("*.json"))], ids=lambda p: p.parent.name + "/" + p.stem)
def test_widget_values_fit_the_inputs(path):
    """Full validation (types, ranges, combos, VALIDATE_INPUTS) passes without running anything."""
    prompt = load_workflow(path, NODE_CLASS_MAPPINGS, display_names=NODE_DISPLAY_NAME_MAPPINGS)
    targets = Engine(NODE_CLASS_MAPPINGS).validate(prompt)
    kinds = {prompt.nodes[t]["class_type"] for t in targets}
    assert "LingBotSaveVideo" in kinds and kinds <= {"LingBotSaveVideo", "LingBotMemoryReport"}


def test_files_are_generated_from_the_current_spec(capsys):
    """`python workflows/build.py --check`, in this process (a new one spends ~15 s importing the pack again)."""
    assert build.main(["--check"]) == 0, capsys.readouterr().out


def test_every_offload_node_and_prompt_field_is_sane():
    for path in (ROOT / "api").glob("*.json"):
        prompt = json.loads(path.read_text())
        kinds = [n["class_type"] for n in prompt.values()]
        assert "LingBotOffload" in kinds, path.name
        # plans (and requires) the refiner exactly when the workflow refines: a MoE folder without
        # refiner/ is refused before the base pass only where that matters
        plans = {n["inputs"]["plan_refine"] for n in prompt.values() if n["class_type"] == "LingBotOffload"}
        assert plans == {"LingBotRefine" in kinds}, path.name
        for node in prompt.values():
            if node["class_type"] == "LingBotTextEncode":
                given = node["inputs"]["prompt"]
                if isinstance(given, list):  # prose rewritten into the caption by a Rewrite node
                    assert prompt[given[0]]["class_type"] == "LingBotRewrite", path.name
                else:
                    json.loads(given)  # structured captions ship as valid JSON


# -- independent truth ---------------------------------------------------------------------------------
# The tests above check the UI files against our converter and the API files, which build.py writes
# from the same spec. The ones below do not go through `ui_to_api`: a conversion written out by
# hand for one workflow, and invariants read straight from the node classes' declarations.

def _ui_prompt_text() -> str:
    ui = json.loads(build.ui_path("lingbot_t2v_dense").read_text())
    return next(n for n in ui["nodes"] if n["id"] == 3)["widgets_values"][0]


def test_t2v_dense_converts_as_written_out_by_hand():
    """What ComfyUI's frontend sends for the T2V dense editor file, worked out by hand from the file.

    Its rules (graphToPrompt): one entry per node that is not a Note, keyed by the node id as a string;
    every widget's value under the widget's name, except the seed's "control after generate" widget,
    which is not serialised; a linked input as [source id, output slot]; unlinked optional inputs
    are absent; `_meta.title` is the node's title. If you change the workflow on purpose, redo this
    by hand from the new file; do not paste the converter's output here.
    """
    expected = {
        "1": {"class_type": "LingBotLoader", "_meta": {"title": "Loader"},
              "inputs": {"checkpoint": "tiny (built-in dense)", "variant": "auto", "dtype": "auto",
                         "attention": "default", "path": "", "device": "auto", "weights": "auto",
                         "transformer_path": "", "compile": "off", "ffn_chunk": "auto",
                         "fp8_matmul": "decode"}},
        "2": {"class_type": "LingBotOffload", "_meta": {"title": "Offload"},
              "inputs": {"pipe": ["1", 0], "mode": "model", "use_stream": True, "low_cpu_mem_usage": False,
                         "num_blocks_per_group": 1, "plan_width": 832, "plan_height": 480, "plan_frames": 121,
                         "plan_refine": False, "offload_to": "ram"}},
        "3": {"class_type": "LingBotTextEncode", "_meta": {"title": "Prompt"},
              "inputs": {"pipe": ["2", 0], "prompt": _ui_prompt_text(), "negative_prompt": "", "task": "t2v",
                         "image_width": 832, "image_height": 480, "encode_negative": True}},
        "4": {"class_type": "LingBotDenoise", "_meta": {"title": "Denoise"},
              "inputs": {"pipe": ["2", 0], "conditioning": ["3", 0], "width": 64, "height": 64, "frames": 9,
                         "steps": 4, "cfg": 3.0, "shift": 3.0, "seed": 42, "sampler": "flow_unipc", "sigmas": "",
                         "cfg_batch": "off", "step_cache": "off", "cache_threshold": 0.0, "cache_warmup_steps": -1,
                         "cache_max_skips": -1, "denoise": 1.0}},
        "5": {"class_type": "LingBotDecode", "_meta": {"title": "Decode"},
              "inputs": {"pipe": ["2", 0], "latent": ["4", 0], "tiling": False, "tile_height": 256,
                         "tile_width": 256, "stride_height": 192, "stride_width": 192, "fps": 24.0, "vae": "full"}},
        "6": {"class_type": "LingBotSaveVideo", "_meta": {"title": "Save"},
              "inputs": {"images": ["5", 0], "fps": 24.0, "filename_prefix": "lingbot/t2v"}},
    }
    assert _ui_prompt_text().startswith('{"caption":{"comprehensive_description"')
    ui = json.loads(build.ui_path("lingbot_t2v_dense").read_text())
    assert ui_to_api(ui, NODE_CLASS_MAPPINGS, display_names=NODE_DISPLAY_NAME_MAPPINGS) == expected
    assert json.loads((ROOT / "api" / "lingbot_t2v_dense.json").read_text()) == expected


def _declared(class_type: str):
    from lingbot_core.workflow.nodeinfo import NodeClassInfo

    return NodeClassInfo(class_type, NODE_CLASS_MAPPINGS[class_type])


def _fits(spec, value) -> bool:
    options = spec.combo_options
    if options is not None:
        return value in options
    kind = spec.type
    if kind == "BOOLEAN":
        return isinstance(value, bool)
    if kind == "INT":
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind == "FLOAT":
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif kind == "STRING":
        return isinstance(value, str)
    else:
        return False  # a connection type cannot take a constant
    low, high = spec.options.get("min"), spec.options.get("max")
    return ok and (low is None or value >= low) and (high is None or value <= high)


@pytest.mark.parametrize("path", sorted((ROOT / "api").glob("*.json")), ids=lambda p: p.stem)
def test_api_files_follow_the_declarations(path):
    """Every input is declared, every required one is given, constants fit their widget, and every
    link leaves an existing output whose type is the one the input declares."""
    prompt = json.loads(path.read_text())
    for nid, node in prompt.items():
        info = _declared(node["class_type"])
        visible = {s.name: s for s in info.visible_inputs()}
        assert set(node["inputs"]) <= set(visible), (nid, set(node["inputs"]) - set(visible))
        required = {n for n, s in visible.items() if s.category == "required"}
        assert required <= set(node["inputs"]), (nid, required - set(node["inputs"]))
        for name, value in node["inputs"].items():
            spec = visible[name]
            if isinstance(value, list):
                src, slot = value
                returns = _declared(prompt[src]["class_type"]).return_types
                assert slot < len(returns), (nid, name)
                assert "*" in (returns[slot], spec.type) or returns[slot] in spec.type.split(","), (nid, name, returns[slot])
            else:
                assert _fits(spec, value), (nid, name, value)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_ui_widget_values_line_up_with_the_declared_widgets(name):
    """One saved value per declared widget, in declaration order, plus one after each seed and the upload
    button's after the last required widget (where the editor adds it); the API twin holds the same
    constants (the shipped API file, not our converter's output)."""
    ui = json.loads(build.ui_path(name).read_text())
    api = json.loads(build.api_path(name).read_text())
    nodes = [n for n in ui["nodes"] if n["type"] != "Note"]
    assert {str(n["id"]) for n in nodes} == set(api)
    for node in nodes:
        widgets = [s for s in _declared(node["type"]).visible_inputs() if s.is_widget]
        values = list(node.get("widgets_values") or [])
        controls = sum(bool(s.options.get("control_after_generate")) for s in widgets)
        uploads = sum(s.has_upload_widget for s in widgets)
        assert len(values) == len(widgets) + controls + uploads, node["title"]
        required = sum(s.category == "required" for s in widgets) + sum(
            bool(s.options.get("control_after_generate")) for s in widgets if s.category == "required")
        assert values[required:required + uploads] == ["image"] * uploads, node["title"]
        del values[required:required + uploads]
        for spec in widgets:
            value = values.pop(0)
            if spec.options.get("control_after_generate"):
                assert values.pop(0) in ("fixed", "increment", "decrement", "randomize"), node["title"]
            linked = any(i["name"] == spec.name and i.get("link") is not None for i in node.get("inputs", []))
            if not linked:
                assert api[str(node["id"])]["inputs"][spec.name] == value, (node["title"], spec.name)


def test_notes_quote_the_estimator_for_their_own_model():
    """The Notes' VRAM figures are the estimator's (bench/memory_table.py) and each Note speaks of
    its own model: no dense figure in a MoE workflow, no "suits 24 GB cards" for the MoE."""
    import sys

    sys.path.insert(0, str(ROOT.parent))
    from bench.recipes import note_figures

    assert build.NOTE_FIGURES == note_figures()  # tests/test_advice.py checks them against the README's tables
    for name, spec in build.WORKFLOWS.items():
        note = spec["note"]
        moe = any((n[1] == "LingBotLoader" and n[3].get("variant") == "moe") or
                  (n[1] == "LingBotLoaderFiles" and "moe" in n[3].get("checkpoint", "")) for n in spec["nodes"])
        assert "24 GB cards" not in note
        if moe:
            assert build.DENSE_OFFLOAD not in note and any(f"about {build._F[k]} GiB" in note
                                                           for k in ("moe_base", "moe_base_cfg1")), name
        else:  # a dense Note may name a MoE template by its title, and speaks of no MoE otherwise
            prose = note
            for other in build.WORKFLOWS.values():
                prose = prose.replace(other["title"], "")
            assert build.DENSE_OFFLOAD in note and "MoE" not in prose, name


TITLE_BAR = 30  # the editor draws a node's title bar above its saved position


def _box(node: dict) -> tuple[float, float, float, float]:
    x, y = node["pos"]
    w, h = node["size"]
    return x, y - TITLE_BAR, x + w, y + h


@pytest.mark.parametrize("path", UI_FILES, ids=lambda p: p.stem)
def test_ui_nodes_do_not_overlap(path):
    """Nodes (title bar included) and the Note lie side by side: a wider node pushes the next column right."""
    nodes = json.loads(path.read_text())["nodes"]
    for i, a in enumerate(nodes):
        ax0, ay0, ax1, ay1 = _box(a)
        for b in nodes[i + 1:]:
            bx0, by0, bx1, by1 = _box(b)
            assert ax1 <= bx0 or bx1 <= ax0 or ay1 <= by0 or by1 <= ay0, (a["title"], b["title"])


def _text_boxes(class_type: str) -> set[str]:
    """The node's multiline text widgets (the boxes the classic canvas gives its spare room)."""
    from lingbot_core.workflow.nodeinfo import NodeClassInfo

    return {s.name for s in NodeClassInfo(class_type, NODE_CLASS_MAPPINGS[class_type]).visible_inputs()
            if s.is_widget and s.options.get("multiline")}


def _content_height(node: dict) -> int:
    """What the classic canvas needs for a saved node, counted on the file (its slots, outputs and saved widget
    values; the text boxes at their smallest), with the frontend's numbers `workflows/build.py` states."""
    slots = sum(1 for entry in node["inputs"] if "widget" not in entry)
    rows = max(1, slots, len(node["outputs"]))
    boxes = len(_text_boxes(node["type"]))
    widgets = len(node["widgets_values"])
    tall = (widgets - boxes) * (build.WIDGET_ROW + build.WIDGET_GAP) + boxes * (build.TEXT_BOX_ROW + build.WIDGET_GAP)
    margin = build.WIDGETS_MARGIN if widgets or build._sends_notes(node["type"]) else 0
    return rows * build.SLOT_ROW + tall + margin + build.NODE_MARGIN


@pytest.mark.parametrize("path", UI_FILES, ids=lambda p: p.stem)
def test_nodes_are_saved_as_tall_as_the_canvas_draws_them(path):
    """A node opens at its saved height, so one saved taller than its content shows empty room at its bottom
    (Denoise was saved 606 px tall for 498 px of widgets): every node is saved at its content's height, but one
    with a text box the user types in, whose boxes take the room past the content and keep the room they had
    (at least 90 px past their smallest height each). A linked box shows no text and gets no room."""
    for node in json.loads(path.read_text())["nodes"]:
        if node["type"] == "Note":
            continue
        linked = {entry["widget"]["name"] for entry in node["inputs"] if "widget" in entry}
        typed = _text_boxes(node["type"]) - linked
        need, height = _content_height(node), node["size"][1]
        if typed:
            assert height >= need + 90 * len(typed), (path.stem, node["title"], height, need)
        else:
            assert height == need, (path.stem, node["title"], height, need)


def test_the_pictures_draw_every_widget_inside_its_node():
    """The thumbnails and README picture (docs/render_graph.py) lay the widgets out as the canvas does, so
    every saved widget is drawn, inside its node (a node saved at its content's height has no row to spare)."""
    build_graph = build._render_graph()
    for path in UI_FILES:
        for node in json.loads(path.read_text())["nodes"]:
            if node["type"] == "Note":
                continue
            rows = build_graph.widget_rows(node)
            assert len(rows) == len(node["widgets_values"]), (path.stem, node["title"])
            _name, _value, top, tall = rows[-1] if rows else ("", None, node["pos"][1], 0)
            assert top + tall <= node["pos"][1] + node["size"][1], (path.stem, node["title"])


@pytest.mark.parametrize("path", UI_FILES, ids=lambda p: p.stem)
def test_files_loader_is_wide_enough_for_file_names(path):
    """Loader (files) is saved wide enough that a long file name does not hide its label (issue 37 item 6),
    and the group around the graph spans every node."""
    ui = json.loads(path.read_text())
    for node in ui["nodes"]:
        if node["type"] == "LingBotLoaderFiles":
            assert node["size"][0] >= build.FILES_LOADER_WIDTH, path.stem
    gx, _gy, gw, _gh = ui["groups"][0]["bounding"]
    assert all(gx <= n["pos"][0] and n["pos"][0] + n["size"][0] <= gx + gw for n in ui["nodes"]), path.stem


def test_memory_report_is_titled_by_its_name():
    """Memory Report is saved under its own name (a bare "Memory" read as a cut title)."""
    titles = {n["title"] for path in UI_FILES for n in json.loads(path.read_text())["nodes"]
              if n["type"] == "LingBotMemoryReport"}
    assert titles == {NODE_DISPLAY_NAME_MAPPINGS["LingBotMemoryReport"].removeprefix("LingBot ")}
