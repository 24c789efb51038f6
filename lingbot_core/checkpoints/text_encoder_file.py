"""The Qwen3-VL text encoder from one `.safetensors` file, as users keep it in `models/text_encoders`.

Namings met in the wild, all mapped to transformers' `Qwen3VLForConditionalGeneration` names:
- transformers (a merged checkpoint `text_encoder/`): `model.language_model.*`, `model.visual.*`, with
  or without `lm_head.weight` (tied to the embedding in Qwen3-VL-4B, so it may be left out);
- ComfyUI (Comfy-Org's `qwen3vl_4b_bf16.safetensors`): the text tower as `model.layers.*`,
  `model.embed_tokens.weight`, `model.norm.weight`, the vision tower as `model.visual.*`;
- older layouts: `visual.*`, `language_model.model.*`, and ComfyUI's whole-checkpoint prefix
  `text_encoders.<name>.transformer.`.
transformers 5 registers no legacy renaming for `qwen3_vl` (its folder route assumes the current
names), so the table is ours: `canonical_name`.

Quantized storage, decoded once on load into the compute dtype (bf16 on a GPU):
- ComfyUI `scaled_fp8`: a marker tensor `scaled_fp8`, fp8 Linear weights and one float32
  `<layer>.scale_weight` each (`<layer>.scale_input` is for fp8 matmuls and is not needed);
- ComfyUI `comfy_quant`: `<layer>.comfy_quant` (JSON bytes naming the format), `<layer>.weight_scale`
  (a scalar or one per output row); float8 formats only, others are refused by name.
weight = stored.float() * scale, then cast.

The config comes from the checkpoint folder when one is given, else from the shipped Qwen3-VL-4B
config with every size that the tensors show (layers, widths, heads, vocabulary, vision depth and
width) taken from them. A text-only file (no `model.visual.*`, e.g. a text-only export) loads with
an empty vision tower marked `text_only`; a TI2V encode refuses it (`require_vision`).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError
from ..json_text import parse_json_text
from ..weights.checks import tensor_set_problems
from ..weights.fileio import regular_file_problem
from ..weights.safetensors_header import SafetensorsHeader, TensorReader, read_safetensors_file
from ..weights.state import ModelState
from .configs import check_text_encoder_config

CONFIG_FILE = Path(__file__).resolve().parent.parent / "configs" / "qwen3-vl-4b.text_encoder.json"
WHERE = "models/text_encoders"
FIX = (f"Use the Qwen3-VL-4B text encoder (Comfy-Org's qwen3vl_4b_bf16.safetensors or "
       f"qwen3vl_4b_fp8_scaled.safetensors, or the checkpoint's text_encoder/ merged into one file) in {WHERE}.")
TEXT_ONLY_MESSAGE = ("the text encoder file {name} holds only Qwen3-VL's text tower (no model.visual.* tensors), "
                     "and TI2V encodes the first frame with the vision tower. Use a text encoder file with the "
                     "vision tower (qwen3vl_4b_bf16.safetensors or qwen3vl_4b_fp8_scaled.safetensors), or run "
                     "T2V/T2I.")
SCALED_FP8_MARKER = "scaled_fp8"
FP8_DTYPES = {"F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
COMFY_QUANT_FORMATS = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}
_MAX_QUANT_JSON = 4096  # bytes of one `.comfy_quant` entry we are willing to read
_AUX_SUFFIXES = (".scale_weight", ".scale_input", ".weight_scale", ".input_scale", ".comfy_quant")
_OUTER_PREFIX = re.compile(r"^text_encoders\.[A-Za-z0-9_]+\.transformer\.")


def canonical_name(name: str) -> str:
    """A text-encoder tensor name in any known naming -> transformers' Qwen3-VL name."""
    name = _OUTER_PREFIX.sub("", name)
    if name.startswith(("model.language_model.", "model.visual.")) or name.startswith("lm_head."):
        return name
    if name.startswith("language_model.model."):
        return "model.language_model." + name[len("language_model.model."):]
    if name.startswith("language_model.lm_head."):
        return name[len("language_model."):]
    if name.startswith("visual."):
        return "model." + name
    if name.startswith("model."):  # ComfyUI: the text tower directly under model.
        return "model.language_model." + name[len("model."):]
    return name


