"""The public offload names the README documents; placement itself lives in `lingbot_core.placement`."""

from __future__ import annotations

from .hooks import inventory as hook_inventory
from .hooks import strip as strip_hooks
from .placement import (
    MODES,
    MODULE_COMPONENTS,
    OffloadSettings,
    allowed_resident,
    configure_offload,
    effective_mode,
    evict,
    execution_device,
    fall_back,
    has_fallen_back,
    installed_mode,
    ledger,
    module_bytes,
    release,
    resident_bytes,
    resident_components,
    stage,
)
from .placement.door import add_listeners, check_handle, component_device, require_refiner
from .placement.fit import DoesNotFit

__all__ = [
    "MODES", "MODULE_COMPONENTS", "DoesNotFit", "OffloadSettings", "add_listeners", "check_handle", "require_refiner",
    "allowed_resident", "component_device", "configure_offload", "effective_mode", "evict", "execution_device",
    "fall_back", "has_fallen_back", "hook_inventory", "installed_mode", "ledger", "module_bytes", "release", "resident_bytes", "resident_components",
    "stage", "strip_hooks",
]
