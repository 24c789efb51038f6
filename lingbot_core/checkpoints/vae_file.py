"""The Wan 2.1 VAE from one `.safetensors` file, as users keep it in ComfyUI's `models/vae`.

Two namings are met in the wild: the original Wan code's (Comfy-Org's `wan_2.1_vae.safetensors`,
e.g. `decoder.middle.0.residual.0.gamma`) and diffusers' `AutoencoderKLWan` state dict (community
packs, or a checkpoint's `vae/diffusion_pytorch_model.safetensors` copied out). Both load into
diffusers' `AutoencoderKLWan`, the class the folder route uses, so a file holding the same values
decodes bit for bit like the folder.

The renaming is diffusers' own `convert_wan_vae_to_diffusers` for everything but the decoder's
upsampling stages: that function numbers them for the published layout only (blocks 3/7/11 are the
resamplers, the one shortcut sits in block 4), which is wrong for any other `num_res_blocks` or
channel plan (the tiny test VAE among them). Those keys are regrouped here from the structure
itself: each stage is `num_res_blocks + 1` residual blocks, then one resampler (not after the last).

The structure (base width, channel multipliers, residual blocks per stage, temporal downsampling)
is read from the tensor shapes; the latent statistics come from the Wan 2.1 config shipped as
package data (never from the network). The header is checked against the file size before
anything is read, every tensor shape is compared with the model the inferred config builds, and a
file of another VAE (Wan 2.2's 48-channel one, an SD/SDXL/Flux/SD3 image VAE, not a VAE at all) is
refused with one line that says what it is.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError
from ..weights.checks import vae_shapes
from ..weights.fileio import regular_file_problem
from ..weights.safetensors_header import SafetensorsHeader, StoredTensor, TensorReader, read_safetensors_file
from .configs import check_vae_config

CONFIG_FILE = Path(__file__).resolve().parent.parent / "configs" / "wan2.1.vae.json"
# Keys of the latent statistics and of the structure we infer; everything else in the shipped
# config (class name, scale factors) is taken as it is.
_STRUCTURE = ("base_dim", "z_dim", "dim_mult", "num_res_blocks", "temperal_downsample", "in_channels",
              "out_channels")
WAN21_LATENT_CHANNELS = 16
FLOAT_DTYPES = ("F32", "F16", "BF16")
WHERE = "models/vae"  # the ComfyUI folder the file belongs in (for messages)
FIX = (f"Use the Wan 2.1 VAE (Comfy-Org's wan_2.1_vae.safetensors, or the checkpoint's "
       f"vae/diffusion_pytorch_model.safetensors) in {WHERE}.")

# What a file is when it is not a Wan 2.1 VAE: (test on the tensor names, description). First match wins.
_ORIGINAL_MARK = "decoder.middle.0.residual.0.gamma"
_DIFFUSERS_MARK = "decoder.mid_block.resnets.0.norm1.gamma"
_WAN22_ORIGINAL_MARK = "decoder.upsamples.0.upsamples.0.residual.2.weight"


@dataclass(frozen=True)
class VAEFile:
    """What `inspect_vae_file` found: the file, its naming, and the diffusers config it loads with."""

    path: Path
    naming: str  # "wan" (original Wan names) or "diffusers"
    config: dict[str, Any]
    stored_dtypes: tuple[str, ...]
    names: dict[str, str]  # diffusers name -> the file's tensor name
    values: int = 0  # weight values the loaded model holds (the memory estimate scales them to its dtype)
    header: SafetensorsHeader | None = None  # the checked header (the load reads through it: `TensorReader`)

    @property
    def nbytes(self) -> int:
        return self.path.stat().st_size


def shipped_config() -> dict[str, Any]:
    """The Wan 2.1 VAE's diffusers config (package data)."""
    return json.loads(CONFIG_FILE.read_text(encoding="utf-8"))


def _other_vae(path: Path, entries: Mapping[str, StoredTensor]) -> str | None:
    """A one-line description of a file that is not a Wan 2.1 VAE, or None when it may be one."""
    names = set(entries)
    if _WAN22_ORIGINAL_MARK in names:
        return "a Wan 2.2 VAE (48 latent channels)"
    if any(n.startswith("first_stage_model.") for n in names):
        return "a whole Stable Diffusion checkpoint (its VAE is under first_stage_model.), not a VAE file"
    ldm = entries.get("decoder.conv_in.weight")
    if "encoder.down.0.block.0.conv1.weight" in names and ldm is not None:
        z = ldm.shape[1] if len(ldm.shape) > 1 else "?"
        kind = {4: "an SD 1.x / SD 2.x / SDXL image VAE", 16: "an SD3 / Flux image VAE",
                32: "a Flux.2 image VAE"}.get(z, "an image VAE of the Stable Diffusion family")
        return f"{kind} ({z} latent channels)"
    conv_in = entries.get("encoder.conv_in.weight") or entries.get("encoder.conv1.weight")
    if conv_in is not None and len(conv_in.shape) == 4:
        return "a 2-D image VAE (its convolutions are not 3-D)"
    if any(n.startswith(("model.language_model.", "model.layers.", "model.visual.")) for n in names):
        return "a text encoder"
    if any(n.startswith(("blocks.0.", "model.diffusion_model.", "diffusion_model.", "patch_embedder"))
           for n in names):
        return "a diffusion model (DiT)"
    return None


