"""LoRA files for the LingBot-Video DiTs: key formats -> our parameter names, merged per view.

A LoRA travels on a pipe *view*, like offload settings: `with_lora(handle, file, strength)` returns
a view whose `LoraStack` the stage door applies to the shared DiTs when a stage enters (and takes
off again when a view with another stack enters). So two branches with different LoRAs on one
handle are each exact, in any order.

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

Arithmetic (float32 whatever the weight dtype, cast back once): W' = W + sum over the stack of
float32(strength * scale) * (up.float() @ down.float()) (batched per expert for 3-D factors),
diffs add float32(strength) * diff. scale = alpha / rank when the file has an alpha, else 1.
The factors are upcast *before* the product: multiplying bf16 factors in bf16 is visibly wrong.

Exactness: the first LoRA on a parameter keeps a pristine CPU copy of it (only the targeted
parameters); every application starts from that copy and removal copies it back, so removing
a LoRA or changing its strength restores the weights bit for bit. The door hands `apply` and
`remove` plain modules (offload suspended, every tensor in its CPU home), so the merge is the same
computation under every offload mode, `sequential`'s meta weights included.
"""

from __future__ import annotations

import logging
import math
import os
import re
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

DIT_COMPONENTS = ("transformer", "refiner")
TARGETS = ("auto", "transformer", "refiner", "both")


class LoraError(ValueError):
    """A LoRA that cannot be used as asked; the message says why and what to do."""


# -- key normalisation ----------------------------------------------------------------------------

