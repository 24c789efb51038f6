"""The one adapter between our nodes and their host: ComfyUI when it is there, our engine otherwise.

Progress, interruption, the output folder, model folders and memory cooperation all come through
here, so node classes stay thin and import neither ComfyUI nor the engine directly.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from lingbot_core.interrupt import interrupt_checker


def in_comfy() -> bool:
    return "comfy.model_management" in sys.modules or "comfy" in sys.modules and "folder_paths" in sys.modules


def _comfy(module: str):
    try:
        return __import__(module, fromlist=["_"])
    except ImportError:
        return None


def interrupt_check() -> Callable[[], None]:
    """A function that raises when the user cancelled (ComfyUI's flag, or our engine's)."""
    mm = _comfy("comfy.model_management") if in_comfy() else None
    if mm is not None:
        return mm.throw_exception_if_processing_interrupted
    from lingbot_core.workflow import check_interrupt

    return check_interrupt


class Progress:
    """Per-step progress: ComfyUI's ProgressBar, our engine's reporter, or a terminal bar."""

    def __init__(self, total: int, label: str = "lingbot"):
        self.total = total
        self._bar = None
        self._tqdm = None
        utils = _comfy("comfy.utils") if in_comfy() else None
        if utils is not None:
            self._bar = utils.ProgressBar(total)
            return
        from lingbot_core.workflow import current_context

        self._engine = current_context()
        if self._engine is None or self._engine.progress is None:
            from tqdm.auto import tqdm

            self._tqdm = tqdm(total=total, desc=label, leave=False, disable=not sys.stderr.isatty())

    def update(self, value: int, total: int | None = None) -> None:
        total = total or self.total
        if self._bar is not None:
            self._bar.update_absolute(value, total)
        elif self._tqdm is not None:
            self._tqdm.n = value
            self._tqdm.refresh()
        else:
            from lingbot_core.workflow import report_progress

            report_progress(value, total)

    def close(self) -> None:
        if self._tqdm is not None:
            self._tqdm.close()


@contextmanager
def node_work(total_steps: int = 0, label: str = "lingbot") -> Iterator[Callable[[int, int, object], None]]:
    """Run node work with cancellation points installed; yield a per-step callback for stages."""
    check = interrupt_check()
    bar = Progress(total_steps, label) if total_steps else None

    def on_step(step: int, total: int, _latents: object) -> None:
        if bar is not None:
            bar.update(step, total)
        check()

    check()
    try:
        with interrupt_checker(check):
            yield on_step
    finally:
        if bar is not None:
            bar.close()


def output_dir() -> Path:
    folder_paths = _comfy("folder_paths") if in_comfy() else None
    if folder_paths is not None:
        return Path(folder_paths.get_output_directory())
    return Path(os.environ.get("LINGBOT_OUTPUT_DIR", "output"))


def model_roots() -> list[Path]:
    """Folders whose sub-folders are offered as checkpoints (ComfyUI: models/lingbot_video/)."""
    folder_paths = _comfy("folder_paths") if in_comfy() else None
    roots: list[Path] = []
    if folder_paths is not None:
        if "lingbot_video" not in folder_paths.folder_names_and_paths:
            folder_paths.add_model_folder_path("lingbot_video", os.path.join(folder_paths.models_dir, "lingbot_video"))
        roots += [Path(p) for p in folder_paths.get_folder_paths("lingbot_video")]
    env = os.environ.get("LINGBOT_MODELS_DIR")
    if env:
        roots += [Path(p) for p in env.split(os.pathsep) if p]
    roots.append(Path("models") / "lingbot_video")
    return roots


def _free_comfy_memory(name, module, device, nbytes) -> None:
    mm = _comfy("comfy.model_management")
    if mm is not None and nbytes:
        mm.free_memory(nbytes + mm.minimum_inference_memory(), device)


class ResidentStandIn:
    """Our components that stay on the GPU between stages, as one entry of ComfyUI's
    `current_loaded_models`: its free-memory requests, the "Unload models" button and its
    out-of-memory handling then move ours off the GPU too (the next stage brings back what it needs).

    It speaks the part of ComfyUI's LoadedModel protocol that `free_memory`, `cleanup_models` and
    `unload_all_models` use. `currently_used` stays False so ComfyUI never tries to reload it.
    """

    def __init__(self, shared, device):
        import weakref

        self._shared = weakref.ref(shared)
        self.device = device
        self.currently_used = False
        self.model_finalizer = None

    @property
    def model(self):
        return self

    def real_model(self):
        return self._shared()  # None once the components are gone: ComfyUI then drops this entry

    def is_dead(self) -> bool:
        return False

    def _resident_bytes(self) -> int:
        from lingbot_core.offload import resident_bytes

        shared = self._shared()
        return 0 if shared is None else resident_bytes(shared)

    def model_memory(self) -> int:
        return self._resident_bytes()

    model_loaded_memory = model_memory
    model_size = model_memory
    loaded_size = model_memory

    def model_offloaded_memory(self) -> int:
        return 0

    def model_memory_required(self, device) -> int:
        return 0

    def model_use_more_vram(self, extra_memory, force_patch_weights=False) -> int:
        return 0

    def model_unload(self, memory_to_free=None, unpatch_weights=True) -> bool:
        from lingbot_core.offload import evict

        shared = self._shared()
        if shared is not None:
            evict(shared)
        return True

    def is_clone(self, other) -> bool:
        return other is self

    def __eq__(self, other) -> bool:
        return getattr(other, "model", None) is self

    __hash__ = object.__hash__


def _track_resident(shared, device) -> None:
    """After a stage: make sure ComfyUI knows about what we keep on its device."""
    from lingbot_core.offload import resident_bytes

    mm = _comfy("comfy.model_management")
    if mm is None or not resident_bytes(shared):
        return
    if device.type == "cuda" and device.index is None:  # ComfyUI compares devices with their index
        import torch

        device = torch.device("cuda", torch.cuda.current_device())
    for entry in mm.current_loaded_models:
        if isinstance(entry, ResidentStandIn) and entry.real_model() is shared:
            return
    mm.current_loaded_models.append(ResidentStandIn(shared, device))


def install_memory_cooperation() -> None:
    """Inside ComfyUI: free ComfyUI's models before ours move onto the GPU, and let ComfyUI's memory
    requests free ours."""
    from lingbot_core.placement import door

    if not in_comfy():
        return
    if _free_comfy_memory not in door.MEMORY_LISTENERS:
        door.MEMORY_LISTENERS.append(_free_comfy_memory)
    if _track_resident not in door.SETTLE_LISTENERS:
        door.SETTLE_LISTENERS.append(_track_resident)
