"""Writes the shipped workflows, UI format (for the editor) and API format (for headless runs).

Both files come from one spec per workflow. The API file is written directly from the spec; the UI
file is laid out for the editor. `tests/test_workflows.py` checks that the editor's conversion of
each UI file gives exactly the shipped API file, and that the files are current:

    python workflows/build.py          # rewrite (and redraw the stale template thumbnails)
    python workflows/build.py --check  # exit 1 if a file or thumbnail would change

The editor files are named by the titles ComfyUI's template browser shows (the registry `nodes/shipped.py`);
the API files keep the short names (`api/<name>.json`).
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from bench.recipes import note_figures  # noqa: E402
from lingbot_core.workflow.convert import CONTROL, UPLOAD_VALUE, WidgetSlot, saved_widget_slots  # noqa: E402
from lingbot_core.workflow.nodeinfo import InputSpec, NodeClassInfo  # noqa: E402
from nodes import NODE_CLASS_MAPPINGS, shipped  # noqa: E402
from nodes.image_input import TEST_PATTERN  # noqa: E402
from nodes.shipped import SHIPPED  # noqa: E402

# The shipped example captions, each in the reference's prompt-file shape ({"caption": ..., "duration": ...}) and
# passing the pack's caption check (tests/test_caption_shapes.py): video for T2V/V2V, the model's image shape
# (comprehensive_description one string, the image camera lists) for T2I, video from a first frame for TI2V.
_CAMERA = ('"camera_info":{"color":"Warm","frame_size":"Medium","shot_type_angle":"Eye level","lens_size":"Medium",'
           '"composition":"Center","lighting":"Soft light","lighting_type":"Daylight"}')
_STILL_CAMERA = ('"camera_info":{"color":"Warm","frame_size":"Close Up","shot_type_angle":"High angle",'
                 '"lens_size":"Medium","composition":"Center","lighting":"Soft light","lighting_type":"Daylight"}')
PROMPT = ('{"caption":{"comprehensive_description":{"scene_content_description":"A small red paper boat drifts along '
          'a narrow canal at dawn. Soft mist hangs over the water and a stone bridge arches in the background.",'
          '"camera_movement_description":"The camera tracks slowly to the right, keeping the boat centered."},'
          + _CAMERA + ',"world_knowledge":[],"prominent_elements":[{"name":"paper boat","description":"A folded red '
          'paper boat.","actions":[{"timestamp":"[0.0s - 5.0s]","action":"Floats forward with the current."}]}]},'
          '"duration":5}')
IMAGE_PROMPT = ('{"caption":{"comprehensive_description":"A round teapot with a blue glaze stands on a wooden table '
                'by a window, a gentle curl of steam rising from its spout.",' + _STILL_CAMERA +
                ',"world_knowledge":[],"prominent_elements":[{"name":"teapot","description":"Round, blue glaze.",'
                '"location":"center of the frame","relative_size":"large"}]},"duration":null}')
FRAME_PROMPT = ('{"caption":{"comprehensive_description":{"scene_content_description":"The teapot on a wooden '
                'table, a gentle curl of steam rising from its spout.","camera_movement_description":"Static '
                'camera."},' + _STILL_CAMERA + ',"world_knowledge":[],"prominent_elements":[{"name":"teapot",'
                '"description":"Round, blue glaze.","actions":[{"timestamp":"[0.0s - 5.0s]","action":"Steam '
                'curls up from the spout."}]}]},"duration":5}')

NOTE = ("Runs as shipped on the built-in tiny random-weight model (its output is noise) at a small size. "
        "For real output pick your checkpoint folder under models/lingbot_video/ in the Loader, then use "
        "{size} and 40 steps. {offload}")
# The VRAM (GiB) the Notes quote: the fit check's figures under the Loaders' default ffn_chunk, from the one
# generator of every memory figure in the README (bench/recipes.py; tests/test_advice.py compares).
NOTE_FIGURES = note_figures()
_F = NOTE_FIGURES
_R = _F["refine"]
_REFINE_W, _REFINE_H = _R["size"].split("x")
DENSE_OFFLOAD = (f"Offload (estimates at 480x832x121): 'model' or 'group' need about {_F['dense_model']} GiB of VRAM "
                 f"(about {_F['dense_tiled']} GiB with Decode tiling on), 'none' about {_F['dense_none']} GiB and is "
                 "the fastest; 'sequential' is the smallest and slowest. The Offload node checks the planned size "
                 "against your GPU and RAM and says what to change.")
MOE_OFFLOAD = (f"Offload (estimates): the MoE base pass at 480x832x121 needs about {_F['moe_base']} GiB of VRAM under "
               f"'group' or 'sequential', with offload_to 'disk' unless you have about 130 GB of RAM ('model' and "
               f"'none' hold a 60 GB DiT on the GPU). On a {_R['gpu_gb']} GB card with {_R['ram_gb']} GB of RAM the "
               f"recipe refines to {_REFINE_H}x{_REFINE_W} (about {_R['gib']} GiB with the Loader's ffn_chunk auto) "
               f"with {_R['weights']} DiTs"
               + (f" (python -m lingbot_core.quantize SRC DST --to {_R['quantize']})" if _R["quantize"] else "")
               + f" under '{_R['mode']}', offload_to '{_R['offload_to']}'. 'auto' picks the "
               "mode and offload_to from the free memory and says what to change when nothing fits.")

# Saved node widths (px). The editor keeps a loaded node at its saved size, and the classic canvas of the 1.5x
# frontends hides a widget's label when its value does not fit beside it: Loader (files) lists file names of
# about 55 characters (Q4_K_M GGUFs, qwen3vl_4b_fp8_scaled...), which web/lingbot_text.js's nodeCreated fit
# (label + value up to 360 px + 100 px of margins and arrows, 12 px font) makes about 470 px wide.
NODE_WIDTH = 320
FILES_LOADER_WIDTH = 470
NODE_GAP = 20  # horizontal room between two columns


def node_width(class_type: str) -> int:
    return FILES_LOADER_WIDTH if class_type == "LingBotLoaderFiles" else NODE_WIDTH


# Saved node heights (px, the body below the title bar). The editor keeps a loaded node at its saved height, so a
# node saved taller than its content opens with empty room at its bottom. A node is saved at the smallest height the
# classic canvas gives it (LiteGraph's LGraphNode.computeSize, alike in the 1.27 and 1.5x frontends, whose numbers
# these are): its slot rows (the inputs that are not widgets, or its outputs, whichever are more; at least one),
# then each widget with the gap under it, then a margin under the widgets and one under the node. A multiline text
# box counts at its smallest height there and takes every pixel the node has past its content. Nodes 2.0 draws the
# same widgets taller (1.5x: a node grows to fit them; 1.27 sizes each node from its content alone).
SLOT_ROW = 20  # LiteGraph.NODE_SLOT_HEIGHT
WIDGET_ROW = 20  # LiteGraph.NODE_WIDGET_HEIGHT: a number, combo, toggle, one-line text, button
TEXT_BOX_ROW = 50  # a multiline text box at its smallest (the DOM widget's default minHeight)
WIDGET_GAP = 4  # under each widget
WIDGETS_MARGIN = 8  # under the widgets, when the node has a widget
NODE_MARGIN = 6  # at the bottom of every node


def _text_box(spec: InputSpec) -> bool:
    return bool(spec.is_widget and spec.options.get("multiline"))


def _sends_notes(class_type: str) -> bool:
    """Whether the node's runs send text to show on it (its `execute` returns `nodes.notices.on_node`): on the
    frontends without a text preview for extensions (1.27) web/lingbot_text.js makes its notes box with the node,
    hidden while empty, and the canvas then counts the widgets' margin for a node with no other widget."""
    return "on_node(" in inspect.getsource(NODE_CLASS_MAPPINGS[class_type].execute)


