"""The light decoder's file (TAEHV `taew2_1` / LightTAE `lighttaew2_1`), as ComfyUI keeps it in
`models/vae_approx`: read with the same bounded header checks as every other file, every decoder
tensor's name and shape compared with the network (`models.light_vae`) before anything is
allocated, and a wrong file refused in one line that says what it is.

The two files hold the same tensors but decode different latents (raw for LightTAE, normalised for
TAEHV); nothing inside a file tells them apart, so its name does (`LIGHT_FILES`), as in ComfyUI.
Only `.safetensors` is read (a `.pth` is a pickle: code, not data). Encoder tensors, when present,
are skipped: only the decoder is used.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import CheckpointError
from ..models.light_vae import LATENT_CHANNELS, LightVideoDecoder, expected_shapes, grow_weights
from ..weights.checks import tensor_set_problems
from ..weights.fileio import regular_file_problem
from ..weights.safetensors_header import SafetensorsHeader, TensorReader, read_safetensors_file

WHERE = "models/vae_approx"  # ComfyUI's folder for preview decoders (messages)


@dataclass(frozen=True)
class LightFileKind:
    """A light decoder file we read: the start of its name, the latents it decodes, where it comes from."""

    prefix: str
    latent_space: str  # a key of models.light_vae.LATENT_SPACES
    source: str


LIGHT_FILES: tuple[LightFileKind, ...] = (  # the order is the preference when several are present
    LightFileKind("lighttaew2_1", "raw", "LightTAE for Wan 2.1 (lightx2v/Autoencoders)"),
    LightFileKind("taew2_1", "normalised", "TAEHV for Wan 2.1 (madebyollin/taehv)"),
)
PUT = f"Put {' or '.join(k.prefix + '.safetensors' for k in LIGHT_FILES)} in {WHERE}"
FIX = f"{PUT}, or decode with vae: full."
FLOAT_DTYPES = ("F32", "F16", "BF16")
_FULL_VAE_MARKS = ("decoder.middle.0.residual.0.gamma", "decoder.mid_block.resnets.0.norm1.gamma")


@dataclass(frozen=True)
class LightVAEFile:
    """What `inspect_light_vae_file` found: the checked header and how to read it."""

    path: Path
    kind: LightFileKind
    header: SafetensorsHeader
    keep_rows: dict[str, int]  # grow weights stored with more rows than used: name -> rows kept (the last)

    @property
    def latent_space(self) -> str:
        return self.kind.latent_space


def file_kind(path: str | Path) -> LightFileKind | None:
    """The kind a file name says it is (its name starts with a `LIGHT_FILES` prefix), or None."""
    name = Path(path).name.lower()
    return next((kind for kind in LIGHT_FILES if name.startswith(kind.prefix)), None)


def _what_else(path: Path, tensors: dict) -> str | None:
    """A phrase naming what a file is when it is not a Wan 2.1 light decoder, or None."""
    if any(mark in tensors for mark in _FULL_VAE_MARKS):
        return "the full Wan 2.1 VAE (it belongs in models/vae)"
    first = tensors.get("decoder.1.weight")
    if first is None or "decoder.22.bias" not in tensors:
        return "not a light video decoder (no tensors named decoder.1.weight / decoder.22.bias)"
    channels = first.shape[1] if len(first.shape) == 4 else None
    if channels == 48:
        return "a Wan 2.2 light decoder (taew2_2, 48 latent channels)"
    if channels is not None and channels != LATENT_CHANNELS:
        return f"a light decoder for {channels} latent channels (Wan 2.1 has {LATENT_CHANNELS})"
    return None


def inspect_light_vae_file(path: str | Path) -> LightVAEFile:
    """Check a light decoder file from its header alone: name, dtypes, every decoder tensor's shape."""
    path = Path(path)
    if path.suffix.lower() != ".safetensors":
        raise CheckpointError(f"{path.name}: a light decoder must be .safetensors (got {path.suffix or 'no extension'}). "
                              f"{FIX}")
    problem = regular_file_problem(path)
    if problem is not None:
        raise CheckpointError(f"light decoder {path} {problem}. {FIX}")
    kind = file_kind(path)
    if kind is None:
        raise CheckpointError(f"{path.name}: a light decoder's name must start with "
                              f"{' or '.join(k.prefix for k in LIGHT_FILES)} (the two read different latents and only "
                              f"the name tells them apart). {FIX}")
    header = read_safetensors_file(path)
    tensors = header.tensors
    other = _what_else(path, tensors)
    if other is not None:
        raise CheckpointError(f"{path.name} is {other}, not a Wan 2.1 light decoder. {FIX}")
    decoder = {name: entry for name, entry in tensors.items() if name.startswith("decoder.")}
    expected = expected_shapes()
    grows = grow_weights()
    keep_rows: dict[str, int] = {}
    shapes = {}
    for name, entry in decoder.items():
        shape = tuple(entry.shape)
        rows = grows.get(name)
        if rows is not None and len(shape) == 4 and shape[0] > rows and shape[0] % rows == 0:
            keep_rows[name] = rows  # trained with a larger stride: the last frame's rows are this one's
            shape = (rows, *shape[1:])
        shapes[name] = shape
    problems = tensor_set_problems(shapes, expected)
    if problems:
        raise CheckpointError(f"{path.name}: not a complete Wan 2.1 light decoder ({'; '.join(problems)}). {FIX}")
    bad = sorted({decoder[name].dtype for name in expected} - set(FLOAT_DTYPES))
    if bad:
        raise CheckpointError(f"{path.name}: decoder tensors stored as {bad[0]}; a light decoder is read in "
                              f"F32, F16 or BF16 only. {FIX}")
    return LightVAEFile(path, kind, header, keep_rows)


def load_light_vae(source: str | Path | LightVAEFile, *, dtype: torch.dtype = torch.float32) -> LightVideoDecoder:
    """The decoder (CPU, eval, no grad) from a checked file."""
    info = source if isinstance(source, LightVAEFile) else inspect_light_vae_file(source)
    state: dict[str, torch.Tensor] = {}
    with TensorReader(info.header) as reader:
        for name in expected_shapes():
            value = reader.get(name)
            rows = info.keep_rows.get(name)
            if rows is not None:
                value = value[-rows:]
            state[name] = value.to(dtype)
    with torch.inference_mode(False):
        model = LightVideoDecoder(info.latent_space).to(dtype)
        model.load_state_dict(state, strict=True)
    return model.eval().requires_grad_(False)


_LOADED: dict[tuple, LightVideoDecoder] = {}


def cached_light_vae(path: str | Path) -> LightVideoDecoder:
    """`load_light_vae` once per file (same path, size and modification time): previews call it every step."""
    path = Path(path)
    problem = regular_file_problem(path)
    if problem is not None:
        raise CheckpointError(f"light decoder {path} {problem}. {FIX}")
    info = os.stat(path)
    key = (str(path.resolve()), info.st_size, info.st_mtime_ns)
    model = _LOADED.get(key)
    if model is None:
        model = load_light_vae(path)
        _LOADED.clear()  # one file at a time: a few tens of MB, not worth more
        _LOADED[key] = model
    return model
