"""One typed, validated object for a DiT `config.json` (the `transformer/` and `refiner/` folders).

The key names are the published checkpoints' (they are what diffusers writes and reads); everything
else here is ours. A config is parsed once, checked once, and the model classes take the result, so
no layer re-reads loose dictionary fields or repeats a consistency check.

`DiTConfig.from_mapping` accepts exactly the keys of `config.json`: diffusers bookkeeping keys
(leading underscore) are ignored, any other unknown key is an error, missing keys take the
published defaults (those of the dense 1.3B model, with no experts).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

__all__ = ["DiTConfig", "MoEConfig"]


# -- converters: one per kind of value, each names the key it rejects ----------------------------

def _whole(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ValueError(f"DiT config: {key} must be a whole number, got {value!r}")
    return value


def _count(key: str, value: Any) -> int:
    number = _whole(key, value)
    if number < 1:
        raise ValueError(f"DiT config: {key} must be at least 1, got {number}")
    return number


def _non_negative(key: str, value: Any) -> int:
    number = _whole(key, value)
    if number < 0:
        raise ValueError(f"DiT config: {key} must not be negative, got {number}")
    return number


def _maybe_count(key: str, value: Any) -> int | None:
    return None if value is None else _non_negative(key, value)


def _real(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"DiT config: {key} must be a finite number, got {value!r}")
    return float(value)


def _positive_real(key: str, value: Any) -> float:
    number = _real(key, value)
    if number <= 0.0:
        raise ValueError(f"DiT config: {key} must be above 0, got {number}")
    return number


def _flag(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"DiT config: {key} must be true or false, got {value!r}")
    return value


def _ints(key: str, value: Any) -> tuple[int, ...]:
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise ValueError(f"DiT config: {key} must be a list of whole numbers, got {value!r}")
    return tuple(_whole(key, item) for item in value)


def _three_counts(key: str, value: Any) -> tuple[int, int, int]:
    items = _ints(key, value)
    if len(items) != 3 or min(items) < 1:
        raise ValueError(f"DiT config: {key} needs three numbers >= 1 (frames, rows, columns), got {list(items)}")
    return items  # type: ignore[return-value]


def _scoring(key: str, value: Any) -> str:
    if value not in ("sigmoid", "softmax"):
        raise ValueError(f"DiT config: {key} is {value!r}; this model family scores experts with 'sigmoid' or 'softmax'")
    return value


# -- the typed config ------------------------------------------------------------------------------

@dataclass(frozen=True)
class MoEConfig:
    """The expert layers' settings; `num_experts == 0` means a dense model (every FFN is a SwiGLU)."""

    num_experts: int = field(default=0, metadata={"parse": _non_negative})
    num_experts_per_tok: int = field(default=8, metadata={"parse": _count})
    routed_scaling_factor: float = field(default=1.0, metadata={"parse": _real})
    norm_topk_prob: bool = field(default=True, metadata={"parse": _flag})
    score_func: str = field(default="sigmoid", metadata={"parse": _scoring})
    # group-limited routing: the experts split into n_group groups, tokens pick from topk_group of them
    n_group: int | None = field(default=None, metadata={"parse": _maybe_count})
    topk_group: int | None = field(default=None, metadata={"parse": _maybe_count})
    moe_intermediate_size: int = field(default=512, metadata={"parse": _count})
    n_shared_experts: int | None = field(default=None, metadata={"parse": _maybe_count})
    # which layers are sparse: every decoder_sparse_step-th one, except those listed
    decoder_sparse_step: int = field(default=1, metadata={"parse": _count})
    mlp_only_layers: tuple[int, ...] = field(default=(), metadata={"parse": _ints})

    def __post_init__(self) -> None:
        if not self.num_experts:
            return
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"DiT config: each token picks num_experts_per_tok={self.num_experts_per_tok} experts, "
                f"but there are only num_experts={self.num_experts}"
            )
        if self.grouped:
            groups = self.n_group or 0
            if self.num_experts % groups:
                raise ValueError(f"DiT config: num_experts={self.num_experts} does not split into n_group={groups} "
                                 "equal groups")
            if not self.topk_group or self.topk_group > groups:
                raise ValueError(f"DiT config: with n_group={groups}, topk_group must be between 1 and {groups}, "
                                 f"got {self.topk_group!r}")

    @property
    def grouped(self) -> bool:
        """Whether expert choice is limited to the best groups first."""
        return bool(self.n_group and self.n_group > 1)

    @property
    def shared_width(self) -> int:
        """Inner width of the always-on shared expert (0: none)."""
        return self.moe_intermediate_size * (self.n_shared_experts or 0)

    def is_sparse(self, layer: int) -> bool:
        """Whether block `layer` (0-based) has the expert FFN rather than the dense one."""
        if not self.num_experts or layer in self.mlp_only_layers:
            return False
        return (layer + 1) % self.decoder_sparse_step == 0


