"""The pipeline handle: a lazy resource that every stage goes through.

ComfyUI caches node outputs, so the handle a Loader returned is handed again, unchanged, to every
later run. It therefore never dies: components load on first use, `release()` drops them, and the
next stage that needs one loads it again from the checkpoint folder.

A handle is a *view*: shared components (one copy in RAM, shared by every view and by the base and
refiner DiTs) plus the view's own execution device, offload settings and per-view states (a LoRA
stack, say), which the stage door (`placement.door.stage`) applies when a stage enters. The shared
components own one opaque placement object (`placement.state.Placement`); only the door acts on it.

Attribute access never loads anything: components come from `component(name)`.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import torch

from .checkpoints.inspection import (
    CheckpointInfo,
    default_dtypes,
    inspect_checkpoint,
    inspect_files,
    inspect_student,
)
from .checkpoints.loading import load_component, load_refiner, load_transformer
from .components import ALL, DITS, REFINER, TRANSFORMER, ComponentFiles
from .errors import quoted
from .placement.modes import AUTO, check_guards
from .placement.settings import OffloadSettings
from .placement.state import Placement
from .weights.state import ModelState

log = logging.getLogger("lingbot_core.weights")
ALL_COMPONENTS = ALL  # the component table's names (components.TABLE)
__all__ = ["ALL_COMPONENTS", "HandleSettings", "OffloadSettings", "PipelineHandle", "SharedComponents", "default_device"]


def _fp8_matmuls() -> list[str]:
    from .weights.fp8 import FP8_MATMULS

    return list(FP8_MATMULS)


def _decoders() -> list[str]:
    from .weights.decode import DECODERS

    return list(DECODERS)


def _compile_choices() -> list[str]:
    from .models.compile import COMPILE_CHOICES

    return list(COMPILE_CHOICES)


def _chunk_choices() -> list[str]:
    from .placement.estimate import FFN_CHUNK_CHOICES

    return list(FFN_CHUNK_CHOICES)


def _chunk_flag(text: str) -> str | int:
    """`--ffn-chunk`: `auto`, or a number of tokens >= 0 (0: never chunk)."""
    import argparse

    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected auto or a number of tokens, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 (never chunk) or more, got {text}")
    return value


DEFAULT_ATTENTION = "default"


def _attention_value(choice: str) -> str | None:
    """The CLI's/Loaders' attention choice as the setting: "default" is PyTorch SDPA (None)."""
    return None if choice == DEFAULT_ATTENTION else choice


def attention_choices() -> list[str]:
    """The attention choices of the CLI and both Loaders: default (PyTorch SDPA), diffusers' backends
    offered here (`models.transformer.attention_backends`: its registry, what is installed) and sparse."""
    from .models.sparse_attention import SPARSE
    from .models.transformer import attention_backends

    return [DEFAULT_ATTENTION, *attention_backends(), SPARSE]


#: the Loaders' dtype widget: the DiTs' and the text encoder's dtype (auto: the DiTs as stored)
DTYPE_CHOICES: dict[str, torch.dtype | None] = {"auto": None, "bf16": torch.bfloat16, "fp16": torch.float16,
                                                "fp32": torch.float32}


def _dtypes_of_choice(choice: str) -> dict[str, torch.dtype | None]:
    """The Loaders' dtype widget as the `dtypes` setting: auto keeps the DiTs as stored (the encoders'
    device defaults); any other sets both DiTs and the text encoder (the VAE stays fp32)."""
    dtype = DTYPE_CHOICES[choice]
    if dtype is None:
        return {"transformer": None, "refiner": None}
    return {"transformer": dtype, "refiner": dtype, "text_encoder": dtype}


def _dtypes_json(dtypes: Any) -> dict[str, str | None]:
    # LingBot Parallel's workers load only the DiTs; the encoders keep their device defaults there
    return {k: (None if v is None else str(v).replace("torch.", "")) for k, v in dtypes.items() if k in DITS}


def _dtypes_from_json(value: dict[str, str | None]) -> dict[str, torch.dtype | None]:
    names = {"bfloat16", "float16", "float32", "float64"}
    out: dict[str, torch.dtype | None] = {}
    for k, v in value.items():
        if v is not None and v not in names:
            raise ValueError(f"unknown dtype {v!r} for {k}")
        out[k] = None if v is None else getattr(torch, v)
    return out


def _sparse_json(value: Any) -> dict[str, Any] | None:
    if value is None:
        return None
    from dataclasses import asdict

    return {**asdict(value), "dense_blocks": list(value.dense_blocks)}


def _sparse_from_json(value: dict[str, Any] | None) -> Any:
    if value is None:
        return None
    from .models.sparse_attention import SparseSettings

    return SparseSettings(**{**value, "dense_blocks": tuple(value.get("dense_blocks", (0,)))})


def knob(default: Any = None, *, default_factory: Any = None, cli: str | None = None, widget: str | None = None,
         choices: Any = None, widget_choices: Any = None, parse: Any = None, value: Any = None,
         widget_value: Any = None, cli_default: Any = None, help: str = "", tooltip: str = "", to_json: Any = None,
         from_json: Any = None, surface: str = "") -> Any:
    """A field of `HandleSettings` with how it shows: `cli` (its flag on `python -m lingbot_core`, generated
    when `choices` or `parse` says how to read it), `widget` (its name on both Loaders; generated from
    `widget_choices` or `choices` and `tooltip`, the first choice the default), `value` (the flag's and
    widget's value as the setting; `widget_value` where the widget's differs), `to_json`/`from_json`
    (LingBot Parallel's description; plain values cross as they are) and `surface` (where a field that
    is no plain flag or widget is set, for the test that every field shows)."""
    meta = dict(cli=cli, widget=widget, choices=choices, widget_choices=widget_choices, parse=parse, value=value,
                widget_value=widget_value, cli_default=cli_default, help=help, tooltip=tooltip, to_json=to_json,
                from_json=from_json, surface=surface)
    if default_factory is not None:
        return field(default_factory=default_factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class HandleSettings:
    """Every setting of a handle's shared components, validated once (`checked` / `check_attention`) by
    `PipelineHandle.open`. A new knob is one field here (with its flag and widget in the metadata) and
    its one consumer; the CLI, both Loaders and LingBot Parallel's workers follow from the field."""

    dtypes: dict[str, Any] = knob(default_factory=dict, to_json=_dtypes_json, from_json=_dtypes_from_json,
                                  widget="dtype", widget_choices=lambda: list(DTYPE_CHOICES),
                                  widget_value=_dtypes_of_choice, surface="the Loaders' dtype widget, Python",
                                  tooltip="auto: the DiT as stored (bf16 for the published checkpoints); text "
                                          "encoder bf16 on GPU, fp32 on CPU (the VAE stays fp32)")
    weights: str = knob("auto", cli="--weights", widget="weights", choices=lambda: ["auto", "fp8_e4m3"],
                        help="auto: the DiT as stored (bf16, fp8 or GGUF); fp8_e4m3: quantize it on load",
                        tooltip="auto: as stored (bf16, pre-quantized fp8, or a transformer/*.gguf); "
                                "fp8_e4m3: quantize the DiT's weights on load")
    attention_backend: str | None = knob(
        None, cli="--attention", widget="attention", value=_attention_value, parse=str, cli_default=DEFAULT_ATTENTION,
        widget_choices=attention_choices,
        help="DiT attention: default (PyTorch SDPA), a diffusers backend name (flash, _flash_3, sage, "
             "_native_cudnn, ...: tried on the first call, SDPA where it fails) or sparse (block-sparse, see "
             "docs/benchmarks.md)",
        tooltip="Attention kernel of the DiT. default: PyTorch SDPA; the others are diffusers' backends installed "
                "here (flash/sage/xformers/_flash_3 need their package). Any other than SDPA is tried when the "
                "Loader opens (refused there if it cannot run) and on its first call (SDPA from then on, with one "
                "warning, where it fails or differs); calls with a mask (padded prompts) go to SDPA on backends "
                "that take none. sparse: block-sparse attention for long videos (12,288+ tokens, after the first "
                "20 % of the schedule, not in block 0; else dense): less attention work, a small change to the "
                "output; comfy-kitchen's CUDA kernel when installed, else a slow eager path (not run on a GPU yet)")
    text_attn: str = knob("sdpa", surface="Python only (PipelineHandle.open(text_attn=...))")
    compile: str = knob("off", cli="--compile", widget="compile", choices=_compile_choices,
                        help="off (default) or blocks: torch.compile each DiT block (the first run compiles)",
                        tooltip="blocks: torch.compile each DiT block (the first run compiles for a minute or more, "
                                "then each step runs faster; needs triton on CUDA or a C++ compiler on CPU). Every "
                                "offload mode runs the compiled blocks (the offload hooks stay outside them)")
    ffn_chunk: int | str | None = knob("auto", cli="--ffn-chunk", widget="ffn_chunk", parse=_chunk_flag,
                                       widget_choices=_chunk_choices, widget_value=lambda c: ffn_chunk_setting(c),
                                       help="tokens per FFN/MoE pass: auto (default: chunks only when the memory "
                                            "estimate needs them), 0 (never), or a number",
                                       tooltip="Tokens per FFN/MoE pass in the DiTs: the same math per token, with "
                                               "the FFN's and the MoE routing's memory bounded to one chunk. auto: "
                                               "whole sequences when the memory estimate fits the free GPU memory, "
                                               "else the largest chunk that fits (the Memory Report says which); "
                                               "off: never chunk; a number: always that many tokens (smaller: less "
                                               "memory, a little slower). Changing it opens the checkpoint again: "
                                               "the next run reloads the models")
    fp8_matmul: str = knob("decode", cli="--fp8-matmul", widget="fp8_matmul", choices=_fp8_matmuls,
                           help="fp8 DiT weights: decode (default, exact), auto (fp8 tensor cores on GPUs of compute "
                                "capability 9.0+, else decode) or scaled_mm",
                           tooltip="fp8 DiT weights only. decode: each layer's weight is decoded to bf16 for its "
                                   "matmul (exact, every device); auto: fp8 tensor cores (torch._scaled_mm, the "
                                   "activations quantized per row: faster, not bit-equal) for bf16 on GPUs of compute "
                                   "capability 8.9+, else decode; scaled_mm: the tensor cores (refused when the Loader "
                                   "opens if a trial on the GPU fails). Where the first fp8 matmul fails or differs, "
                                   "the layers decode (one warning)")
    decoder: str = knob("auto", cli="--decoder", choices=_decoders,
                        help="fp8/GGUF DiT weights: auto (default: a compiled decoder on the CPU for big weights, "
                             "checked against eager on first use; eager elsewhere or if it fails), eager or compiled")
    sparse: Any = knob(None, to_json=_sparse_json, from_json=_sparse_from_json,
                       surface="--sparse-tau/--sparse-density/--sparse-min-tokens")  # a SparseSettings (None: defaults)

    def checked(self, device: torch.device) -> HandleSettings:
        """These settings checked before anything opens (the ones that need no checkpoint), normalised."""
        from .models.compile import COMPILE_CHOICES, compile_problem
        from .models.sparse_attention import SparseSettings
        from .weights.decode import check_decoder
        from .weights.loader import check_weights_mode

        check_weights_mode(self.weights)
        check_decoder(self.decoder)
        chunk = check_ffn_chunk(self.ffn_chunk)
        check_fp8_matmul(self.fp8_matmul, device)
        if self.compile not in COMPILE_CHOICES:
            raise ValueError(f"unknown compile setting {self.compile!r}; choose one of {', '.join(COMPILE_CHOICES)}")
        if self.compile != "off" and (problem := compile_problem(device)):
            raise ValueError(problem)
        if self.sparse is not None and not isinstance(self.sparse, SparseSettings):
            raise ValueError(f"sparse= takes a SparseSettings (lingbot_core.models.sparse_attention), not {self.sparse!r}")
        return replace(self, ffn_chunk=chunk)

    def check_attention(self, device: torch.device) -> None:
        """Refuse an attention backend that is unknown or cannot run on `device` (in the DiT's dtype)."""
        from .models.sparse_attention import SPARSE

        backend = self.attention_backend
        if backend is None:
            return
        if backend != SPARSE:
            from diffusers.models.attention_dispatch import AttentionBackendName

            try:
                AttentionBackendName(backend)
            except ValueError:
                names = ", ".join([*(b.value for b in AttentionBackendName), SPARSE])
                raise ValueError(f"unknown attention backend {backend!r}; choose one of {names}") from None
        check_attention(backend, device, self.dtypes.get(TRANSFORMER))

    def to_json(self) -> dict[str, Any]:
        """These settings as JSON-able values (LingBot Parallel's workers open their handle from them)."""
        out = {}
        for f in fields(self):
            convert = f.metadata.get("to_json")
            out[f.name] = convert(getattr(self, f.name)) if convert else getattr(self, f.name)
        return out

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> HandleSettings:
        known = {f.name: f for f in fields(cls)}
        unknown = set(value) - set(known)
        if unknown:
            raise ValueError(f"unknown handle settings {sorted(unknown)}")
        given = {}
        for name, v in value.items():
            convert = known[name].metadata.get("from_json")
            given[name] = convert(v) if convert else v
        return cls(**given)