# The group frame's room below the nodes: 1.5x's Nodes 2.0 keeps a node's saved height as its least and draws its
# rows taller than the canvas (a widget row 4 px more, a one-line text field 12, its header and badge row 24 more
# per node; on 1.58.1 this is at or above every shipped node's height there), so the frame leaves that room and
# GROUP_PAD under it. A node whose text boxes take its spare room is drawn at its saved height.
NODES2_NODE, NODES2_ROW, NODES2_TEXT = 24, 4, 8
GROUP_PAD = 20


def nodes2_extra(class_type: str, links: dict) -> int:
    """How much taller than its saved height Nodes 2.0 may draw the node (above)."""
    inputs = _inputs(class_type)
    if any(_text_box(s) and s.name not in links for s in inputs):
        return 0
    widgets = saved_widget_slots(inputs)
    texts = sum(1 for slot in widgets if slot.spec is not None and slot.spec.type_name() == "STRING"
                and not _text_box(slot.spec))
    return NODES2_NODE + NODES2_ROW * len(widgets) + NODES2_TEXT * texts


def node_height(class_type: str, links: dict) -> int:
    """The node's saved height: what the classic canvas needs for its content (above); a node with a text box
    that is not linked (a prompt the user types) keeps the room the shipped files have always given it, which
    its boxes share."""
    inputs = _inputs(class_type)
    slots = sum(1 for s in inputs if not s.is_widget)
    rows = max(1, slots, len(_info(class_type).return_types))
    widgets = saved_widget_slots(inputs)
    tall = sum((TEXT_BOX_ROW if slot.spec is not None and _text_box(slot.spec) else WIDGET_ROW) + WIDGET_GAP
               for slot in widgets)
    margin = WIDGETS_MARGIN if widgets or _sends_notes(class_type) else 0
    height = rows * SLOT_ROW + tall + margin + NODE_MARGIN
    if any(_text_box(s) and s.name not in links for s in inputs):
        # the room the files gave such a node before (26 px a widget and a slot, 60, and 90 a box), its boxes' share
        linked = sum(1 for s in inputs if s.is_widget and s.name in links)
        boxes = sum(1 for s in inputs if _text_box(s))
        height = max(height, 60 + 26 * (len(widgets) + slots + linked) + 90 * boxes)
    return height


PLAN = dict(plan_width=832, plan_height=480, plan_frames=121)


def loader(checkpoint: str = "tiny (built-in dense)", variant: str = "auto") -> tuple:
    return (1, "LingBotLoader", "Loader", dict(checkpoint=checkpoint, variant=variant, dtype="auto",
                                               attention="default", path="", device="auto"), {})


def files_loader(checkpoint: str = "tiny (built-in dense)") -> tuple:
    """LingBot Loader (files); as shipped every component comes from the tiny checkpoint."""
    return (1, "LingBotLoaderFiles", "Loader (files)", dict(checkpoint=checkpoint), {})


FILES_NOTE = ("Single files from ComfyUI's model folders: pick the DiT in dit ({dit}), the Wan 2.1 VAE in vae "
              "(wan_2.1_vae.safetensors, models/vae) and Qwen3-VL-4B in text_encoder (qwen3vl_4b_bf16 or "
              "qwen3vl_4b_fp8_scaled, models/text_encoders); set checkpoint to none, or keep a checkpoint folder for "
              "the parts you have as a folder and for its processor/. As shipped it runs on the built-in tiny "
              "random-weight model (its output is noise). {how}")