@dataclass(frozen=True)
class DiTConfig:
    """Architecture of one LingBot DiT, as read from its `config.json`."""

    # trunk
    hidden_size: int = field(default=2048, metadata={"parse": _count})
    num_attention_heads: int = field(default=16, metadata={"parse": _count})
    depth: int = field(default=24, metadata={"parse": _non_negative})
    intermediate_size: int = field(default=6144, metadata={"parse": _count})
    norm_eps: float = field(default=1e-6, metadata={"parse": _positive_real})
    qkv_bias: bool = field(default=False, metadata={"parse": _flag})
    out_bias: bool = field(default=True, metadata={"parse": _flag})
    # latent video in and out, cut into patches of (frames, rows, columns)
    in_channels: int = field(default=16, metadata={"parse": _count})
    out_channels: int = field(default=16, metadata={"parse": _count})
    patch_size: tuple[int, int, int] = field(default=(1, 2, 2), metadata={"parse": _three_counts})
    patch_embed_bias: bool = field(default=True, metadata={"parse": _flag})
    # conditioning: text features from the encoder, sinusoidal timestep features
    text_dim: int = field(default=2560, metadata={"parse": _count})
    freq_dim: int = field(default=256, metadata={"parse": _count})
    timestep_mlp_bias: bool = field(default=True, metadata={"parse": _flag})
    # rotary positions: channels per axis (they add up to the head width) and initial table lengths
    axes_dims: tuple[int, int, int] = field(default=(32, 48, 48), metadata={"parse": _three_counts})
    axes_lens: tuple[int, int, int] = field(default=(8192, 1024, 1024), metadata={"parse": _three_counts})
    rope_theta: float = field(default=256.0, metadata={"parse": _positive_real})
    moe: MoEConfig = field(default_factory=MoEConfig)

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"DiT config: hidden_size={self.hidden_size} is not a multiple of "
                             f"num_attention_heads={self.num_attention_heads}")
        if sum(self.axes_dims) != self.head_dim:
            raise ValueError(f"DiT config: the rotary axes_dims {list(self.axes_dims)} add up to {sum(self.axes_dims)}, "
                             f"but each attention head is {self.head_dim} wide")
        if any(width % 2 for width in self.axes_dims):
            raise ValueError(f"DiT config: rotary axes_dims {list(self.axes_dims)} must all be even "
                             "(channels rotate in pairs)")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def patch_volume(self) -> int:
        """Latent positions folded into one token."""
        return math.prod(self.patch_size)

    # -- conversion to and from the flat config.json layout ------------------------------------------

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any]) -> DiTConfig:
        """Parse `config.json` content (a dict); see the module docstring for the rules."""
        given = {key: value for key, value in raw.items() if not str(key).startswith("_")}
        unknown = sorted(set(given) - set(_PARSERS))
        if unknown:
            raise ValueError(f"DiT config: unknown keys {unknown}; the known keys are {sorted(_PARSERS)}")
        parsed = {key: _PARSERS[key](key, value) for key, value in given.items()}
        experts = {key: parsed.pop(key) for key in list(parsed) if key in _MOE_KEYS}
        return cls(moe=MoEConfig(**experts), **parsed)

    def to_mapping(self) -> dict[str, Any]:
        """The flat `config.json` fields (lists for sequences, as JSON has them)."""
        flat: dict[str, Any] = {}
        for section in (self, self.moe):
            for item in fields(section):
                value = getattr(section, item.name)
                if not isinstance(value, MoEConfig):
                    flat[item.name] = list(value) if isinstance(value, tuple) else value
        return flat

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        """Every `config.json` key this config reads, in declaration order."""
        return tuple(_PARSERS)


def _parsers() -> dict[str, Callable[[str, Any], Any]]:
    table = {}
    for section in (DiTConfig, MoEConfig):
        for item in fields(section):
            if "parse" in item.metadata:
                table[item.name] = item.metadata["parse"]
    return table


_PARSERS = _parsers()
_MOE_KEYS = frozenset(item.name for item in fields(MoEConfig))
