"""LingBot Loader (files): the pipe from single files in ComfyUI's model folders.

Users who already run Wan or Krea-2 in ComfyUI keep the parts as single files: the DiT in
`models/diffusion_models` (or `unet`), the Wan 2.1 VAE in `models/vae`, the Qwen3-VL-4B text encoder
in `models/text_encoders` (or `clip`). This node offers those files in dropdowns; any component left
on `(from checkpoint)` comes from a diffusers checkpoint folder chosen in `checkpoint`.

Path rules are the Loader's: the dropdowns list only regular files that resolve inside the folder
they are listed from (a symlink pointing out of it is not offered, and not accepted by name), and
inside ComfyUI a typed `*_path` must lie under its model folders (LINGBOT_ALLOW_ANY_MODEL_PATH=1
lifts that); headless any path is fine.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from lingbot_core.save_path import is_inside

from . import paths, runtime
from .loader import (
    TINY,
    attention_problem_at_run,
    checkpoint_choices,
    open_settings,
    resolve_checkpoint,
    setting_input,
    validate_attention,
    with_setting_inputs,
)
from .types import CATEGORY, Choice, Pipe
from .v3 import io

FROM_CHECKPOINT = "(from checkpoint)"
NONE = "none"
AUTO = "auto"


@dataclass(frozen=True)
class FileKind:
    """One dropdown: which ComfyUI folders it lists and which file endings."""

    folders: tuple[str, ...]  # ComfyUI folder names, first is where new files should go
    suffixes: tuple[str, ...]


FILE_KINDS: dict[str, FileKind] = {
    "dit": FileKind(("diffusion_models", "unet"), (".safetensors", ".gguf")),
    "vae": FileKind(("vae",), (".safetensors",)),
    "text_encoder": FileKind(("text_encoders", "clip"), (".safetensors",)),
    # the light decoder (TAEHV / LightTAE) that Decode's `vae: light` and the previews use
    "vae_approx": FileKind(("vae_approx",), (".safetensors",)),
}


def file_roots(kind: str) -> list[Path]:
    """The folders a kind's files are offered from: ComfyUI's own folders for it, or headless
    `./models/<folder>` (and `$LINGBOT_FILES_DIR/<folder>`)."""
    spec = FILE_KINDS[kind]
    folder_paths = runtime._comfy("folder_paths") if runtime.in_comfy() else None
    roots: list[Path] = []
    if folder_paths is not None:
        for name in spec.folders:
            if name in getattr(folder_paths, "folder_names_and_paths", {}):
                roots += [Path(p) for p in folder_paths.get_folder_paths(name)]
        return list(dict.fromkeys(roots))
    bases = [Path(p) for p in os.environ.get("LINGBOT_FILES_DIR", "").split(os.pathsep) if p]
    bases.append(Path("models"))
    return list(dict.fromkeys(base / name for base in bases for name in spec.folders))


def file_choices(kind: str) -> list[str]:
    """Files of this kind, as paths relative to their folder; only regular files that stay inside it."""
    spec = FILE_KINDS[kind]
    names: list[str] = []
    for root in file_roots(kind):
        if not root.is_dir():
            continue
        for path in sorted(root.rglob("*")):
            if path.suffix.lower() in spec.suffixes and path.is_file() and is_inside(root, path):
                names.append(path.relative_to(root).as_posix())
    return list(dict.fromkeys(names))


def resolve_file(kind: str, name: str, path: str = "") -> Path | None:
    """The file a dropdown choice (or a typed path) names; None for `(from checkpoint)` / `none`."""
    if path and path.strip():
        chosen = paths.checkpoint_path(path)
        if not chosen.is_file():
            from lingbot_core.weights.fileio import regular_file_problem

            problem = regular_file_problem(chosen) or "is not a file"  # what it is: a FIFO, a directory, ...
            raise ValueError(f"{kind} file {str(path)[:200]!r} {problem}")
        return chosen
    if name in (FROM_CHECKPOINT, NONE, "", None):
        return None
    rel = Path(str(name))
    if "\x00" in str(name) or rel.is_absolute() or ".." in rel.parts:
        raise ValueError(f"{kind} {str(name)[:80]!r} is not a file name from the list")
    for root in file_roots(kind):
        candidate = root / rel
        if candidate.is_file() and is_inside(root, candidate):
            return candidate
    where = ", ".join(FILE_KINDS[kind].folders)
    raise ValueError(f"{kind} file {str(name)[:200]!r} not found in ComfyUI's {where} folder(s)")


def comfy_tokenizer_folder() -> Path | None:
    """The Qwen tokenizer files ComfyUI ships (comfy/text_encoders/qwen25_tokenizer), inside ComfyUI."""
    if not runtime.in_comfy():
        return None
    module = runtime._comfy("comfy.text_encoders")
    base = getattr(module, "__path__", None) if module is not None else None
    for folder in list(base or []):
        candidate = Path(folder) / "qwen25_tokenizer"
        if (candidate / "vocab.json").is_file():
            return candidate
    return None


def resolve_processor(choice: str, path: str, checkpoint: Path | None) -> Path | None:
    """The processor folder: a typed folder, else the checkpoint's, else ComfyUI's Qwen tokenizer."""
    if path and path.strip():
        folder = paths.checkpoint_path(path)
        paths.check_folder_files_inside(folder, "processor_path")
        return folder
    if checkpoint is not None:
        return None  # the checkpoint's processor/ (its files checked by resolve_checkpoint)
    found = comfy_tokenizer_folder()
    if found is None:
        raise ValueError("no processor: choose a checkpoint (its processor/ folder is used), or give processor_path "
                         "(a checkpoint's processor/ folder; `hf download robbyant/lingbot-video-dense-1.3b --include "
                         "\"processor/*\"` fetches it)")
    return found


class LingBotLoaderFiles(io.ComfyNode):
    """A pipe from single files (DiT, VAE, text encoder) in ComfyUI's model folders."""

    @classmethod
    def define_schema(cls):
        fill = [FROM_CHECKPOINT]
        return io.Schema(
            node_id="LingBotLoaderFiles",
            display_name="LingBot Loader (files)",
            category=CATEGORY,
            description="Opens LingBot-Video from single files in ComfyUI's model folders: the DiT (.safetensors or "
                        ".gguf) in diffusion_models, the Wan 2.1 VAE in vae, the Qwen3-VL-4B text encoder in "
                        "text_encoders. A component left on (from checkpoint) comes from the checkpoint folder. "
                        "Nothing heavy loads here.",
            inputs=with_setting_inputs([  # a newer setting's widget: last
                Choice("dit", options=fill + file_choices("dit"), default=FROM_CHECKPOINT,
                       tooltip="The LingBot-Video DiT: a file in models/diffusion_models (or unet), dense or MoE, "
                               ".safetensors or .gguf"),
                Choice("vae", options=fill + file_choices("vae"), default=FROM_CHECKPOINT,
                       tooltip="The Wan 2.1 VAE in models/vae (e.g. wan_2.1_vae.safetensors)"),
                Choice("text_encoder", options=fill + file_choices("text_encoder"), default=FROM_CHECKPOINT,
                       tooltip="Qwen3-VL-4B in models/text_encoders (e.g. qwen3vl_4b_bf16.safetensors or "
                               "qwen3vl_4b_fp8_scaled.safetensors)"),
                Choice("checkpoint", options=[NONE] + checkpoint_choices(), default=NONE,
                       tooltip="A diffusers checkpoint folder for the components left on (from checkpoint), "
                               "and its processor/. none: every component must be a file"),
                Choice("refiner", options=fill + file_choices("dit"), default=FROM_CHECKPOINT, optional=True,
                       tooltip="MoE refiner DiT file (only the Refine node reads it); (from checkpoint): the "
                               "checkpoint's refiner/, if it has one"),
                setting_input("dtype"),
                setting_input("attention"),
                Choice("device", options=["auto", "cuda", "cpu"], default="auto", optional=True,
                       tooltip="Execution device. auto: ComfyUI's device"),
                setting_input("weights"),
                io.String.Input("processor_path", default="", optional=True,
                                tooltip="A processor folder (a checkpoint's processor/). Empty: the checkpoint's, "
                                        "else ComfyUI's Qwen tokenizer files (unverified; see docs/single-files.md)"),
                io.String.Input("checkpoint_path", default="", optional=True,
                                tooltip="A checkpoint folder instead of the combo (ComfyUI: under its model folders)"),
                io.String.Input("dit_path", default="", optional=True, tooltip="A DiT file instead of the combo"),
                io.String.Input("refiner_path", default="", optional=True, tooltip="A refiner file instead of the combo"),
                io.String.Input("vae_path", default="", optional=True, tooltip="A VAE file instead of the combo"),
                io.String.Input("text_encoder_path", default="", optional=True,
                                tooltip="A text encoder file instead of the combo"),
                setting_input("ffn_chunk"),
                setting_input("compile"),
                setting_input("fp8_matmul"),
            ]),
            outputs=[Pipe.Output(display_name="pipe", tooltip="The pipeline handle")],
        )

    @classmethod
    def validate_inputs(cls, attention=None):
        return validate_attention(attention)  # the Loader's check, shared

    @classmethod
    def execute(cls, dit, vae, text_encoder, checkpoint, refiner=FROM_CHECKPOINT, dtype="auto", attention="default",
                device="auto", processor_path="", checkpoint_path="", dit_path="", refiner_path="", vae_path="",
                text_encoder_path="", **settings):
        """`settings`: the setting widgets past `dtype` and `attention` (`handle.HandleSettings`' widgets)."""
        problem = attention_problem_at_run(attention, device)
        if problem:
            raise ValueError(problem)
        opened = open_settings({**settings, "dtype": dtype, "attention": attention})  # before any file is opened
        folder = None
        if checkpoint_path.strip() or checkpoint not in (NONE, "", None):
            folder = resolve_checkpoint(checkpoint if checkpoint != NONE else next(iter(TINY)), checkpoint_path)
        chosen = {"transformer": resolve_file("dit", dit, dit_path),
                  "refiner": resolve_file("dit", refiner, refiner_path),
                  "vae": resolve_file("vae", vae, vae_path),
                  "text_encoder": resolve_file("text_encoder", text_encoder, text_encoder_path)}
        if folder is None:
            missing = [n for n in ("transformer", "vae", "text_encoder") if chosen[n] is None]
            if missing:
                raise ValueError(f"no checkpoint chosen, so every component must be a file: choose "
                                 f"{', '.join('dit' if n == 'transformer' else n for n in missing)} (or a checkpoint)")
        processor = resolve_processor(AUTO, processor_path, folder)
        options = dict(device=runtime.execution_device(device), **opened)
        from lingbot_core.handle import PipelineHandle
        from lingbot_core.interrupt import interrupt_checker

        # opening reads headers and builds shape skeletons: a cancel (ComfyUI's /interrupt) stops it
        with interrupt_checker(runtime.interrupt_check()), runtime.server_paths_hidden():  # ComfyUI's folders named
            if processor is None and not any(chosen.values()):  # everything from the checkpoint folder
                handle = PipelineHandle.open(folder, **options)
            else:
                from lingbot_core.components import ComponentFiles

                handle = PipelineHandle.open(folder, files=ComponentFiles(**chosen, processor=processor), **options)
        return io.NodeOutput(runtime.install_memory_cooperation(handle))


def light_vae_file() -> Path | None:
    """The light decoder in `models/vae_approx` (ComfyUI's folder; headless `./models/vae_approx` and
    `$LINGBOT_FILES_DIR/vae_approx`): the first of `LIGHT_FILES`' names found, else None."""
    from lingbot_core.checkpoints.light_vae_file import LIGHT_FILES, file_kind

    found = [Path(name) for name in file_choices("vae_approx")]
    for kind in LIGHT_FILES:
        for name in found:
            if file_kind(name) == kind and "/" not in name.as_posix():
                return resolve_file("vae_approx", name.as_posix())
    return None
