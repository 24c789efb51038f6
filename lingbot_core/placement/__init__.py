"""What lives where while stages run. settings.py: OffloadSettings, modes, options, guards (a leaf);
modes/: one class per mode (install / acquire / settle / uninstall / estimate); state.py: the opaque
placement object the shared components own; door.py: stage(), configure, evict, release, OOM
fallback, per-view state; estimate.py: memory arithmetic and `auto`; report.py: the memory report;
tensors.py: tensor homes and held bytes; hooks.py: accelerate / diffusers hooks."""

from __future__ import annotations

from .door import (
    allowed_resident,
    configure_offload,
    effective_mode,
    evict,
    execution_device,
    fall_back,
    has_fallen_back,
    installed_mode,
    ledger,
    memory_report,
    module_bytes,
    oom_fallback,
    release,
    resident_bytes,
    resident_components,
    stage,
)
from .hooks import hook_inventory, strip_hooks
from .settings import MODES, MODULE_COMPONENTS, OPTIONS, OffloadSettings, check_guards

__all__ = ["MODES", "MODULE_COMPONENTS", "OPTIONS", "OffloadSettings", "allowed_resident", "check_guards",
           "configure_offload", "effective_mode", "evict", "execution_device", "fall_back", "has_fallen_back",
           "hook_inventory", "installed_mode", "ledger", "memory_report", "module_bytes", "oom_fallback", "release",
           "resident_bytes", "resident_components", "stage", "strip_hooks"]