def offload_node(mode: str = "model", refine: bool = False) -> tuple:
    """plan_refine only where the workflow refines: with it, a MoE folder without refiner/ is refused."""
    return (2, "LingBotOffload", "Offload", dict(mode=mode, use_stream=True, low_cpu_mem_usage=False,
                                                 num_blocks_per_group=1, plan_refine=refine, **PLAN), {"pipe": (1, 0)})


def decode_node(node_id: int, latent_from: int, tiled: bool = False) -> tuple:
    tiles = (dict(tile_height=384, tile_width=640, stride_height=288, stride_width=480) if tiled else
             dict(tile_height=256, tile_width=256, stride_height=192, stride_width=192))
    return (node_id, "LingBotDecode", "Decode", dict(tiling=tiled, **tiles), {"pipe": (2, 0), "latent": (latent_from, 0)})

# Sampling profiles: what Denoise needs for each kind of checkpoint (the distilled ones run without
# CFG, so their Text Encode skips the negative).
PROFILES = {
    "default": dict(sampler="flow_unipc", steps=40, cfg=3.0, shift=3.0),
    "DMD 8-step": dict(sampler="dmd_student", steps=8, cfg=1.0, shift=3.0),
    "LightLingBot 4-step": dict(sampler="flow_unipc", steps=4, cfg=1.0, shift=3.0),
}
FEW_STEP_NOTE = ("Profile {profile}: sampler {sampler}, {steps} steps, cfg {cfg}, shift {shift}; no negative is encoded. "
                 "Runs as shipped on the built-in tiny random-weight model (its output is noise). {how}")


def profile_note(profile: str, how: str) -> str:
    return FEW_STEP_NOTE.format(profile=profile, how=how, **PROFILES[profile])


STUDENT_RELEASE = "robbyant/lingbot-video-moe-dmd-30b-a3b"  # lingbot_core.notices.STUDENT_RELEASE (a test compares)
STUDENT_TINY = "tiny (built-in moe dmd student)"  # the tiny root laid out like the release (no refiner/)
STUDENT_HOW = (f"For real output download {STUDENT_RELEASE} (a complete model root: model_index.json, transformer/ "
               "holding the student, text_encoder/, processor/, vae/, scheduler/; no refiner/) into "
               "models/lingbot_video/ and pick it in the Loader, then use 480x832 (H x W), 121 frames and fps 24, "
               "the upstream recipe. The files do not mark a student: the sampler dmd_student is how the pack "
               f"knows. Offload (estimate): its base pass needs about {_F['moe_base_cfg1']} GiB of VRAM under 'group' "
               "or 'sequential'; the 60 GB student DiT lives in host RAM, or with offload_to 'disk' (or a GGUF "
               "copy from python -m lingbot_core.quantize, Q8_0 32 GB / Q4_0 17 GB) on less than about 70 GB of "
               "RAM. Refining after the student (not part of the upstream recipe): load the base MoE root (it "
               "has refiner/) in the Loader with transformer_path set to the student root (its transformer/ "
               "runs, the base's text encoder and VAE are used), add LingBot Refine after Denoise, and keep "
               "Refine as it is: it samples with flow_unipc, as upstream's refiner does after the student.")


def student_nodes(task: str, prefix: str) -> list:
    """The DMD student's graph on the tiny root laid out like the release: T2V, or TI2V with a first frame."""
    prompt = PROMPT if task == "t2v" else FRAME_PROMPT
    denoise = dict(width=64, height=64, frames=9, seed=42, **PROFILES["DMD 8-step"])
    if task == "t2v":
        return [
            loader(STUDENT_TINY, "moe"),
            offload_node("group"),
            (3, "LingBotTextEncode", "Prompt", dict(prompt=prompt, negative_prompt="", task=task,
                                                    encode_negative=False), {"pipe": (2, 0)}),
            (4, "LingBotDenoise", "Denoise (DMD 8-step)", denoise, {"pipe": (2, 0), "conditioning": (3, 0)}),
            decode_node(5, 4, tiled=True),
            (6, "LingBotSaveVideo", "Save", dict(fps=24.0, filename_prefix=prefix), {"images": (5, 0)}),
        ]
    return [
        loader(STUDENT_TINY, "moe"),
        offload_node("group"),
        (3, "LingBotLoadImage", "Load Image", dict(path=TEST_PATTERN), {}),
        (4, "LingBotImageEncode", "First frame", dict(width=64, height=64), {"pipe": (2, 0), "image": (3, 0)}),
        (5, "LingBotTextEncode", "Prompt", dict(prompt=prompt, negative_prompt="", task=task, encode_negative=False),
         {"pipe": (2, 0), "image_cond": (4, 0)}),
        (6, "LingBotDenoise", "Denoise (DMD 8-step)", denoise,
         {"pipe": (2, 0), "conditioning": (5, 0), "image_cond": (4, 0)}),
        decode_node(7, 6, tiled=True),
        (8, "LingBotSaveVideo", "Save", dict(fps=24.0, filename_prefix=prefix), {"images": (7, 0)}),
    ]


