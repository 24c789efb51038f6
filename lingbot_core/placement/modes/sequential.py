"""`sequential`: accelerate's per-leaf offload; weights live on `meta` between calls.

Qwen3-VL's vision tower reads `pos_embed.weight` outside its children's forwards (transformers
5.8), and a MoE FFN reads its expert tensors inside the sparse block, so both are preloaded as one
unit. The VAE moves as a whole (its `encode`/`decode` bypass a hooked `forward`).

accelerate's hooks put weights back on `meta` in `post_forward`, which an exception or a cancel
inside the forward skips; `settle` finishes that job.
"""

from __future__ import annotations

from typing import Any

import torch

from ... import hooks
from ...components import DITS
from .base import Mode, peak_over_phases

WHOLE = ("vae",)


def _preload_classes(name: str, module: torch.nn.Module) -> list[str]:
    if name == "text_encoder":
        return [type(m).__name__ for m in module.modules() if type(m).__name__.endswith("VisionModel")][:1]
    if name in DITS:
        from ...models.moe import SparseMoE

        return [SparseMoE.__name__]  # its expert tensors have no forward of their own
    return []


def reoffload(module: torch.nn.Module) -> int:
    """Put every weight an offloading accelerate hook materialised back on `meta`; returns how many."""
    from accelerate.utils import named_module_tensors

    count = 0
    for sub, hook in hooks.hooks_named(module, hooks.ACCELERATE):
        if not getattr(hook, "offload", False):
            continue
        names = [n for n, t in named_module_tensors(sub, include_buffers=hook.offload_buffers,
                                                     recurse=hook.place_submodules, remove_non_persistent=True)
                 if t.device.type != "meta"]
        if names:
            hook.post_forward(sub, None)  # accelerate's own clean-up: back to meta, tied-pointer map cleared
            count += len(names)
    return count


class SequentialMode(Mode):
    name = "sequential"
    speed = 3
    disk_unit = "layer"
    summary = "layer by layer (smallest, slowest)"
    whole = frozenset(WHOLE)

    def _keeps_homes(self, name: str) -> bool:
        return True  # accelerate keeps the same storages as its weights map: remembering them is free

    def _install(self, name: str, module: torch.nn.Module) -> None:
        if name in WHOLE:
            return
        from accelerate import cpu_offload

        device = torch.device("cpu") if self.device.type == "cpu" else self.device  # accelerate and `cpu:0`
        cpu_offload(module, execution_device=device, offload_buffers=False,
                    preload_module_classes=_preload_classes(name, module) or None)

    def _settle_streamed(self, name: str, module: torch.nn.Module) -> None:
        reoffload(module)

    @staticmethod
    def estimate(sizes: Any, geometry: Any, activations: dict[str, int]) -> int:
        # one leaf (or one preloaded MoE FFN / DiT block) at a time; the VAE whole
        # a rewrite's LM head (the tied embedding) is one leaf, brought whole
        weights = {"text": sizes.text_largest_layer, "denoise": sizes.largest_block, "refine": sizes.largest_block,
                   "rewrite": max(sizes.text_largest_layer, sizes.text_head)}
        return peak_over_phases(sizes, activations, weights)
