"""LoRA files: read a safetensors file, recognise its key formats, group its tensors by target.

Key formats (see the project's notes on LoRA formats; one example each):

    blocks.0.attn.to_q.lora_A.weight / .lora_B.weight            peft / diffusers, no prefix
    blocks.0.attn.to_q.lora.down.weight / .lora.up.weight        diffusers' converted form (LightX2V mixes both)
    blocks.0.attn.to_q.lora_A.default.weight                     DiffSynth (adapter name kept)
    transformer.blocks.0.attn.to_q.lora_A.weight                 diffusers pipelines
    diffusion_model.blocks.0.attn.to_q.lora_down.weight + .alpha ComfyUI / LightX2V Wan releases
    lora_unet_blocks_0_attn_to_q.lora_down.weight + .alpha       kohya (module path with '_' for '.')
    lora_unet.blocks.0.attn.to_q.lora_down.weight + .alpha       mirai's dotted kohya export
    blocks.0.attn.to_out.diff / .diff_b                          full weight / bias deltas
    lora_unet.blocks.0.ffn.experts.w1.lora_down.weight [E,r,in]  3-D LoRAs on the stacked MoE experts
    refiner.blocks.0.attn.to_q.lora_A.weight                     the MoE refiner (the prefix says so)

Factors stored as fp8 (e4m3 / e5m2) are widened to bf16 when the file is read: every fp8 value is
a bf16 value, so this is exact, and the merge and runtime arithmetic (float32) is the same as for a
bf16 file. A scaled-fp8 file (a per-tensor `scale_weight` beside fp8 factors) is refused: its
factors mean nothing without a scale this loader does not apply.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..components import REFINER, TRANSFORMER


class LoraError(ValueError):
    """A LoRA that cannot be used as asked; the message says why and what to do."""


# -- key normalisation ----------------------------------------------------------------------------

# (prefix, component it implies or None). Longest first where one is a prefix of another.
_PREFIXES: tuple[tuple[str, str | None], ...] = (
    ("model.diffusion_model.", TRANSFORMER),
    ("diffusion_model.", TRANSFORMER),
    ("base_model.model.", None),
    ("pipe.dit.", TRANSFORMER),
    ("transformer.", TRANSFORMER),
    ("refiner.", REFINER),
    ("lora_unet.", None),
)
_UNDERSCORE_PREFIX = "lora_unet_"

# suffix -> role; checked longest first.
_SUFFIXES: dict[str, str] = {
    ".lora_A.default.weight": "down", ".lora_B.default.weight": "up",
    ".lora_linear_layer.down.weight": "down", ".lora_linear_layer.up.weight": "up",
    ".lora.down.weight": "down", ".lora.up.weight": "up",
    "_lora.down.weight": "down", "_lora.up.weight": "up",
    ".lora_down.weight": "down", ".lora_up.weight": "up",
    ".lora_A.weight": "down", ".lora_B.weight": "up",
    ".lora_A": "down", ".lora_B": "up",
    ".alpha": "alpha",
    ".diff_b": "diff_b",
    ".diff": "diff",
}
_SUFFIX_ORDER = sorted(_SUFFIXES, key=len, reverse=True)
# Keys we recognise but cannot apply faithfully: refusing beats a silently different result.
_UNSUPPORTED = {".dora_scale": "DoRA magnitudes", ".lora_mid.weight": "LoCon mid factors",
                ".rslora": "rank-stabilised scaling markers", ".hada_w1_a": "LoHa factors",
                ".lokr_w1": "LoKr factors"}


_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_FP8_SCALE_SUFFIXES = (".scale_weight", ".weight_scale", ".scale_input", ".input_scale")


@dataclass
class _Group:
    """The tensors of one target as the file spells them."""

    base: str
    component: str | None
    underscored: bool
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    keys: dict[str, str] = field(default_factory=dict)
    # roles whose tensors passed the float/finite check: the stack is resolved again at every stage
    # entry, and a 305 MB file's scan took seconds each time
    checked: set[str] = field(default_factory=set)

    def require_finite(self, role: str, name: str) -> None:
        """Refuse a non-float or non-finite tensor of this target, scanning each one once."""
        if role in self.checked:
            return
        if not _float_and_finite(self.tensors[role]):
            raise LoraError(f"{name}: {self.keys[role]} holds non-finite or non-float values")
        self.checked.add(role)


def _split_key(key: str) -> tuple[str, str | None, bool, str] | None:
    """key -> (module/parameter path, implied component, underscored?, role), None if not a LoRA key."""
    role = None
    for suffix in _SUFFIX_ORDER:
        if key.endswith(suffix):
            role, key = _SUFFIXES[suffix], key[: -len(suffix)]
            break
    if role is None:
        return None
    component = None
    changed = True
    while changed:  # prefixes can stack (diffusion_model.lora_unet. is not a thing, transformer.base_model. is)
        changed = False
        for prefix, implied in _PREFIXES:
            if key.startswith(prefix):
                key = key[len(prefix):]
                component = implied or component
                changed = True
    underscored = False
    if key.startswith(_UNDERSCORE_PREFIX):
        key, underscored = key[len(_UNDERSCORE_PREFIX):], True
    return key, component, underscored, role


# -- the file ---------------------------------------------------------------------------------------

@dataclass(frozen=True, eq=False)
class LoraFile:
    """A LoRA file read into memory (CPU tensors, as stored), grouped by target.

    Compared by `fingerprint` (path, size and mtime for a file): the same file read twice is the
    same LoRA, so a re-executed node does not re-merge.
    """

    name: str
    fingerprint: tuple
    groups: dict[tuple[str | None, str, bool], _Group]
    unsupported: dict[str, str]
    ignored: tuple[str, ...]
    metadata: dict[str, str]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LoraFile) and self.fingerprint == other.fingerprint

    def __hash__(self) -> int:
        return hash(self.fingerprint)

    @property
    def num_keys(self) -> int:
        return sum(len(g.tensors) for g in self.groups.values()) + len(self.unsupported) + len(self.ignored)

    def components(self) -> set[str]:
        """The components the file's prefixes name (empty: it does not say)."""
        return {g.component for g in self.groups.values() if g.component is not None}

    @classmethod
    def from_state_dict(cls, tensors: Mapping[str, torch.Tensor], *, name: str = "lora",
                        metadata: Mapping[str, str] | None = None, fingerprint: tuple | None = None) -> LoraFile:
        groups: dict[tuple[str | None, str, bool], _Group] = {}
        unsupported: dict[str, str] = {}
        ignored = []
        scaled = [k for k in tensors if k.endswith(_FP8_SCALE_SUFFIXES)]
        for key, tensor in tensors.items():
            if not isinstance(tensor, torch.Tensor):
                raise LoraError(f"{name}: {key} is not a tensor")
            if tensor.dtype in _FP8:
                if scaled:
                    raise LoraError(f"{name}: scaled fp8 factors ({key} with {scaled[0]}) are not supported; use "
                                    "the bf16/fp16 release of this LoRA, or convert it to plain factors")
                tensor = tensor.to(torch.bfloat16)  # exact: every fp8 value is a bf16 value
            what = next((w for s, w in _UNSUPPORTED.items() if key.endswith(s)), None)
            if what is not None:
                unsupported[key] = what
                continue
            split = _split_key(key)
            if split is None:
                ignored.append(key)
                continue
            base, component, underscored, role = split
            group = groups.setdefault((component, base, underscored), _Group(base, component, underscored))
            if role in group.tensors:
                raise LoraError(f"{name}: two keys give the {role} of {base} ({group.keys[role]} and {key})")
            group.tensors[role] = tensor
            group.keys[role] = key
        if unsupported:
            kinds = sorted(set(unsupported.values()))
            raise LoraError(f"{name}: holds {', '.join(kinds)} (e.g. {next(iter(unsupported))}), which this loader "
                            "does not apply; convert it to a plain LoRA (lora_A/lora_B or lora_down/lora_up)")
        if not groups:
            sample = ", ".join(list(tensors)[:3]) or "no tensors at all"
            raise LoraError(f"{name}: no LoRA keys found (first keys: {sample}); expected names ending in "
                            "lora_A/lora_B, lora_down/lora_up, lora.down/lora.up, .diff or .diff_b")
        return cls(name, fingerprint or ("memory", name, id(tensors)), groups, unsupported, tuple(ignored),
                   dict(metadata or {}))


