"""Text and first-frame conditioning nodes."""

from __future__ import annotations

from . import runtime
from .types import COND, IMAGE_COND, MAX_SIZE, PIPE, geometry_errors


class LingBotTextEncode:
    """Prompt (structured JSON caption or prose) and negative -> cached conditioning (CPU)."""

    CATEGORY = "LingBot-Video"
    RETURN_TYPES = (COND,)
    RETURN_NAMES = ("conditioning",)
    FUNCTION = "encode"

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "pipe": (PIPE,),
                "prompt": ("STRING", {"multiline": True, "dynamicPrompts": False,
                                      "default": '{"comprehensive_description":{"scene_content_description":'
                                                 '"A small red paper boat drifts along a canal at dawn."}}'}),
                "negative_prompt": ("STRING", {"multiline": True, "dynamicPrompts": False, "default": "",
                                               "tooltip": "empty: the reference default negative"}),
                "task": (["t2v", "t2i", "ti2v"], {"default": "t2v",
                                                  "tooltip": "picks the default negative (image one for t2i)"}),
            },
            "optional": {
                "image_cond": (IMAGE_COND, {"tooltip": "TI2V: both prompts see the first frame (preferred)"}),
                "image": ("IMAGE", {"tooltip": "TI2V without the VAE Encode node: the first frame, prepared at "
                                              "image_width x image_height (use the Denoise size)"}),
                "image_width": ("INT", {"default": 832, "min": 16, "max": MAX_SIZE, "step": 16}),
                "image_height": ("INT", {"default": 480, "min": 16, "max": MAX_SIZE, "step": 16}),
            },
        }

    @classmethod
    def VALIDATE_INPUTS(cls, prompt=None):
        if isinstance(prompt, str):
            from lingbot_core.prompt import caption_to_text

            try:
                if not caption_to_text(prompt).strip():
                    return "the prompt is empty"
            except ValueError as err:
                return str(err)
        return True

    def encode(self, pipe, prompt, negative_prompt="", task="t2v", image_cond=None, image=None, image_width=832,
               image_height=480):
        from lingbot_core import stages
        from lingbot_core.image import load_image, prepare_image_pixels

        if image_cond is None and image is not None:
            # The vision tower sees the frame as prepared for the video size, as the reference does.
            image_cond = prepare_image_pixels(load_image(image), int(image_height), int(image_width))
        if task == "ti2v" and image_cond is None:
            raise ValueError("task ti2v needs the first frame: connect image_cond (LingBot VAE Encode) or image")
        with runtime.node_work(label="text encode"):
            cond = stages.encode_prompt(pipe, prompt, negative_prompt, image=image_cond,
                                        mode=task if image_cond is None else "ti2v")
        return (cond,)


class LingBotImageEncode:
    """TI2V first frame: reference pixel preparation and the VAE posterior of the frame."""

    CATEGORY = "LingBot-Video"
    RETURN_TYPES = (IMAGE_COND,)
    RETURN_NAMES = ("image_cond",)
    FUNCTION = "encode"

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "pipe": (PIPE,),
                "image": ("IMAGE",),
                "width": ("INT", {"default": 832, "min": 16, "max": MAX_SIZE, "step": 16}),
                "height": ("INT", {"default": 480, "min": 16, "max": MAX_SIZE, "step": 16}),
            }
        }

    @classmethod
    def VALIDATE_INPUTS(cls, width=None, height=None):
        if width is None or height is None:
            return True
        return geometry_errors(width, height)

    def encode(self, pipe, image, width, height):
        from lingbot_core import stages

        with runtime.node_work(label="vae encode"):
            return (stages.encode_image(pipe, image, int(height), int(width)),)
