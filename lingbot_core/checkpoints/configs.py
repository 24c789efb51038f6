"""A checkpoint's configs checked before anything is built from them: every value a model's shape or
the sampler depends on, bounded (`CONFIG_LIMITS`, `FLOAT_RANGES`), and no JSON of the folder asking
for remote code (`refuse_remote_code`). Read from JSON only; a bad value is refused with a message
naming the file, the key and the fix. A downloaded checkpoint is untrusted input like a workflow:
nothing here runs Python from the folder.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from ..components import TRANSFORMER
from ..errors import CheckpointError
from ..json_text import parse_json_text

CheckFailed = CheckpointError  # the name used inside this module

# -- config values ---------------------------------------------------------------------------------

CONFIG_LIMITS: dict[str, dict[str, int]] = {
    # The LingBot-Video DiTs (configs/dense-1.3b, configs/moe-30b-a3b): depth 24/48, hidden 2048, 16 heads,
    # intermediate 6144, text_dim 2560, freq_dim 256, 16 channels, patch [1, 2, 2], axes_lens <= 8192,
    # 128 experts (8 per token, 768 wide, 1 shared, 4 groups). Larger video DiTs (Wan 14B: hidden 5120,
    # 40 heads, 40 layers, 13824 wide) stay far inside; the bounds leave 5-10x headroom (a 256-deep MoE
    # skeleton still builds in seconds).
    TRANSFORMER: {
        "depth": 256, "hidden_size": 32768, "num_attention_heads": 1024, "intermediate_size": 262144,
        "text_dim": 32768, "freq_dim": 16384, "in_channels": 1024, "out_channels": 1024, "patch_size": 64,
        "axes_dims": 4096, "axes_lens": 65536, "num_experts": 4096, "num_experts_per_tok": 1024,
        "moe_intermediate_size": 262144, "n_shared_experts": 256, "decoder_sparse_step": 256, "n_group": 4096,
        "topk_group": 4096,
    },
    # The Wan 2.1 VAE (configs/wan2.1.vae): z_dim 16, base_dim 96, dim_mult [1, 2, 4, 4], 2 res blocks,
    # 3 channels, scale factors 8 / 4; Wan 2.2's VAE: z_dim 48, base_dim 160, 12 channels (patchified).
    "vae": {
        "z_dim": 1024, "base_dim": 4096, "decoder_base_dim": 4096, "num_res_blocks": 16, "dim_mult": 64,
        "dim_mult_len": 8, "in_channels": 64, "out_channels": 64, "attn_scales_len": 16, "patch_size": 16,
        "scale_factor_spatial": 64, "scale_factor_temporal": 64,
    },
    # Qwen3-VL-4B (configs/qwen3-vl-4b.text_encoder): 36 layers, hidden 2560, intermediate 9728, 32 heads
    # (8 kv, head_dim 128), vocab 151936, 262144 positions; the largest Qwen3-VL has 94 layers, hidden 4096.
    "text_encoder": {
        "num_hidden_layers": 256, "hidden_size": 32768, "intermediate_size": 262144, "num_attention_heads": 1024,
        "num_key_value_heads": 1024, "head_dim": 1024, "vocab_size": 1 << 21, "max_position_embeddings": 1 << 24,
    },
    # its vision tower: depth 24, hidden 1024, intermediate 4096, 16 heads, 2304 positions, patch 16
    "vision": {
        "depth": 128, "hidden_size": 16384, "intermediate_size": 131072, "num_heads": 1024,
        "num_position_embeddings": 1 << 18, "out_hidden_size": 32768, "patch_size": 64, "temporal_patch_size": 16,
        "spatial_merge_size": 16, "in_channels": 64, "deepstack_visual_indexes": 255, "deepstack_visual_indexes_len": 64,
    },
    "scheduler": {"num_train_timesteps": 100000},  # published: 1000
}
"""Upper bounds of config values, per component: no published or plausible model exceeds them, and a
config past one (a corrupt or hostile `"depth": 1000000`) is refused before any module is built
(building its skeleton would take minutes and gigabytes). A `_len` entry bounds a list's length."""


