"""The public memory names the README documents; they live in `lingbot_core.placement`
(`estimate.py`: the estimate; `fit.py`: the `auto` choice and the fit check; `report.py`: where everything is now)."""

from __future__ import annotations

from .placement.door import free_accelerator_bytes, memory_report
from .placement.estimate import (
    RESERVE_BYTES,
    Geometry,
    GiB,
    ModelSizes,
    activation_bytes,
    estimate_peak,
    geometry_from,
    host_bytes,
)
from .placement.fit import AutoChoice, choose_mode, describe
from .placement.modes import MODE_ORDER
from .placement.report import ComponentMemory, MemoryReport, location

sizes_from_modules = ModelSizes.from_modules

__all__ = [
    "MODE_ORDER", "RESERVE_BYTES", "AutoChoice", "ComponentMemory", "Geometry", "GiB", "MemoryReport", "ModelSizes",
    "activation_bytes", "choose_mode", "describe", "estimate_peak", "free_accelerator_bytes", "geometry_from",
    "host_bytes", "location", "memory_report", "sizes_from_modules",
]