# (prefix, component it implies or None). Longest first where one is a prefix of another.
_PREFIXES: tuple[tuple[str, str | None], ...] = (
    ("model.diffusion_model.", "transformer"),
    ("diffusion_model.", "transformer"),
    ("base_model.model.", None),
    ("pipe.dit.", "transformer"),
    ("transformer.", "transformer"),
    ("refiner.", "refiner"),
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
        for key, tensor in tensors.items():
            if not isinstance(tensor, torch.Tensor):
                raise LoraError(f"{name}: {key} is not a tensor")
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


# -- resolving against a model ----------------------------------------------------------------------

@dataclass(frozen=True)
class Patch:
    """One parameter's change from one file: a low-rank pair or a full delta (CPU tensors)."""

    param: str
    kind: str  # "lora" or "diff"
    down: torch.Tensor | None = None
    up: torch.Tensor | None = None
    diff: torch.Tensor | None = None
    scale: float = 1.0
    keys: tuple[str, ...] = ()


@dataclass
class MatchReport:
    """What a LoRA matched on one component."""

    component: str
    patches: list[Patch]
    unmatched: list[str]  # file keys that name nothing in this model
    total_keys: int

    @property
    def modules(self) -> int:
        return len({p.param.rsplit(".", 1)[0] if p.param.endswith((".weight", ".bias")) else p.param
                    for p in self.patches})

    def summary(self) -> str:
        text = f"{self.component}: {len(self.patches)} parameters in {self.modules} modules"
        if self.unmatched:
            text += f"; {len(self.unmatched)} of {self.total_keys} keys matched nothing (e.g. {self.unmatched[0]})"
        return text


def _layout(model: torch.nn.Module) -> dict[str, Any]:
    """Parameter shapes plus the module/parameter lookup tables a file's names resolve through.

    Quantized layers (fp8/GGUF, `lingbot_core.weights`) hold packed bytes, not a float weight; they
    are listed under their logical names (`to_q.weight`, `experts.w1`) and marked `quantized`, so
    a LoRA on them becomes a runtime delta instead of a merge.
    """
    from .weights.modules import QuantizedExperts, QuantizedLinear

    params = {n: tuple(p.shape) for n, p in model.named_parameters()}
    quantized: dict[str, tuple[str, str]] = {}
    for name, module in model.named_modules():
        if isinstance(module, QuantizedLinear):
            params[f"{name}.weight"] = tuple(module.packing.shape)
            quantized[f"{name}.weight"] = (name, "linear")
        elif isinstance(module, QuantizedExperts):
            for w in QuantizedExperts.NAMES:
                params[f"{name}.{w}"] = tuple(module.packings[w].shape)
                quantized[f"{name}.{w}"] = (name, "experts")
    modules = {n for n, _ in model.named_modules() if n}
    underscored = {n.replace(".", "_"): n for n in [*modules, *params]}
    return {"params": params, "modules": modules, "underscored": underscored, "quantized": quantized}


def _resolve(group: _Group, layout: dict[str, Any]) -> tuple[str | None, str | None] | None:
    """(parameter the factors/.diff change, parameter .diff_b changes), or None when the model has no
    such target. A parameter path (stacked experts, the router) is its own target."""
    base = group.base
    if group.underscored:
        base = layout["underscored"].get(base)
        if base is None:
            return None
    params, modules = layout["params"], layout["modules"]
    if base in params:
        return base, None
    if base in modules and f"{base}.weight" in params:
        return f"{base}.weight", (f"{base}.bias" if f"{base}.bias" in params else None)
    return None


def _float_and_finite(tensor: torch.Tensor) -> bool:
    """Floating point with no NaN/inf. Every stage entry re-checks the whole stack, so this uses one
    reduction (min and max propagate NaN and hold any inf) instead of a full boolean mask."""
    if not tensor.is_floating_point():
        return False
    if tensor.numel() == 0:
        return True
    low, high = torch.aminmax(tensor)
    return bool(torch.isfinite(low) & torch.isfinite(high))


def _factor_patch(group: _Group, param: str, shape: tuple[int, ...], name: str) -> Patch:
    t = group.tensors
    if "down" not in t or "up" not in t:
        have = next(iter(group.keys.values()))
        missing = "up" if "down" in t else "down"
        raise LoraError(f"{name}: {have} has no matching {missing} factor; the file is incomplete")
    down, up = t["down"], t["up"]
    where = f"{name}: {group.keys['down']}"
    if down.ndim != up.ndim or down.ndim not in (2, 3):
        raise LoraError(f"{where}: factors shaped {tuple(down.shape)} and {tuple(up.shape)} are not a LoRA pair "
                        "(2-D, or 3-D for stacked experts)")
    rank = int(down.shape[-2])
    if rank == 0:
        raise LoraError(f"{where}: rank 0 (factors {tuple(down.shape)} and {tuple(up.shape)} hold nothing); "
                        "the file is empty or broken")
    if int(up.shape[-1]) != rank:
        raise LoraError(f"{where}: rank mismatch, down has rank {rank} {tuple(down.shape)} but up has "
                        f"{int(up.shape[-1])} {tuple(up.shape)}")
    if down.ndim == 3:
        if len(shape) != 3:
            raise LoraError(f"{where}: 3-D (per-expert) factors for {param}, which is {len(shape)}-D {shape}")
        if down.shape[0] != shape[0] or up.shape[0] != shape[0]:
            raise LoraError(f"{where}: the LoRA has {int(down.shape[0])} experts, {param} has {shape[0]}; it was "
                            "made for another model")
        out_shape = (int(up.shape[0]), int(up.shape[1]), int(down.shape[2]))
    else:
        if len(shape) != 2:
            raise LoraError(f"{where}: 2-D factors for {param}, which is {len(shape)}-D {shape}")
        out_shape = (int(up.shape[0]), int(down.shape[1]))
    if out_shape != shape:
        raise LoraError(f"{where}: the delta would be {out_shape} but {param} is {shape}; the LoRA was made for a "
                        "model of another size")
    scale = 1.0
    if "alpha" in t:
        alpha = t["alpha"]
        if alpha.numel() != 1:
            raise LoraError(f"{name}: {group.keys['alpha']} must hold one number, it has {alpha.numel()}")
        alpha_value = float(alpha.float().reshape(()).item())
        if not math.isfinite(alpha_value):
            raise LoraError(f"{name}: {group.keys['alpha']} is not finite")
        scale = alpha_value / rank
    group.require_finite("down", name)
    group.require_finite("up", name)
    keys = tuple(group.keys[r] for r in ("down", "up", "alpha") if r in group.keys)
    return Patch(param, "lora", down=down, up=up, scale=scale, keys=keys)


def _diff_patch(group: _Group, param: str, shape: tuple[int, ...], name: str, role: str) -> Patch:
    diff = group.tensors[role]
    if tuple(diff.shape) != shape:
        raise LoraError(f"{name}: {group.keys[role]} is {tuple(diff.shape)} but {param} is {shape}")
    group.require_finite(role, name)
    return Patch(param, "diff", diff=diff, keys=(group.keys[role],))


def match(lora: LoraFile, model: torch.nn.Module | dict[str, Any], component: str, *,
          apply_to: str = "auto") -> MatchReport:
    """Resolve `lora`'s keys on one DiT (a module, or a layout from `_layout`)."""
    layout = model if isinstance(model, dict) else _layout(model)
    patches, unmatched, total = [], [], 0
    for group in lora.groups.values():
        if not _group_targets(group, component, apply_to):
            continue
        total += len(group.keys)
        found = _resolve(group, layout)
        if found is None:
            unmatched.extend(group.keys.values())
            continue
        weight, bias = found
        roles = set(group.tensors)
        if "diff" in roles and roles & {"down", "up"}:
            raise LoraError(f"{lora.name}: {group.keys['diff']} and a LoRA pair both change {weight}; keep one")
        if "diff_b" in roles:
            if bias is None:
                unmatched.append(group.keys["diff_b"])
            else:
                patches.append(_diff_patch(group, bias, layout["params"][bias], lora.name, "diff_b"))
        if "diff" in roles:
            patches.append(_diff_patch(group, weight, layout["params"][weight], lora.name, "diff"))
        elif roles & {"down", "up", "alpha"}:
            patches.append(_factor_patch(group, weight, layout["params"][weight], lora.name))
    return MatchReport(component, patches, sorted(unmatched), total)


def _group_targets(group: _Group, component: str, apply_to: str) -> bool:
    """auto: the DiT the key's prefix names (no prefix: the base DiT); otherwise every key on the
    DiT(s) asked for, whatever its prefix."""
    if apply_to == "auto":
        return (group.component or "transformer") == component
    return apply_to == "both" or apply_to == component


def _partial_hint(report: MatchReport) -> str:
    names = " ".join(report.unmatched)
    if "shared_experts" in names or ".experts." in names or "router" in names:
        return " (it looks made for the MoE model)"
    blocks = [int(m) for m in re.findall(r"blocks[._](\d+)[._]", names)]
    if blocks:
        return f" (it reaches block {max(blocks)}: made for a deeper model)"
    return ""


# -- the stack on a view ----------------------------------------------------------------------------

@dataclass(frozen=True)
class LoraItem:
    lora: LoraFile
    strength: float = 1.0
    apply_to: str = "auto"

    def __post_init__(self) -> None:
        if isinstance(self.strength, bool) or not isinstance(self.strength, (int, float)) \
                or not math.isfinite(self.strength):
            raise LoraError(f"LoRA strength must be a finite number, got {self.strength!r}")
        if self.apply_to not in TARGETS:
            raise LoraError(f"apply_to must be one of {', '.join(TARGETS)}, got {self.apply_to!r}")


# module -> {parameter name: pristine CPU copy}; weak, so a released DiT takes its copies with it.
_PRISTINE: weakref.WeakKeyDictionary[torch.nn.Module, dict[str, torch.Tensor]] = weakref.WeakKeyDictionary()


def pristine_copies(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The saved originals of the parameters a LoRA changed on `module` (empty when none)."""
    return dict(_PRISTINE.get(module, {}))


@dataclass(frozen=True)
class LoraStack:
    """The LoRAs of one view, in order. The stage door's per-view state of kind "lora"."""

    items: tuple[LoraItem, ...] = ()
    kind: str = field(default="lora", init=False)

    def then(self, item: LoraItem) -> LoraStack:
        return LoraStack((*self.items, item))

    def reports(self, model: torch.nn.Module | dict[str, Any], component: str) -> list[MatchReport]:
        return [match(item.lora, model, component, apply_to=item.apply_to) for item in self.items]

    # -- the door's protocol --------------------------------------------------------------------
    def apply(self, components: Mapping[str, Any], names: Iterable[str]) -> None:
        """Merge the stack into each named DiT, starting from its pristine weights."""
        for name in names:
            if name in DIT_COMPONENTS and isinstance(components.get(name), torch.nn.Module):
                _merge(components[name], self._patches(components[name], name))

    def remove(self, components: Mapping[str, Any], names: Iterable[str]) -> None:
        for name in names:
            module = components.get(name)
            if name in DIT_COMPONENTS and isinstance(module, torch.nn.Module):
                restore(module)

    def _patches(self, module: torch.nn.Module, name: str) -> list[tuple[float, Patch]]:
        layout = _layout(module)
        out = []
        for item in self.items:
            report = match(item.lora, layout, name, apply_to=item.apply_to)
            out.extend((float(item.strength), p) for p in report.patches)
        return out


# module -> [(quantized layer, its delta entry)] added by `_merge`, so `restore` takes off only ours.
_RUNTIME: weakref.WeakKeyDictionary[torch.nn.Module, list[tuple[Any, Any]]] = weakref.WeakKeyDictionary()


def _runtime_delta(patch: Patch, coefficient: float):
    """`x -> coefficient * x @ (up @ down)^T` (or `x @ diff^T`), computed in float32 on x's device.

    The factors stay on the CPU and travel with each call, so every offload mode computes the same
    thing; the quantized weight itself is never touched.
    """
    import torch.nn.functional as F

    if patch.kind == "diff":
        diff = patch.diff

        def delta(x: torch.Tensor) -> torch.Tensor:
            return F.linear(x.float(), diff.to(x.device, torch.float32)) * coefficient
    else:
        down, up = patch.down, patch.up

        def delta(x: torch.Tensor) -> torch.Tensor:
            h = F.linear(x.float(), down.to(x.device, torch.float32))
            return F.linear(h, up.to(x.device, torch.float32)) * coefficient
    return delta


def _expert_runtime_delta(patch: Patch, coefficient: float):
    """`(e, rows) -> coefficient * rows @ (up[e] @ down[e])^T` (or `rows @ diff[e]^T`) in float32.

    Factors are [E, r, in] / [E, out, r] (a diff is [E, out, in]) and stay on the CPU; only expert
    e's slice travels to the rows' device, and only for the experts the block routes tokens to.
    """
    import torch.nn.functional as F

    if patch.kind == "diff":
        diff = patch.diff

        def delta(e: int, x: torch.Tensor) -> torch.Tensor:
            return F.linear(x.float(), diff[e].to(x.device, torch.float32)) * coefficient
    else:
        down, up = patch.down, patch.up

        def delta(e: int, x: torch.Tensor) -> torch.Tensor:
            h = F.linear(x.float(), down[e].to(x.device, torch.float32))
            return F.linear(h, up[e].to(x.device, torch.float32)) * coefficient
    return delta


def restore(module: torch.nn.Module) -> None:
    """Put back the original value of every parameter a LoRA changed (bit-exact) and forget the copies;
    take off the runtime deltas it added to quantized layers."""
    for layer, fn in _RUNTIME.pop(module, []):
        if fn in layer.deltas:
            layer.deltas.remove(fn)
    saved = _PRISTINE.pop(module, None)
    if not saved:
        return
    params = dict(module.named_parameters())
    with torch.no_grad():
        for name, original in saved.items():
            params[name].copy_(original)


def _delta(patch: Patch, coefficient: torch.Tensor) -> torch.Tensor:
    if patch.kind == "diff":
        return coefficient * patch.diff.float()
    return coefficient * torch.matmul(patch.up.float(), patch.down.float())


def _merge(module: torch.nn.Module, patches: list[tuple[float, Patch]]) -> None:
    """W' = pristine(W) + sum of deltas, in float32, cast back to W's dtype once."""
    restore(module)
    live = [(s, p) for s, p in patches if s != 0.0]
    if not live:
        return
    quantized = _layout(module)["quantized"]
    if any(p.param in quantized for _s, p in live):
        layers = dict(module.named_modules())
        added = []
        for strength, patch in live:
            if patch.param not in quantized:
                continue
            owner, kind = quantized[patch.param]
            coefficient = strength if patch.kind == "diff" else strength * patch.scale
            layer = layers[owner]
            if kind == "linear":
                fn = _runtime_delta(patch, coefficient)
                layer.add_delta(fn)
                added.append((layer, fn))
            else:  # stacked experts: a per-expert delta on w1/w2/w3, run only for the routed experts
                added.append((layer, layer.add_delta(patch.param.rsplit(".", 1)[1],
                                                      _expert_runtime_delta(patch, coefficient))))
        _RUNTIME[module] = added
        live = [(s, p) for s, p in live if p.param not in quantized]
        if not live:
            return
    params = dict(module.named_parameters())
    by_param: dict[str, list[tuple[float, Patch]]] = {}
    for strength, patch in live:
        by_param.setdefault(patch.param, []).append((strength, patch))
    from .weights.disk import materialize

    if materialize(module, set(by_param)):  # disk offload: the targeted weights were still in their file
        params = dict(module.named_parameters())
    for name in by_param:
        param = params[name]
        if param.device.type == "meta":
            raise LoraError(f"cannot merge a LoRA into {name}: its weights are on the meta device (the stage door "
                            "must hand plain modules to LoRA application)")
        if not param.dtype.is_floating_point or param.dtype.itemsize < 2:
            raise LoraError(f"cannot merge a LoRA into {name} stored as {param.dtype}: merged LoRAs need "
                            "bf16/fp16/fp32 weights")
    saved = {name: params[name].detach().to("cpu", copy=True) for name in by_param}
    _PRISTINE[module] = saved
    with torch.no_grad():
        for name, items in by_param.items():
            acc = saved[name].float()
            for strength, patch in items:
                scale = strength if patch.kind == "diff" else strength * patch.scale
                acc = acc + _delta(patch, torch.tensor(scale, dtype=torch.float32))
            params[name].copy_(acc.to(params[name].dtype))


# -- public helpers -------------------------------------------------------------------------------------

def dit_layout(handle: Any, component: str) -> dict[str, Any]:
    """Parameter names and shapes of a handle's DiT without loading its weights when it is not loaded."""
    module = handle.shared.loaded.get(component)
    if isinstance(module, torch.nn.Module):
        return _layout(module)
    from .models.transformer import LingBotVideoTransformer3DModel

    info = handle.info
    resolved = info.sources.get(component) if info is not None else None
    if resolved is not None and resolved.config is not None:  # a single DiT file: its inferred config
        config = resolved.config
    elif handle.folder is None:
        raise LoraError(f"the {component} is not loaded and this handle has no checkpoint folder to read it from")
    else:
        source = getattr(handle.shared, "transformer_source", None) if component == "transformer" else None
        folder = source[0] / source[1] if source else handle.folder / component
        config = LingBotVideoTransformer3DModel.load_config(folder)
    with torch.device("meta"):
        skeleton = LingBotVideoTransformer3DModel.from_config(config)
    return _layout(skeleton)


def plan(handle: Any, lora: LoraFile, strength: float = 1.0, apply_to: str = "auto") -> list[MatchReport]:
    """Check a LoRA against a handle's DiTs before any work: refuse when it matches nothing, warn when
    it matches only part of what the file holds. Returns one report per DiT it applies to."""
    item = LoraItem(lora, float(strength), apply_to)
    if apply_to == "refiner" or (apply_to == "auto" and lora.components() == {"refiner"}):
        wanted = ["refiner"]
    elif apply_to == "both" or (apply_to == "auto" and "refiner" in lora.components()):
        wanted = ["transformer", "refiner"]
    else:
        wanted = ["transformer"]
    if "refiner" in wanted and not handle.has_refiner:
        if wanted == ["refiner"]:
            raise LoraError(f"{lora.name} is for the refiner, but this checkpoint has none (only the MoE one does)")
        log.warning("LoRA %s: this checkpoint has no refiner, so the LoRA goes on the transformer only "
                    "(its refiner. keys, if any, are not applied)", lora.name)
        wanted = ["transformer"]
    reports = [match(lora, dit_layout(handle, c), c, apply_to=item.apply_to) for c in wanted]
    if not any(r.patches for r in reports):
        first = next(iter(lora.groups.values()))
        sample = next(iter(first.keys.values()))
        raise LoraError(f"{lora.name}: none of its {lora.num_keys} keys matches a parameter of the "
                        f"{' or '.join(wanted)} (e.g. {sample} -> {first.base!r}); it is for another model")
    for report in reports:
        if report.unmatched:
            log.warning("LoRA %s matches only part of the %s: %s%s", lora.name, report.component, report.summary(),
                        _partial_hint(report))
        else:
            log.info("LoRA %s: %s", lora.name, report.summary())
    return reports


def with_lora(handle: Any, lora: LoraFile | str | os.PathLike, strength: float = 1.0, *,
              apply_to: str = "auto") -> Any:
    """A view of `handle` with `lora` added to its stack (checked now; merged when a stage enters)."""
    if not isinstance(lora, LoraFile):
        lora = load_lora_file(lora)
    item = LoraItem(lora, float(strength), apply_to)
    plan(handle, lora, strength, apply_to)
    stack = lora_stack(handle).then(item)
    return handle.with_view_state(stack)


def lora_stack(handle: Any) -> LoraStack:
    """The view's LoRA stack (empty when it has none)."""
    return next((s for s in getattr(handle, "view_states", ()) if getattr(s, "kind", None) == "lora"), LoraStack())


def without_lora(handle: Any) -> Any:
    """A view of `handle` with no LoRAs."""
    return handle.without_view_state("lora")
