"""The VAE, text encoder and processor from single files / folders outside a checkpoint: the slot the
handle fills when `PipelineHandle.open(..., files=...)` names them.

`inspect_file` checks a file from its header when the handle opens (cheap, before any stage), and
returns what `load_file` needs later; `check_fit` holds the parts to each other and to the DiT's
config (latent channels, text width, the processor's vision token ids), so a mixed-up set of files
is refused at open with a message naming the file, not in the middle of a run.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError

FILE_COMPONENTS = ("vae", "text_encoder", "processor")


@dataclass(frozen=True)
class FileComponent:
    """One component given as a file (or, for the processor, a folder), checked from its header."""

    name: str  # "vae", "text_encoder" or "processor"
    path: Path
    info: Any = None  # VAEFile / TextEncoderFile (header facts); the processor folder's kind
    config: dict[str, Any] | None = None  # the diffusers / transformers config it loads with

    @property
    def nbytes(self) -> int:
        if self.path.is_file():
            return self.path.stat().st_size
        return 0


def _folder_config(folder: Path | None, name: str) -> dict[str, Any] | None:
    if folder is None:
        return None
    path = Path(folder) / name / "config.json"
    if not path.is_file():
        return None
    from ..json_text import parse_json_text

    data = parse_json_text(path.read_text(encoding="utf-8"), str(path))
    return data if isinstance(data, dict) else None


def inspect_file(name: str, path: str | Path, *, folder: Path | None = None) -> FileComponent:
    """Check one file from its header. `folder`: a checkpoint folder whose config (text encoder)
    describes the file better than the shipped one (used when present)."""
    path = Path(path).expanduser()
    if name == "vae":
        from .vae_file import inspect_vae_file

        info = inspect_vae_file(path)
        return FileComponent(name, path, info, info.config)
    if name == "text_encoder":
        from .text_encoder_file import inspect_text_encoder_file

        info = inspect_text_encoder_file(path, config=_folder_config(folder, "text_encoder"))
        return FileComponent(name, path, info, info.config)
    if name == "processor":
        from .processor_files import resolve_processor_folder

        where, kind = resolve_processor_folder(path)
        return FileComponent(name, where, kind)
    raise ValueError(f"{name!r} cannot be given as a single file here; expected one of {FILE_COMPONENTS}")


def load_file(component: FileComponent, *, dtype: torch.dtype | None = None,
              attn_implementation: str = "sdpa") -> Any:
    """Load a checked file component (CPU). dtype None: float32."""
    if component.name == "vae":
        from .vae_file import load_vae_file

        return load_vae_file(component.info, dtype=dtype)
    if component.name == "text_encoder":
        from .text_encoder_file import load_text_encoder_file

        return load_text_encoder_file(component.info, dtype=dtype, attn_implementation=attn_implementation)
    if component.name == "processor":
        from .processor_files import load_processor

        return load_processor(component.path)
    raise ValueError(f"unknown file component {component.name!r}")


def check_fit(dit_config: dict[str, Any] | None, vae_config: dict[str, Any] | None,
              text_encoder_config: dict[str, Any] | None, where: dict[str, Path]) -> None:
    """The parts must belong together: the VAE's latent channels are the DiT's input channels, the
    text encoder's width is the DiT's text width. `where`: the file each config came from."""
    if dit_config is not None and vae_config is not None:
        z, dit_in = vae_config.get("z_dim"), dit_config.get("in_channels")
        if z is not None and dit_in is not None and z != dit_in:
            raise CheckpointError(f"{where.get('vae', 'the VAE')}: the VAE has {z} latent channels, the DiT "
                                  f"({where.get('transformer', 'transformer')}) takes {dit_in}; use the Wan 2.1 VAE.")
    if dit_config is not None and text_encoder_config is not None:
        width = (text_encoder_config.get("text_config") or {}).get("hidden_size")
        text_dim = dit_config.get("text_dim")
        if width is not None and text_dim is not None and width != text_dim:
            raise CheckpointError(f"{where.get('text_encoder', 'the text encoder')}: its hidden size is {width}, the "
                                  f"DiT ({where.get('transformer', 'transformer')}) reads text {text_dim} wide; use "
                                  "Qwen3-VL-4B (qwen3vl_4b_bf16.safetensors or qwen3vl_4b_fp8_scaled.safetensors).")
