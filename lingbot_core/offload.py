"""The public offload names the README documents; placement itself lives in `lingbot_core.placement`."""

from __future__ import annotations

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
    hook_inventory,
    installed_mode,
    ledger,
    module_bytes,
    release,
    resident_bytes,
    resident_components,
    stage,
    strip_hooks,
)
from .placement.fit import DoesNotFit, check_handle, require_refiner
from .placement.hooks import component_device

__all__ = [
    "MODES", "MODULE_COMPONENTS", "DoesNotFit", "OffloadSettings", "check_handle", "require_refiner",
    "allowed_resident", "component_device", "configure_offload", "effective_mode", "evict", "execution_device",
    "fall_back", "has_fallen_back", "hook_inventory", "installed_mode", "ledger", "module_bytes", "release", "resident_bytes", "resident_components",
    "stage", "strip_hooks",
]
