"""A LingBot-Video DiT (base or refiner, dense or MoE) from one `.safetensors` or `.gguf` file.

Community files name the same tensors in several ways; all are read as the checkpoint's own names:
- a prefix on every name: `model.diffusion_model.` (stable-diffusion.cpp, ComfyUI checkpoints),
  `diffusion_model.`, `transformer.` (a diffusers pipeline's state dict);
- MoE expert stacks stored 3-D (`blocks.N.ffn.experts.w1`), or one 2-D tensor per expert as
  `...experts.w1.E` or `...experts.w1.E.weight` (the ComfyUI MoE GGUF);
- GGUF tensors reshaped by ComfyUI-GGUF's converter, with their torch shape in
  `comfy.gguf.orig_shape.<name>` (the GGUF source reads it);
- any `general.architecture`, or none.

The file carries no config: the variant and sizes come from the tensors. Each known config (the two
published ones, shipped as package data in `lingbot_core/configs/`, and the tiny test models) is
tried with the file's block count; the one whose every tensor name and shape the file matches is
the file's config. A file matching none is refused naming the first tensor that differs; a file of
another model family (a Wan or Flux DiT, an SD UNet, a VAE, a text encoder) is refused in one line
saying what it is.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..components import TRANSFORMER
from ..errors import CheckpointError
from ..weights.formats import format_of
from ..weights.resolve import ComponentSource

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
PUBLISHED = {"dense": "dense-1.3b.transformer.json", "moe": "moe-30b-a3b.transformer.json"}
PREFIXES = ("model.diffusion_model.", "diffusion_model.", "transformer.")
_PER_EXPERT_WEIGHT = re.compile(r"^(?P<stack>.+\.experts\.w[123])\.(?P<expert>\d+)\.weight$")
_BLOCK = re.compile(r"^blocks\.(\d+)\.")
FIX = ("Put a LingBot-Video DiT file (dense 1.3B or MoE 30B-A3B, .safetensors or .gguf) in "
       "models/diffusion_models, or load the diffusers checkpoint folder.")
# Tensor names that only a LingBot-Video DiT has (after the prefixes are taken off).
_OURS = ("patch_embedder.weight", "text_embedder.linear_1.weight", "time_modulation.1.weight")


def canonical_name(stored: str) -> str:
    """The checkpoint's own name of a tensor stored under a community convention."""
    for prefix in PREFIXES:
        if stored.startswith(prefix):
            stored = stored[len(prefix):]
            break
    found = _PER_EXPERT_WEIGHT.match(stored)
    return f"{found['stack']}.{found['expert']}" if found else stored


_REGISTERED: list[tuple[str, dict[str, Any]]] = []


def register_config(label: str, config: dict[str, Any]) -> None:
    """Make another DiT shape known to single-file loading (a fine-tune of another width, a benchmark's
    model); the file still has to match it tensor for tensor."""
    import inspect

    from ..models.transformer import LingBotVideoTransformer3DModel

    defaults = {k: p.default for k, p in inspect.signature(LingBotVideoTransformer3DModel.__init__).parameters.items()
                if p.default is not inspect.Parameter.empty and k != "spec"}  # a partial config means the class's
    _REGISTERED.append((label, {**defaults, **{k: v for k, v in config.items() if not k.startswith("_")}}))


def known_configs() -> list[tuple[str, dict[str, Any]]]:
    """(label, config) of every DiT shape a single file may have: the published checkpoints', the tiny
    test models' (`lingbot_core.tiny`), then any registered with `register_config`."""
    from ..tiny import tiny_dit_config

    out = [(f"published {variant}", json.loads((CONFIGS / name).read_text(encoding="utf-8")))
           for variant, name in PUBLISHED.items()]
    out += [(f"tiny {variant}", tiny_dit_config(variant)) for variant in ("dense", "moe")]
    return out + list(_REGISTERED)