FLOAT_RANGES: dict[str, tuple[float, float]] = {
    # published: norm_eps 1e-6, rope_theta 256 (DiT) / 5e6 (Qwen3-VL), routed_scaling_factor 1.0 / 2.5, shift 1-12
    "norm_eps": (1e-12, 1e-2), "rms_norm_eps": (1e-12, 1e-2), "rope_theta": (1.0, 1e9),
    "routed_scaling_factor": (1e-3, 100.0),
}
"""Bounds of config floats: `rope_theta 1e-300`, `norm_eps 1e300` or `routed_scaling_factor 1e308` are
finite and positive but give NaN or silently wrong frames; a value outside is refused at open.
The scheduler's `shift` uses `sampling.sigmas.SHIFT_RANGE` (the same range as the sampling inputs)."""


LATENT_MEAN_LIMIT = 1e3
"""|latents_mean| bound (Wan 2.1: within 1.6); latents are shifted by it, so 1e308 makes NaN frames."""


LATENT_STD_RANGE = (1e-3, 1e3)
"""latents_std bounds (Wan 2.1: 1.1 to 3.3); latents are divided and multiplied by it."""


def _need(config: Mapping[str, Any], key: str, where: str, check, what: str, *, default: Any = None,
          optional: bool = False) -> Any:
    value = config.get(key, default)
    if value is None and optional:
        return None
    if not check(value):
        shown = json.dumps(value)[:80] if _jsonable(value) else type(value).__name__
        raise CheckFailed(f"{where}: '{key}' must be {what}, got {shown}. The config is corrupt or not a "
                          "LingBot-Video checkpoint; re-download it.")
    return value


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
        return True
    except (TypeError, ValueError):
        return False


def _pos_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 1 <= v < 1 << 31


def _upto(limit: int, low: int = 1):
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and low <= v <= limit


def _bounded(config: Mapping[str, Any], component: str, key: str, where: str, *, low: int = 1,
             optional: bool = False, default: Any = None) -> Any:
    """`config[key]`: an integer in [low, CONFIG_LIMITS[component][key]]."""
    limit = CONFIG_LIMITS[component][key]
    what = f"{'a positive integer' if low == 1 else f'an integer >= {low}'} no larger than {limit}"
    return _need(config, key, where, _upto(limit, low), what, optional=optional, default=default)


def _bounded_list(config: Mapping[str, Any], component: str, key: str, where: str, n: int | None, *,
                  optional: bool = False, low: int = 1) -> Any:
    """`config[key]`: a list (of `n` items, else up to the `_len` bound) of integers in [low, limit]."""
    limits = CONFIG_LIMITS[component]
    limit, most = limits[key], limits.get(f"{key}_len", n)
    count = f"{n}" if n is not None else f"1 to {most}"

    def ok(v: Any) -> bool:
        return (isinstance(v, (list, tuple)) and (len(v) == n if n is not None else 1 <= len(v) <= most)
                and all(_upto(limit, low)(x) for x in v))

    return _need(config, key, where, ok, f"a list of {count} integers in [{low}, {limit}]", optional=optional)


def _nonneg_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 31


