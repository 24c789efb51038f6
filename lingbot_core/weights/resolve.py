"""One place that turns "a checkpoint folder" (and, later, "a single file per component") into one
weights source per component, resolved and opened once, then handed to the loaders.

A `ComponentSource` knows its component (a row of `components.TABLE`), its format (a row of
`weights.formats.FORMATS`), its files, where its config comes from, and the header facts read when
it was resolved. Everything after that (the folder checks, the size estimates, the DiT loader, a
reload after release) reads those facts; no file's header is read twice per open.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..components import component as component_row
from ..errors import CheckpointError, WeightsError
from ..json_text import parse_json_text
from .formats import FORMATS, PICKLED_SUFFIXES, WeightFormat

log = logging.getLogger("lingbot_core.weights")


@dataclass(eq=False)
class ComponentSource:
    """Where one component's weights are, in which format, with their headers read (once)."""

    component: str
    format: WeightFormat
    files: tuple[Path, ...]
    config_dir: Path | None  # the folder whose config file describes it (None: `config` is given)
    headers: Any = field(default=None, repr=False)  # what `format.read` returned
    config: dict[str, Any] | None = field(default=None, repr=False)  # a config not read from a folder
    rename: dict[str, str] | None = field(default=None, repr=False)  # stored name -> the checkpoint's own
    _source: Any = field(default=None, repr=False)

    @property
    def where(self) -> Path:
        """What messages name: the file (one) or the folder (shards)."""
        return self.files[0] if len(self.files) == 1 else self.files[0].parent

    @property
    def stored_bytes(self) -> int:
        return sum(f.stat().st_size for f in self.files)

    def open(self) -> Any:
        """The DiT weights source (`weights.sources`), made from the header facts already read."""
        if self._source is None:
            self._source = self.format.source(list(self.files), self.headers, self.rename)
        return self._source

    def stored_tensors(self) -> dict[str, Any]:
        """Safetensors: name -> StoredTensor of every file (the folder checks compare these)."""
        from .safetensors_header import stored_tensors

        if self.format.name != "safetensors":
            raise ValueError(f"{self.where} is {self.format.name}, not safetensors")
        return stored_tensors(self.headers)


def _read_index(index: Path, component: str) -> dict[str, Any]:
    try:
        text = index.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{component}: cannot read {index} ({err}). The file is corrupt; re-download it.") from err
    data = parse_json_text(text, f"{component}: {index}")
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{component}: {index} has no weight_map; re-download it.")
    return weight_map


def find_gguf(folder: Path) -> Path | None:
    """The one `*.gguf` file in a component folder, or None; several are ambiguous."""
    found = sorted(p for p in folder.glob("*.gguf") if p.is_file())
    if len(found) > 1:
        raise WeightsError(f"{folder} holds {len(found)} GGUF files ({', '.join(p.name for p in found)}); keep one, "
                           "or pass the file to load explicitly.")
    return found[0] if found else None


def folder_files(folder: Path, component: str) -> tuple[WeightFormat, list[Path]]:
    """A component folder's weights: the single safetensors file, the shards its index lists, or (a
    component that may be quantized) its one GGUF file. Pickled weights are named and refused."""
    row = component_row(component)
    stem = row.weight_stem
    single = folder / f"{stem}.safetensors"
    index = folder / f"{stem}.safetensors.index.json"
    if single.is_file():
        _warn_ignored(folder, component, [single], row.quantizable)
        return FORMATS["safetensors"], [single]
    if index.is_file():
        files = [folder / name for name in sorted(set(_read_index(index, component).values()))]
        for f in files:
            if not f.is_file() or f.parent != folder:
                raise CheckpointError(f"{component}: shard {f} listed in {index.name} is missing; re-download it.")
        _warn_ignored(folder, component, files, row.quantizable)
        return FORMATS["safetensors"], files
    if row.quantizable:
        found = find_gguf(folder)
        if found is not None:
            return FORMATS["gguf"], [found]
    pickled = sorted(p.name for p in folder.iterdir() if p.suffix.lower() in PICKLED_SUFFIXES) if folder.is_dir() else []
    hint = (f" Found only {', '.join(pickled)}: pickled weights are never loaded; convert them to "
            "safetensors.") if pickled else " Re-download the checkpoint."
    raise CheckpointError(f"{component}: missing weights {single} (or a sharded {index.name}).{hint}")


def _warn_ignored(folder: Path, component: str, used: list[Path], quantizable: bool) -> None:
    """Weight files beside the ones used (a GGUF or an fp8 copy dropped next to the bf16 weights) are
    not loaded: say so, naming them, so nobody streams bf16 believing it is the smaller file."""
    if not quantizable or not folder.is_dir():
        return
    others = sorted(p.name for p in folder.iterdir()
                    if p.is_file() and p.suffix in (".gguf", ".safetensors") and p not in used)
    if others:
        log.warning("%s: %s loads %s; %s beside it %s NOT used. To use %s, move it into its own copy of the "
                    "checkpoint folder without the plain weights (or convert with python -m lingbot_core.quantize).",
                    component, folder, used[0].name if len(used) == 1 else f"{len(used)} shards",
                    ", ".join(others), "is" if len(others) == 1 else "are", others[0])


def folder_source(folder: Path, component: str) -> ComponentSource:
    """Resolve a component folder of a diffusers checkpoint: find its files and read their headers once.

    A DiT's weights source is opened here too, so a format problem (an fp8 tensor without its scale
    row, an unknown GGUF type) is refused when the checkpoint opens, not when the DiT loads.
    """
    fmt, files = folder_files(folder, component)
    resolved = ComponentSource(component, fmt, tuple(files), folder, headers=fmt.read(files))
    row = component_row(component)
    if row.quantizable:
        resolved.open()
    else:
        _refuse_quantized(resolved)
    return resolved


def _refuse_quantized(resolved: ComponentSource) -> None:
    """fp8 / GGUF weights are for the DiTs only; the VAE and text encoder must be plain safetensors."""
    folder = resolved.config_dir or resolved.where
    stray = sorted(p.name for p in folder.glob("*.gguf")) if folder.is_dir() else []
    fp8 = [k for k, t in resolved.stored_tensors().items() if t.dtype.startswith("F8")]
    if stray or fp8:
        name = resolved.component
        what = f"GGUF file {stray[0]}" if stray else f"fp8 tensor {fp8[0]}"
        raise CheckpointError(f"{name}: {folder} holds quantized weights ({what}); lingbot-nodes quantizes only "
                              f"the transformer and refiner. Use the checkpoint's original bf16/fp32 {name} folder.")


def check_weights_mode_for(resolved: ComponentSource, weights: str) -> None:
    """Refuse a weights mode the stored format cannot give (fp8 on load of a GGUF), before anything loads."""
    from .modules import FP8

    if weights == FP8 and not resolved.format.fp8_on_load:
        raise WeightsError(f"{resolved.where} is already quantized ({resolved.format.name.upper()}); load it with "
                           "weights 'auto', or point the loader at a bf16 checkpoint to quantize to fp8.")