REWRITE_NOTE = ("Write what you want in plain words in Rewrite's prompt: it writes the structured caption Text Encode "
                "reads (first a detailed timed description, then the caption; both show on the node), with the "
                "checkpoint's own text encoder, or with an OpenAI-compatible server (endpoint; on a shared server "
                "only those listed in LINGBOT_REWRITE_ENDPOINTS). The built-in tiny model has random weights and "
                "writes no caption (the Rewrite refuses it at once), so pick your checkpoint folder under "
                "models/lingbot_video/ in the Loader first, then use {size} and 40 steps, and set Rewrite's "
                "duration to the clip's length (121 frames at 24 fps: 5.0 s). Rewriting on the text encoder adds "
                "its generation memory (KV cache for max_new_tokens) to the text stage; the Offload check counts it. "
                "{offload}")
BOAT_PROSE = "a red paper boat drifting along a narrow canal at dawn, mist on the water, the camera tracking right"
TEAPOT_PROSE = "the teapot on the table, a gentle curl of steam rising from its spout, static camera"


def rewrite_node(node_id: int, prose: str, task: str, links: dict) -> tuple:
    """LingBot Rewrite on the pipe's own text encoder (endpoint empty: the `local` backend)."""
    return (node_id, "LingBotRewrite", "Rewrite", dict(prompt=prose, task=task, duration=5.0, endpoint="",
                                                       expand_model="", map_model="", max_new_tokens=2048,
                                                       temperature=0.0, seed=0, auto_negative=False), links)


# Titles a Note names (the title the browser shows)
GGUF_REFINE = SHIPPED["lingbot_t2v_moe_gguf_refine"].title
MOE_DMD8_T2V = SHIPPED["lingbot_t2v_moe_dmd8"].title
MOE_DMD8_TI2V = SHIPPED["lingbot_ti2v_moe_dmd8"].title

