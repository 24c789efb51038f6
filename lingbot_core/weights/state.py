"""One owner for the mutable state of a loaded model, in the spirit of ComfyUI's `ModelPatcher`.

A component's module tree is what the loader built. What the load found out about it, and whatever
changes it afterwards and must be undone exactly, is written down on one `ModelState` per loaded
component, held by the handle's shared components (`SharedComponents.states`), never on the modules
and never in module-global tables:

- `spans`: the loader's disk homes -- file, offset and size of every tensor kept exactly as stored
  (`weights.disk`: a DiT that streams reads these);
- `exact`: which of those tensors hold exactly their file's bytes now (object and version as read);
- `format`, `reads`: what the load read (e.g. 'gguf: Q4_0 x98') and how many tensors it read;
- `text_only`: a text encoder loaded from a file without a vision tower: that file's name (a TI2V
  encode is refused, `checkpoints.text_encoder_file.require_vision`);
- `pristine`: a LoRA merge's originals -- a CPU copy of every parameter the merge changed;
- `runtime`: LoRA deltas added to quantized layers -- (layer, function) pairs to take off again.

A state belongs to one module object (`bind`): `state_for` gives a fresh one when the component was
released and loaded again, and a release drops the old one.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

import torch


class ModelState:
    """The mutable state of one loaded model (see the module docstring)."""

    def __init__(self) -> None:
        self._model: weakref.ref | None = None
        self.spans: dict[str, Any] = {}  # full tensor name -> weights.disk.FileSpan
        self.exact: dict[str, tuple[weakref.ref, int]] = {}
        self.format = ""
        self.reads = 0
        self.text_only = ""
        self.pristine: dict[str, torch.Tensor] = {}
        self.runtime: list[tuple[Any, Any]] = []

    def bind(self, model: torch.nn.Module) -> ModelState:
        """Make this the state of `model` (the loader and `state_for` call it); returns itself."""
        self._model = weakref.ref(model)
        return self

    def belongs_to(self, model: Any) -> bool:
        return self._model is not None and self._model() is model


def state_for(states: dict[str, ModelState], name: str, model: Any) -> ModelState:
    """The state of component `name`, whose module is `model` (made on first use, remade when the module
    was replaced since)."""
    state = states.get(name)
    if state is None or not state.belongs_to(model):
        state = states[name] = ModelState().bind(model)
    return state


class Models(dict):
    """Components by name plus the owner of each one's state: what the stage door hands a view state's
    `apply` / `remove` (a plain mapping of modules to everything that only reads them)."""

    def __init__(self, modules: Mapping[str, Any], states: dict[str, ModelState] | None = None):
        super().__init__(modules)
        self.states = states if states is not None else {}

    def state(self, name: str) -> ModelState:
        """The state of component `name` (see `state_for`)."""
        return state_for(self.states, name, self[name])