def settings_flags() -> list[tuple[str, dict[str, Any]]]:
    """`python -m lingbot_core`'s flags of the settings' plain fields: (flag, argparse keywords) each."""
    flags = []
    for f in fields(HandleSettings):
        meta = f.metadata
        if not meta.get("cli") or not (meta.get("choices") or meta.get("parse")):
            continue
        options: dict[str, Any] = {"default": meta["cli_default"] if meta.get("cli_default") is not None else f.default,
                                   "help": meta["help"]}
        if meta.get("choices"):
            options["choices"] = meta["choices"]()
        if meta.get("parse"):
            options["type"] = meta["parse"]
        flags.append((meta["cli"], options))
    return flags


def settings_from_flags(args: Any) -> dict[str, Any]:
    """The parsed flags of `settings_flags` as `PipelineHandle.open`'s keyword arguments."""
    out = {}
    for f in fields(HandleSettings):
        meta = f.metadata
        if meta.get("cli") and (meta.get("choices") or meta.get("parse")):
            value = getattr(args, meta["cli"].lstrip("-").replace("-", "_"))
            out[f.name] = meta["value"](value) if meta.get("value") else value
    return out


def _widget_fields() -> list[Any]:
    return [f for f in fields(HandleSettings) if f.metadata.get("widget")]