@dataclass(frozen=True)
class TextEncoderFile:
    """What `inspect_text_encoder_file` found (header only)."""

    path: Path
    naming: str  # "transformers" or "comfyui"
    quantization: str  # "none", "scaled_fp8" or "comfy_quant"
    config: dict[str, Any]
    text_only: bool
    names: dict[str, str]  # transformers name -> the file's tensor name
    scales: dict[str, str] = field(default_factory=dict)  # transformers weight name -> the file's scale tensor
    values: int = 0  # values the loaded model holds (an empty vision tower too; lm_head is tied, not counted)
    header: SafetensorsHeader | None = None  # the checked header (the load reads through it: `TensorReader`)

    @property
    def nbytes(self) -> int:
        return self.path.stat().st_size


def shipped_config() -> dict[str, Any]:
    """The Qwen3-VL-4B-Instruct config (package data)."""
    return json.loads(CONFIG_FILE.read_text(encoding="utf-8"))


def known_configs() -> list[tuple[str, dict[str, Any]]]:
    """(label, config) of the text encoder shapes a file may have without its folder: Qwen3-VL-4B's,
    then the tiny test model's (`lingbot_core.tiny`)."""
    from ..tiny import tiny_text_encoder_config

    return [("Qwen3-VL-4B", shipped_config()), ("tiny", tiny_text_encoder_config())]


# The tensors whose sizes make the config, and the rank each must have (checked before any is indexed).
_RANKS = {"model.language_model.embed_tokens.weight": 2, "model.language_model.layers.0.self_attn.q_norm.weight": 1,
          "model.language_model.layers.0.mlp.gate_proj.weight": 2,
          "model.language_model.layers.0.self_attn.q_proj.weight": 2,
          "model.language_model.layers.0.self_attn.k_proj.weight": 2, "model.visual.patch_embed.proj.weight": 5,
          "model.visual.blocks.0.mlp.linear_fc1.weight": 2, "model.visual.merger.linear_fc2.weight": 2,
          "model.visual.pos_embed.weight": 2}


def _check_ranks(shapes: Mapping[str, tuple[int, ...]], path: Path) -> None:
    for name, rank in _RANKS.items():
        shape = shapes.get(name)
        if shape is not None and (len(shape) != rank or not all(shape)):
            raise CheckpointError(f"{path}: tensor {name} has shape {list(shape)}; in a Qwen3-VL text encoder it is "
                                  f"{rank}-D with no empty dimension. The file is corrupt. {FIX}")


