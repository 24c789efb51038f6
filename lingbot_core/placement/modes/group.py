"""`group`: diffusers' block-level group offloading (block streaming).

The DiTs are grouped as diffusers sees them (their `blocks` list, plus one group for the rest). For
Qwen3-VL the top-level children are `model` and `lm_head`, so block level there would degrade to
whole-model offload hooked on a forward the encoder call bypasses; the language model and the
vision tower are grouped instead. The VAE moves as a whole.

Two gaps in the hooks are closed here:
- Qwen3VLModel looks up token embeddings itself, before calling its language model, and under
  block offloading those embeddings belong to the language model's top-level group. A pre-hook
  onloads that group when the inner model is entered, and, with a prefetch stream, waits for the
  copy the way diffusers' own hook does after a synchronous onload (`stream.synchronize()`).
- A group is offloaded in its leader's `post_forward`, which an exception or a cancel skips;
  `settle` offloads any group left on the device.
"""

from __future__ import annotations

from typing import Any

import torch

from ... import hooks
from ...components import DITS
from ..settings import CPU
from .base import Mode, peak_over_phases, positive_int

WHOLE = ("vae",)


def group_targets(name: str, module: torch.nn.Module) -> list[torch.nn.Module]:
    if name in DITS:
        return [module]
    if name == "text_encoder":
        inner = module.model
        return [inner.language_model, inner.visual]
    return []


def pin_in_place(module: torch.nn.Module) -> None:
    """Rebind every CPU tensor of `module` to a pinned copy, one tensor at a time.

    With a stream, diffusers pins a copy of each tensor of every group of a target before its hooks
    rebind the weights to those copies, so the whole pageable target would live next to its pinned
    copy for a moment. Pinned here first, its `pin_memory()` returns the tensor itself (no copy), and the
    host holds the pageable and the pinned bytes of one tensor at a time."""
    seen: set[int] = set()
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            if id(t) in seen or t.device.type != "cpu" or t.is_pinned():
                continue
            seen.add(id(t))
            t.data = t.data.pin_memory()


def unpin_in_place(module: torch.nn.Module) -> None:
    """Rebind every pinned CPU tensor of `module` to a pageable copy, one tensor at a time (undoes
    `pin_in_place` when `group` lets the module go: the pinned blocks, rounded up to powers of two, go back
    to torch's pinned cache once nothing holds them)."""
    seen: set[int] = set()
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            if id(t) in seen or t.device.type != "cpu" or not t.is_pinned():
                continue
            seen.add(id(t))
            data = t.data
            t.data = torch.empty_strided(data.size(), data.stride(), dtype=data.dtype, device="cpu").copy_(data)


def group_is_onloaded(group: Any) -> bool:
    """Does any tensor of the group live off its offload device?"""
    tensors = [*group.parameters, *group.buffers]
    for m in group.modules:
        tensors += [*m.parameters(), *m.buffers()]
    return any(t.device != group.offload_device for t in tensors)


def onload_and_wait(group: Any) -> None:
    """Onload a group now and wait for the copy (diffusers' synchronous onload in `pre_forward`)."""
    group.onload_()
    if group.stream is not None:
        group.stream.synchronize()


@hooks.named("lingbot.group_embedding_onload", "group offload: onloads the Qwen language model's top-level "
             "group (its token embeddings) when the inner model is entered")
class EmbeddingOnload(hooks.Hook):
    def __init__(self, group: Any):
        super().__init__()
        self.group = group

    def pre_forward(self, module, *args, **kwargs):
        if self.group is not None:
            onload_and_wait(self.group)
        return args, kwargs


def _embedding_onload(text_encoder: torch.nn.Module) -> None:
    hook = hooks.find(text_encoder.model.language_model, "group_offloading")
    hooks.attach(text_encoder.model, EmbeddingOnload(getattr(hook, "group", None)))