def _widget_choices(meta: Any) -> list[str]:
    return list((meta.get("widget_choices") or meta["choices"])())


def setting_widgets() -> list[str]:
    """The Loaders' widgets of the settings, in the fields' order (a new field goes last in
    `HandleSettings`, so its widget is appended last on both Loaders)."""
    return [f.metadata["widget"] for f in _widget_fields()]


def setting_widget(name: str) -> dict[str, Any]:
    """A Loader's plain widget for the settings field whose widget is `name`: options, default, tooltip."""
    for f in _widget_fields():
        if f.metadata["widget"] == name:
            choices = _widget_choices(f.metadata)
            return {"options": choices, "default": choices[0], "tooltip": f.metadata["tooltip"]}
    raise KeyError(f"no handle setting has the widget {name!r}")


def settings_from_widgets(values: dict[str, Any]) -> dict[str, Any]:
    """The Loaders' setting widgets (by widget name; a missing one, as in a workflow saved before it
    existed, takes its default) as `PipelineHandle.open`'s keywords. A value that is none of its
    widget's choices, or a widget no setting has, is refused in one line before anything opens."""
    unknown = sorted(set(values) - set(setting_widgets()))
    if unknown:
        raise ValueError(f"no handle setting has the widget(s) {', '.join(map(quoted, unknown))}")
    out = {}
    for f in _widget_fields():
        meta = f.metadata
        choices = _widget_choices(meta)
        value = values.get(meta["widget"], choices[0])
        if not isinstance(value, str) or value not in choices:
            raise ValueError(f"{meta['widget']} must be one of {', '.join(choices)}; got {quoted(value)}")
        convert = meta.get("widget_value") or meta.get("value")
        out[f.name] = convert(value) if convert else value
    return out