def _z_dim(entries: Mapping[str, StoredTensor], naming: str) -> int | None:
    # post-quant conv: [z, z, 1, 1, 1] in both namings
    conv = entries.get("conv2.weight" if naming == "wan" else "post_quant_conv.weight")
    return conv.shape[0] if conv is not None and conv.shape else None


def _decoder_stage_names(original: list[str], num_res_blocks: int) -> dict[str, str]:
    """Original `decoder.upsamples.<flat>.<rest>` names -> diffusers `decoder.up_blocks.<stage>...`."""
    per_stage = num_res_blocks + 2  # residual blocks, then one resampler
    residual = {"residual.0.gamma": "norm1.gamma", "residual.2.weight": "conv1.weight",
                "residual.2.bias": "conv1.bias", "residual.3.gamma": "norm2.gamma",
                "residual.6.weight": "conv2.weight", "residual.6.bias": "conv2.bias",
                "shortcut.weight": "conv_shortcut.weight", "shortcut.bias": "conv_shortcut.bias"}
    out: dict[str, str] = {}
    pattern = re.compile(r"^decoder\.upsamples\.(\d+)\.(.+)$")
    for name in original:
        match = pattern.match(name)
        if match is None:
            continue
        flat, rest = int(match.group(1)), match.group(2)
        stage, slot = divmod(flat, per_stage)
        if slot <= num_res_blocks and rest in residual:
            out[name] = f"decoder.up_blocks.{stage}.resnets.{slot}.{residual[rest]}"
        elif slot == num_res_blocks + 1 and rest.startswith(("resample.", "time_conv.")):
            out[name] = f"decoder.up_blocks.{stage}.upsamplers.0.{rest}"
        else:  # left unmapped: the shape comparison names it as unexpected
            out[name] = name
    return out


def _rename_original(names: list[str]) -> dict[str, str]:
    """Original Wan names -> diffusers names (the file's name for each diffusers name)."""
    from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers

    decoder = [n for n in names if n.startswith("decoder.upsamples.")]
    rest = [n for n in names if not n.startswith("decoder.upsamples.")]
    # diffusers' converter maps keys to keys; feed it the names themselves as values.
    converted = convert_wan_vae_to_diffusers({n: n for n in rest})
    mapping = {new: old for new, old in converted.items()}
    first_resample = [int(m.group(1)) for n in mapping
                      if (m := re.match(r"^encoder\.down_blocks\.(\d+)\.resample\.", n))]
    num_res_blocks = min(first_resample) if first_resample else 2
    for old, new in _decoder_stage_names(decoder, num_res_blocks).items():
        mapping[new] = old
    return mapping


