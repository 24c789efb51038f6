"""Live previews while sampling: Wan 2.1 latents -> a small RGB image, every step.

Inside ComfyUI the preview comes from ComfyUI's own previewer for its `Wan21` latent format (it
honours `--preview-method`; `auto` means the latent-to-RGB approximation) and travels with the
progress bar. Headless there is no editor to show it in: when `LINGBOT_PREVIEW_DIR` is set, one
PNG per step is written there instead, made with the same linear approximation (under torchrun in
its ``rank<RANK>`` sub-folder: with --jobs several processes preview different jobs at once).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch

# Wan 2.1 latent channel -> RGB (rows: the 16 latent channels) and its bias: ComfyUI's table for
# its Wan21 latent format, applied to the normalised (DiT-space) latents our sampler works on.
WAN21_RGB_FACTORS = (
    (-0.1299, -0.1692, 0.2932), (0.0671, 0.0406, 0.0442), (0.3568, 0.2548, 0.1747), (0.0372, 0.2344, 0.1420),
    (0.0313, 0.0189, -0.0328), (0.0296, -0.0956, -0.0665), (-0.3477, -0.4059, -0.2925), (0.0166, 0.1902, 0.1975),
    (-0.0412, 0.0267, -0.1364), (-0.1293, 0.0740, 0.1636), (0.0680, 0.3019, 0.1128), (0.0032, 0.0581, 0.0639),
    (-0.1251, 0.0927, 0.1699), (0.0060, -0.0633, 0.0005), (0.3477, 0.2275, 0.2950), (0.1984, 0.0913, 0.1861),
)
WAN21_RGB_BIAS = (-0.1835, -0.0868, -0.3360)


def latent_rgb(latents: torch.Tensor, frame: int = 0) -> torch.Tensor:
    """(1,16,T,h,w) DiT-space latents -> one frame as uint8 [h,w,3] (the cheap approximation)."""
    x = latents[0, :, min(frame, latents.shape[2] - 1)].detach().float().cpu()  # (16,h,w)
    factors = torch.tensor(WAN21_RGB_FACTORS)  # (16,3)
    rgb = torch.einsum("chw,cr->hwr", x, factors) + torch.tensor(WAN21_RGB_BIAS)
    return ((rgb + 1.0) / 2.0).clamp(0, 1).mul(255).round().to(torch.uint8)


class Previewer:
    """Turns the sampler's latents into what the host shows: a ComfyUI preview tuple, or a file."""

    def __init__(self, label: str, comfy: bool) -> None:
        self.label = label
        self._comfy = None
        self._folder: Path | None = None
        if comfy:
            try:
                import comfy.latent_formats
                import comfy.model_management
                import latent_preview

                self._comfy = latent_preview.get_previewer(comfy.model_management.get_torch_device(),
                                                           comfy.latent_formats.Wan21())
            except Exception:  # no previewer (an older or stripped-down ComfyUI): progress only
                self._comfy = None
        elif os.environ.get("LINGBOT_PREVIEW_DIR"):
            self._folder = Path(os.environ["LINGBOT_PREVIEW_DIR"])
            rank = os.environ.get("RANK", "")
            if os.environ.get("WORLD_SIZE", "1") != "1" and rank.isdigit():
                # a torchrun world: the leader of each video group previews its own job, so one folder each
                self._folder = self._folder / f"rank{int(rank)}"

    @property
    def active(self) -> bool:
        return self._comfy is not None or self._folder is not None

    def comfy_preview(self, latents: torch.Tensor):
        """ComfyUI's ("JPEG", image, max size) tuple for `ProgressBar.update_absolute`, or None."""
        if self._comfy is None or not isinstance(latents, torch.Tensor) or latents.ndim != 5:
            return None
        return self._comfy.decode_latent_to_preview_image("JPEG", latents)

    def write(self, step: int, latents: torch.Tensor, node_id: str | None = None) -> Path | None:
        """Headless: the step's preview as a PNG under LINGBOT_PREVIEW_DIR."""
        if self._folder is None or not isinstance(latents, torch.Tensor) or latents.ndim != 5:
            return None
        from lingbot_core.distributed.stage import writes_outputs

        if not writes_outputs():  # a parallel run's other ranks write nothing
            return None
        from PIL import Image

        self._folder.mkdir(parents=True, exist_ok=True)
        stem = f"{self.label}_{node_id}" if node_id else self.label
        path = self._folder / f"{_file_stem(stem)}_{step:04d}.png"
        Image.fromarray(latent_rgb(latents).numpy()).save(path)
        return path


def _file_stem(text: str) -> str:
    """A plain file name stem: node ids are workflow text (subgraph ids hold ':', any may hold '/')."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", text).lstrip(".")[:160] or "preview"
