"""The placement object a handle's shared components own: what is installed, what is resident.

Opaque to the handle. The door (`door.py`) drives it; tests and hosts read it through the door's
functions. Installing is transactional: `install()` either leaves the new mode fully installed on
every loaded component or, after any failure (an exception or an interrupt), the previous mode
installed exactly as a fresh install would leave it, and re-raises the original error.
"""

from __future__ import annotations

import logging
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch

from .. import hooks
from ..weights.state import Models
from .modes import MODE_CLASSES, Mode
from .modes.disk import make_mode
from .settings import CPU, MODULE_COMPONENTS, OffloadSettings, same_device
from .tensors import stored_bytes

log = logging.getLogger("lingbot_core.offload")

LEDGER_SIZE = 512
"""Acquire/release events kept (the newest); enough for a test to read one run, bounded for servers."""


class Placement:
    def __init__(self, states: dict[str, Any] | None = None) -> None:
        self.states = states if states is not None else {}  # each model's ModelState (the handle's)
        self.mode: Mode | None = None  # the concrete mode installed
        self.requested: OffloadSettings | None = None  # what the view asked for (possibly `auto`)
        self.auto: Any = None  # fit.AutoChoice when `requested` is auto
        self.fell_back = False
        self.resident: set[str] = set()  # components the mode holds on the accelerator now
        self.in_stage: set[str] = set()  # components the running stage uses
        self.ledger: deque[tuple[str, str, str]] = deque(maxlen=LEDGER_SIZE)  # (event, component, stage)
        self.view_states: dict[str, tuple[Any, dict[str, Any]]] = {}  # kind -> (state, {component: weakref})
        self.ffn_chunks: dict[str, tuple[int | None, str]] = {}  # DiT -> (FFN/MoE chunk of its last run, why)
        # the text encoder's last generation (a rewrite, `door.note_generation`): (context tokens, bytes by part)
        self.generation: tuple[int, dict[str, int]] | None = None
        # on CUDA: each stage's last measured peak next to its estimate, by stage label (`calibration`)
        self.measured: dict[str, Any] = {}
        # the running stage's request as far as memory is concerned (`door.stage`'s geometry; a sampling stage's
        # as it runs, `door.sampling_figures`), which its measured peak is set against; None: it gave none
        self.stage_geometry: Any = None
        # the host's listeners on this handle (all its views), never process-wide: see door.add_listeners
        self.memory_listeners: list[Callable[[str, Any, torch.device, int], None]] = []
        self.settle_listeners: list[Callable[[Any, torch.device], None]] = []
        # the host's own reading of free accelerator bytes (ComfyUI: its get_free_memory, less the headroom
        # its dynamic VRAM keeps), used instead of the driver's figure when set: see door.add_listeners
        self.free_reader: Callable[[torch.device], int] | None = None

    # -- what is installed -------------------------------------------------------------------------
    @property
    def device(self) -> torch.device | None:
        return self.mode.device if self.mode is not None else None

    def matches(self, requested: OffloadSettings, device: torch.device) -> bool:
        return (self.mode is not None and self.requested == requested and same_device(self.mode.device, device))

    def install(self, loaded: Mapping[str, Any], requested: OffloadSettings, concrete: OffloadSettings,
                device: torch.device, *, auto: Any = None, fell_back: bool = False) -> None:
        """Replace what is installed by `concrete`, or leave the previous state exactly."""
        previous = (self.requested, self.mode.settings, self.mode.device, self.auto, self.fell_back) \
            if self.mode is not None else None
        try:
            self.uninstall_all(loaded)
            self.mode = make_mode(MODE_CLASSES, concrete, device, self.states)
            self.requested, self.auto, self.fell_back = requested, auto, fell_back
            self.install_pending(loaded)
        except BaseException as err:
            self._roll_back(loaded, previous, err)
            raise
        log.info("offload: %s on %s", concrete.mode, device)

    def _roll_back(self, loaded: Mapping[str, Any], previous: tuple | None, err: BaseException) -> None:
        try:
            self.uninstall_all(loaded)
            if previous is not None:
                requested, settings, device, auto, fell_back = previous
                self.mode = make_mode(MODE_CLASSES, settings, device, self.states)
                self.requested, self.auto, self.fell_back = requested, auto, fell_back
                self.install_pending(loaded)
        except BaseException as rollback:  # keep the original error; say what else went wrong
            log.error("offload: restoring the previous installation failed too: %r", rollback)
            err.add_note(f"restoring the previous offload installation also failed: {rollback!r}")
            self.mode = None
            self.requested = None

    @contextmanager
    def suspended(self, loaded: Mapping[str, Any], names: list[str]) -> Iterator[None]:
        """The named components as plain modules for the body: under an offloading mode, hooks off and
        every tensor in its CPU home, the mode taking them over again afterwards. Under `none` (a mode that
        keeps components resident) they are plain modules already: they stay where they are, so a LoRA
        change merges on the device (no round trip of the whole DiT through host RAM) and FSDP's sharded
        parameters stay the objects FSDP put there. Components not installed yet are left alone (the next
        install takes them)."""
        mode = self.mode
        if mode is not None and mode.keeps_resident:
            yield
            return
        held = [n for n in names if mode is not None and n in mode.homes]
        for name in held:
            mode.uninstall(name, loaded.get(name))
            self.resident.discard(name)
        try:
            yield
        finally:
            for name in held:
                if name in loaded:
                    mode.install(name, loaded[name])

    def ensure(self, loaded: Mapping[str, Any], requested: OffloadSettings, device: torch.device,
               plan: tuple[OffloadSettings, Any] | None) -> None:
        """Make `requested` the installed settings as the door planned them: `plan` is None when they are
        installed already (then only components loaded since are taken), else (the concrete settings,
        `auto`'s choice or None) to install."""
        if plan is None:
            self.install_pending(loaded)
            return
        concrete, choice = plan
        self.install(loaded, requested, concrete, device, auto=choice)

    def install_pending(self, loaded: Mapping[str, Any]) -> None:
        """Install the current mode on components loaded since (lazy loads, reloads after release)."""
        mode = self.mode
        for name in MODULE_COMPONENTS:
            if name in loaded and name not in mode.homes and isinstance(loaded[name], torch.nn.Module):
                mode.install(name, loaded[name])

    def uninstall_all(self, loaded: Mapping[str, Any]) -> None:
        """Every component back to plain modules on the CPU; the first failure is raised after all ran."""
        mode, failure = self.mode, None
        if mode is not None:
            for name in sorted(mode.installed()):
                try:
                    mode.uninstall(name, loaded.get(name))
                    mode.let_go(name, loaded.get(name))
                except BaseException as err:  # noqa: PERF203 - every component must be tried
                    failure = failure or err
        self.mode, self.requested, self.auto = None, None, None
        self.resident.clear()
        if failure is not None:
            raise failure

    # -- per-view state (see the door's docstring, "View state") ------------------------------------
    def apply_view_states(self, loaded: Mapping[str, Any], wanted_states: tuple[Any, ...]) -> None:
        """Make the view's states (`wanted_states`, one per kind) the ones the loaded module components
        carry: per kind, `remove` the old state where it differs and `apply` the new one where it is
        missing (a component (re)loaded since carries none), under `suspended` (plain modules)."""
        modules = Models({n: loaded[n] for n in MODULE_COMPONENTS if isinstance(loaded.get(n), torch.nn.Module)},
                         self.states)
        wanted = {state.kind: state for state in wanted_states}
        plans, touched = [], set()
        for kind in sorted(set(wanted) | set(self.view_states)):
            state = wanted.get(kind)
            old, applied = self.view_states.get(kind, (None, {}))
            carried = [n for n, ref in applied.items() if n in modules and ref() is modules[n]]
            stale = carried if old is not None and old != state else []
            keep = [n for n in carried if n not in stale]
            fresh = [n for n in modules if n not in keep] if state is not None else []
            if stale or fresh or (state is None and old is not None):
                plans.append((kind, state, old, stale, keep, fresh))
                touched.update(stale + fresh)
        if not plans:
            return
        with self.suspended(loaded, sorted(touched)):
            for kind, state, old, stale, keep, fresh in plans:
                if stale:
                    old.remove(modules, stale)
                if state is None:
                    self.view_states.pop(kind, None)
                    continue
                if fresh:
                    state.apply(modules, fresh)
                self.view_states[kind] = (state, {n: weakref.ref(modules[n]) for n in [*keep, *fresh]})

    # -- stages ------------------------------------------------------------------------------------
    def enter(self, loaded: Mapping[str, Any], names: tuple[str, ...], label: str, device: torch.device) -> None:
        """Start a stage: the clean state for what is resident, then the stage's components on the
        device (the host's memory listeners first, where a whole one moves), each checked to compute
        on `device`, the handle's execution device."""
        self.settle_stage(loaded)
        self.in_stage = set(names)
        for name in names:
            if name in MODULE_COMPONENTS:
                self.acquire(name, loaded[name])
                self.ledger.append(("acquire", name, label))
        for name in names:
            check_device(name, loaded.get(name), device)

    def leave(self, loaded: Mapping[str, Any], names: tuple[str, ...], label: str) -> None:
        """End a stage (finished, failed or interrupted): every component it used back in the clean state."""
        for name in names:
            if name in MODULE_COMPONENTS:
                self.ledger.append(("release", name, label))
        self.in_stage = set()
        self.settle_stage(loaded, names)

    def acquire(self, name: str, module: Any) -> None:
        """Bring a stage's component onto the device; the memory listeners first, when a whole one moves."""
        mode = self.mode
        if name not in self.resident and mode.device.type != "cpu" and mode.moves_whole(name):
            for listener in list(self.memory_listeners):
                listener(name, module, mode.device, stored_bytes(module, include_meta=True))
        self.mode.acquire(name, module)
        self.resident.add(name)

    def settle_stage(self, loaded: Mapping[str, Any], used: tuple[str, ...] = ()) -> None:
        """The clean state for what is resident and what a stage used (only those can hold anything)."""
        self.settle(loaded, [n for n in MODULE_COMPONENTS if n in self.resident or n in used])
        if self.device is not None and self.device.type == "cuda" and not self.mode.keeps_resident:
            torch.cuda.empty_cache()

    def resident_bytes(self, loaded: Mapping[str, Any]) -> int:
        """Bytes of the components held on the accelerator between stages (what a host may ask back)."""
        return sum(stored_bytes(loaded.get(n)) for n in self.resident)

    def settle(self, loaded: Mapping[str, Any], names: list[str] | None = None) -> list[str]:
        """Bring components (all loaded by default) to the mode's clean state; returns those moved off."""
        mode = self.mode
        if mode is None:
            return []
        moved = []
        for name in names if names is not None else [n for n in MODULE_COMPONENTS if n in loaded]:
            if name not in mode.homes:
                continue
            mode.settle(name, loaded.get(name))
            if not mode.keeps_resident and name in self.resident:
                self.resident.discard(name)
                moved.append(name)
        return moved

    def allowed_resident(self, loaded: Mapping[str, Any]) -> set[str]:
        if self.mode is None or self.mode.keeps_resident:
            return {n for n in MODULE_COMPONENTS if n in loaded}
        return set()

    def drop(self, name: str, module: Any) -> None:
        """Let go of one component (a release): hooks off, tensors home, then forget it."""
        if self.mode is not None and name in self.mode.homes:
            self.mode.uninstall(name, module)  # disk: hooks off, the streamed weights not read back
        elif isinstance(module, torch.nn.Module):
            from ..weights.disk import on_disk
            from ..weights.state import state_for

            hooks.strip(module, keep=hooks.LASTING)
            if not on_disk(module, state_for(self.states, name, module)):  # loaded for disk offload: nothing to move
                module.to(CPU)
        self.resident.discard(name)
        for _kind, (_state, applied) in self.view_states.items():
            applied.pop(name, None)


def component_device(module: Any) -> torch.device | None:
    """Where a component computes: the device its first moving hook onloads to (an offload mode's, disk
    streaming's; see `lingbot_core.hooks`), else where its weights are."""
    if not isinstance(module, torch.nn.Module):
        return None
    for sub in module.modules():
        for _name, hook in hooks.attached(sub):
            device = hooks.onload_device(hook)
            if device is not None:
                return device
    for p in module.parameters():
        if p.device.type != "meta":
            return p.device
    return None


def check_device(name: str, module: Any, device: torch.device) -> None:
    """Refuse a component set up to compute somewhere else than `device`."""
    found = component_device(module)
    if found is not None and not same_device(found, device):
        raise RuntimeError(f"{name} is set up to run on {found} but the handle's execution device is "
                           f"{device}; reconfigure offload")
