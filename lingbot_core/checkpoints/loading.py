"""Load the components of a LingBot-Video checkpoint (as `inspection` found it) onto the CPU.

The DiTs load tensor by tensor from their resolved sources (`weights.loader.load_dit`); the VAE and
text encoder through diffusers / transformers from their folders, or through the single-file route
registered for them (`inspection.FILE_ROUTES`). Every loaded component is scanned for NaN/inf.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from ..components import DITS, REFINER, TABLE, TRANSFORMER
from ..errors import CheckpointError
from ..weights import checks
from ..weights.resolve import ComponentSource, folder_source
from ..weights.state import ModelState
from .inspection import COMPONENTS, FILE_ROUTES, CheckpointInfo, check_state_dict, inspect_checkpoint


def load_transformer(folder: str | os.PathLike | None, subfolder: str = TRANSFORMER, *,
                     dtype: torch.dtype | None = None, weights: str = "auto",
                     streamed: bool = False, source: ComponentSource | None = None,
                     state: ModelState | None = None) -> torch.nn.Module:
    """A DiT, tensor by tensor from its files (`weights.loader.load_dit`).

    `source`: the component as resolved when the checkpoint opened (its headers are not read
    again); without it `folder/subfolder` is resolved now. dtype None keeps the stored dtype
    (fp32-kept modules in fp32); `weights` "fp8_e4m3" quantizes the linear and expert weights on
    load. `streamed`: for disk-backed offload, the tensors kept as stored stay in the file (on `meta`).
    `state`: a fresh `weights.state.ModelState` that receives what the load found (disk homes and the
    like; the handle keeps it as the model's state).
    """
    from ..weights.loader import load_dit

    if source is None:
        if folder is None:
            raise ValueError("load_transformer needs a folder or a resolved source")
        source = folder_source(Path(folder) / subfolder, subfolder if subfolder in DITS else TRANSFORMER)
    return load_dit(source, dtype=dtype, weights=weights, streamed=streamed, state=state)


def load_refiner(folder: str | os.PathLike | None, *, dtype: torch.dtype | None = None,
                 weights: str = "auto", streamed: bool = False, info: CheckpointInfo | None = None,
                 state: ModelState | None = None) -> torch.nn.Module:
    """The MoE refiner DiT, loaded only when asked for; a dense checkpoint gets a clear error.
    `info`: the checkpoint as opened (its resolved refiner source is used; else `folder` is inspected)."""
    info = info if info is not None else inspect_checkpoint(folder)
    if not info.has_refiner:
        raise CheckpointError(
            f"{info.folder} has no refiner/ folder: the refiner ships only with the MoE checkpoint "
            "(robbyant/lingbot-video-moe-30b-a3b). Load that checkpoint, or disable refinement."
        )
    source = info.sources[REFINER]
    return _finite(load_transformer(None, dtype=dtype, weights=weights, streamed=streamed, source=source,
                                    state=state), REFINER, source.config_dir or source.where)


def _finite(module: Any, name: str, where: Path) -> Any:
    """Weights with NaN/inf are refused when the component loads (a sum per tensor: cheap).
    `where`: the component's folder or file, as messages name it."""
    if os.environ.get("LINGBOT_SKIP_WEIGHT_SCAN") != "1" and isinstance(module, torch.nn.Module):
        checks.scan_non_finite(module, name, Path(where))
    return module


def load_component(folder: Path, name: str, *, dtype: torch.dtype | None = None,
                   attn_implementation: str = "sdpa", weights: str = "auto", streamed: bool = False,
                   source: ComponentSource | None = None, state: ModelState | None = None) -> Any:
    """Load one component from a validated folder (CPU). dtype None: as stored (the DiT) or float32.
    `streamed` (the DiT only): its stored tensors stay in the file, for disk-backed offload.
    `source`: the component as resolved when the checkpoint opened (else it is resolved now): a
    `ComponentSource`, what a single-file route resolved (`FILE_ROUTES`), or a processor folder.
    `state`: receives what the load found (a DiT's disk homes, a text-only encoder; see `weights.state`)."""
    if source is not None and not isinstance(source, (ComponentSource, Path)):
        route = FILE_ROUTES[TABLE[name].role]
        module = route.load(source, dtype=dtype, attn_implementation=attn_implementation, weights=weights,
                            streamed=streamed, state=state)
        return _finite(module, name, Path(getattr(source, "path", name)))
    if name == TRANSFORMER:
        dit = load_transformer(folder, dtype=dtype, weights=weights, streamed=streamed, source=source, state=state)
        return _finite(dit, name, (source.config_dir or source.where) if source is not None else Path(folder) / name)
    if name == "vae":
        from diffusers import AutoencoderKLWan

        with torch.device("meta"):
            skeleton = AutoencoderKLWan.from_config(AutoencoderKLWan.load_config(folder / "vae"))
        source = source or folder_source(Path(folder) / "vae", "vae")
        check_state_dict("vae", source, {k: tuple(v.shape) for k, v in skeleton.state_dict().items()})
        vae = AutoencoderKLWan.from_pretrained(folder, subfolder="vae", torch_dtype=dtype or torch.float32,
                                               use_safetensors=True, local_files_only=True)
        return _finite(vae.eval().requires_grad_(False), name, folder / name)
    if name == "text_encoder":
        from transformers import Qwen3VLForConditionalGeneration
        from transformers.utils import logging as hf_logging

        # Stored key names may predate transformers' renaming, so check what it reports after loading.
        bars = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()  # one bar per load is noise in a node graph's log
        try:
            model, report = Qwen3VLForConditionalGeneration.from_pretrained(
                folder / "text_encoder", dtype=dtype or torch.float32, attn_implementation=attn_implementation,
                use_safetensors=True, local_files_only=True, output_loading_info=True, trust_remote_code=False,
            )
        finally:
            if bars:
                hf_logging.enable_progress_bar()
        missing = sorted(k for k in report.get("missing_keys", ()) if k != "lm_head.weight")
        if missing or report.get("mismatched_keys"):
            raise CheckpointError(
                f"text_encoder: the weights in {folder / 'text_encoder'} do not match its config.json "
                f"(missing: {missing[:3]}, mismatched: {list(report.get('mismatched_keys') or [])[:3]}). "
                "Re-download it."
            )
        return _finite(model.eval().requires_grad_(False), name, folder / name)
    if name == "processor":
        from transformers import Qwen3VLProcessor

        if isinstance(source, Path):  # given apart from a checkpoint: any of the places processor_files reads
            from .processor_files import load_processor

            return load_processor(source)
        try:
            return Qwen3VLProcessor.from_pretrained(folder / "processor", local_files_only=True,
                                                    trust_remote_code=False)
        except Exception as err:  # transformers' and tokenizers' own errors (tokenizers raises bare Exception)
            raise CheckpointError(f"processor: {folder / 'processor'} cannot be loaded ({type(err).__name__}: "
                                  f"{str(err)[:300]}). The tokenizer/processor files are corrupt; re-download "
                                  "them.") from err
    if name == "scheduler":
        from ..scheduler import FlowUniPCScheduler

        if folder is None:  # only single files were given: the scheduler's default config
            return FlowUniPCScheduler()
        return FlowUniPCScheduler.from_pretrained(folder, subfolder="scheduler", local_files_only=True)
    raise ValueError(f"unknown component {name!r}; expected one of {COMPONENTS}")