def _pos_float(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def _in_range(low: float, high: float):
    return lambda v: _pos_float(v) and low <= v <= high


def _ranged_float(config: Mapping[str, Any], key: str, where: str, bounds: tuple[float, float] | None = None) -> Any:
    """`config[key]` (optional): a number in `FLOAT_RANGES[key]` (or `bounds`)."""
    low, high = bounds or FLOAT_RANGES[key]
    return _need(config, key, where, _in_range(low, high), f"a number in [{low:g}, {high:g}]", optional=True)


def _bool(v: Any) -> bool:
    return isinstance(v, bool)


def check_transformer_config(config: Mapping[str, Any], where: str) -> None:
    """The DiT's config values: types, ranges and the relations the model relies on."""
    for key in ("in_channels", "out_channels", "hidden_size", "num_attention_heads", "depth",
                "intermediate_size", "text_dim", "freq_dim"):
        _bounded(config, TRANSFORMER, key, where)
    _bounded_list(config, TRANSFORMER, "patch_size", where, 3)
    heads, hidden = config["num_attention_heads"], config["hidden_size"]
    if hidden % heads:
        raise CheckFailed(f"{where}: hidden_size {hidden} is not divisible by num_attention_heads {heads}; "
                          "the config is corrupt, re-download it.")
    axes = _bounded_list(config, TRANSFORMER, "axes_dims", where, 3)
    if sum(axes) != hidden // heads or any(a % 2 for a in axes):
        raise CheckFailed(f"{where}: axes_dims {axes} must be even and sum to the head size {hidden // heads}; "
                          "the config is corrupt, re-download it.")
    _bounded_list(config, TRANSFORMER, "axes_lens", where, 3)
    for key in ("norm_eps", "rope_theta"):
        _ranged_float(config, key, where)
    for key in ("qkv_bias", "out_bias", "patch_embed_bias", "timestep_mlp_bias"):
        _need(config, key, where, _bool, "true or false", optional=True)
    experts = _bounded(config, TRANSFORMER, "num_experts", where, low=0, default=0, optional=True) or 0
    if experts:
        _need(config, "num_experts_per_tok", where, lambda v: _pos_int(v) and v <= experts,
              f"an integer in [1, num_experts={experts}]")
        _bounded(config, TRANSFORMER, "moe_intermediate_size", where)
        _bounded(config, TRANSFORMER, "decoder_sparse_step", where, optional=True)
        _bounded(config, TRANSFORMER, "n_shared_experts", where, low=0, optional=True)
        _need(config, "score_func", where, lambda v: v in ("sigmoid", "softmax"), "'sigmoid' or 'softmax'",
              optional=True)
        _need(config, "norm_topk_prob", where, _bool, "true or false", optional=True)
        groups = _need(config, "n_group", where, lambda v: _pos_int(v) and experts % v == 0,
                       f"a positive divisor of num_experts={experts} or null", optional=True)
        if groups and groups > 1:
            _need(config, "topk_group", where, lambda v: _pos_int(v) and v <= groups,
                  f"an integer in [1, n_group={groups}]")
        _ranged_float(config, "routed_scaling_factor", where)
    layers = config.get("mlp_only_layers", [])
    if layers is not None and not (isinstance(layers, list) and len(layers) <= config["depth"]
                                   and all(_nonneg_int(x) and x < config["depth"] for x in layers)):
        raise CheckFailed(f"{where}: 'mlp_only_layers' must be a list of layer indices below depth "
                          f"{config['depth']}; re-download the checkpoint.")


def check_vae_config(config: Mapping[str, Any], where: str) -> None:
    """The Wan VAE's config: channel counts and the latent statistics every stage divides by."""
    z_dim = _bounded(config, "vae", "z_dim", where)
    for key in ("base_dim", "decoder_base_dim", "num_res_blocks", "in_channels", "out_channels", "patch_size",
                "scale_factor_spatial", "scale_factor_temporal"):
        _bounded(config, "vae", key, where, optional=True)
    _bounded_list(config, "vae", "dim_mult", where, None, optional=True)
    scales = config.get("attn_scales")
    if scales is not None and not (isinstance(scales, list) and len(scales) <= CONFIG_LIMITS["vae"]["attn_scales_len"]):
        raise CheckFailed(f"{where}: 'attn_scales' must be a short list; re-download the checkpoint.")

    def finite_list(v: Any) -> bool:
        return isinstance(v, list) and len(v) == z_dim and all(
            isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in v)

    mean = _need(config, "latents_mean", where, finite_list, f"a list of {z_dim} finite numbers")
    std = _need(config, "latents_std", where, finite_list, f"a list of {z_dim} finite numbers")
    low, high = LATENT_STD_RANGE
    if any(not low <= x <= high for x in std):
        bad = next(x for x in std if not low <= x <= high)
        raise CheckFailed(f"{where}: latents_std holds {bad}; every entry must be in [{low:g}, {high:g}] (latents "
                          "are divided by it). The config is corrupt; re-download it.")
    if any(abs(x) > LATENT_MEAN_LIMIT for x in mean):
        bad = next(x for x in mean if abs(x) > LATENT_MEAN_LIMIT)
        raise CheckFailed(f"{where}: latents_mean holds {bad}; every entry must be within +-{LATENT_MEAN_LIMIT:g} "
                          "(larger shifts overflow the frames to NaN). The config is corrupt; re-download it.")


def check_scheduler_config(config: Mapping[str, Any], where: str) -> None:
    _bounded(config, "scheduler", "num_train_timesteps", where, default=1000)
    from ..sampling.sigmas import SHIFT_RANGE

    _ranged_float(config, "shift", where, SHIFT_RANGE)
    _need(config, "solver_order", where, lambda v: _pos_int(v) and v <= 3, "1, 2 or 3", optional=True)
    from ..scheduler import UniPCSettings

    try:  # what the sampler would refuse when it runs (a solver variant, a prediction type), refused now
        UniPCSettings.from_mapping(config)
    except (ValueError, TypeError, NotImplementedError) as err:
        raise CheckFailed(f"{where}: {err}. The scheduler config is not one LingBot-Video's sampler runs; "
                          "re-download it.") from None


def check_text_encoder_config(config: Mapping[str, Any], where: str, text_dim: int | None) -> None:
    text = config.get("text_config")
    if not isinstance(text, dict):
        raise CheckFailed(f"{where}: no 'text_config' object; a Qwen3-VL config has one. Re-download it.")
    hidden = _bounded(text, "text_encoder", "hidden_size", f"{where} (text_config)")
    for key in CONFIG_LIMITS["text_encoder"]:
        if key != "hidden_size":
            _bounded(text, "text_encoder", key, f"{where} (text_config)", optional=True)
    _ranged_float(text, "rms_norm_eps", f"{where} (text_config)")
    vision = config.get("vision_config")
    if vision is not None:
        if not isinstance(vision, dict):
            raise CheckFailed(f"{where}: 'vision_config' must be an object; re-download the checkpoint.")
        for key in CONFIG_LIMITS["vision"]:
            if key == "deepstack_visual_indexes":
                if vision.get(key):  # layer indices (may be 0)
                    _bounded_list(vision, "vision", key, f"{where} (vision_config)", None, low=0)
            elif not key.endswith("_len"):
                _bounded(vision, "vision", key, f"{where} (vision_config)", optional=True)
    if text_dim is not None and hidden != text_dim:
        raise CheckFailed(f"{where}: the text encoder's hidden_size is {hidden}, but the transformer's text_dim is "
                          f"{text_dim}; the two folders come from different models. Re-download the checkpoint.")


# -- remote code -----------------------------------------------------------------------------------

REMOTE_CODE_KEYS = ("auto_map",)


def refuse_remote_code(folder: Path, subfolders: Iterable[str]) -> None:
    """Refuse any config that asks transformers/diffusers to import Python from the checkpoint.

    ``auto_map`` (in a config, tokenizer or processor file) names classes inside the folder's own
    ``.py`` files; loading those would run the checkpoint's code. Loads always set
    trust_remote_code to False; refusing here also means transformers never gets to ask "[y/N]".
    """
    candidates = [folder / "model_index.json"]
    for sub in subfolders:
        if (folder / sub).is_dir():
            candidates += sorted((folder / sub).glob("*.json"))
    for path in candidates:
        if not path.is_file() or path.name.endswith(".safetensors.index.json"):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise CheckFailed(f"cannot read {path} ({err}); the file is corrupt, re-download it.") from None
        data = parse_json_text(text, str(path))  # every JSON file of the checkpoint must parse
        key = _find_key(data, REMOTE_CODE_KEYS)
        if key is not None:
            raise CheckFailed(
                f"{path} has an '{key}' entry: it asks to run Python code shipped with the checkpoint, which "
                "lingbot-nodes never does (trust_remote_code is always False). Use the official "
                "LingBot-Video checkpoint files, or delete the entry if you know the stock classes apply.")


def _find_key(data: Any, keys: tuple[str, ...]) -> str | None:
    stack = [data]
    while stack:
        value = stack.pop()
        if isinstance(value, dict):
            for k, v in value.items():
                if k in keys:
                    return k
                if isinstance(v, (dict, list)):
                    stack.append(v)
        elif isinstance(value, list):
            stack += [v for v in value if isinstance(v, (dict, list))]
    return None