# Each shipped workflow's spec, by its name in the registry `nodes/shipped.py` (which gives its title, the
# editor file's name, and its summary, drawn on the thumbnail; both are added to the spec below). Nodes: (id,
# class, title, widgets, links {input: (source id, output slot)}).
WORKFLOWS = {
    "lingbot_t2v_dense": dict(
        note=NOTE.format(size="480x832 (H x W) and 121 frames", offload=DENSE_OFFLOAD),
        nodes=[
            loader(),
            offload_node(),
            (3, "LingBotTextEncode", "Prompt", dict(prompt=PROMPT, negative_prompt="", task="t2v"), {"pipe": (2, 0)}),
            (4, "LingBotDenoise", "Denoise", dict(width=64, height=64, frames=9, steps=4, cfg=3.0, shift=3.0, seed=42),
             {"pipe": (2, 0), "conditioning": (3, 0)}),
            decode_node(5, 4),
            (6, "LingBotSaveVideo", "Save", dict(fps=24.0, filename_prefix="lingbot/t2v"), {"images": (5, 0)}),
        ],
    ),
    "lingbot_t2i_dense": dict(
        note=NOTE.format(size="480x832 (H x W), 1 frame,", offload=DENSE_OFFLOAD),
        nodes=[
            loader(),
            offload_node(),
            (3, "LingBotTextEncode", "Prompt", dict(prompt=IMAGE_PROMPT, negative_prompt="", task="t2i"),
             {"pipe": (2, 0)}),
            (4, "LingBotDenoise", "Denoise", dict(width=96, height=64, frames=1, steps=4, cfg=3.0, shift=3.0, seed=42),
             {"pipe": (2, 0), "conditioning": (3, 0)}),
            decode_node(5, 4),
            (6, "LingBotSaveVideo", "Save", dict(fps=24.0, filename_prefix="lingbot/t2i"), {"images": (5, 0)}),
        ],
    ),
    "lingbot_ti2v_dense": dict(
        note=NOTE.format(size="480x832 (H x W) and 121 frames", offload=DENSE_OFFLOAD) +
        " Load your own first frame in Load Image.",
        nodes=[
            loader(),
            offload_node(),
            (3, "LingBotLoadImage", "Load Image", dict(path=TEST_PATTERN), {}),
            (4, "LingBotImageEncode", "First frame", dict(width=64, height=64), {"pipe": (2, 0), "image": (3, 0)}),
            (5, "LingBotTextEncode", "Prompt", dict(prompt=FRAME_PROMPT, negative_prompt="", task="ti2v"),
             {"pipe": (2, 0), "image_cond": (4, 0)}),
            (6, "LingBotDenoise", "Denoise", dict(width=64, height=64, frames=9, steps=4, cfg=3.0, shift=3.0, seed=42),
             {"pipe": (2, 0), "conditioning": (5, 0), "image_cond": (4, 0)}),
            decode_node(7, 6),
            (8, "LingBotSaveVideo", "Save", dict(fps=24.0, filename_prefix="lingbot/ti2v"), {"images": (7, 0)}),
        ],
    ),
    "lingbot_v2v_dense": dict(
        note=NOTE.format(size="480x832 (H x W) and 121 frames", offload=DENSE_OFFLOAD) +
        " Video-to-video: choose or upload your clip in Load Video's path (ComfyUI's input folder; "
        "(test pattern): a built-in drifting test pattern); set Load Video's frame_count to Denoise's frames. Denoise's denoise is "
        "the share of the steps run from the re-noised clip (0.6 of 40: the last 24): lower keeps more of the "
        "clip, 1 ignores it. Quality on the real weights is untested.",
        nodes=[
            loader(),
            offload_node(),
            (3, "LingBotLoadVideo", "Load Video", dict(path=TEST_PATTERN, start_frame=0, frame_count=9, stride=1,
                                                       width=64, height=64), {}),
            (4, "LingBotTextEncode", "Prompt", dict(prompt=PROMPT, negative_prompt="", task="t2v"), {"pipe": (2, 0)}),
            (5, "LingBotDenoise", "Denoise", dict(width=64, height=64, frames=9, steps=5, cfg=3.0, shift=3.0, seed=42,
                                                  denoise=0.6),
             {"pipe": (2, 0), "conditioning": (4, 0), "video": (3, 0)}),
            decode_node(6, 5),
            (7, "LingBotSaveVideo", "Save", dict(fps=24.0, filename_prefix="lingbot/v2v"), {"images": (6, 0)}),
        ],
    ),
    "lingbot_extend_dense": dict(
        note=NOTE.format(size="480x832 (H x W) and 121 frames", offload=DENSE_OFFLOAD) +
        " Extension: Load Video gives the clip to continue ((test pattern): a built-in drifting test pattern; set its "
        "width and height to the video size). Extend Video adds `segments` segments of `frames` frames, each "
        "conditioned on the last k latent frames (overlap k: the last 4(k-1)+1 frames) and joined without "
        "repeating them; one line per segment in `prompts` changes the prompt along the way. Each segment costs "
        "one Denoise and one Decode. Finished segments are saved and reused by a rerun. No end-frame "
        "conditioning in this model; quality on the real weights is untested.",
        nodes=[
            loader(),
            offload_node(),
            (3, "LingBotLoadVideo", "Load Video", dict(path=TEST_PATTERN, start_frame=0, frame_count=9, stride=1,
                                                       width=64, height=64), {}),
            (4, "LingBotTextEncode", "Prompt", dict(prompt=PROMPT, negative_prompt="", task="t2v"), {"pipe": (2, 0)}),
            (5, "LingBotExtendVideo", "Extend Video", dict(segments=3, overlap=1, frames=9, steps=4, cfg=3.0,
                                                          shift=3.0, seed=42),
             {"pipe": (2, 0), "conditioning": (4, 0), "video": (3, 0)}),
            (6, "LingBotSaveVideo", "Save", dict(fps=24.0, filename_prefix="lingbot/extend"), {"images": (5, 0)}),
        ],
    ),
    "lingbot_t2v_moe_refine": dict(
        note=NOTE.format(size="480x832 (H x W) and 121 frames, refined to 1088x1920,", offload=MOE_OFFLOAD) +
        " Refine drops the base DiT before the refiner loads (the text encoder and VAE stay shared); Memory Report "
        "shows where everything lives.",
        nodes=[
            loader("tiny (built-in moe)", "moe"),
            offload_node("auto", refine=True),
            (3, "LingBotTextEncode", "Prompt", dict(prompt=PROMPT, negative_prompt="", task="t2v"), {"pipe": (2, 0)}),
            (4, "LingBotDenoise", "Denoise (base)", dict(width=64, height=64, frames=9, steps=4, cfg=3.0, shift=3.0,
                                                         seed=42), {"pipe": (2, 0), "conditioning": (3, 0)}),
            (5, "LingBotRefine", "Refine", dict(width=128, height=128, steps=8, t_thresh=0.85, cfg=3.0, shift=3.0,
                                                seed=42, tiling=True, release_base="on"),
             {"pipe": (2, 0), "conditioning": (3, 0), "latent": (4, 0)}),
            decode_node(6, 5, tiled=True),
            (7, "LingBotMemoryReport", "Memory Report", dict(), {"pipe": (2, 0), "value": (6, 0)}),
            (8, "LingBotSaveVideo", "Save", dict(fps=24.0, filename_prefix="lingbot/t2v_refined"), {"images": (7, 0)}),
        ],
    ),
    "lingbot_t2v_dense_dmd8": dict(
        note=profile_note("DMD 8-step", "No dense DMD student is published: the only one is "
                          f"{STUDENT_RELEASE} (the templates {MOE_DMD8_T2V} / {MOE_DMD8_TI2V}). This "
                          "workflow is for a dense student of your own: load the dense base checkpoint in the "
                          "Loader and set its transformer_path to the student folder (it differs only in "
                          "transformer/), then use 480x832 and 121 frames. " + DENSE_OFFLOAD),
        nodes=[
            loader(),
            offload_node(),
            (3, "LingBotTextEncode", "Prompt", dict(prompt=PROMPT, negative_prompt="", task="t2v",
                                                    encode_negative=False), {"pipe": (2, 0)}),
            (4, "LingBotDenoise", "Denoise (DMD 8-step)", dict(width=64, height=64, frames=9, seed=42,
                                                               **PROFILES["DMD 8-step"]),
             {"pipe": (2, 0), "conditioning": (3, 0)}),
            decode_node(5, 4),
            (6, "LingBotSaveVideo", "Save", dict(fps=24.0, filename_prefix="lingbot/t2v_dmd8"), {"images": (5, 0)}),
        ],
    ),
    "lingbot_t2v_moe_dmd8": dict(
        note=profile_note("DMD 8-step", STUDENT_HOW),
        nodes=student_nodes("t2v", "lingbot/t2v_moe_dmd8"),
    ),
    "lingbot_ti2v_moe_dmd8": dict(
        note=profile_note("DMD 8-step", STUDENT_HOW) + " Load your own first frame in Load Image. To refine "
        "a TI2V result, give Refine text-only conditioning and this image as its first_frame.",
        nodes=student_nodes("ti2v", "lingbot/ti2v_moe_dmd8"),
    ),
    "lingbot_t2v_moe_lightlingbot4": dict(
        note=profile_note("LightLingBot 4-step", "For real output pick the MoE checkpoint in the Loader and "
                          "lightlingbot_video_moe30b_4steps_rank128_v2.safetensors (from models/loras) in LoRA at "
                          "strength 1.0, then use 480x832 and 121 frames; the LoRA needs plain (bf16) DiT weights "
                          "to be merged (fp8/GGUF apply it at run time). sampler euler gives its training grid. "
                          f"Offload (estimate): the MoE at 480x832x121 with cfg 1 needs about {_F['moe_base_cfg1']} "
                          "GiB of VRAM "
                          "under 'group' or 'sequential', with offload_to 'disk' unless you have about 130 GB of "
                          "RAM."),
        nodes=[
            loader("tiny (built-in moe)", "moe"),
            offload_node(),
            (3, "LingBotLoRA", "LoRA (LightLingBot)", dict(lora_name="none", strength=1.0, apply_to="auto", path=""),
             {"pipe": (2, 0)}),
            (4, "LingBotTextEncode", "Prompt", dict(prompt=PROMPT, negative_prompt="", task="t2v",
                                                    encode_negative=False), {"pipe": (3, 0)}),
            (5, "LingBotDenoise", "Denoise (LightLingBot 4-step)", dict(width=64, height=64, frames=9, seed=42,
                                                                        **PROFILES["LightLingBot 4-step"]),
             {"pipe": (3, 0), "conditioning": (4, 0)}),
            (6, "LingBotDecode", "Decode", dict(tiling=False, tile_height=256, tile_width=256, stride_height=192,
                                                stride_width=192), {"pipe": (3, 0), "latent": (5, 0)}),
            (7, "LingBotSaveVideo", "Save", dict(fps=24.0, filename_prefix="lingbot/t2v_lightlingbot4"),
             {"images": (6, 0)}),
        ],
    ),
    "lingbot_t2v_dense_files": dict(
        note=FILES_NOTE.format(dit="the dense 1.3B DiT, models/diffusion_models",
                               how="Then use 480x832 (H x W), 121 frames, 40 steps. " + DENSE_OFFLOAD),
        nodes=[
            files_loader(),
            offload_node(),
            (3, "LingBotTextEncode", "Prompt", dict(prompt=PROMPT, negative_prompt="", task="t2v"), {"pipe": (2, 0)}),
            (4, "LingBotDenoise", "Denoise", dict(width=64, height=64, frames=9, steps=4, cfg=3.0, shift=3.0, seed=42),
             {"pipe": (2, 0), "conditioning": (3, 0)}),
            decode_node(5, 4, tiled=True),
            (6, "LingBotSaveVideo", "Save", dict(fps=24.0, filename_prefix="lingbot/t2v_files"), {"images": (5, 0)}),
        ],
    ),
    "lingbot_t2v_moe_gguf_lightlingbot4": dict(
        note=FILES_NOTE.format(dit="a MoE GGUF such as a Q4_K_M or Q3_K_M file, models/diffusion_models",
                               how=profile_note("LightLingBot 4-step", "Pick "
                                                "lightlingbot_video_moe30b_4steps_rank128_v2.safetensors (models/loras) "
                                                "in LoRA at strength 1.0 (on GGUF weights it runs as a run-time delta), "
                                                "then use 480x832 and 121 frames; offload_to disk when host RAM is "
                                                "short.") + " " + MOE_OFFLOAD + " This workflow has no Refine "
                               "node: to refine with a refiner file, open the template " + GGUF_REFINE + "."),
        nodes=[
            files_loader("tiny (built-in moe)"),
            offload_node("group"),
            (3, "LingBotLoRA", "LoRA (LightLingBot)", dict(lora_name="none", strength=1.0, apply_to="auto", path=""),
             {"pipe": (2, 0)}),
            (4, "LingBotTextEncode", "Prompt", dict(prompt=PROMPT, negative_prompt="", task="t2v",
                                                    encode_negative=False), {"pipe": (3, 0)}),
            (5, "LingBotDenoise", "Denoise (LightLingBot 4-step)", dict(width=64, height=64, frames=9, seed=42,
                                                                        **PROFILES["LightLingBot 4-step"]),
             {"pipe": (3, 0), "conditioning": (4, 0)}),
            decode_node(6, 5, tiled=True),
            (7, "LingBotSaveVideo", "Save", dict(fps=24.0, filename_prefix="lingbot/t2v_moe_gguf4"),
             {"images": (6, 0)}),
        ],
    ),
    "lingbot_t2v_moe_gguf_refine": dict(
        note=FILES_NOTE.format(dit="the MoE base DiT as a GGUF, e.g. a Q4_K_M or Q3_K_M file, models/diffusion_models",
                               how="Pick the MoE refiner DiT as a second file in refiner (the same folder; a GGUF "
                                   "from python -m lingbot_core.quantize of the MoE folder, or a community one). "
                                   "Then use 480x832 (H x W), 121 frames and 40 steps, refined to 1088x1920. "
                                   + MOE_OFFLOAD + " Refine drops the base DiT before the refiner loads; Memory "
                                   "Report shows where everything lives."),
        nodes=[
            files_loader("tiny (built-in moe)"),
            offload_node("auto", refine=True),
            (3, "LingBotTextEncode", "Prompt", dict(prompt=PROMPT, negative_prompt="", task="t2v"), {"pipe": (2, 0)}),
            (4, "LingBotDenoise", "Denoise (base)", dict(width=64, height=64, frames=9, steps=4, cfg=3.0, shift=3.0,
                                                         seed=42), {"pipe": (2, 0), "conditioning": (3, 0)}),
            (5, "LingBotRefine", "Refine", dict(width=128, height=128, steps=8, t_thresh=0.85, cfg=3.0, shift=3.0,
                                                seed=42, tiling=True, release_base="on"),
             {"pipe": (2, 0), "conditioning": (3, 0), "latent": (4, 0)}),
            decode_node(6, 5, tiled=True),
            (7, "LingBotMemoryReport", "Memory Report", dict(), {"pipe": (2, 0), "value": (6, 0)}),
            (8, "LingBotSaveVideo", "Save", dict(fps=24.0, filename_prefix="lingbot/t2v_moe_gguf_refined"),
             {"images": (7, 0)}),
        ],
    ),
    "lingbot_t2v_dense_rewrite": dict(
        note=REWRITE_NOTE.format(size="480x832 (H x W) and 121 frames", offload=DENSE_OFFLOAD),
        nodes=[
            loader(),
            offload_node(),
            rewrite_node(3, BOAT_PROSE, "t2v", {"pipe": (2, 0)}),
            (4, "LingBotTextEncode", "Prompt", dict(prompt="", negative_prompt="", task="t2v"),
             {"pipe": (2, 0), "prompt": (3, 0), "negative_prompt": (3, 2)}),
            (5, "LingBotDenoise", "Denoise", dict(width=64, height=64, frames=9, steps=4, cfg=3.0, shift=3.0, seed=42),
             {"pipe": (2, 0), "conditioning": (4, 0)}),
            decode_node(6, 5),
            (7, "LingBotSaveVideo", "Save", dict(fps=24.0, filename_prefix="lingbot/t2v_rewrite"), {"images": (6, 0)}),
        ],
    ),
    "lingbot_ti2v_dense_rewrite": dict(
        note=REWRITE_NOTE.format(size="480x832 (H x W) and 121 frames", offload=DENSE_OFFLOAD) +
        " Load your own first frame in Load Image: the Rewrite looks at it too.",
        nodes=[
            loader(),
            offload_node(),
            (3, "LingBotLoadImage", "Load Image", dict(path=TEST_PATTERN), {}),
            (4, "LingBotImageEncode", "First frame", dict(width=64, height=64), {"pipe": (2, 0), "image": (3, 0)}),
            rewrite_node(5, TEAPOT_PROSE, "ti2v", {"pipe": (2, 0), "image": (3, 0)}),
            (6, "LingBotTextEncode", "Prompt", dict(prompt="", negative_prompt="", task="ti2v"),
             {"pipe": (2, 0), "prompt": (5, 0), "negative_prompt": (5, 2), "image_cond": (4, 0)}),
            (7, "LingBotDenoise", "Denoise", dict(width=64, height=64, frames=9, steps=4, cfg=3.0, shift=3.0, seed=42),
             {"pipe": (2, 0), "conditioning": (6, 0), "image_cond": (4, 0)}),
            decode_node(8, 7),
            (9, "LingBotSaveVideo", "Save", dict(fps=24.0, filename_prefix="lingbot/ti2v_rewrite"), {"images": (8, 0)}),
        ],
    ),
}