class SharedComponents:
    """Components of one checkpoint, loaded on demand and shared by every view of it."""

    def __init__(self, folder: str | os.PathLike | None, *, info: CheckpointInfo | None,
                 settings: HandleSettings | None = None, preloaded: dict[str, Any] | None = None, **knobs: Any):
        """`settings` (or its fields as keywords, `knobs`): how the components load and run."""
        if settings is None:
            settings = HandleSettings(**knobs)
        elif knobs:
            settings = replace(settings, **knobs)
        self.settings = replace(settings, ffn_chunk=check_ffn_chunk(settings.ffn_chunk))
        self.folder = Path(folder) if folder is not None else None
        self.info = info
        self.loaded: dict[str, Any] = dict(preloaded or {})
        self.lock = threading.RLock()
        self.states: dict[str, ModelState] = {}  # each loaded model's mutable state (weights/state.py)
        self.placement = Placement(self.states)  # what is installed and resident (placement/door.py acts on it)
        self.load_count: dict[str, int] = {}
        self.transformer_source: tuple[Path, str] | None = None  # (root, subfolder) of a student DiT

    # each setting read (and, for tests, set) as an attribute, as before the settings were one object
    dtypes = property(lambda self: self.settings.dtypes, lambda self, v: self._set(dtypes=v))
    weights = property(lambda self: self.settings.weights, lambda self, v: self._set(weights=v))
    attention_backend = property(lambda self: self.settings.attention_backend,
                                 lambda self, v: self._set(attention_backend=v))
    text_attn = property(lambda self: self.settings.text_attn, lambda self, v: self._set(text_attn=v))
    compile = property(lambda self: self.settings.compile, lambda self, v: self._set(compile=v))
    ffn_chunk = property(lambda self: self.settings.ffn_chunk, lambda self, v: self._set(ffn_chunk=v))
    fp8_matmul = property(lambda self: self.settings.fp8_matmul, lambda self, v: self._set(fp8_matmul=v))
    decoder = property(lambda self: self.settings.decoder, lambda self, v: self._set(decoder=v))
    sparse = property(lambda self: self.settings.sparse, lambda self, v: self._set(sparse=v))

    def _set(self, **change: Any) -> None:
        self.settings = replace(self.settings, **change)

    def get(self, name: str, *, streamed: bool = False) -> Any:
        """The component, loaded now if it is not. `streamed` (the DiTs; the stage door passes it when
        the component will run under disk-backed offload): its stored tensors are not read, they stay
        in the file (`weights.disk`). Ignored when the component is loaded already."""
        if name not in ALL_COMPONENTS:
            raise ValueError(f"unknown component {name!r}; expected one of {ALL_COMPONENTS}")
        with self.lock:
            if name not in self.loaded:
                # the sources resolved when the handle opened: no header is read again, on reload neither
                source = None
                if self.info is not None:
                    source = self.info.sources.get(name) or self.info.file_sources.get(name)
                if self.folder is None and source is None and not (self.info is not None and name == "scheduler"):
                    raise RuntimeError(f"component {name!r} was released and this handle has no checkpoint "
                                       "folder to reload it from")
                state = ModelState()  # what the load finds (disk homes...), kept as the model's state
                if name == REFINER:
                    module = load_refiner(self.folder, dtype=self.dtypes[REFINER], weights=self.weights,
                                          streamed=streamed, info=self.info, state=state)
                elif name == TRANSFORMER and self.transformer_source is not None:
                    root, sub = self.transformer_source
                    module = load_transformer(root, sub, dtype=self.dtypes.get(name), weights=self.weights,
                                              streamed=streamed, source=source, state=state)
                else:
                    module = load_component(self.folder, name, dtype=self.dtypes.get(name),
                                            attn_implementation=self.text_attn, weights=self.weights,
                                            streamed=streamed and name == TRANSFORMER, source=source,
                                            state=state)
                self.states[name] = state.bind(module)
                if name in DITS:
                    module.set_attention_backend(self.attention_backend, self.sparse)
                    if self.fp8_matmul != "decode":
                        from .weights.modules import set_fp8_matmul

                        set_fp8_matmul(module, self.fp8_matmul)
                    if self.decoder != "auto":  # the modules' own default; only the DiTs hold packed weights
                        from .weights.modules import set_decoder

                        set_decoder(module, self.decoder)
                    if self.compile == "blocks":
                        from .models.compile import compile_blocks

                        compile_blocks(module)
                self.loaded[name] = module
                self.load_count[name] = self.load_count.get(name, 0) + 1
                if log.isEnabledFor(logging.INFO) and isinstance(module, torch.nn.Module):
                    from .placement.report import weight_format

                    stored, compute = weight_format(module)
                    log.info("loaded %s: %s weights, computes in %s%s", name, stored, compute,
                             " (streamed from its file)" if streamed and name in DITS else "")
            return self.loaded[name]