def _infer_structure(shapes: Mapping[str, tuple[int, ...]], path: Path) -> dict[str, Any]:
    """The structural config fields of a diffusers-named Wan VAE, from its tensor shapes."""
    def shape(name: str) -> tuple[int, ...]:
        if name not in shapes:
            raise CheckpointError(f"{path}: no tensor {name!r}, which every Wan 2.1 VAE has; the file is "
                                  f"incomplete or not a Wan 2.1 VAE. {FIX}")
        return shapes[name]

    conv_in = shape("encoder.conv_in.weight")
    for name, rank in (("encoder.conv_in.weight", 5), ("post_quant_conv.weight", 5), ("decoder.conv_out.weight", 5)):
        if len(shape(name)) != rank:
            raise CheckpointError(f"{path}: tensor {name} has shape {list(shape(name))}, not the {rank}-D convolution "
                                  f"weight of a Wan 2.1 VAE. {FIX}")
    base = conv_in[0]
    stages = len({m.group(1) for n in shapes if (m := re.match(r"^decoder\.up_blocks\.(\d+)\.", n))})
    resnets = {int(m.group(1)) for n in shapes if (m := re.match(r"^decoder\.up_blocks\.0\.resnets\.(\d+)\.", n))}
    if not stages or not resnets or base <= 0:
        raise CheckpointError(f"{path}: its decoder has no up blocks named as in a Wan 2.1 VAE. {FIX}")
    num_res_blocks = max(resnets)  # the decoder has one more residual block per stage than the encoder
    per_stage = num_res_blocks + 1  # encoder: residual blocks, then a resampler
    dim_mult, temporal = [], []
    for stage in range(stages):
        conv = shape(f"encoder.down_blocks.{stage * per_stage}.conv1.weight")
        out = conv[0] if conv else 0
        if out % base or not out:
            raise CheckpointError(f"{path}: encoder stage {stage} has {out} channels, not a multiple of the base "
                                  f"width {base}; not a Wan 2.1 VAE. {FIX}")
        dim_mult.append(out // base)
        if stage < stages - 1:
            temporal.append(f"encoder.down_blocks.{stage * per_stage + num_res_blocks}.time_conv.weight" in shapes)
    return {"base_dim": base, "z_dim": shape("post_quant_conv.weight")[0], "dim_mult": dim_mult,
            "num_res_blocks": num_res_blocks, "temperal_downsample": temporal, "in_channels": conv_in[1],
            "out_channels": shape("decoder.conv_out.weight")[0]}


def inspect_vae_file(path: str | Path) -> VAEFile:
    """Check a single-file VAE from its header alone: naming, structure, dtypes, every shape."""
    path = Path(path)
    if path.suffix.lower() != ".safetensors":
        raise CheckpointError(f"{path}: a VAE file must be .safetensors (got {path.suffix or 'no extension'}). {FIX}")
    problem = regular_file_problem(path)
    if problem is not None:
        raise CheckpointError(f"VAE file {path} {problem}. {FIX}")
    header = read_safetensors_file(path)
    entries = header.tensors
    if not entries:
        raise CheckpointError(f"{path} holds no tensors. {FIX}")
    other = _other_vae(path, entries)
    if _ORIGINAL_MARK in entries:
        naming = "wan"
    elif _DIFFUSERS_MARK in entries:
        naming = "diffusers"
    else:
        naming = ""
    z = _z_dim(entries, naming) if naming else None
    if other is None and z is not None and z != WAN21_LATENT_CHANNELS:
        other = ("a Wan 2.2 VAE (48 latent channels)" if z == 48
                 else f"a video VAE with {z} latent channels (Wan 2.1 has {WAN21_LATENT_CHANNELS})")
    if other is not None or not naming:
        what = other or "not a Wan 2.1 VAE (none of its tensors is named like one)"
        raise CheckpointError(f"{path.name} is {what}, not the Wan 2.1 VAE LingBot-Video uses. {FIX}")
    if naming == "wan":
        try:
            names = _rename_original(list(entries))
        except (KeyError, IndexError, ValueError, TypeError) as err:  # diffusers' converter on odd names
            raise CheckpointError(f"{path}: its tensor names cannot be read as the Wan 2.1 VAE's ({type(err).__name__}: "
                                  f"{str(err)[:120]}). {FIX}") from None
    else:
        names = {n: n for n in entries}
    shapes = {new: entries[old].shape for new, old in names.items()}
    dtypes = sorted({entries[old].dtype for old in names.values()})
    bad = [d for d in dtypes if d not in FLOAT_DTYPES]
    if bad:
        raise CheckpointError(f"{path}: tensors stored as {bad[0]}; a VAE file is read in F32, F16 or BF16 only. {FIX}")
    config = {**shipped_config(), **_infer_structure(shapes, path)}
    try:  # bounded before the skeleton is built (a 100,000-block decoder would take minutes and gigabytes)
        check_vae_config(config, f"{path} (the structure its tensors imply)")
    except CheckpointError as err:
        raise CheckpointError(f"{err} {FIX}") from None
    expected = vae_shapes(config, str(path))
    from ..weights.checks import tensor_set_problems

    problems = tensor_set_problems(shapes, expected)
    if problems:
        raise CheckpointError(f"{path}: not a complete Wan 2.1 VAE ({'; '.join(problems)}). {FIX}")
    return VAEFile(path, naming, config, tuple(dtypes), names, _count(expected.values()), header)


def _count(shapes: Any) -> int:
    total = 0
    for shape in shapes:
        total += math.prod(shape)
    return total


def load_vae_file(source: str | Path | VAEFile, *, dtype: torch.dtype | None = None) -> Any:
    """An `AutoencoderKLWan` (CPU, eval, no grad) from a single file; dtype None: float32."""
    from accelerate import init_empty_weights
    from diffusers import AutoencoderKLWan

    from ..interrupt import interruptible_build

    info = source if isinstance(source, VAEFile) else inspect_vae_file(source)
    header = info.header if info.header is not None else read_safetensors_file(info.path)
    dtype = dtype or torch.float32
    with torch.inference_mode(False):
        with interruptible_build(), init_empty_weights(include_buffers=False):
            model = AutoencoderKLWan.from_config({k: v for k, v in info.config.items() if not k.startswith("_")})
        state: dict[str, torch.Tensor] = {}
        with TensorReader(header) as handle:  # the checked file itself (pread; a replaced file is refused)
            for new, old in info.names.items():
                state[new] = handle.get(old).to(dtype)
        model.load_state_dict(state, strict=True, assign=True)
    return model.eval().requires_grad_(False)
