"""The LoRA stack a pipe view carries, and the public calls that build it.

A LoRA travels on a pipe *view*, like offload settings: `with_lora(handle, file, strength)` returns
a view whose `LoraStack` the stage door applies to the shared DiTs when a stage enters (and takes
off again when a view with another stack enters). So two branches with different LoRAs on one
handle are each exact, in any order. The door hands `apply` and `remove` plain modules (offload
suspended, every tensor in its CPU home; under `none`, where they are: on the device) with the owner
of their state (`weights.state.Models`). The merge's arithmetic runs on the CPU from the pristine
copies whatever the weights' device, so it is the same computation under every offload mode,
`sequential`'s meta weights included, and under `none` only the changed parameters travel.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..components import REFINER, TRANSFORMER
from ..weights.state import Models
from .files import LoraError, LoraFile, load_lora_file
from .matching import DIT_COMPONENTS, TARGETS, MatchReport, Patch, _layout, _partial_hint, dit_layout, match
from .merging import merge, restore

log = logging.getLogger("lingbot_core.lora")


@dataclass(frozen=True)
class LoraItem:
    lora: LoraFile
    strength: float = 1.0
    apply_to: str = "auto"

    def __post_init__(self) -> None:
        if isinstance(self.strength, bool) or not isinstance(self.strength, (int, float)) \
                or not math.isfinite(self.strength):
            raise LoraError(f"LoRA strength must be a finite number, got {self.strength!r}")
        if self.apply_to not in TARGETS:
            raise LoraError(f"apply_to must be one of {', '.join(TARGETS)}, got {self.apply_to!r}")


@dataclass(frozen=True)
class LoraStack:
    """The LoRAs of one view, in order. The stage door's per-view state of kind "lora"."""

    items: tuple[LoraItem, ...] = ()
    kind: str = field(default="lora", init=False)

    def then(self, item: LoraItem) -> LoraStack:
        return LoraStack((*self.items, item))

    def reports(self, model: torch.nn.Module | dict[str, Any], component: str) -> list[MatchReport]:
        return [match(item.lora, model, component, apply_to=item.apply_to) for item in self.items]

    # -- the door's protocol --------------------------------------------------------------------
    def apply(self, components: Models, names: Iterable[str]) -> None:
        """Merge the stack into each named DiT, starting from its pristine weights (kept on its state)."""
        for name in names:
            if name in DIT_COMPONENTS and isinstance(components.get(name), torch.nn.Module):
                merge(components[name], _owner(components).state(name), self._patches(components[name], name))

    def remove(self, components: Models, names: Iterable[str]) -> None:
        for name in names:
            module = components.get(name)
            if name in DIT_COMPONENTS and isinstance(module, torch.nn.Module):
                restore(module, _owner(components).state(name))

    def _patches(self, module: torch.nn.Module, name: str) -> list[tuple[float, Patch]]:
        layout = _layout(module)
        out = []
        for item in self.items:
            report = match(item.lora, layout, name, apply_to=item.apply_to)
            out.extend((float(item.strength), p) for p in report.patches)
        return out


def _owner(components: Mapping[str, Any]) -> Models:
    if not isinstance(components, Models):
        raise TypeError("LoraStack.apply/remove need a weights.state.Models (the components and the owner of "
                        "their state), not a plain mapping")
    return components


def plan(handle: Any, lora: LoraFile, strength: float = 1.0, apply_to: str = "auto") -> list[MatchReport]:
    """Check a LoRA against a handle's DiTs before any work: refuse when it matches nothing, warn when
    it matches only part of what the file holds. Returns one report per DiT it applies to."""
    item = LoraItem(lora, float(strength), apply_to)
    if apply_to == REFINER or (apply_to == "auto" and lora.components() == {REFINER}):
        wanted = [REFINER]
    elif apply_to == "both" or (apply_to == "auto" and REFINER in lora.components()):
        wanted = [TRANSFORMER, REFINER]
    else:
        wanted = [TRANSFORMER]
    if REFINER in wanted and not handle.has_refiner:
        if wanted == [REFINER]:
            raise LoraError(f"{lora.name} is for the refiner, but this checkpoint has none (only the MoE one does)")
        log.warning("LoRA %s: this checkpoint has no refiner, so the LoRA goes on the transformer only "
                    "(its refiner. keys, if any, are not applied)", lora.name)
        wanted = [TRANSFORMER]
    reports = [match(lora, dit_layout(handle, c), c, apply_to=item.apply_to) for c in wanted]
    if not any(r.patches for r in reports):
        first = next(iter(lora.groups.values()))
        sample = next(iter(first.keys.values()))
        raise LoraError(f"{lora.name}: none of its {lora.num_keys} keys matches a parameter of the "
                        f"{' or '.join(wanted)} (e.g. {sample} -> {first.base!r}); it is for another model")
    for report in reports:
        if report.unmatched:
            log.warning("LoRA %s matches only part of the %s: %s%s", lora.name, report.component, report.summary(),
                        _partial_hint(report))
        else:
            log.info("LoRA %s: %s", lora.name, report.summary())
    return reports


def with_lora(handle: Any, lora: LoraFile | str | os.PathLike, strength: float = 1.0, *,
              apply_to: str = "auto") -> Any:
    """A view of `handle` with `lora` added to its stack (checked now; merged when a stage enters)."""
    if not isinstance(lora, LoraFile):
        lora = load_lora_file(lora)
    item = LoraItem(lora, float(strength), apply_to)
    plan(handle, lora, strength, apply_to)
    stack = lora_stack(handle).then(item)
    return handle.with_view_state(stack)


def lora_stack(handle: Any) -> LoraStack:
    """The view's LoRA stack (empty when it has none)."""
    return next((s for s in handle.view_states if getattr(s, "kind", None) == "lora"), LoraStack())