@dataclass
class PipelineHandle:
    """One view of a checkpoint: shared components + this view's device, offload settings and states.

    `view_states` holds per-view state objects applied at stage entry (see `placement.door`).
    """

    shared: SharedComponents
    device: torch.device
    offload: OffloadSettings = field(default_factory=OffloadSettings)
    view_states: tuple[Any, ...] = ()
    parallel: Any = None  # a `parallel.ParallelLayout` when this view runs on several processes (`with_parallel`)
    # LingBot Parallel's `worker_pool.pool.WorkerPool` for this view and the views made from it (`pool.tag`)
    pool: Any = field(default=None, compare=False, repr=False)

    @classmethod
    def open(
        cls,
        folder: str | os.PathLike | None,
        *,
        files: ComponentFiles | None = None,
        device: str | torch.device | None = None,
        transformer_folder: str | os.PathLike | None = None,
        settings: HandleSettings | None = None,
        **knobs: Any,
    ) -> PipelineHandle:
        """Validate the checkpoint now (cheap); load components when a stage first needs them.

        `transformer_folder` swaps in a student DiT (a DMD-distilled one, say): a folder that differs
        from `folder` only in `transformer/`, or that transformer folder itself. Everything else
        (text encoder, VAE, refiner) comes from `folder`.
        `files` (`components.ComponentFiles`): single files per component. With a folder they override
        that folder's components; without one (`folder` None) every component a run needs must be a
        file. A DiT file (`.safetensors` / `.gguf`, any community naming) is read by
        `checkpoints.dit_file`; the VAE and text-encoder slots load through the routes registered in
        `checkpoints.inspection.FILE_ROUTES` (one row each); `processor` is a folder with the tokenizer files.
        `dtypes` maps a component to a dtype; None for a DiT keeps its stored dtype. `weights`:
        "auto" (as stored: plain, fp8 or GGUF) or "fp8_e4m3" (quantize the DiTs on load).
        `compile`: "off" or "blocks" (regional torch.compile of the DiTs' repeated blocks, see
        `models/compile.py`; refused here when the compiler cannot build for the device).
        `ffn_chunk`: tokens per FFN/MoE pass in the DiTs. "auto" (default): whole sequences when the
        memory estimate fits the device, else the largest chunk that does (`placement.estimate.
        ffn_chunk_tokens`); a number: always that many (0 or None: never chunk).
        `fp8_matmul`: how the DiTs' fp8 layers multiply (`weights.fp8.FP8_MATMULS`): "decode" (default:
        the weight decoded to bf16, exact), "auto" (fp8 tensor cores where the GPU has them, else decode)
        or "scaled_mm" (refused here where the device cannot run it).
        `decoder`: how the DiTs' packed (fp8/GGUF) weights decode (`weights.decode.DECODERS`): "auto"
        (default: on the CPU, weights of 1M+ values in the formats measured faster compiled decode
        through one compiled kernel per packed format, checked bit for bit against the eager decode on
        first use; eager elsewhere, and for the rest of the process after a compile failure or a
        difference), "eager" (never compiled) or "compiled" (the compiled kernel on every device and
        size, with the same first-use check and fallback).
        `attention_backend="sparse"`: block-sparse attention in the DiTs (`models/sparse_attention.py`);
        `sparse` (a `SparseSettings`) sets its safeguards and density (default: its defaults).
        `text_attn`: the text encoder's attention implementation (transformers' names).
        `knobs`: these settings by their `HandleSettings` field names (left out: the field's default);
        `settings`: all of them at once (a `HandleSettings`; the keywords are then left out).
        """
        device = torch.device(device) if device is not None else default_device()
        if settings is not None and knobs:
            raise ValueError("PipelineHandle.open takes settings= or the settings' keywords, not both")
        if settings is None:
            unknown = sorted(set(knobs) - {f.name for f in fields(HandleSettings)})
            if unknown:
                raise ValueError(f"unknown handle setting(s) {', '.join(unknown)}; the settings are "
                                 f"{', '.join(f.name for f in fields(HandleSettings))}")
            settings = HandleSettings(**{**knobs, "dtypes": dict(knobs.get("dtypes") or {})})
        settings = settings.checked(device)
        if folder is None or not str(folder).strip():
            if files is None:
                raise ValueError("PipelineHandle.open needs a checkpoint folder, files=ComponentFiles(...), or both")
            info = inspect_files(files)
        else:
            info = inspect_checkpoint(folder, files)
        student = None
        if transformer_folder is not None and str(transformer_folder).strip():
            root, sub, source = inspect_student(transformer_folder, info)
            student = (root, sub)
            info = replace(info, sources={**info.sources, TRANSFORMER: source})
        info.check_weights_mode(settings.weights)  # fp8 on load of a GGUF DiT: refused now, before any stage
        from .notices import cpu_notice

        cpu_notice(info, device)  # a real checkpoint on the CPU: said once, with the likely reason
        settings = replace(settings, dtypes={**default_dtypes(device), **settings.dtypes})
        settings.check_attention(device)
        shared = SharedComponents(info.folder, info=info, settings=settings)
        shared.transformer_source = student
        return cls(shared, device)

    @classmethod
    def from_components(cls, components: dict[str, Any], *, device: str | torch.device = "cpu",
                        folder: str | os.PathLike | None = None) -> PipelineHandle:
        """Wrap components that are already in memory (tests, Python users)."""
        device = torch.device(device)
        info = inspect_checkpoint(folder) if folder is not None else None
        shared = SharedComponents(folder, info=info, settings=HandleSettings(dtypes=default_dtypes(device)),
                                  preloaded=components)
        return cls(shared, device)

    # -- views ----------------------------------------------------------------------------------
    def with_offload(self, mode: str, *, offload_to: str = "ram", **options: Any) -> PipelineHandle:
        """A view over the same components with other offload settings (validated here, installed at
        the next stage or by `configure_offload`)."""
        from .distributed.stage import active_layout

        settings = OffloadSettings.make(mode, offload_to, **options)
        if self.pool is not None and settings.mode not in ("none", AUTO):
            from .distributed.layout import pooled_offload_refusal

            raise ValueError(pooled_offload_refusal(settings.mode))
        check_guards(settings, self.device, self.shared.loaded, active_layout(self))
        if mode == AUTO and any(settings.option(k) is not None for k in ("height", "width", "num_frames")):
            from .stage_inputs import validate_geometry  # the size `auto` plans for is a request like any

            validate_geometry(int(settings.option("height", 480)), int(settings.option("width", 832)),
                              int(settings.option("num_frames", 121)))
        return replace(self, offload=settings)

    def with_view_state(self, state: Any) -> PipelineHandle:
        """A view that carries `state` (replacing any state of the same `kind`), applied to the shared
        components when this view's stages enter (see `placement.door`)."""
        kept = tuple(s for s in self.view_states if s.kind != state.kind)
        return replace(self, view_states=(*kept, state))

    def without_view_state(self, kind: str) -> PipelineHandle:
        """A view without a state of this kind (its stages take it off the shared components)."""
        return replace(self, view_states=tuple(s for s in self.view_states if s.kind != kind))

    def with_parallel(self, layout: Any) -> PipelineHandle:
        """A view whose stages run on the processes of `layout` (a `parallel.ParallelLayout`; None or a
        one-process layout: this process alone). Every rank must then call the same stages with the same
        inputs; see `lingbot_core.distributed.stage` for what each stage does on which rank."""
        from .distributed.stage import check_view

        return replace(self, parallel=check_view(self, layout))

    def with_device(self, device: str | torch.device) -> PipelineHandle:
        return replace(self, device=torch.device(device))

    # -- components -----------------------------------------------------------------------------
    @property
    def info(self) -> CheckpointInfo | None:
        return self.shared.info

    @property
    def folder(self) -> Path | None:
        return self.shared.folder

    @property
    def variant(self) -> str:
        if self.shared.info is not None:
            return self.shared.info.variant
        dit = self.shared.loaded.get(TRANSFORMER)
        return "moe" if dit is not None and dit.config.num_experts > 0 else "dense"

    @property
    def has_refiner(self) -> bool:
        if self.shared.info is not None:
            return self.shared.info.has_refiner
        return REFINER in self.shared.loaded

    def component(self, name: str) -> Any:
        """The component, loading it if needed. Stages call this only inside the stage door."""
        return self.shared.get(name)

    def vae_config(self) -> Any:
        """The VAE's config (latent statistics) without loading its weights when it is not loaded."""
        if "vae" in self.shared.loaded:
            return self.shared.loaded["vae"].config
        given = self.info.file_sources.get("vae") if self.info is not None else None
        if given is not None:  # a single VAE file: the config it resolved with
            return dict(given.config)
        if self.folder is None:
            raise RuntimeError("no VAE loaded and no checkpoint folder to read its config from")
        from diffusers import AutoencoderKLWan

        return AutoencoderKLWan.load_config(self.folder / "vae")

    def dtype_of(self, name: str) -> torch.dtype:
        """The compute dtype of a DiT or encoder: its bulk weights' dtype (not the fp32-kept norms)."""
        module = self.shared.get(name)
        if name in DITS:
            from .models.precision import matmul_dtype

            return matmul_dtype(module.patch_embedder)
        return next(module.parameters()).dtype