def _pick_base(shapes: Mapping[str, tuple[int, ...]], text_only: bool) -> dict[str, Any]:
    """The known config whose vision tower (head width, DeepStack count) and text width fit the tensors."""
    hidden = shapes.get("model.language_model.embed_tokens.weight", (0, 0))[1]
    width = shapes.get("model.visual.patch_embed.proj.weight", (0,))[0]
    stacks = len({n.split(".")[3] for n in shapes if n.startswith("model.visual.deepstack_merger_list.")})
    for _label, config in known_configs():
        vision = config["vision_config"]
        if config["text_config"]["hidden_size"] != hidden:
            continue
        if text_only or (width % (vision["hidden_size"] // vision["num_heads"]) == 0
                         and stacks == len(vision["deepstack_visual_indexes"])):
            return config
    return shipped_config()


def _is_gguf(path: Path) -> bool:
    try:
        with open(path, "rb") as fh:
            return fh.read(4) == b"GGUF"
    except OSError:
        return False


def _what_else(names: set[str]) -> str | None:
    """What a file is when it is not a Qwen3-VL text encoder, or None."""
    if "decoder.middle.0.residual.0.gamma" in names or any(n.startswith(("decoder.up_blocks.", "encoder.down"))
                                                          for n in names):
        return "a VAE"
    if any(n.startswith(("blocks.0.", "model.diffusion_model.", "diffusion_model.", "patch_embedder"))
           for n in names):
        return "a diffusion model (DiT)"
    if any(n.startswith(("encoder.block.", "shared.", "encoder.final_layer_norm")) for n in names):
        return "a T5 / UMT5 text encoder (Wan's), not Qwen3-VL"
    if any(n.startswith("text_model.") for n in names):
        return "a CLIP text encoder, not Qwen3-VL"
    return None


def _infer_config(shapes: Mapping[str, tuple[int, ...]], base: dict[str, Any], text_only: bool,
                  path: Path) -> dict[str, Any]:
    """`base` with every size the tensors show replaced by theirs."""
    def shape(name: str) -> tuple[int, ...]:
        if name not in shapes:
            raise CheckpointError(f"{path}: no tensor {name!r}; the file is incomplete or not a Qwen3-VL text "
                                  f"encoder. {FIX}")
        return shapes[name]

    def count(pattern: str) -> int:
        return len({m.group(1) for n in shapes if (m := re.match(pattern, n))})

    text = dict(base["text_config"])
    vocab, hidden = shape("model.language_model.embed_tokens.weight")
    head_dim = shape("model.language_model.layers.0.self_attn.q_norm.weight")[0]
    if head_dim <= 0:  # (ranks and empty dimensions are refused before: `_check_ranks`)
        raise CheckpointError(f"{path}: q_norm is empty, so the head size is 0; the file is corrupt. {FIX}")
    text.update(vocab_size=vocab, hidden_size=hidden, head_dim=head_dim,
                num_hidden_layers=count(r"^model\.language_model\.layers\.(\d+)\."),
                intermediate_size=shape("model.language_model.layers.0.mlp.gate_proj.weight")[0],
                num_attention_heads=shape("model.language_model.layers.0.self_attn.q_proj.weight")[0] // head_dim,
                num_key_value_heads=shape("model.language_model.layers.0.self_attn.k_proj.weight")[0] // head_dim)
    vision = dict(base["vision_config"])
    if not text_only:
        width = shape("model.visual.patch_embed.proj.weight")
        base_head = vision["hidden_size"] // vision["num_heads"]
        if width[0] % base_head:
            raise CheckpointError(f"{path}: a vision tower {width[0]} wide is not one whose head count is known; "
                                  "give the checkpoint folder its config.json comes from.")
        stacks = count(r"^model\.visual\.deepstack_merger_list\.(\d+)\.")
        if stacks != len(vision["deepstack_visual_indexes"]):
            raise CheckpointError(f"{path}: {stacks} DeepStack mergers, {len(vision['deepstack_visual_indexes'])} "
                                  "in the Qwen3-VL config; give the checkpoint folder its config.json comes from.")
        vision.update(hidden_size=width[0], in_channels=width[1], temporal_patch_size=width[2], patch_size=width[3],
                      num_heads=width[0] // base_head, depth=count(r"^model\.visual\.blocks\.(\d+)\."),
                      intermediate_size=shape("model.visual.blocks.0.mlp.linear_fc1.weight")[0],
                      out_hidden_size=shape("model.visual.merger.linear_fc2.weight")[0],
                      num_position_embeddings=shape("model.visual.pos_embed.weight")[0])
    else:
        vision.update(out_hidden_size=hidden)
    return {**base, "text_config": text, "vision_config": vision}


def _expected_shapes(config: dict[str, Any], where: str = "text encoder") -> dict[str, tuple[int, ...]]:
    from accelerate import init_empty_weights

    model = _skeleton(config, torch.float32, "sdpa", init_empty_weights, where)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def _skeleton(config: dict[str, Any], dtype: torch.dtype, attn: str, empty: Any, where: str = "text encoder") -> Any:
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    from ..interrupt import check_interrupt, interruptible_build

    clean = {k: v for k, v in config.items() if k not in ("architectures", "transformers_version", "auto_map")}
    check_interrupt()
    with interruptible_build() as cancelled:
        try:
            hf_config = Qwen3VLConfig(**clean)
            with empty(include_buffers=False):
                return Qwen3VLForConditionalGeneration._from_config(hf_config, dtype=dtype, attn_implementation=attn)
        except Exception as err:  # transformers' own error about a config it cannot build
            if cancelled:
                raise
            raise CheckpointError(f"{where}: the config cannot build Qwen3-VL ({type(err).__name__}: "
                                  f"{str(err)[:200]}). {FIX}") from None


def _read_comfy_quant(header: SafetensorsHeader, name: str) -> dict[str, Any]:
    path, entry = header.path, header.tensors[name]
    if len(entry.shape) != 1 or entry.shape[0] > _MAX_QUANT_JSON or entry.dtype not in ("U8", "I8"):
        raise CheckpointError(f"{path}: {name} is not a short JSON byte string; the file is corrupt.")
    with TensorReader(header) as fh:
        data = bytes(fh.get(name).view(torch.uint8).tolist())
    try:
        value = parse_json_text(data.decode("utf-8"), f"{path}: {name}")
    except (UnicodeDecodeError, CheckpointError):
        raise CheckpointError(f"{path}: {name} does not hold JSON; the file is corrupt.") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: {name} does not hold a JSON object; the file is corrupt.")
    return value


def inspect_text_encoder_file(path: str | Path, *, config: dict[str, Any] | None = None) -> TextEncoderFile:
    """Check a single-file text encoder from its header (and its `.comfy_quant` entries): naming,
    quantization, config, every shape. `config`: a checkpoint folder's text_encoder config.json."""
    path = Path(path)
    problem = regular_file_problem(path)
    if problem is not None:
        raise CheckpointError(f"text encoder file {path} {problem}. {FIX}")
    if _is_gguf(path) or path.suffix.lower() == ".gguf":
        raise CheckpointError(f"{path.name} is a GGUF text encoder (llama.cpp layout: the text tower only, the "
                              "vision tower is in a separate mmproj file); lingbot-nodes reads the text encoder "
                              f"from .safetensors only. {FIX}")
    if path.suffix.lower() != ".safetensors":
        raise CheckpointError(f"{path}: a text encoder file must be .safetensors (got {path.suffix or 'no extension'}). {FIX}")
    header = read_safetensors_file(path)
    entries = header.tensors
    names = set(entries)
    weights = {n for n in names if n != SCALED_FP8_MARKER and not n.endswith(_AUX_SUFFIXES)}
    canonical = {canonical_name(n): n for n in weights}
    if len(canonical) != len(weights):
        raise CheckpointError(f"{path}: the same tensor is stored under two namings; the file is corrupt. {FIX}")
    if "model.language_model.embed_tokens.weight" not in canonical:
        other = _what_else(names)
        what = other or "not a Qwen3-VL text encoder (no embed_tokens tensor under any known naming)"
        raise CheckpointError(f"{path.name} is {what}. {FIX}")
    bare = [_OUTER_PREFIX.sub("", n) for n in weights]
    naming = "comfyui" if any(n.startswith(("model.layers.", "model.embed_tokens.")) for n in bare) else "transformers"
    text_only = not any(n.startswith("model.visual.") for n in canonical)
    quantization, scales = _quantization(header, canonical)
    shapes = {k: entries[v].shape for k, v in canonical.items()}
    _check_ranks(shapes, path)
    base = config if config is not None else _pick_base(shapes, text_only)
    full = _infer_config(shapes, base, text_only, path)
    try:  # bounded before the skeleton is built (as a folder's config is)
        check_text_encoder_config(full, f"{path} (the config its tensors imply)", None)
    except CheckpointError as err:
        raise CheckpointError(f"{err} {FIX}") from None
    expected = _expected_shapes(full, str(path))
    ignore = ["lm_head.weight"] + ([k for k in expected if k.startswith("model.visual.")] if text_only else [])
    problems = tensor_set_problems(shapes, expected, ignore_missing=ignore)
    if problems:
        source = "its checkpoint folder's config" if config is not None else "the Qwen3-VL config"
        raise CheckpointError(f"{path}: does not match {source} ({'; '.join(problems)}). {FIX}")
    bad = sorted({entries[v].dtype for k, v in canonical.items() if k not in scales}
                 - {"F32", "F16", "BF16"})
    if bad:
        raise CheckpointError(f"{path}: tensors stored as {bad[0]} without a scale; expected F32/F16/BF16, or fp8 "
                              f"with ComfyUI's scaled_fp8 or comfy_quant scales. {FIX}")
    values = sum(math.prod(shape) for name, shape in expected.items() if name != "lm_head.weight")
    return TextEncoderFile(path, naming, quantization, full, text_only, canonical, scales, values, header)


def _quantization(header: SafetensorsHeader, canonical: Mapping[str, str]) -> tuple[str, dict[str, str]]:
    """Which fp8 layout the file uses and, per fp8 weight, the tensor holding its scale."""
    path, entries = header.path, header.tensors
    scales: dict[str, str] = {}
    kind = "none"
    for new, old in canonical.items():
        if entries[old].dtype not in FP8_DTYPES:
            continue
        layer = old[: -len(".weight")] if old.endswith(".weight") else old
        quant = f"{layer}.comfy_quant"
        if quant in entries:
            kind = "comfy_quant"
            spec = _read_comfy_quant(header, quant)
            fmt = spec.get("format")
            if fmt not in COMFY_QUANT_FORMATS:
                raise CheckpointError(f"{path}: {layer} is stored as comfy_quant format {str(fmt)[:40]!r}; "
                                      f"lingbot-nodes reads {', '.join(COMFY_QUANT_FORMATS)} only. {FIX}")
            scale = f"{layer}.weight_scale"
        else:
            kind = "scaled_fp8" if SCALED_FP8_MARKER in entries or kind == "none" else kind
            scale = f"{layer}.scale_weight"
        if scale not in entries:
            raise CheckpointError(f"{path}: the fp8 weight {old} has no {scale.rsplit('.', 1)[1]} tensor; the file "
                                  f"is incomplete. {FIX}")
        rows = entries[old].shape[0] if entries[old].shape else 1
        numel = 1
        for d in entries[scale].shape:
            numel *= d
        if numel not in (1, rows) or entries[scale].dtype not in ("F32", "F16", "BF16"):
            raise CheckpointError(f"{path}: {scale} has shape {list(entries[scale].shape)} ({entries[scale].dtype}); "
                                  f"expected one float or one per output row ({rows}). The file is corrupt.")
        scales[new] = scale
    return kind, scales


def _dequantize(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    scale = scale.float().reshape(-1)
    if scale.numel() != 1:
        scale = scale.reshape(-1, *([1] * (weight.dim() - 1)))
    return (weight.float() * scale).to(dtype)


def load_text_encoder_file(source: str | Path | TextEncoderFile, *, dtype: torch.dtype | None = None,
                           attn_implementation: str = "sdpa", config: dict[str, Any] | None = None,
                           state: ModelState | None = None) -> Any:
    """A `Qwen3VLForConditionalGeneration` (CPU, eval, no grad) from one file. dtype None: float32
    (fp8 files are decoded into it). A text-only file gets an empty vision tower, and its name is
    noted as `state.text_only` (the model's `weights.state.ModelState`)."""
    from accelerate import init_empty_weights

    info = source if isinstance(source, TextEncoderFile) else inspect_text_encoder_file(source, config=config)
    header = info.header if info.header is not None else read_safetensors_file(info.path)
    dtype = dtype or torch.float32
    with torch.inference_mode(False):
        model = _skeleton(info.config, dtype, attn_implementation, init_empty_weights, str(info.path))
        tensors: dict[str, torch.Tensor] = {}
        with TensorReader(header) as fh:  # the checked file itself (pread; a replaced file is refused)
            for new, old in info.names.items():
                tensor = fh.get(old)
                if new in info.scales:
                    tensor = _dequantize(tensor, fh.get(info.scales[new]), dtype)
                tensors[new] = tensor.to(dtype)
        # Only hidden states are used (never logits): the head is tied to the embedding, stored or not.
        tensors.pop("lm_head.weight", None)
        result = model.load_state_dict(tensors, strict=False, assign=True)
        missing = [k for k in result.missing_keys if k != "lm_head.weight" and not
                   (info.text_only and k.startswith("model.visual."))]
        if missing or result.unexpected_keys:
            raise CheckpointError(f"{info.path}: does not load into Qwen3-VL (missing {missing[:3]}, unexpected "
                                  f"{list(result.unexpected_keys)[:3]}). {FIX}")
        if info.text_only:
            _zero_missing_parameters(model.model.visual)
        model.tie_weights()
    if state is not None:
        state.text_only = info.path.name if info.text_only else ""
    return model.eval().requires_grad_(False)


def _zero_missing_parameters(tower: torch.nn.Module) -> None:
    """Zeros for the parameters the file does not hold (still on `meta`). Only those: the tower's buffers
    were built for real (the rotary embedding's frequencies), and re-allocating them empty would leave
    them as whatever the memory held, NaN at times, which the load's NaN scan then blames on the file."""
    for module in tower.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if param.is_meta:
                setattr(module, name, torch.nn.Parameter(torch.zeros(param.shape, dtype=param.dtype),
                                                         requires_grad=False))


def require_vision_file(source: Any) -> None:
    """The same refusal from the header facts (a `TextEncoderFile` resolved at open), so a TI2V encode
    refuses a text-only file before the encoder loads; anything else passes."""
    if isinstance(source, TextEncoderFile) and source.text_only:
        raise CheckpointError(TEXT_ONLY_MESSAGE.format(name=source.path.name))


def require_vision(state: ModelState | None) -> None:
    """Refuse a text-only text encoder where the vision tower is needed (a TI2V first frame); `state`:
    the encoder's `ModelState` (None: a model loaded without one, taken to have its vision tower)."""
    name = state.text_only if state is not None else ""
    if name:
        raise CheckpointError(TEXT_ONLY_MESSAGE.format(name=name))
