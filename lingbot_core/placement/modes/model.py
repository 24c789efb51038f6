"""`model`: one whole component on the device at a time, for the stage that uses it.

No hooks: the door acquires what a stage names and settles it afterwards. Moving is rebinding
each tensor between its CPU home and a device copy (`tensors.Homes`), so offloading copies
nothing back and the home storage is never copied.
"""

from __future__ import annotations

from typing import Any

from .base import Mode, peak_over_phases


class ModelMode(Mode):
    name = "model"
    speed = 1
    disk_unit = "model"
    summary = "one component at a time"

    def _keeps_homes(self, name: str) -> bool:
        return True

    whole = None  # every component moves as one piece

    @staticmethod
    def estimate(sizes: Any, geometry: Any, activations: dict[str, int]) -> int:
        weights = {"text": sizes.text_encoder, "denoise": sizes.transformer,
                   "refine": sizes.refiner or sizes.transformer}
        return peak_over_phases(sizes, activations, weights)