def check_ffn_chunk(value: Any) -> int | str | None:
    """The FFN chunk setting, checked: "auto", None/0 (never chunk) or a token count."""
    if value == "auto":
        return "auto"
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value or None
    raise ValueError(f"ffn_chunk must be 'auto', 0 (never chunk) or a number of tokens, got {value!r}")


def check_fp8_matmul(value: Any, device: torch.device) -> str:
    """The fp8 matmul setting, checked (`weights.fp8.FP8_MATMULS`); `scaled_mm` is refused here, before
    anything loads, where a small trial on the device fails (`kernels.probe`; `auto` decodes there)."""
    from .weights.fp8 import FP8_MATMULS, scaled_mm_problem

    if not isinstance(value, str) or value not in FP8_MATMULS:
        raise ValueError(f"fp8_matmul must be one of {', '.join(FP8_MATMULS)}; got {quoted(value)}")
    if value == "scaled_mm":
        problem = scaled_mm_problem(device, torch.bfloat16, 16, 16)
        if problem is None:
            from . import kernels

            trial = kernels.probe("scaled_mm", device, torch.bfloat16)
            problem = None if trial["verdict"] == kernels.FAST else f"torch._scaled_mm {trial['verdict']}: {trial['reason']}"
        if problem:
            raise ValueError(f"fp8_matmul scaled_mm cannot run here: {problem}; choose auto (fp8 tensor cores where "
                             "the GPU runs them, else decode) or decode")
    return value


