"""The editor check's own bookkeeping (bench/comfy_editor.py; the check itself needs ComfyUI and Chromium):
which frontend's renderer a known limit excuses, which of a new node's widgets are the pack's, and which
saved heights leave empty room."""

from __future__ import annotations

import pytest

from bench import comfy_editor as check


@pytest.fixture(autouse=True)
def _fresh_results(monkeypatch):
    monkeypatch.setattr(check, "RESULTS", [])
    monkeypatch.setattr(check, "KNOWN", [])
    monkeypatch.setattr(check, "PREFIX", "")


def test_a_known_limit_excuses_a_failure_only_on_its_frontend_line_and_renderer(monkeypatch, capsys):
    key = next(iter(check.KNOWN_LIMITS))
    line, renderer, limit = key
    monkeypatch.setattr(check, "FRONTEND", (f"{line}.10", renderer))
    check.record(False, "no node lies over another", "a and b: 88 px", limit=limit)
    assert check.RESULTS[-1][0] is True and check.KNOWN == ["no node lies over another"]
    assert capsys.readouterr().out.startswith("KNOWN no node lies over another: a and b: 88 px (")
    for other in ((f"{line}.10", "classic"), ("9.99.0", renderer)):
        monkeypatch.setattr(check, "FRONTEND", other)
        check.record(False, "no node lies over another", limit=limit)
        assert check.RESULTS[-1][0] is False
    check.record(False, "something else")  # no limit named: a failure wherever
    assert check.RESULTS[-1][0] is False and len(check.KNOWN) == 1


def test_a_new_nodes_own_widgets_are_told_from_the_frontends():
    """The seed's control, an upload combo's button and the pack's notes box are not declared widgets; an
    upload combo offers its declared first choice, the server's files after it."""
    want = check.declared("LingBotLoadVideo")
    widgets = [{"name": name, "value": default, "type": "combo" if choices else "number",
                "options": (choices + ["clip.mp4"]) if choices else None} for name, (default, choices) in want.items()]
    widgets += [{"name": "upload", "value": "image", "type": "button", "options": None},
                {"name": check.NOTES[-1], "value": "", "type": "customtext", "options": None}]
    assert check.widgets_match({"widgets": widgets}, "LingBotLoadVideo") == []
    moved = [widgets[1], widgets[0], *widgets[2:]]
    assert check.widgets_match({"widgets": moved}, "LingBotLoadVideo")  # order counts
    no_button = widgets[:-2]  # a list of files without an upload button offers exactly what is declared
    assert any("offers" in p for p in check.widgets_match({"widgets": no_button}, "LingBotLoadVideo"))


def test_a_node_saved_taller_than_its_content_is_loose_unless_a_text_box_takes_the_room():
    """A loaded node's height on the classic canvas against its content (computeSize): Denoise as shipped before
    (606 px for 498 px of widgets) is loose; one saved at its content, or within the widgets' margin of it, is
    not; a node whose text boxes share the room past the content may be taller, never shorter; a node the
    canvas grew (saved too short) is loose."""
    def row(saved, content, shares=False, height=None):
        return {"title": "n", "saved": saved, "height": saved if height is None else height, "content": content,
                "shares": shares, "outside": []}

    assert check.loose_heights([row(606, 498)])
    assert not check.loose_heights([row(498, 498), row(54, 54 - check.SPARE_PX), row(474, 278, shares=True)])
    assert check.loose_heights([row(54, 54 - check.SPARE_PX - 1)])
    assert check.loose_heights([row(270, 278, shares=True)])
    assert check.loose_heights([row(260, 278, height=278)])
