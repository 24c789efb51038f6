"""What every offload mode does, and the shared way of moving a whole component.

A mode is one small class. The door calls, per component:

- `install(name, module)` when the mode takes over a component (a configure, or a component
  loaded later). Atomic per component: if it fails part way, the component is put back as it was.
- `acquire(name, module)` when a stage is about to use the component: bring onto the device what
  the mode moves explicitly.
- `settle(name, module)` after every stage (success, error or cancel) and before the next: return
  to the mode's clean state, whatever a hooked forward that did not finish left on the device.
- `uninstall(name, module)` when the mode lets go (a switch, a release): hooks removed, every
  tensor back in its slot (ties included) and on the CPU; `let_go(name, module)` after it on a switch.
- `estimate(sizes, activations)` the peak accelerator bytes the mode needs for one request
  (pure arithmetic over `estimate.ModelSizes` and the per-phase activation bytes).
- `check(settings, device, loaded, layout)` (a classmethod) refuses settings the mode cannot run with,
  before anything is touched.

The class attributes (`name`, `speed`, `options`, `disk_unit`, `summary`) are what the registry
(`modes/__init__.py`) derives the mode lists, `auto`'s order and the Offload node's choices from.

Modes move tensors generically (`tensors.Homes`): stored dtypes and tensor subclasses travel as
they are, so quantized weights move at their stored size.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from ... import hooks
from ...models.shards import is_sharded
from ..settings import CPU, OffloadSettings
from ..tensors import Homes


def positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


class Mode:
    name: ClassVar[str] = ""
    """The registry key (`modes.MODE_CLASSES`); a subclass without one is not a mode (`Mode` itself)."""
    speed: ClassVar[int] = 0
    """Rank in `MODE_ORDER`, fastest first: `auto` tries the modes in this order."""
    options: ClassVar[frozenset[str]] = frozenset()
    """The options a view may pass with this mode (`OffloadSettings.option`)."""
    disk_unit: ClassVar[str | None] = None
    """With `offload_to="disk"`, what the DiTs stream at once (`weights.disk`): "model" (the whole DiT),
    "block" or "layer"; None: the mode keeps no host home to replace (it does not stream)."""
    summary: ClassVar[str] = ""
    """One phrase for the Offload node's tooltip."""
    pins: ClassVar[frozenset[str]] = frozenset()
    """The components whose host copies the mode pins (page-locked) when it runs with its defaults on an
    accelerator: `estimate.host_bytes` counts them at their pinned size (`ModelSizes.pinned`)."""
    keeps_resident: ClassVar[bool] = False
    """True if components may stay on the device between stages (`none`)."""
    whole: ClassVar[frozenset[str] | None] = frozenset()
    """The components `acquire` moves onto the device as one piece (None: every one); the mode's
    hooks stream the others, and `_settle_streamed` puts those back."""

    def __init__(self, settings: OffloadSettings, device: torch.device, states: dict | None = None):
        self.settings = settings
        self.device = device
        self.states = states if states is not None else {}  # the handle's ModelStates, by component
        self.homes: dict[str, Homes] = {}

    def state(self, name: str, module: torch.nn.Module) -> Any:
        """The `weights.state.ModelState` of component `name` (its disk homes, when it streams)."""
        from ...weights.state import state_for

        return state_for(self.states, name, module)

    @classmethod
    def check(cls, settings: OffloadSettings, device: torch.device, loaded: Mapping[str, Any],
              layout: Any = None) -> None:
        """Refuse settings this mode cannot run with (before anything is touched); `loaded` components.
        `layout`: the view's `parallel.ParallelLayout` (or the process layout), None for a one-process
        view. Only a layout of several processes (sequence/CFG parallel, FSDP) refuses offloading: a
        data-parallel rank (`--jobs`) runs whole videos alone, so a torch.distributed world alone does not."""
        if cls.keeps_resident:
            return
        if layout is not None and getattr(layout, "world_size", 1) > 1:
            raise ValueError(f"offload mode {cls.name!r} cannot run under a multi-process group (FSDP, CFG- or "
                             "context-parallel): each rank holds a shard; use offload 'none' there")
        for name, module in loaded.items():
            if isinstance(module, torch.nn.Module) and is_sharded(module):
                raise ValueError(f"offload mode {cls.name!r} cannot manage the sharded component {name!r}; "
                                 "use offload 'none' with sharded models")

    # -- the interface the door uses ---------------------------------------------------------------
    def install(self, name: str, module: Any) -> None:
        if not isinstance(module, torch.nn.Module):
            return
        from ...weights.disk import materialize

        materialize(module, self.state(name, module))  # loaded for disk offload: this mode's home is host memory
        if not self.keeps_resident and any(t.device.type not in ("cpu", "meta") for t in module.parameters()):
            module.to(CPU)  # built or loaded on the device (benchmarks do): its home is the CPU
        self.homes[name] = Homes(module, keep_data=self._keeps_homes(name))
        try:
            self._install(name, module)
        except BaseException:
            self.uninstall(name, module)
            raise

    def acquire(self, name: str, module: Any) -> None:
        """Bring what this mode moves explicitly onto the device (hooks move the rest)."""
        if self.moves_whole(name):
            self._onload_whole(name)

    def settle(self, name: str, module: Any) -> None:
        """Back to the clean state of the mode."""
        if self.moves_whole(name):
            self._offload_whole(name)
        elif isinstance(module, torch.nn.Module):
            self._settle_streamed(name, module)

    def uninstall(self, name: str, module: Any) -> None:
        homes = self.homes.pop(name, None)
        if not isinstance(module, torch.nn.Module):
            return
        self._before_strip(name, module)
        hooks.strip(module, keep=hooks.LASTING)  # a compiled region stays: it is the model's
        if homes is not None:
            homes.restore()
            lost = homes.lost()
            if lost:
                raise RuntimeError(f"{name}: {len(lost)} weights have no data after removing offload hooks "
                                   f"(e.g. {lost[0]})")

    def let_go(self, name: str, module: Any) -> None:
        """After `uninstall`, when another mode (or none) takes over: give back what only this mode needed
        on the host (a `suspended` uninstall, which reinstalls the same mode, skips it)."""

    def moves_whole(self, name: str) -> bool:
        """Does `acquire` move this component onto the device as a whole (hosts free memory first)?"""
        return self.whole is None or name in self.whole

    def installed(self) -> set[str]:
        return set(self.homes)

    @staticmethod
    def estimate(sizes: Any, geometry: Any, activations: dict[str, int]) -> int:
        """Peak accelerator bytes of one request (`estimate.ModelSizes`, `estimate.Geometry`)."""
        raise NotImplementedError

    # -- for subclasses ----------------------------------------------------------------------------
    def _keeps_homes(self, name: str) -> bool:
        """Keep each tensor's home storage (rebinding moves) rather than only its slot."""
        return False

    def _install(self, name: str, module: torch.nn.Module) -> None:
        pass

    def _before_strip(self, name: str, module: torch.nn.Module) -> None:
        pass

    def _settle_streamed(self, name: str, module: torch.nn.Module) -> None:
        """Offload whatever the hooks of a streamed (not `whole`) component left on the device."""

    # -- moving a component as a whole -------------------------------------------------------------
    def _onload_whole(self, name: str) -> None:
        self.homes[name].onload(self.device)

    def _offload_whole(self, name: str) -> None:
        homes = self.homes.get(name)
        if homes is not None:
            homes.offload()


def peak_over_phases(sizes: Any, activations: dict[str, int], weights: dict[str, int]) -> int:
    """The largest weights-plus-activations over the phases; phases not named hold the VAE whole,
    except a rewrite, which runs the text encoder: the text phase's weights unless named."""
    def held(phase: str) -> int:
        if phase == "rewrite" and phase not in weights:
            return weights.get("text", sizes.text_encoder)
        return weights.get(phase, sizes.vae)

    return max(held(phase) + act for phase, act in activations.items())