class GroupMode(Mode):
    name = "group"
    speed = 2
    options = frozenset({"use_stream", "low_cpu_mem_usage", "num_blocks_per_group", "record_stream"})
    disk_unit = "block"
    summary = "DiT blocks streamed"
    whole = frozenset(WHOLE)
    pins = frozenset({*DITS, "text_encoder"})  # with a stream: diffusers keeps a pinned copy of every grouped tensor

    @classmethod
    def check(cls, settings, device, loaded, layout=None) -> None:
        super().check(settings, device, loaded, layout)
        use_stream = settings.option("use_stream", device.type == "cuda")
        if use_stream and device.type == "cpu":
            raise ValueError("group offload with use_stream needs an accelerator with streams; on CPU pass "
                             "use_stream=False")
        if settings.option("record_stream", False) and not use_stream:
            raise ValueError("record_stream only applies with use_stream=True")
        blocks = settings.option("num_blocks_per_group", 1)
        positive_int("num_blocks_per_group", blocks)
        if use_stream and blocks != 1:
            # diffusers' stream prefetch works one block at a time and silently resets the group size.
            raise ValueError(f"num_blocks_per_group={blocks} cannot be combined with use_stream: stream "
                             "prefetching moves one block at a time; drop num_blocks_per_group or pass "
                             "use_stream=False")
        try:
            import diffusers
            from diffusers.hooks import apply_group_offloading  # noqa: F401
        except ImportError as err:  # pragma: no cover - diffusers without hooks
            raise ValueError(f"group offload needs diffusers' group offloading ({err})") from err
        version = tuple(int(x) for x in diffusers.__version__.split(".")[:2] if x.isdigit())
        if device.type == "cpu" and version < (0, 42):
            raise ValueError(f"group offload on CPU needs diffusers >= 0.42 (found {diffusers.__version__})")

    def _keeps_homes(self, name: str) -> bool:
        # The VAE moves by rebinding. Grouped components keep only their slots: with a stream,
        # diffusers rebinds weights to pinned copies, and keeping the pageable originals too would
        # double the host memory.
        return name in WHOLE

    def _install(self, name: str, module: torch.nn.Module) -> None:
        targets = group_targets(name, module)
        if not targets:
            return
        from diffusers.hooks import apply_group_offloading

        s = self.settings
        use_stream = bool(s.option("use_stream", self.device.type == "cuda"))
        if use_stream and not s.option("low_cpu_mem_usage", False):
            pin_in_place(module)
        for target in targets:
            apply_group_offloading(
                target, onload_device=self.device, offload_device=CPU, offload_type="block_level",
                num_blocks_per_group=int(s.option("num_blocks_per_group", 1)), use_stream=use_stream,
                record_stream=bool(s.option("record_stream", False)),
                low_cpu_mem_usage=bool(s.option("low_cpu_mem_usage", False)),
            )
        if name == "text_encoder":
            _embedding_onload(module)

    def _settle_streamed(self, name: str, module: torch.nn.Module) -> None:
        for _sub, hook in hooks.hooks_named(module, "group_offloading"):
            if group_is_onloaded(hook.group):
                hook.group.offload_()

    def _before_strip(self, name: str, module: torch.nn.Module) -> None:
        self.settle(name, module)

    def let_go(self, name: str, module: Any) -> None:
        if isinstance(module, torch.nn.Module) and group_targets(name, module):
            unpin_in_place(module)  # the next mode counts pageable host copies, not rounded pinned ones

    @staticmethod
    def estimate(sizes: Any, geometry: Any, activations: dict[str, int]) -> int:
        # two blocks in flight (prefetch) plus the top-level group; the VAE whole
        # a rewrite also holds a device copy of the tied LM head (rewrite.local_backend._FollowingHead)
        weights = {"text": 2 * sizes.text_largest_layer, "denoise": 3 * sizes.largest_block,
                   "refine": 3 * sizes.largest_block, "rewrite": 2 * sizes.text_largest_layer + sizes.text_head}
        return peak_over_phases(sizes, activations, weights)
