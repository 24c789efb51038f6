"""Text and first-frame conditioning nodes."""

from __future__ import annotations

import logging

from . import runtime
from .notices import on_node
from .types import CATEGORY, MAX_SIZE, SIZE_GRID, Choice, Cond, ImageCond, Pipe
from .v3 import io

log = logging.getLogger("lingbot_nodes")

DEFAULT_PROMPT = ('{"comprehensive_description":{"scene_content_description":'
                  '"A small red paper boat drifts along a canal at dawn."}}')
_warned_prose = False
PROSE_NOTICE = ("The prompt is plain prose; LingBot-Video was trained on structured JSON captions and follows "
                "them better. Build one with the LingBot Caption node.")


def warn_if_prose(prompt: str) -> bool:
    """Log once per process that a plain-text prompt was given: LingBot was trained on structured
    JSON captions and follows prose less well. Returns whether the prompt is prose (the node shows
    the notice on itself every time)."""
    global _warned_prose
    prose = isinstance(prompt, str) and bool(prompt.strip()) and not prompt.lstrip().startswith(("{", "["))
    if prose and not _warned_prose:
        _warned_prose = True
        log.warning("lingbot: %s", PROSE_NOTICE)
    return prose


def caption_note(prompt: str, task: str) -> str | None:
    """A note when a JSON caption uses values outside the lists the model's rewriter keeps (the
    reference's own example captions do; the caption is encoded as written, this only says so)."""
    import json

    from lingbot_core.caption_schema import caption_notes

    if not isinstance(prompt, str) or not prompt.lstrip().startswith("{"):
        return None
    try:
        document = json.loads(prompt)
    except ValueError:
        return None
    declared = document.get("duration") if isinstance(document, dict) else None
    video = task != "t2i"
    duration = (declared if isinstance(declared, (int, float)) and declared > 0 else 1.0) if video else None
    notes = caption_notes(document, duration)
    if not notes:
        return None
    more = f" (and {len(notes) - 2} more)" if len(notes) > 2 else ""
    return ("The caption is used as written; it differs from the values the " + ("video" if video else "image")
            + " rewriter keeps: " + "; ".join(notes[:2]) + more + ".")


class LingBotTextEncode(io.ComfyNode):
    """Prompt (structured JSON caption or prose) and negative -> cached conditioning (CPU)."""

    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="LingBotTextEncode",
            display_name="LingBot Text Encode",
            category=CATEGORY,
            description="Encodes the prompt and the negative prompt with the Qwen3-VL text encoder. The prompt "
                        "is best a structured JSON caption (see LingBot Caption); for TI2V both prompts also "
                        "see the first frame. The result is cached on the CPU, so a new seed does not re-encode.",
            inputs=[
                Pipe.Input("pipe", tooltip="From LingBot Loader or LingBot Offload"),
                io.String.Input("prompt", multiline=True, dynamic_prompts=False, default=DEFAULT_PROMPT,
                                tooltip="A structured JSON caption (preferred) or plain text"),
                io.String.Input("negative_prompt", multiline=True, dynamic_prompts=False, default="",
                                tooltip="Empty: the reference default negative prompt"),
                Choice("task", options=["t2v", "t2i", "ti2v"], default="t2v",
                       tooltip="Picks the default negative (the image one for t2i); ti2v needs a first frame"),
                ImageCond.Input("image_cond", optional=True,
                                tooltip="TI2V: the first frame from LingBot VAE Encode (preferred)"),
                io.Image.Input("image", optional=True,
                               tooltip="TI2V without the VAE Encode node: the first frame, prepared at "
                                       "image_width x image_height (use the Denoise size)"),
                io.Int.Input("image_width", default=832, max=MAX_SIZE, **SIZE_GRID, optional=True,
                             tooltip="Width the raw `image` is prepared at"),
                io.Int.Input("image_height", default=480, max=MAX_SIZE, **SIZE_GRID, optional=True,
                             tooltip="Height the raw `image` is prepared at"),
                io.Boolean.Input("encode_negative", default=True, optional=True,
                                 tooltip="Off: no negative is encoded. cfg 1 and the distilled few-step profiles "
                                         "(DMD 8-step, LightLingBot 4-step) never use it"),
            ],
            outputs=[Cond.Output(display_name="conditioning", tooltip="Prompt and negative embeddings (CPU)")],
        )

    @classmethod
    def validate_inputs(cls, prompt=None):
        if isinstance(prompt, str):
            from lingbot_core.prompt import caption_to_text

            try:
                if not caption_to_text(prompt).strip():
                    return "the prompt is empty"
            except ValueError as err:
                return str(err)
        return True

    @classmethod
    def execute(cls, pipe, prompt, negative_prompt="", task="t2v", image_cond=None, image=None, image_width=832,
                image_height=480, encode_negative=True):
        from lingbot_core import stages
        from lingbot_core.image import load_image, prepare_image_pixels

        prose = warn_if_prose(prompt)
        if image_cond is None and image is not None:
            # The vision tower sees the frame as prepared for the video size, as the reference does.
            image_cond = prepare_image_pixels(load_image(image), int(image_height), int(image_width))
        if task == "ti2v" and image_cond is None:
            raise ValueError("task ti2v needs the first frame: connect image_cond (LingBot VAE Encode) or image")
        from lingbot_core.interrupt import text_units

        forwards = 2 if encode_negative else 1  # the prompt, then the negative
        with runtime.node_work(label="text encode", units=text_units(pipe, forwards, image_cond is not None)):
            cond = stages.encode_prompt(pipe, prompt, negative_prompt if encode_negative else None, image=image_cond,
                                        mode=task if image_cond is None else "ti2v")
        return io.NodeOutput(cond, ui=on_node(PROSE_NOTICE if prose else caption_note(prompt, task)))


class LingBotImageEncode(io.ComfyNode):
    """TI2V first frame: reference pixel preparation and the VAE posterior of the frame."""

    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="LingBotImageEncode",
            display_name="LingBot VAE Encode (first frame)",
            category=CATEGORY,
            description="TI2V: resizes and crops the first frame as the reference does and encodes it with the "
                        "Wan VAE. Feed it to Text Encode and Denoise at the same width and height.",
            inputs=[
                Pipe.Input("pipe", tooltip="From LingBot Loader or LingBot Offload"),
                io.Image.Input("image", tooltip="The first frame (the first image of the batch is used)"),
                io.Int.Input("width", default=832, max=MAX_SIZE, **SIZE_GRID,
                             tooltip="Video width (a multiple of 16); must match Denoise"),
                io.Int.Input("height", default=480, max=MAX_SIZE, **SIZE_GRID,
                             tooltip="Video height (a multiple of 16); must match Denoise"),
            ],
            outputs=[ImageCond.Output(display_name="image_cond", tooltip="Prepared pixels and the VAE latent")],
        )

    @classmethod
    def execute(cls, pipe, image, width, height):
        from lingbot_core import stages

        with runtime.node_work(label="vae encode"):
            return io.NodeOutput(stages.encode_image(pipe, image, int(height), int(width)))
