"""The registry of weight file formats: a new format is one module (its source class) and one row here.

A row says which files are in the format (by suffix), how their headers are read (once: `read`
returns the header facts, bounded and validated against the file), how a DiT weights source is made
from those facts without reading again (`source`), and whether the format can be quantized to fp8
on load (GGUF is quantized already: asking for `fp8_e4m3` is refused when the checkpoint opens).
Pre-quantized fp8 is a safetensors file whose fp8 tensors carry `.scale` rows: the safetensors
source tells it apart, tensor by tensor.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import WeightsError


@dataclass(frozen=True)
class WeightFormat:
    name: str
    suffix: str
    read: Callable[[list[Path]], Any]  # files -> header facts (read once per open)
    source: Callable[[list[Path], Any, dict[str, str] | None], Any]  # (files, facts, rename) -> a DiT source
    fp8_on_load: bool = True  # plain tensors may be quantized to fp8 while loading


def _read_safetensors(files: list[Path]) -> Any:
    from .safetensors_header import read_safetensors_file

    return [read_safetensors_file(f) for f in files]


def _safetensors_source(files: list[Path], headers: Any, rename: dict[str, str] | None) -> Any:
    from .sources import SafetensorsSource

    return SafetensorsSource(files, headers, rename=rename)


def _read_gguf(files: list[Path]) -> Any:
    from .sources import GGUFSource

    return GGUFSource(files[0])  # parsing the header is opening the source


def _gguf_source(files: list[Path], opened: Any, rename: dict[str, str] | None) -> Any:
    if rename:
        opened.rename(rename)  # re-indexed under the checkpoint's own names; the header is not read again
    return opened


FORMATS: dict[str, WeightFormat] = {f.name: f for f in (
    WeightFormat("safetensors", ".safetensors", _read_safetensors, _safetensors_source),
    WeightFormat("gguf", ".gguf", _read_gguf, _gguf_source, fp8_on_load=False),
)}

# Files that are weights but never loaded: they unpickle (run code) when read.
PICKLED_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def format_of(path: Path) -> WeightFormat:
    """The format of a weights file, by its suffix; anything else is refused naming what is read."""
    suffix = path.suffix.lower()
    for fmt in FORMATS.values():
        if suffix == fmt.suffix:
            return fmt
    if suffix in PICKLED_SUFFIXES:
        raise WeightsError(f"{path} is a pickled weights file; pickles are never loaded (they can run code). "
                           "Use a .safetensors or .gguf file.")
    known = ", ".join(f.suffix for f in FORMATS.values())
    raise WeightsError(f"{path} is not a weights file lingbot-nodes reads (it reads {known}).")
