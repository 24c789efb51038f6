"""LingBot LoRA: a view of the pipe with one more LoRA on its stack (merged when a stage enters)."""

from __future__ import annotations

import os
from pathlib import Path

from . import runtime
from .notices import on_node
from .types import CATEGORY, Choice, Pipe
from .v3 import io

NONE = "none"
APPLY_TO = ["auto", "transformer", "refiner", "both"]


def lora_roots() -> list[Path]:
    """Folders LoRA files are offered from: ComfyUI's `loras` folders; headless LINGBOT_LORA_DIR and models/loras."""
    folder_paths = runtime._comfy("folder_paths") if runtime.in_comfy() else None
    if folder_paths is not None:
        # Only ComfyUI's folders: a path relative to the server's working directory is no folder of its.
        return [Path(p) for p in folder_paths.get_folder_paths("loras")]
    roots: list[Path] = []
    env = os.environ.get("LINGBOT_LORA_DIR")
    if env:
        roots += [Path(p) for p in env.split(os.pathsep) if p]
    roots.append(Path("models") / "loras")
    return roots


def lora_choices() -> list[str]:
    names: list[str] = []
    for root in lora_roots():
        if root.is_dir():
            # only what resolve_lora accepts: a link to a file outside the folder is not offered
            names += sorted(p.relative_to(root).as_posix() for p in root.rglob("*.safetensors")
                            if p.is_file() and _inside(p, [root]))
    return [NONE, *dict.fromkeys(names)]


def _inside(path: Path, roots: list[Path]) -> bool:
    real = path.resolve()
    return any(real.is_relative_to(root.resolve()) for root in roots if root.is_dir())


def resolve_lora(name: str, path: str = "") -> Path | None:
    """The LoRA file to load, or None for `none`. Inside ComfyUI nothing outside its loras folders is read."""
    roots = lora_roots()
    if path and path.strip():
        chosen = Path(path.strip()).expanduser()
        if runtime.in_comfy() and not _inside(chosen, roots):
            raise ValueError(f"path {path.strip()[:200]!r} is outside ComfyUI's loras folders; put the file there and pick it "
                             "in lora_name")
        return chosen
    if name == NONE:
        return None
    for root in roots:
        candidate = root / name
        if candidate.is_file() and _inside(candidate, [root]):
            return candidate
    from .runtime import shown_path

    raise ValueError(f"LoRA {name!r} not found under {', '.join(shown_path(root) for root in roots)}")


class LingBotLoRA(io.ComfyNode):
    """Adds a LoRA to the pipe's stack; chain several. The shared DiT is changed only while a stage of
    this view runs, so branches with other LoRAs (or none) on the same Loader stay exact."""

    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="LingBotLoRA",
            display_name="LingBot LoRA",
            category=CATEGORY,
            description="Applies a LoRA file (.safetensors: peft/diffusers, kohya, ComfyUI, LightX2V and mirai "
                        "spellings, 3-D MoE expert LoRAs) to the LingBot DiT. It is checked here (how many modules "
                        "match) and merged in float32 when a stage of this pipe runs; strength 0 or removing the "
                        "node gives the original weights back exactly.",
            inputs=[
                Pipe.Input("pipe", tooltip="From LingBot Loader, Offload or another LingBot LoRA"),
                Choice("lora_name", options=lora_choices(), default=NONE,
                       tooltip="A file in ComfyUI's models/loras folder; none passes the pipe through"),
                io.Float.Input("strength", default=1.0, min=-10.0, max=10.0, step=0.01,
                               tooltip="Multiplies the LoRA's change; 0 leaves the model as it is"),
                Choice("apply_to", options=APPLY_TO, default="auto", optional=True,
                       tooltip="auto: the DiT the file's key prefixes name (none: the base DiT). "
                               "MoE: refiner or both to adapt the refiner too"),
                io.String.Input("path", default="", optional=True,
                                tooltip="A .safetensors path instead of lora_name (inside ComfyUI it must lie in a "
                                        "loras folder)"),
            ],
            outputs=[Pipe.Output(display_name="pipe", tooltip="A view of the pipe with this LoRA added")],
        )

    @classmethod
    def execute(cls, pipe, lora_name, strength, apply_to="auto", path=""):
        from lingbot_core import lora as lora_ops

        file = resolve_lora(lora_name, path)
        if file is None:
            from lingbot_core.notices import is_real_size

            info = pipe.shared.info
            notice = ("lora_name is 'none': the pipe passes on without a LoRA. A few-step workflow needs its LoRA "
                      "here (LightLingBot 4-step: lightlingbot_video_moe30b_4steps_rank128_v1.safetensors from "
                      "lightx2v/LightLingBot-Video in models/loras)") if is_real_size(info) else None
            return io.NodeOutput(pipe, ui=on_node(notice))
        from .runtime import server_paths_hidden

        with server_paths_hidden():  # a bad file's message names ComfyUI's loras folder, not the server's layout
            return io.NodeOutput(lora_ops.with_lora(pipe, file, float(strength), apply_to=apply_to))