for _name, _spec in WORKFLOWS.items():  # the registry's title and summary, read here like the rest of a spec
    _spec.update(title=SHIPPED[_name].title, summary=SHIPPED[_name].summary)
if set(WORKFLOWS) != set(SHIPPED):
    raise SystemExit(f"workflows/build.py and nodes/shipped.py name different workflows: {set(WORKFLOWS) ^ set(SHIPPED)}")


def _info(class_type: str) -> NodeClassInfo:
    return NodeClassInfo(class_type, NODE_CLASS_MAPPINGS[class_type])


def _inputs(class_type: str) -> list[InputSpec]:
    """Required then optional inputs, as the engine and the editor order them."""
    return _info(class_type).visible_inputs()


def _widget_value(widgets: dict, spec: InputSpec):
    """The spec's value, else the input's declared default (new optional widgets need no spec edit)."""
    if spec.name in widgets:
        return widgets[spec.name]
    if "default" in spec.options:
        return spec.options["default"]
    choices = spec.combo_options
    return choices[0] if choices else None


SEED_CONTROL = "fixed"  # a shipped seed stays as written, so the editor queues what the API twin holds


def _saved_value(slot: WidgetSlot, widgets: dict, links: dict):
    """What the editor file saves at one position of a node's widgets_values (the layout is the converter's)."""
    if slot.spec is None:
        return SEED_CONTROL if slot.ui_only == CONTROL else UPLOAD_VALUE
    if slot.spec.name in links:  # a converted widget keeps its saved value; the link wins when queued
        return widgets.get(slot.spec.name)
    return _widget_value(widgets, slot.spec)


