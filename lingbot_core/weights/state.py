"""One owner for the mutable state of a loaded model, in the spirit of ComfyUI's `ModelPatcher`.

A component's module tree is what the loader built. Whatever changes it afterwards and must be
undone exactly is written down on one `ModelState` per loaded component, held by the handle's
shared components (`SharedComponents.states`), never on the modules and never in module-global
tables:

- `pristine`: a LoRA merge's originals -- a CPU copy of every parameter the merge changed;
- `runtime`: LoRA deltas added to quantized layers -- (layer, function) pairs to take off again.

A state belongs to one module object: `Models.state(name)` gives a fresh one when the component was
released and loaded again, and a release drops the old one.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

import torch


class ModelState:
    """The mutable state of one loaded model (see the module docstring)."""

    def __init__(self, model: torch.nn.Module):
        self._model = weakref.ref(model)
        self.pristine: dict[str, torch.Tensor] = {}
        self.runtime: list[tuple[Any, Any]] = []

    def belongs_to(self, model: Any) -> bool:
        return self._model() is model


class Models(dict):
    """Components by name plus the owner of each one's state: what the stage door hands a view state's
    `apply` / `remove` (a plain mapping of modules to everything that only reads them)."""

    def __init__(self, modules: Mapping[str, Any], states: dict[str, ModelState] | None = None):
        super().__init__(modules)
        self.states = states if states is not None else {}

    def state(self, name: str) -> ModelState:
        """The state of component `name` (made on first use, remade when the module was replaced)."""
        state = self.states.get(name)
        if state is None or not state.belongs_to(self[name]):
            state = self.states[name] = ModelState(self[name])
        return state