def other_family(names: Iterable[str], architecture: str | None) -> str | None:
    """What a file holds when it is not a LingBot-Video DiT (one phrase), or None when it may be one."""
    names = set(names)

    def has(*marks: str) -> bool:
        return any(_strip(n).startswith(marks) for n in names)

    if has(*_OURS):
        return None
    if has("blocks.0.self_attn.q.", "patch_embedding.", "text_embedding.0.") or \
            (has("condition_embedder.time_embedder.", "blocks.0.attn1.to_q.") and has("blocks.0.attn2.")):
        return "a Wan 2.1/2.2 video DiT"
    if has("double_blocks.0.img_attn.", "single_blocks.0.linear1.", "single_transformer_blocks.0."):
        return "a Flux-style image DiT"
    if has("joint_blocks.0.context_block."):
        return "an SD3 (MMDiT) image DiT"
    if has("transformer_blocks.0.img_mod."):
        return "a Qwen-Image DiT"
    if has("input_blocks.0.0.", "down_blocks.0.resnets.0.", "conv_in.weight") and not has("decoder."):
        return "a Stable Diffusion / SDXL UNet"
    if has("adaln_single.") and has("transformer_blocks.0.attn1."):
        return "an LTX-Video / PixArt DiT"
    if has("decoder.middle.0.", "decoder.mid_block.", "encoder.down", "first_stage_model."):
        return "a VAE"
    if has("model.language_model.", "model.layers.", "model.visual.", "encoder.block.", "text_model.",
           "token_embd.", "blk.0."):
        return "a text encoder"
    if architecture and architecture not in ("lingbot_video", "lingbot"):
        return f"a GGUF whose general.architecture is {architecture!r}"
    return None


def _strip(name: str) -> str:
    for prefix in PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix):]
    return name


def _stored_shapes(fmt_name: str, headers: Any) -> tuple[dict[str, tuple[int, ...]], str | None]:
    """Stored name -> torch shape (GGUF: its recorded original shape), and the GGUF architecture."""
    if fmt_name == "safetensors":
        return {k: t.shape for h in headers for k, t in h.tensors.items()}, None
    header = headers.header
    return ({k: header.orig_shape(k) or t.shape for k, t in header.tensors.items()}, header.architecture)


def _logical_shapes(shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """Canonical name -> shape, per-expert tensors stacked and fp8 scale rows left out."""
    out: dict[str, tuple[int, ...]] = {}
    experts: dict[str, list[tuple[int, ...]]] = {}
    for stored, shape in shapes.items():
        name = canonical_name(stored)
        stack, _, index = name.rpartition(".")
        if index.isdigit() and re.search(r"\.experts\.w[123]$", stack):
            experts.setdefault(stack, []).append(shape)
        elif not (name.endswith(".weight.scale")):
            out[name] = shape
    for stack, parts in experts.items():
        out[stack] = (len(parts), *parts[0])
    return out


def _match(shapes: dict[str, tuple[int, ...]], path: Path) -> dict[str, Any]:
    """The known config (at the file's depth) whose tensors the file holds exactly."""
    from ..weights.checks import dit_shapes, tensor_set_problems
    from .configs import check_transformer_config

    blocks = {int(m.group(1)) for n in shapes if (m := _BLOCK.match(n))}
    depth = max(blocks) + 1 if blocks else 0
    moe = any(".experts.w1" in n for n in shapes)
    best: tuple[int, str, list[str]] | None = None
    for label, known in known_configs():
        if bool(known.get("num_experts")) != moe:
            continue
        config = {**known, "depth": depth}
        try:
            check_transformer_config(config, f"{path} (as {label})")
            expected = dit_shapes(config, str(path))
        except CheckpointError:
            continue
        problems = tensor_set_problems(shapes, expected)
        if not problems:
            return config
        differing = sum(shapes.get(k) != v for k, v in expected.items()) + len(set(shapes) - set(expected))
        if best is None or differing < best[0]:
            best = (differing, label, problems)
    variant = "MoE" if moe else "dense"
    detail = f" ({'; '.join(best[2][:2])}, compared with the {best[1]} config)" if best else ""
    raise CheckpointError(f"{path.name}: a LingBot-Video {variant} DiT of a size lingbot-nodes does not know"
                          f"{detail}. {FIX}")


def dit_file_source(path: str | Path, component: str = TRANSFORMER) -> ComponentSource:
    """Resolve a single DiT file: its format, headers (read once), names and config (inferred)."""
    from ..weights.fileio import regular_file_problem

    path = Path(path).expanduser()
    problem = regular_file_problem(path)
    if problem is not None:
        raise CheckpointError(f"{component}: the DiT file {path} {problem}. {FIX}")
    fmt = format_of(path)
    headers = fmt.read([path])
    stored, architecture = _stored_shapes(fmt.name, headers)
    what = other_family(stored, architecture)
    if what is not None:
        raise CheckpointError(f"{path.name} is {what}, not a LingBot-Video DiT. {FIX}")
    rename = {name: canonical_name(name) for name in stored if canonical_name(name) != name}
    config = _match(_logical_shapes(stored), path)
    config.setdefault("_class_name", "LingBotVideoTransformer3DModel")
    resolved = ComponentSource(component, fmt, (path,), None, headers=headers, config=config, rename=rename or None)
    resolved.open()  # format problems (fp8 scales, GGUF types, expert stacks) are found now
    return resolved