def to_api(nodes: list) -> dict:
    api = {}
    for node_id, class_type, title, widgets, links in nodes:
        inputs = {}
        for spec in _inputs(class_type):
            if spec.name in links:
                src, slot = links[spec.name]
                inputs[spec.name] = [str(src), slot]
            elif spec.is_widget:
                inputs[spec.name] = _widget_value(widgets, spec)
        api[str(node_id)] = {"inputs": inputs, "class_type": class_type, "_meta": {"title": title}}
    return api


def to_ui(nodes: list, note: str) -> dict:
    link_rows, ui_nodes, bottoms = [], [], []
    x = 60  # each column starts after the one before it, so a wider node pushes the rest right
    outputs: dict[tuple[int, int], list[int]] = {}
    order = {node_id: i for i, (node_id, *_rest) in enumerate(nodes)}
    classes = {node_id: class_type for node_id, class_type, *_rest in nodes}
    for node_id, class_type, _title, _widgets, links in nodes:
        for name, (src, slot) in links.items():
            link_id = len(link_rows) + 1
            dst_slot = [s.name for s in _inputs(class_type) if not s.is_widget or s.name in links].index(name)
            link_rows.append([link_id, src, slot, node_id, dst_slot, str(_info(classes[src]).return_types[slot])])
            outputs.setdefault((src, slot), []).append(link_id)
    for node_id, class_type, title, widgets, links in nodes:
        info = _info(class_type)
        ui_inputs = []
        for spec in _inputs(class_type):
            if spec.name in links:
                link_id = next(r[0] for r in link_rows if r[3] == node_id and r[2] == links[spec.name][1]
                               and r[1] == links[spec.name][0])
                entry = {"name": spec.name, "type": spec.type_name(), "link": link_id}
                if spec.is_widget:
                    entry["widget"] = {"name": spec.name}
                ui_inputs.append(entry)
            elif not spec.is_widget:
                ui_inputs.append({"name": spec.name, "type": spec.type_name(), "link": None})
        values = [_saved_value(slot, widgets, links) for slot in saved_widget_slots(_inputs(class_type))]
        ui_outputs = [{"name": n, "type": str(t), "links": outputs.get((node_id, i), []), "slot_index": i}
                      for i, (n, t) in enumerate(zip(info.return_names, info.return_types))]
        width = node_width(class_type)
        height = node_height(class_type, links)
        column = order[node_id]
        top = 120 + (column % 2) * 60
        bottoms.append(top + height + nodes2_extra(class_type, links))
        ui_nodes.append({
            "id": node_id, "type": class_type, "title": title,
            "pos": [x, top], "size": [width, height],
            "flags": {}, "order": order[node_id], "mode": 0,
            "inputs": ui_inputs, "outputs": ui_outputs,
            "properties": {"Node name for S&R": class_type}, "widgets_values": values,
        })
        x += width + NODE_GAP
    note_id = max(n[0] for n in nodes) + 1
    ui_nodes.append({"id": note_id, "type": "Note", "pos": [60, -120], "size": [640, 160], "flags": {},
                     "order": len(nodes), "mode": 0, "inputs": [], "outputs": [], "properties": {},
                     "widgets_values": [note]})
    span = x - NODE_GAP  # from x 30 to 30 px past the last column's right edge
    return {
        "last_node_id": note_id, "last_link_id": len(link_rows),
        "nodes": ui_nodes, "links": link_rows,
        "groups": [{"title": "LingBot-Video", "bounding": [30, 40, span, max(bottoms) + GROUP_PAD - 40], "color": "#3f789e"}],
        "config": {}, "extra": {}, "version": 0.4,
    }


