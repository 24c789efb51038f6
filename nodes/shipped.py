"""The shipped workflows, one registry. A workflow's key is its short name: its API file is
`workflows/api/<name>.json`, what `lingbot-run` and scripts run. Its `title` is what ComfyUI's template
browser shows, and both frontends (1.27, 1.5x) take a custom pack's card title from the file name and read
nothing else, so the editor file is `workflows/<title>.json` and its thumbnail `<title>.jpg`; the `summary`
is drawn on the thumbnail (the browser shows no description for a pack's template). `aliases` are the
shorter names `lingbot-run` also takes. `workflows/build.py` writes every file from its spec under these
names; the CLI and the editor check read them here."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ShippedWorkflow:
    title: str
    summary: str
    aliases: tuple[str, ...] = ()


SHIPPED: dict[str, ShippedWorkflow] = {
    "lingbot_t2v_dense": ShippedWorkflow(
        "Text to video · dense 1.3B",
        "The basic graph: a structured caption to a video.",
        aliases=("t2v",)),
    "lingbot_t2i_dense": ShippedWorkflow(
        "Text to image · dense 1.3B",
        "One frame from an image caption (the model's own still-image shape).",
        aliases=("t2i",)),
    "lingbot_ti2v_dense": ShippedWorkflow(
        "Image to video · dense 1.3B",
        "Your first frame in Load Image, and a caption, to a video.",
        aliases=("ti2v",)),
    "lingbot_v2v_dense": ShippedWorkflow(
        "Video to video · dense 1.3B",
        "Restyle a clip: Load Video, then Denoise at strength 0.6.",
        aliases=("v2v",)),
    "lingbot_extend_dense": ShippedWorkflow(
        "Extend a video · dense 1.3B",
        "Load Video, then Extend Video continues it for 3 segments.",
        aliases=("extend",)),
    "lingbot_t2v_moe_refine": ShippedWorkflow(
        "Text to video · MoE 30B + refiner",
        "The 30B-A3B MoE base pass, then its refiner up to 1920x1088.",
        aliases=("moe", "refine")),
    "lingbot_t2v_dense_dmd8": ShippedWorkflow(
        "Text to video · dense DMD 8 steps",
        "A dense DMD student DiT (none is published yet): 8 steps, cfg 1.",
        aliases=()),
    "lingbot_t2v_moe_dmd8": ShippedWorkflow(
        "Text to video · MoE DMD 8 steps",
        "The MoE DMD student release (a whole model root): 8 steps, cfg 1.",
        aliases=("moe-dmd8",)),
    "lingbot_ti2v_moe_dmd8": ShippedWorkflow(
        "Image to video · MoE DMD 8 steps",
        "The MoE DMD student from your first frame: 8 steps, cfg 1.",
        aliases=("ti2v-moe-dmd8",)),
    "lingbot_t2v_moe_lightlingbot4": ShippedWorkflow(
        "Text to video · MoE 4-step LoRA",
        "The MoE with the LightLingBot LoRA: 4 steps, cfg 1.",
        aliases=()),
    "lingbot_t2v_dense_files": ShippedWorkflow(
        "Text to video · dense single files",
        "The dense model from single files in ComfyUI's model folders (Loader (files)).",
        aliases=("t2v-files",)),
    "lingbot_t2v_moe_gguf_lightlingbot4": ShippedWorkflow(
        "Text to video · MoE GGUF 4-step LoRA",
        "A MoE GGUF file with the LightLingBot LoRA, from single files: 4 steps, cfg 1.",
        aliases=("moe-gguf",)),
    "lingbot_t2v_moe_gguf_refine": ShippedWorkflow(
        "Text to video · MoE GGUF + refiner",
        "A MoE GGUF base file and a refiner file, refined up to 1920x1088, with a Memory Report.",
        aliases=("moe-gguf-refine",)),
    "lingbot_t2v_dense_rewrite": ShippedWorkflow(
        "Text to video · dense + Rewrite",
        "Plain words in Rewrite become the caption Text Encode reads.",
        aliases=("t2v-rewrite",)),
    "lingbot_ti2v_dense_rewrite": ShippedWorkflow(
        "Image to video · dense + Rewrite",
        "Plain words and your first frame: Rewrite writes the caption.",
        aliases=("ti2v-rewrite",)),
}

ALIASES = {alias: name for name, shipped in SHIPPED.items() for alias in shipped.aliases}
"""Short name -> the workflow's name (`t2v` -> `lingbot_t2v_dense`)."""


def ui_path(folder: Path, name: str) -> Path:
    """The editor file of shipped workflow `name` in the workflows `folder`: named by its title."""
    return folder / f"{SHIPPED[name].title}.json"


def api_path(folder: Path, name: str) -> Path:
    return folder / "api" / f"{name}.json"