def load_lora_file(path: str | os.PathLike) -> LoraFile:
    """Read a LoRA from a .safetensors file (never unpickles); clear errors for anything else."""
    from safetensors import SafetensorError, safe_open

    p = Path(path).expanduser()
    if not p.is_file():
        raise LoraError(f"LoRA file {p} does not exist (or is not a file)")
    pickled = (f"{p.name} is a pickled checkpoint; LoRAs are only read from .safetensors files (a pickle can "
               "run code when loaded). Convert it to safetensors")
    if p.suffix.lower() in (".pt", ".pth", ".ckpt", ".bin", ".pkl"):
        raise LoraError(pickled)
    try:
        with safe_open(p, framework="pt") as fh:
            tensors = {k: fh.get_tensor(k) for k in fh.keys()}
            metadata = fh.metadata() or {}
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        try:
            with open(p, "rb") as fh:
                head = fh.read(2)
        except OSError as read_err:
            raise LoraError(f"LoRA file {p} cannot be read ({read_err.strerror or read_err}); check its "
                            "permissions") from None
        if head == b"PK" or head[:1] == b"\x80":  # a zip (torch.save) or a raw pickle stream
            raise LoraError(pickled) from None
        raise LoraError(f"{p} is not a readable safetensors file ({err}); re-download it") from None
    stat = p.stat()
    return LoraFile.from_state_dict(tensors, name=p.name, metadata=metadata,
                                    fingerprint=("file", str(p.resolve()), stat.st_size, stat.st_mtime_ns))


def _float_and_finite(tensor: torch.Tensor) -> bool:
    """Floating point with no NaN/inf. Every stage entry re-checks the whole stack, so this uses one
    reduction (min and max propagate NaN and hold any inf) instead of a full boolean mask."""
    if not tensor.is_floating_point():
        return False
    if tensor.numel() == 0:
        return True
    low, high = torch.aminmax(tensor)
    return bool(torch.isfinite(low) & torch.isfinite(high))