def ui_path(name: str) -> Path:
    """The editor file of a shipped workflow: named by its title, which the template browser shows."""
    return shipped.ui_path(HERE, name)


def api_path(name: str) -> Path:
    return shipped.api_path(HERE, name)


def thumbnail_path(name: str) -> Path:
    """The browser asks for the thumbnail at the editor file's name, `.jpg`."""
    return ui_path(name).with_suffix(".jpg")


def render() -> dict[Path, str]:
    files = {}
    for name, spec in WORKFLOWS.items():
        files[ui_path(name)] = json.dumps(to_ui(spec["nodes"], spec["note"]), indent=2) + "\n"
        files[api_path(name)] = json.dumps(to_api(spec["nodes"]), indent=2) + "\n"
    return files


def _render_graph():
    """docs/render_graph.py (a script, not a package): draws the thumbnails."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("render_graph", HERE.parent / "docs" / "render_graph.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def stale_thumbnails(render_graph=None) -> list[str]:
    """Workflows whose thumbnail is missing or was drawn from something else (the digest in its JPEG
    comment covers the editor file, the drawn classes' widgets, the renderer, the title and summary)."""
    from PIL import Image

    render_graph = render_graph or _render_graph()
    stale = []
    for name, spec in WORKFLOWS.items():
        path, ui = thumbnail_path(name), ui_path(name)
        if not path.is_file() or not ui.is_file():
            stale.append(name)
            continue
        with Image.open(path) as image:
            drawn = image.info.get("comment", b"").decode()
        if drawn != f"{render_graph.DIGEST_KEY}={render_graph.inputs_digest(ui, (spec['title'], spec['summary']))}":
            stale.append(name)
    return stale


def strays(files: dict[Path, str]) -> list[Path]:
    """Workflow files and thumbnails in this folder that no registry entry writes (a renamed title)."""
    keep = set(files) | {thumbnail_path(name) for name in WORKFLOWS}
    found = [*HERE.glob("*.json"), *HERE.glob("*.jpg"), *(HERE / "api").glob("*.json")]
    return sorted(path for path in found if path not in keep)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args(argv)
    files = render()
    stale = []
    for path, text in files.items():
        if not path.is_file() or path.read_text() != text:
            stale.append(path)
            if not args.check:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text)
    extra = strays(files)
    render_graph = _render_graph()
    pictures = stale_thumbnails(render_graph)
    if args.check:
        problems = [str(p.relative_to(HERE)) for p in stale] + [f"{thumbnail_path(n).name} (thumbnail)" for n in pictures]
        problems += [f"{p.relative_to(HERE)} (no registry entry)" for p in extra]
        if problems:
            print("stale: " + ", ".join(problems))
            return 1
        return 0
    for path in extra:
        path.unlink()
    for name in pictures:
        spec = WORKFLOWS[name]
        render_graph.render(ui_path(name), thumbnail_path(name), (spec["title"], spec["summary"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
