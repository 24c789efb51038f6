"""What lives where while stages run. settings.py: OffloadSettings, modes, options, guards (a leaf);
modes/: one class per mode (install / acquire / settle / uninstall / estimate); state.py: the opaque
placement object the shared components own; door.py: stage(), configure, evict, release, OOM
fallback, per-view state; estimate.py: memory arithmetic and `auto`; report.py: the memory report;
tensors.py: tensor homes and held bytes. Every hook a mode attaches goes through `lingbot_core.hooks`."""

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
from .modes import MODE_ORDER, MODES, OPTIONS, check_guards
from .settings import MODULE_COMPONENTS, OffloadSettings

__all__ = ["MODES", "MODE_ORDER", "MODULE_COMPONENTS", "OPTIONS", "OffloadSettings", "allowed_resident", "check_guards",
           "configure_offload", "effective_mode", "evict", "execution_device", "fall_back", "has_fallen_back",
           "installed_mode", "ledger", "memory_report", "module_bytes", "oom_fallback", "release",
           "resident_bytes", "resident_components", "stage"]
