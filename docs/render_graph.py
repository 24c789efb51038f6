"""Draw a shipped UI workflow as a PNG for the README (Pillow only; no browser, no ComfyUI).

The picture is drawn from the workflow file itself: node boxes at their saved positions and sizes,
titles, input/output slots, each widget's name (from the node class's declared inputs) with its
saved value, the links between slots coloured by type, and the group frame. It imitates the
ComfyUI editor's look; it is not a screenshot of it.

    python docs/render_graph.py                                   # docs/graph-moe-refine.png
    python docs/render_graph.py "workflows/Text to video · dense 1.3B.json" docs/graph-t2v.png

The template thumbnails (`workflows/<title>.jpg`) are drawn by `python workflows/build.py`, which knows
each workflow's title and summary.
"""

from __future__ import annotations

import hashlib
import json
import sys
import textwrap
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont
from PIL.PngImagePlugin import PngInfo

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / ".dev")]

SCALE = 0.75
# The classic canvas' layout (the numbers workflows/build.py sizes the nodes with): slot rows, then the widgets
# from 6 px below them, each a row and a gap; multiline text boxes share the room the other widgets leave.
TITLE_H, SLOT_H, WIDGET_H, WIDGET_GAP, PAD = 30, 20, 20, 4, 40
WIDGETS_TOP = 6
BACKGROUND, GRID = (32, 32, 32), (40, 40, 40)
NODE_BODY, NODE_TITLE, NODE_EDGE, TEXT, DIM = (53, 53, 53), (34, 34, 34), (20, 20, 20), (230, 230, 230), (160, 160, 160)
WIDGET_BG = (34, 34, 34)
LINK_COLOURS = {"LINGBOT_PIPE": (178, 132, 255), "LINGBOT_COND": (255, 170, 80), "LINGBOT_IMAGE_COND": (120, 200, 120),
                "LATENT": (255, 156, 249), "IMAGE": (100, 181, 246), "*": (200, 200, 200)}


def font(size: int, bold: bool = False) -> ImageFont.ImageFont:
    name = "DejaVuSans-Bold.ttf" if bold else "DejaVuSans.ttf"
    for folder in ("/usr/share/fonts/truetype/dejavu", "/usr/share/fonts/dejavu", "/Library/Fonts"):
        if (Path(folder) / name).is_file():
            return ImageFont.truetype(str(Path(folder) / name), size)
    return ImageFont.load_default()


UPLOAD_LABEL = "choose file to upload"  # the editor's upload button, drawn as a button


def widget_names(class_type: str) -> list[str]:
    """A label for each position of the node's saved widgets_values, in the converter's layout: the
    widget's name, a seed's control widget, an upload button."""
    from lingbot_core.workflow.convert import CONTROL, UPLOAD, saved_widget_slots
    from lingbot_core.workflow.nodeinfo import NodeClassInfo
    from lingbot_nodes import NODE_CLASS_MAPPINGS

    cls = NODE_CLASS_MAPPINGS.get(class_type)
    if cls is None:
        return []
    labels = {CONTROL: "control after generate", UPLOAD: UPLOAD_LABEL}
    return [slot.spec.name if slot.spec is not None else labels[slot.ui_only]
            for slot in saved_widget_slots(NodeClassInfo(class_type, cls).visible_inputs())]


def text_boxes(class_type: str) -> set[str]:
    """The node's multiline text widgets (drawn as boxes sharing the room the other widgets leave)."""
    from lingbot_core.workflow.nodeinfo import NodeClassInfo
    from lingbot_nodes import NODE_CLASS_MAPPINGS

    cls = NODE_CLASS_MAPPINGS.get(class_type)
    if cls is None:
        return set()
    return {s.name for s in NodeClassInfo(class_type, cls).visible_inputs()
            if s.is_widget and s.options.get("multiline")}


def widget_rows(node: dict) -> list[tuple[str, object, float, float]]:
    """Each saved widget of a node with its top and height on the canvas: (name, value, y, height)."""
    x, y = node["pos"]
    slots = [s for s in node.get("inputs", []) if "widget" not in s]
    top = y + max(1, len(slots), len(node.get("outputs", []))) * SLOT_H + WIDGETS_TOP
    names = widget_names(node["type"])
    boxes = text_boxes(node["type"])
    fixed = sum(1 for name in names if name not in boxes) * (WIDGET_H + WIDGET_GAP)
    count = sum(1 for name in names if name in boxes)
    share = max(50.0, (y + node["size"][1] - top - fixed) / count) if count else 0.0
    rows = []
    for name, value in zip(names, node.get("widgets_values") or []):
        tall = share - WIDGET_GAP if name in boxes else WIDGET_H
        rows.append((name, value, top, tall))
        top += tall + WIDGET_GAP
    return rows