def check_attention(backend: str, device: torch.device, dtype: torch.dtype | None) -> None:
    """Refuse, before anything loads, an attention backend chosen explicitly that a small trial on the
    device cannot run (`kernels.probe`, in the DiTs' dtype; bf16 where they keep their stored one on
    CUDA), with the backend's reason. SDPA is the plain path and is never refused."""
    from . import kernels
    from .models.sparse_attention import SPARSE
    from .models.transformer import SDPA_BACKENDS

    if backend in SDPA_BACKENDS:
        return
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    trial = kernels.probe("sparse_attention" if backend == SPARSE else f"attention/{backend}", device, dtype)
    if trial["verdict"] != kernels.FAST:
        raise ValueError(f"attention '{backend}' cannot run on {device} in {str(dtype).replace('torch.', '')}: "
                         f"{trial['reason']} ({trial['verdict']}); choose default (PyTorch SDPA)")


def ffn_chunk_setting(choice: Any) -> int | str | None:
    """A Loader's `ffn_chunk` widget value (one of `placement.estimate.FFN_CHUNK_CHOICES`) as the handle's
    setting: "auto", None for "off" (never chunk), else the number of tokens. Anything else is refused
    with the choices, before anything loads."""
    from .placement.estimate import AUTO_CHUNK, FFN_CHUNK_CHOICES, NO_CHUNK

    if not isinstance(choice, str) or choice not in FFN_CHUNK_CHOICES:
        raise ValueError(f"ffn_chunk must be one of {', '.join(FFN_CHUNK_CHOICES)}; got {quoted(choice)}")
    if choice == AUTO_CHUNK:
        return AUTO_CHUNK
    return None if choice == NO_CHUNK else int(choice)


def default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
