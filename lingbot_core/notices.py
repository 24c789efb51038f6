"""What a run should say before it starts, in words a user can act on.

Each check returns its text (None when there is nothing to say) so a node can show it on itself in
the editor, and logs it as a WARNING the first time it applies in this process (a headless run and
ComfyUI's console see it too). Nothing here loads a model.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

log = logging.getLogger("lingbot_core.notices")

REAL_HIDDEN_SIZE = 1024  # the published DiTs are 2048 wide; the tiny test models a few dozen
FEW_STEPS = 8  # at most this many steps at cfg <= 1 is a distilled recipe
_said: set[tuple[str, ...]] = set()


def _once(key: tuple[str, ...], text: str) -> str:
    if key not in _said:
        _said.add(key)
        log.warning("lingbot: %s", text)
    return text


def is_real_size(info: Any) -> bool:
    """A checkpoint at the published sizes (not one of the tiny random-weight models)."""
    config = getattr(info, "transformer_config", None) or {}
    return int(config.get("hidden_size", 0)) >= REAL_HIDDEN_SIZE


def cpu_notice(info: Any, device: Any) -> str | None:
    """A real checkpoint whose execution device is the CPU: expected to take hours; often a torch
    build whose CUDA does not match the driver."""
    if getattr(device, "type", str(device)) != "cpu" or not is_real_size(info):
        return None
    import torch

    why = ""
    if torch.version.cuda and not torch.cuda.is_available():
        why = (f" This torch is built for CUDA {torch.version.cuda} but sees no GPU: the NVIDIA driver may be too old "
               "for it (`nvidia-smi` shows the driver's CUDA version; install a matching torch build).")
    elif not torch.version.cuda and not getattr(torch.version, "hip", None):
        why = " This torch is a CPU-only build; install a CUDA build for your GPU."
    # The folder's name only: the notice shows on the node, and a shared server's paths are not the user's business.
    folder = getattr(info, "folder", None)
    name = f"The checkpoint '{Path(folder).name}'" if folder else "The checkpoint"
    text = (f"{name} runs on the CPU: a real-size model takes hours there "
            f"(the CPU is for the tiny model and the tests).{why}")
    return _once(("cpu", str(getattr(info, "folder", ""))), text)


def few_step_notice(handle: Any, sampler: str, steps: int, cfg: float) -> str | None:
    """A few-step recipe without what it was distilled for: the DMD sampler without a student DiT,
    or a handful of steps at cfg <= 1 on the base weights without a distillation LoRA."""
    shared = getattr(handle, "shared", None)
    info = getattr(shared, "info", None)
    if info is None or not is_real_size(info):
        return None
    from .lora import lora_stack

    student = getattr(shared, "transformer_source", None) is not None
    if sampler == "dmd_student" and not student:
        return _once(("dmd", str(info.folder)), (
            "sampler dmd_student is for a DMD-distilled student DiT, and none is loaded (the Loader's "
            "transformer_path is empty): on the base weights its 8 steps give unusable output. Set "
            "transformer_path to the student, or use flow_unipc with 40 steps at cfg 3."))
    if sampler != "dmd_student" and steps <= FEW_STEPS and cfg <= 1.0 and not student \
            and not lora_stack(handle).items:
        return _once(("few", str(info.folder), str(steps)), (
            f"{steps} steps at cfg {cfg:g} with no distillation LoRA and no student DiT: the base model needs about "
            "40 steps at cfg 3. Pick the LightLingBot 4-step LoRA in LingBot LoRA (MoE), or raise steps and cfg."))
    return None