THUMBNAIL_SIZE = 512  # square: the template browser's cards are square in both frontends (1.27, 1.5x)
# The band colour of a template's thumbnail, by the task its title starts with ("Text to video · ...").
TASK_COLOURS = {"Text to video": (40, 90, 160), "Image to video": (40, 120, 70), "Text to image": (150, 90, 30),
                "Video to video": (110, 60, 150), "Extend a video": (30, 120, 120)}


def wrap(draw: ImageDraw.ImageDraw, text: str, face: ImageFont.ImageFont, width: int) -> list[str]:
    """Words packed into lines no wider than `width` pixels."""
    lines: list[str] = []
    for word in text.split():
        if lines and draw.textlength(f"{lines[-1]} {word}", font=face) <= width:
            lines[-1] += f" {word}"
        else:
            lines.append(word)
    return lines


def fitted(draw: ImageDraw.ImageDraw, text: str, size: int, width: int, bold: bool = True) -> ImageFont.ImageFont:
    """The largest font up to `size` that draws `text` on one line within `width`."""
    while size > 12 and draw.textlength(text, font=font(size, bold)) > width:
        size -= 1
    return font(size, bold)


def thumbnail(graph: Image.Image, title: str, summary: str) -> Image.Image:
    """A template card: the title on a band in its task's colour (the task large, the rest below it), the
    summary, and the graph drawn small underneath. The browser shows a pack's file name as the title and
    no description; this is where the summary can be read, and what tells two graphs apart at a glance."""
    side, margin = THUMBNAIL_SIZE, 24
    task, _, variant = title.partition(" · ")
    card = Image.new("RGB", (side, side), (28, 28, 28))
    draw = ImageDraw.Draw(card)
    draw.rectangle([0, 0, side, 168], fill=TASK_COLOURS[task])
    brand = font(18, bold=True)  # top right: the newer browser puts its "Node graph" badge top left
    draw.text((side - margin - draw.textlength("LingBot-Video", font=brand), 16), "LingBot-Video", font=brand,
              fill=(225, 232, 240))
    draw.text((margin, 46), task, font=fitted(draw, task, 44, side - 2 * margin), fill=(255, 255, 255))
    draw.text((margin, 106), variant, font=fitted(draw, variant, 34, side - 2 * margin), fill=(255, 255, 255))
    face = font(21)
    y = 184
    for line in wrap(draw, summary, face, side - 2 * margin)[:3]:
        draw.text((margin, y), line, font=face, fill=(222, 222, 222))
        y += 28
    box = (side - 2 * 12, side - y - 24)
    scale = min(box[0] / graph.width, box[1] / graph.height)
    small = graph.convert("RGB").resize((round(graph.width * scale), round(graph.height * scale)), Image.LANCZOS)
    card.paste(small, ((side - small.width) // 2, side - 12 - small.height))
    return card


DIGEST_KEY = "lingbot-inputs"  # PNG text chunk: what the picture was drawn from (tests/test_readme.py)


def inputs_digest(workflow: Path, caption: tuple[str, str] | None = None) -> str:
    """A hash of everything the picture depends on: the workflow file, each drawn class's widget
    names, this script, and a thumbnail's title and summary. A stale picture (a new input, an edited
    workflow, a retitled template) no longer matches."""
    data = json.loads(workflow.read_text())
    widgets = {n["type"]: widget_names(n["type"]) for n in data["nodes"]}
    h = hashlib.sha256()
    parts = [workflow.read_bytes(), json.dumps(widgets, sort_keys=True).encode(), Path(__file__).read_bytes()]
    for part in parts + ([json.dumps(caption).encode()] if caption else []):
        h.update(hashlib.sha256(part).digest())
    return h.hexdigest()


def shown(value: object, width: int) -> str:
    text = json.dumps(value) if isinstance(value, bool) else str(value)
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1] + "…"


def render(workflow: Path, out: Path, caption: tuple[str, str] | None = None) -> Path:
    """The graph as a PNG (`out` .png), or a template thumbnail (`out` .jpg) with `caption` (title, summary)."""
    data = json.loads(workflow.read_text())
    nodes = {n["id"]: n for n in data["nodes"]}
    xs = [n["pos"][0] for n in nodes.values()] + [g["bounding"][0] for g in data.get("groups", [])]
    ys = [n["pos"][1] - TITLE_H for n in nodes.values()] + [g["bounding"][1] for g in data.get("groups", [])]
    x1 = max([n["pos"][0] + n["size"][0] for n in nodes.values()]
             + [g["bounding"][0] + g["bounding"][2] for g in data.get("groups", [])])
    y1 = max([n["pos"][1] + n["size"][1] for n in nodes.values()]
             + [g["bounding"][1] + g["bounding"][3] for g in data.get("groups", [])])
    ox, oy = min(xs) - PAD, min(ys) - PAD

    def p(x: float, y: float) -> tuple[float, float]:
        return ((x - ox) * SCALE, (y - oy) * SCALE)

    size = (int((x1 - ox + PAD) * SCALE), int((y1 - oy + PAD) * SCALE))
    image = Image.new("RGB", size, BACKGROUND)
    draw = ImageDraw.Draw(image)
    for gx in range(0, size[0], int(100 * SCALE)):
        draw.line([(gx, 0), (gx, size[1])], fill=GRID)
    for gy in range(0, size[1], int(100 * SCALE)):
        draw.line([(0, gy), (size[0], gy)], fill=GRID)
    f_title, f_text, f_small = font(int(16 * SCALE), True), font(int(14 * SCALE)), font(int(13 * SCALE))

    for group in data.get("groups", []):
        gx, gy, gw, gh = group["bounding"]
        colour = tuple(int(group.get("color", "#3f789e")[i:i + 2], 16) for i in (1, 3, 5))
        draw.rectangle([p(gx, gy), p(gx + gw, gy + gh)], outline=colour, width=2)
        draw.rectangle([p(gx, gy), p(gx + gw, gy + 34)], fill=tuple(c // 2 for c in colour))
        draw.text(p(gx + 10, gy + 6), group.get("title", ""), font=font(int(20 * SCALE), True), fill=TEXT)

    def slot_y(node: dict, index: int) -> float:  # the middle of a slot row's dot
        return node["pos"][1] + 14 + index * SLOT_H

    def input_y(node: dict, index: int) -> float:
        """A linked widget's input sits beside its widget; the other inputs in the slot rows, in order."""
        entry = node["inputs"][index]
        if "widget" in entry:
            row = next((r for r in widget_rows(node) if r[0] == entry["widget"]["name"]), None)
            if row is not None:
                return row[2] + min(row[3], WIDGET_H) / 2
        return slot_y(node, [s for s in node["inputs"] if "widget" not in s].index(entry))

    # Links first, so the boxes sit on top of their ends.
    for _lid, src, src_slot, dst, dst_slot, kind in data["links"]:
        a, b = nodes[src], nodes[dst]
        start = (a["pos"][0] + a["size"][0], slot_y(a, src_slot))
        end = (b["pos"][0], input_y(b, dst_slot))
        bend = max(60.0, abs(end[0] - start[0]) * 0.5)
        curve = []
        for i in range(41):  # cubic Bezier with horizontal tangents, as litegraph draws links
            t = i / 40
            cx = [start[0], start[0] + bend, end[0] - bend, end[0]]
            cy = [start[1], start[1], end[1], end[1]]
            w = [(1 - t) ** 3, 3 * t * (1 - t) ** 2, 3 * t * t * (1 - t), t ** 3]
            curve.append(p(sum(wi * c for wi, c in zip(w, cx)), sum(wi * c for wi, c in zip(w, cy))))
        draw.line(curve, fill=LINK_COLOURS.get(kind, LINK_COLOURS["*"]), width=max(2, int(4 * SCALE)))

    for node in nodes.values():
        x, y = node["pos"]
        w, h = node["size"]
        title = node.get("title") or node["type"]
        if node["type"] == "Note":
            draw.rectangle([p(x, y - TITLE_H), p(x + w, y + h)], fill=(70, 66, 40), outline=NODE_EDGE)
            draw.text(p(x + 8, y - TITLE_H + 7), "Note", font=f_title, fill=TEXT)
            body = textwrap.wrap(str((node.get("widgets_values") or [""])[0]), width=int(w / 7.4))
            for i, line in enumerate(body[: int(h / 18)]):
                draw.text(p(x + 8, y + 6 + i * 18), line, font=f_small, fill=TEXT)
            continue
        draw.rounded_rectangle([p(x, y - TITLE_H), p(x + w, y + h)], radius=int(8 * SCALE), fill=NODE_BODY,
                               outline=NODE_EDGE, width=2)
        draw.rounded_rectangle([p(x, y - TITLE_H), p(x + w, y)], radius=int(8 * SCALE), fill=NODE_TITLE)
        draw.ellipse([p(x + 10, y - 20), p(x + 20, y - 10)], fill=DIM)
        draw.text(p(x + 28, y - TITLE_H + 7), title, font=f_title, fill=TEXT)
        for i, slot in enumerate(node.get("inputs", [])):
            colour = LINK_COLOURS.get(slot.get("type"), LINK_COLOURS["*"])
            cy = input_y(node, i)
            draw.ellipse([p(x - 5, cy - 5), p(x + 5, cy + 5)], fill=colour if slot.get("link") else BACKGROUND,
                         outline=colour, width=2)
            if "widget" not in slot:  # a linked widget's name is its widget's label
                draw.text(p(x + 12, cy - 8), slot["name"], font=f_text, fill=TEXT if slot.get("link") else DIM)
        for i, slot in enumerate(node.get("outputs", [])):
            colour = LINK_COLOURS.get(slot.get("type"), LINK_COLOURS["*"])
            cy = slot_y(node, i)
            draw.ellipse([p(x + w - 5, cy - 5), p(x + w + 5, cy + 5)], fill=colour, outline=colour)
            label = slot["name"]
            lw = draw.textlength(label, font=f_text) / SCALE
            draw.text(p(x + w - 12 - lw, cy - 8), label, font=f_text, fill=TEXT)
        linked = {s["widget"]["name"] for s in node.get("inputs", []) if "widget" in s}
        boxes = text_boxes(node["type"])
        for name, value, wy, tall in widget_rows(node):
            if wy + tall > y + h:
                break
            draw.rounded_rectangle([p(x + 10, wy), p(x + w - 10, wy + tall)],
                                   radius=int((4 if name in boxes else 10) * SCALE), fill=WIDGET_BG,
                                   outline=(70, 70, 70))
            if name == UPLOAD_LABEL:  # a button: its label in the middle, no value
                lw = draw.textlength(name, font=f_small) / SCALE
                draw.text(p(x + (w - lw) / 2, wy + 3), name, font=f_small, fill=TEXT)
                continue
            if name in boxes:  # a text box: its text from the top left, wrapped; a linked one shows its name
                text = name if name in linked or not value else " ".join(str(value).split())
                lines = textwrap.wrap(text, width=int((w - 30) / 6.6))[: max(1, int((tall - 6) / 15))]
                for i, line in enumerate(lines):
                    draw.text(p(x + 16, wy + 4 + i * 15), line, font=f_small, fill=DIM if text == name else TEXT)
                continue
            draw.text(p(x + 20, wy + 3), name, font=f_small, fill=DIM)
            if name in linked:
                continue
            text = shown(value, 26 if len(name) < 12 else 16)
            tw = draw.textlength(text, font=f_small) / SCALE
            draw.text(p(x + w - 20 - tw, wy + 3), text, font=f_small, fill=TEXT)
    out.parent.mkdir(parents=True, exist_ok=True)
    digest = inputs_digest(workflow, caption)
    if out.suffix.lower() == ".jpg":  # a template thumbnail: small, the digest in the JPEG comment
        if caption is None:
            raise ValueError(f"{out.name}: a thumbnail needs its title and summary (workflows/build.py draws them)")
        card = thumbnail(image, *caption)
        card.save(out, quality=85, optimize=True, comment=f"{DIGEST_KEY}={digest}".encode())
        return out
    info = PngInfo()
    info.add_text(DIGEST_KEY, digest)
    image.save(out, optimize=True, pnginfo=info)
    return out


def shipped_ui(name: str) -> Path:
    """A shipped workflow's editor file, named by its template title (the registry nodes/shipped.py)."""
    from lingbot_nodes import shipped

    return shipped.ui_path(ROOT / "workflows", name)


if __name__ == "__main__":
    args = sys.argv[1:]
    source = Path(args[0]) if args else shipped_ui("lingbot_t2v_moe_refine")
    target = Path(args[1]) if len(args) > 1 else ROOT / "docs" / "graph-moe-refine.png"
    print(render(source, target))
