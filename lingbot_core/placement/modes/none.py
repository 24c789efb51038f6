"""`none`: components move to the device when first used and stay there."""

from __future__ import annotations

from typing import Any

from .base import Mode


class NoneMode(Mode):
    name = "none"
    speed = 0
    summary = "all on the GPU"
    keeps_resident = True

    def moves_whole(self, name: str) -> bool:
        return True

    def acquire(self, name: str, module: Any) -> None:
        module.to(self.device)

    def settle(self, name: str, module: Any) -> None:
        pass  # resident between stages: nothing goes back

    @staticmethod
    def estimate(sizes: Any, geometry: Any, activations: dict[str, int]) -> int:
        # Everything stays resident. With a refiner, the base DiT is dropped first only when the
        # refine stage is told to release it (under `none` it is kept by default).
        dits = sizes.transformer
        if geometry.refine is not None:
            dits = max(sizes.transformer, sizes.refiner) if geometry.release_base else sizes.transformer + sizes.refiner
        return sizes.text_encoder + sizes.vae + dits + max(activations.values())
