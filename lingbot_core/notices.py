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


STUDENT_RELEASE = "robbyant/lingbot-video-moe-dmd-30b-a3b"
"""The published DMD student: a complete MoE model root (model_index.json, transformer/, text_encoder/,
processor/, vae/, scheduler/), without refiner/."""


def student_recipe() -> dict[str, Any]:
    """The recipe a DMD student was distilled for (sampler name plus `DMDStudentSampler.recommended`)."""
    from .sampling import DMDStudentSampler

    return {"sampler": DMDStudentSampler.name, **DMDStudentSampler.recommended}


def _recipe_text() -> str:
    r = student_recipe()
    return f"sampler {r['sampler']}, {r['steps']} steps, cfg {r['guidance_scale']:g}, shift {r['shift']:g}"


def student_layout(info: Any) -> bool:
    """A MoE checkpoint folder whose own transformer/ runs and that has no refiner/: the layout of the
    DMD student release. Not proof (the files carry no student field; a base root without its refiner
    looks the same), so the notices that use it say so."""
    sources = getattr(info, "sources", None) or {}
    source = sources.get("transformer")
    from_folder = source is not None and getattr(source, "config_dir", None) is not None
    return (getattr(info, "folder", None) is not None and getattr(info, "variant", None) == "moe"
            and not getattr(info, "has_refiner", True) and from_folder)


def few_step_notice(handle: Any, sampler: str, steps: int, cfg: float, shift: float | None = None) -> str | None:
    """A few-step recipe without what it was distilled for, or a DMD student run off its recipe.

    How the pack knows a DiT is a student: the upstream files carry no field that says so (upstream
    picks the sampler by hand, `--scheduler dmd_student`), so it takes the user's word: the Loader's
    `transformer_path` (a student DiT), or the sampler choice `dmd_student`. A MoE folder laid out like
    the student release (no refiner/) run on the base recipe gets a hint that names what was seen."""
    shared = handle.shared
    info = shared.info
    if info is None or not is_real_size(info):
        return None
    from .lora import lora_stack

    folder = str(getattr(info, "folder", ""))
    name = Path(folder).name if getattr(info, "folder", None) else "this checkpoint"
    student_path = shared.transformer_source is not None
    recipe = student_recipe()
    if sampler == recipe["sampler"]:
        said = []
        if not student_path and getattr(info, "has_refiner", False):
            said.append(f"sampler dmd_student is for a DMD-distilled student DiT, but '{name}' has a refiner/ as the "
                        f"base MoE root does (the student release {STUDENT_RELEASE} has none) and the Loader's "
                        "transformer_path is empty: on the base weights its 8 steps give unusable output. Load the "
                        "student root in the Loader (or set transformer_path to it), or use flow_unipc with 40 "
                        "steps at cfg 3.")
        elif not student_path and getattr(info, "variant", None) == "dense":
            said.append("sampler dmd_student is for a DMD-distilled student DiT; no dense student is published (the "
                        f"only one is the MoE {STUDENT_RELEASE}), so on the dense base weights its 8 steps give "
                        "unusable output. Set transformer_path to a dense student if you have one, or use "
                        "flow_unipc with 40 steps at cfg 3.")
        if cfg > 1.0:
            said.append(f"cfg {cfg:g} on a DMD student: guidance is distilled into it, so cfg above 1 applies it "
                        f"twice and runs the DiT twice per step. Its recipe: {_recipe_text()}.")
        off = int(steps) != recipe["steps"] or (shift is not None and float(shift) != recipe["shift"])
        if off:
            said.append(f"{steps} steps at shift {shift if shift is not None else '?'} on a DMD student: it was "
                        f"distilled on one step grid, {_recipe_text()}; other grids degrade it.")
        if not said:
            return None
        return _once(("dmd", folder, str(steps), f"{cfg:g}", str(shift)), " ".join(said))
    if student_path and (steps > FEW_STEPS or cfg > 1.0):
        return _once(("student", folder, sampler, str(steps), f"{cfg:g}"), (
            f"the Loader's transformer_path holds a student DiT (a DMD-distilled one, say): {sampler} at {steps} "
            f"steps, cfg {cfg:g} is the base model's recipe and degrades a student. Its recipe: {_recipe_text()}."))
    if student_layout(info) and not lora_stack(handle).items and (steps > FEW_STEPS or cfg > 1.0):
        return _once(("layout", folder, sampler, str(steps), f"{cfg:g}"), (
            f"'{name}' is a MoE checkpoint without refiner/, laid out like the DMD student release {STUDENT_RELEASE} "
            "(its files do not say which it is). If it is the student, run it with "
            f"{_recipe_text()}: {sampler} at {steps} steps, cfg {cfg:g} costs about ten times the DiT work and "
            "degrades it. If it is the base MoE without its refiner, ignore this."))
    if steps <= FEW_STEPS and cfg <= 1.0 and not student_path and not lora_stack(handle).items:
        return _once(("few", folder, str(steps)), (
            f"{steps} steps at cfg {cfg:g} with no distillation LoRA and no student DiT: the base model needs about "
            "40 steps at cfg 3. Pick the LightLingBot 4-step LoRA in LingBot LoRA (MoE), or raise steps and cfg; "
            f"on the DMD student ({STUDENT_RELEASE}) use {_recipe_text()}."))
    return None


def cfg_batch_notice(cfg_batch: str, cfg: float) -> str | None:
    """cfg_batch asked for where there is nothing to batch: at cfg <= 1 (a DMD student's or a few-step
    LoRA's recipe) each step is one DiT pass, so the option changes nothing."""
    if cfg_batch == "off" or cfg > 1.0:
        return None
    return _once(("cfg_batch", cfg_batch), (
        f"cfg_batch '{cfg_batch}' does nothing at cfg {cfg:g}: without guidance each step is one DiT pass "
        "(no negative branch to batch), as in the DMD student's recipe."))
