"""Live previews while sampling: Wan 2.1 latents -> a small RGB image, every step.

Inside ComfyUI the preview comes from ComfyUI's own previewer for its `Wan21` latent format (it
honours `--preview-method`; `auto` means the latent-to-RGB approximation) and travels with the
progress bar. Headless there is no editor to show it in: when `LINGBOT_PREVIEW_DIR` is set, one
PNG per step is written there instead, made with the same linear approximation (under torchrun in
its ``rank<RANK>`` sub-folder: with --jobs several processes preview different jobs at once).

When a light decoder (TAEHV / LightTAE, `lighttaew2_1` or `taew2_1` .safetensors in
`models/vae_approx`) is present, the previews decode the first frame with it instead, at half the
video's size (`light_preview`): real pixels rather than a colour sketch, for a fraction of a second on
a GPU (seconds on a CPU, still small beside a step). Inside ComfyUI only where `--preview-method` is
`auto` or `taesd`; a file that cannot be read leaves the approximation, after one warning.
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


def light_preview(latents: torch.Tensor, light: Path) -> torch.Tensor:
    """(1,16,T,h,w) DiT-space latents -> the first frame as uint8 [H/2,W/2,3], by the light decoder."""
    from lingbot_core.checkpoints.light_vae_file import cached_light_vae
    from lingbot_core.checkpoints.vae_file import shipped_config
    from lingbot_core.models.light_vae import decode_frames

    model = cached_light_vae(light)
    config = shipped_config() if model.latent_space == "raw" else None  # the Wan 2.1 latent statistics
    first = latents[:, :, :1].detach()
    frame = decode_frames(model, first, config, first.device, full_size=False)[0]
    return frame.mul(255).round().to(torch.uint8)


class Previewer:
    """Turns the sampler's latents into what the host shows: a ComfyUI preview tuple, or a file."""

    def __init__(self, label: str, comfy: bool) -> None:
        self.label = label
        self._comfy = None
        self._folder: Path | None = None
        self._light: Path | None = None
        self._max_size = 512
        self._host = "comfy" if comfy else "headless"
        if (_comfy_method_allows_light() if comfy else bool(os.environ.get("LINGBOT_PREVIEW_DIR"))):
            from .files import light_vae_file

            self._light = light_vae_file()
        if comfy:
            try:
                import comfy.latent_formats
                import comfy.model_management
                import latent_preview

                self._comfy = latent_preview.get_previewer(comfy.model_management.get_torch_device(),
                                                           comfy.latent_formats.Wan21())
                self._max_size = getattr(latent_preview, "MAX_PREVIEW_RESOLUTION", self._max_size)
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
        return self._comfy is not None or self._folder is not None or (self._light is not None and self._host == "comfy")

    def _light_frame(self, latents: torch.Tensor) -> torch.Tensor | None:
        """The light decoder's preview frame, or None (no file; or it failed: one warning, then never again)."""
        if self._light is None:
            return None
        try:
            return light_preview(latents, self._light)
        except Exception as err:  # a preview never fails a run
            import logging

            logging.getLogger("lingbot_nodes").warning("lingbot: previews with the light decoder %s failed (%s); "
                                                       "using the latent approximation", self._light.name,
                                                       str(err)[:200])
            self._light = None
            return None

    def comfy_preview(self, latents: torch.Tensor):
        """ComfyUI's ("JPEG", image, max size) tuple for `ProgressBar.update_absolute`, or None."""
        if not isinstance(latents, torch.Tensor) or latents.ndim != 5 or self._host != "comfy":
            return None
        frame = self._light_frame(latents)
        if frame is not None:
            from PIL import Image

            return ("JPEG", Image.fromarray(frame.numpy()), self._max_size)
        if self._comfy is None:
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
        frame = self._light_frame(latents)
        Image.fromarray((frame if frame is not None else latent_rgb(latents)).numpy()).save(path)
        return path


def _comfy_method_allows_light() -> bool:
    """Inside ComfyUI: whether `--preview-method` leaves the choice to us (`auto`) or asks for a
    tiny decoder (`taesd`); `latent2rgb` and `none` are kept as the user set them."""
    try:
        from comfy.cli_args import args

        method = getattr(args.preview_method, "value", args.preview_method)
    except Exception:
        return False
    return str(method) in ("auto", "taesd")


def _file_stem(text: str) -> str:
    """A plain file name stem: node ids are workflow text (subgraph ids hold ':', any may hold '/')."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", text).lstrip(".")[:160] or "preview"


def previewer_for(label: str) -> Previewer | None:
    """The step previewer a node hands to `runtime.node_work`: None where nothing would be shown."""
    from .runtime import in_comfy

    previewer = Previewer(label, comfy=in_comfy())
    return previewer if previewer.active else None
