"""What a LingBot-Video checkpoint is, found when it opens: a diffusers folder and/or single files per
component, checked whole before anything heavy is loaded.

`model_index.json` names the reference's own modules for the transformer and the scheduler; we map
those names to our classes (the component table, `components.TABLE`) instead of importing anything
from the checkpoint (never `trust_remote_code`). Weights come from safetensors files, or (the DiTs)
GGUF, never pickles. `inspect_checkpoint` checks the whole layout (folders, configs, class names,
weight headers and shapes, single files given in its place) so a broken download fails in a second
with one message naming the file and the fix. Each component's weights are resolved once here
(`weights.resolve`, `dit_file`, and the routes of `FILE_ROUTES`): files, format, headers read
once; the loaders (`loading`) take those resolved sources.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..components import DITS, INDEXED, REFINER, TABLE, TRANSFORMER, ComponentFiles
from ..errors import CheckpointError
from ..json_text import parse_json_text
from ..weights import checks
from ..weights.resolve import ComponentSource, check_weights_mode_for, folder_source
from ..weights.safetensors_header import stored_tensors
from .configs import (
    check_scheduler_config,
    check_text_encoder_config,
    check_transformer_config,
    check_vae_config,
    refuse_remote_code,
)

COMPONENTS = INDEXED  # what model_index.json lists (the refiner is found by its folder)


@dataclass
class CheckpointInfo:
    """What `inspect_checkpoint` found: enough to plan loading without touching the weights."""

    folder: Path | None  # None: every component was given as a single file
    variant: str  # "dense" or "moe"
    has_refiner: bool
    transformer_config: dict[str, Any]
    sources: dict[str, ComponentSource] = field(default_factory=dict)  # resolved once, headers read
    file_sources: dict[str, Any] = field(default_factory=dict)  # components given as files of other routes

    @property
    def weight_files(self) -> dict[str, list[Path]]:
        return {name: list(source.files) for name, source in self.sources.items()}

    def component_bytes(self, name: str) -> int:
        """Bytes of weights on disk for a component (an estimate of its RAM in the stored dtype)."""
        source = self.sources.get(name)
        if source is not None:
            return source.stored_bytes
        other = self.file_sources.get(name)
        return int(getattr(other, "nbytes", 0)) if other is not None else 0

    def check_weights_mode(self, weights: str) -> None:
        """Refuse a weights mode a DiT's stored format cannot give (fp8 on load of a GGUF), at open."""
        for name in DITS:
            if name in self.sources:
                check_weights_mode_for(self.sources[name], weights)


def default_dtypes(device: torch.device | str) -> dict[str, torch.dtype]:
    """bf16 DiT and text encoder with an fp32 VAE on CUDA (the table's `cuda_dtype`); everything fp32
    elsewhere (bf16 is slow on CPU)."""
    cuda = torch.device(device).type == "cuda"
    return {name: getattr(torch, row.cuda_dtype) if cuda else torch.float32
            for name, row in TABLE.items() if row.weight_stem is not None}


# -- validation ---------------------------------------------------------------------------------

def _read_json(path: Path, what: str) -> dict[str, Any]:
    if not path.is_file():
        raise CheckpointError(f"{what}: missing file {path}. Re-download the checkpoint or point the loader at the "
                              "folder that holds model_index.json.")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{what}: cannot read {path} ({err}). The file is corrupt; re-download it.") from err
    data = parse_json_text(text, f"{what}: {path}")
    if not isinstance(data, dict):
        raise CheckpointError(f"{what}: {path} does not hold a JSON object; re-download it.")
    return data


def _stored_shapes(files: list[Path]) -> dict[str, tuple[int, ...]]:
    return {name: t.shape for name, t in stored_tensors(files).items()}


def check_state_dict(component: str, source: ComponentSource | list[Path], expected: dict[str, tuple[int, ...]],
                     ignore_missing: Iterable[str] = ()) -> None:
    """Compare stored tensor names and shapes with what the model expects.

    The libraries only warn on missing keys and leave those weights uninitialised; a partial or
    mismatched checkpoint must fail loudly instead. `source`: a resolved component (its headers,
    read once) or safetensors files (read here).
    """
    if isinstance(source, ComponentSource):
        stored = {name: t.shape for name, t in source.stored_tensors().items()}
        where = source.config_dir or source.where
    else:
        stored = _stored_shapes(source)
        where = source[0].parent
    problems = checks.tensor_set_problems(stored, expected, ignore_missing=ignore_missing)
    if problems:
        raise CheckpointError(f"{component}: the weights in {where} do not match its config.json: "
                              f"{'; '.join(problems)}. The folder is incomplete or from another model; re-download it.")


def _check_config_class(folder: Path, component: str) -> dict[str, Any]:
    row = TABLE[component]
    config = _read_json(folder / row.config_file, component)
    accepted = row.config_classes
    if accepted and config.get("_class_name") not in accepted:
        raise CheckpointError(
            f"{component}: {folder / row.config_file} declares class {config.get('_class_name')!r}, "
            f"but lingbot-nodes only knows {' or '.join(map(repr, accepted))} here. Is this a LingBot-Video checkpoint?"
        )
    if component == "text_encoder" and config.get("model_type") != "qwen3_vl":
        raise CheckpointError(
            f"text_encoder: {folder / 'config.json'} has model_type {config.get('model_type')!r}; "
            "LingBot-Video needs a Qwen3-VL text encoder ('qwen3_vl')."
        )
    return config


@dataclass(frozen=True)
class FileRoute:
    """How a component given as a single file is resolved (at open: headers read, names and config
    inferred, problems refused) and loaded (from what `resolve` returned)."""

    resolve: Callable[..., Any]  # (path, component name, folder=checkpoint folder or None) -> the resolved file
    load: Callable[..., Any]  # (resolved, dtype=, attn_implementation=, weights=, streamed=, state=) -> the component


def _load_dit_file(resolved: ComponentSource, *, dtype: torch.dtype | None = None, weights: str = "auto",
                   streamed: bool = False, state: Any = None, **_: Any) -> torch.nn.Module:
    from ..weights.loader import load_dit

    return load_dit(resolved, dtype=dtype, weights=weights, streamed=streamed, state=state)


def _dit_file(path: Path, component: str, folder: Path | None = None) -> ComponentSource:
    from .dit_file import dit_file_source

    return dit_file_source(path, component)


def _vae_file(path: Path, component: str, folder: Path | None = None) -> Any:
    from .vae_file import inspect_vae_file

    return inspect_vae_file(path)


def _load_vae_file(resolved: Any, *, dtype: torch.dtype | None = None, **_: Any) -> torch.nn.Module:
    from .vae_file import load_vae_file

    return load_vae_file(resolved, dtype=dtype)


def _text_encoder_file(path: Path, component: str, folder: Path | None = None) -> Any:
    """A checkpoint folder given with the file lends its text_encoder/config.json (when it has one)."""
    from .single_files import _folder_config
    from .text_encoder_file import inspect_text_encoder_file

    return inspect_text_encoder_file(path, config=_folder_config(folder, "text_encoder"))


def _load_text_encoder_file(resolved: Any, *, dtype: torch.dtype | None = None, attn_implementation: str = "sdpa",
                            state: Any = None, **_: Any) -> torch.nn.Module:
    from .text_encoder_file import load_text_encoder_file

    return load_text_encoder_file(resolved, dtype=dtype, attn_implementation=attn_implementation, state=state)


# Single-file routes by component role: a new one is one row.
FILE_ROUTES: dict[str, FileRoute] = {
    "dit": FileRoute(_dit_file, _load_dit_file),
    "vae": FileRoute(_vae_file, _load_vae_file),
    "text_encoder": FileRoute(_text_encoder_file, _load_text_encoder_file),
}


def _resolve_file(name: str, path: Path, folder: Path | None = None) -> Any:
    route = FILE_ROUTES.get(TABLE[name].role)
    if route is None:
        raise CheckpointError(f"{name}: loading the {name} from a single file ({path.name}) is not supported yet; "
                              f"pass a checkpoint folder for it.")
    return route.resolve(path, name, folder=folder)


def inspect_checkpoint(folder: str | os.PathLike, files: ComponentFiles | None = None) -> CheckpointInfo:
    """Validate a checkpoint folder without loading any weights; raise CheckpointError on the first problem.
    `files`: single files that replace the folder's components (their folders may then be absent)."""
    given = files.given() if files is not None else {}
    root = Path(folder).expanduser()
    if not root.is_dir():
        raise CheckpointError(f"checkpoint folder {root} does not exist. Pass the folder that holds model_index.json.")
    index = _read_json(root / "model_index.json", "model_index.json")
    refuse_remote_code(root, (*COMPONENTS, REFINER))
    for name in COMPONENTS:
        entry = index.get(name)
        if not (isinstance(entry, list) and len(entry) == 2 and all(isinstance(e, str) for e in entry)):
            shown = json.dumps(entry)[:80] if isinstance(entry, (list, str, int, float, type(None))) else "?"
            raise CheckpointError(f"{root / 'model_index.json'} has no usable '{name}' entry (got {shown}); "
                                  "a LingBot-Video checkpoint lists transformer, vae, text_encoder, processor, scheduler "
                                  "as [library, class] pairs.")
        if tuple(entry) not in TABLE[name].index_classes:
            known = ", ".join(f"{lib}.{cls}" for lib, cls in TABLE[name].index_classes)
            raise CheckpointError(f"{root / 'model_index.json'}: '{name}' is {entry[0]}.{entry[1]}, which lingbot-nodes "
                                  f"does not know; expected {known}.")
        if name not in given and not (root / name).is_dir():
            raise CheckpointError(f"{name}: missing folder {root / name}. Re-download the checkpoint.")

    has_refiner = REFINER in given or (root / REFINER).is_dir()
    found = _Found()
    for name in (TRANSFORMER, "vae", "text_encoder", *((REFINER,) if has_refiner else ())):
        if name in given:
            found.add_file(name, given[name], root)
        else:
            found.configs[name] = _check_config_class(root / name, name)
            found.sources[name] = folder_source(root / name, name)
    found.configs["scheduler"] = _check_config_class(root / "scheduler", "scheduler")
    found.add_processor(given.get("processor", root / "processor"), "processor" in given)
    check_values_and_shapes(root, found.configs, found.sources, skip=set(given))
    found.check_processor()
    return found.info(root, has_refiner)


def inspect_files(files: ComponentFiles) -> CheckpointInfo:
    """Validate components given only as single files (no checkpoint folder): every component a run
    needs must be given; the scheduler takes its default config."""
    given = files.given()
    missing = [n for n in (TRANSFORMER, "vae", "text_encoder", "processor") if n not in given]
    if missing:
        raise CheckpointError(f"without a checkpoint folder every component must be given as a file; missing: "
                              f"{', '.join(missing)}. Give them, or pass the checkpoint folder they come from.")
    found = _Found()
    for name in (TRANSFORMER, REFINER, "vae", "text_encoder"):
        if name in given:
            found.add_file(name, given[name])
    found.add_processor(given["processor"], True)
    check_values_and_shapes(Path("."), found.configs, found.sources, skip=set(given), scheduler=False)
    found.check_processor()
    return found.info(None, REFINER in given)


@dataclass
class _Found:
    """What the inspection found so far: resolved sources, other single-file routes, configs."""

    sources: dict[str, ComponentSource] = field(default_factory=dict)
    file_sources: dict[str, Any] = field(default_factory=dict)
    configs: dict[str, dict[str, Any]] = field(default_factory=dict)

    def add_file(self, name: str, path: Path, folder: Path | None = None) -> None:
        resolved = _resolve_file(name, path, folder)
        if isinstance(resolved, ComponentSource):
            self.sources[name] = resolved
        else:
            self.file_sources[name] = resolved
        self.configs[name] = dict(getattr(resolved, "config", None) or {})

    def add_processor(self, folder: Path, given: bool) -> None:
        if given:  # a processor folder, a checkpoint folder, or a Qwen tokenizer folder (processor_files)
            from .processor_files import resolve_processor_folder

            self.file_sources["processor"] = resolve_processor_folder(folder)[0]
        else:
            _check_processor(folder)

    def check_processor(self) -> None:
        """A processor given apart from its checkpoint: its tokenizer's vision token ids against the
        text encoder's config (folder or file), last of the open checks (it builds the tokenizer)."""
        given = self.file_sources.get("processor")
        if given is not None and self.configs.get("text_encoder"):
            from .processor_files import check_folder

            check_folder(given, self.configs["text_encoder"])

    def info(self, root: Path | None, has_refiner: bool) -> CheckpointInfo:
        config = self.configs[TRANSFORMER]
        variant = "moe" if int(config.get("num_experts") or 0) > 0 else "dense"
        return CheckpointInfo(root, variant, has_refiner, config, self.sources, self.file_sources)


def _check_processor(processor: Path) -> None:
    if not (processor / "tokenizer.json").is_file() and not (processor / "tokenizer_config.json").is_file():
        raise CheckpointError(f"processor: no tokenizer in {processor} (tokenizer.json); re-download the checkpoint.")
    if not any((processor / f).is_file() for f in ("processor_config.json", "preprocessor_config.json")):
        raise CheckpointError(f"processor: no processor_config.json or preprocessor_config.json in {processor}; "
                              "re-download the checkpoint.")


def check_values_and_shapes(root: Path, configs: dict[str, dict[str, Any]], sources: dict[str, ComponentSource],
                            skip: set[str] = frozenset(), scheduler: bool = True) -> None:
    """Config values of every component, then every stored tensor's shape against its config.

    Shapes come from the headers read when each component resolved (safetensors or GGUF) and a
    meta-device skeleton of each model, so a mismatched refiner or GGUF is refused when the
    checkpoint opens, not after the text encoder or the base video ran.
    """
    for name in DITS:
        if name in configs:
            check_transformer_config(configs[name], str(root / name / "config.json"))
    where_of = {name: sources[name].where if name in skip and name in sources else root / name / "config.json"
                for name in configs}
    if "vae" not in skip:
        check_vae_config(configs["vae"], str(root / "vae" / "config.json"))
    if scheduler:
        check_scheduler_config(configs["scheduler"], str(root / "scheduler" / "scheduler_config.json"))
    if "text_encoder" not in skip:
        check_text_encoder_config(configs["text_encoder"], str(root / "text_encoder" / "config.json"),
                                         configs[TRANSFORMER].get("text_dim"))
    if "text_encoder" in skip:  # a single file's width against the DiT's text width (a folder's: just above)
        from .single_files import check_fit

        check_fit(configs[TRANSFORMER], None, configs["text_encoder"],
                  {"text_encoder": where_of["text_encoder"], TRANSFORMER: where_of[TRANSFORMER]})
    vae_dim, dit_in = configs["vae"].get("z_dim"), configs[TRANSFORMER]["in_channels"]
    if vae_dim is not None and vae_dim != dit_in:
        raise CheckpointError(f"{where_of['vae']}: the VAE's z_dim is {vae_dim} but the transformer "
                              f"({where_of['transformer']}) takes {dit_in} channels; they come from different models.")
    for name in (TRANSFORMER, REFINER, "vae", "text_encoder"):
        if name not in sources or name in skip:
            continue  # a single file was matched against its config when it resolved
        where = root / name
        if sources[name].format.name != "safetensors":  # a GGUF DiT: its source's logical entries
            check_dit_entries(sources[name], checks.dit_shapes(configs[name], str(where / "config.json")))
            continue
        stored = sources[name].stored_tensors()
        if name in DITS:
            expected = checks.dit_shapes(configs[name], str(where / "config.json"))
            quantized = any(t.dtype.startswith("F8") for t in stored.values())
            checks.compare_shapes(name, where, stored, expected, strict_names=not quantized)
        elif name == "vae":
            checks.compare_shapes(name, where, stored, checks.vae_shapes(configs[name], str(where / "config.json")))
        else:  # transformers may rename stored keys on load: here only shapes, names at load time
            expected = checks.text_encoder_shapes(where, configs[name], str(where / "config.json"))
            checks.compare_shapes(name, where, stored, expected, strict_names=False)


def check_dit_entries(resolved: ComponentSource, expected: dict[str, tuple[int, ...]]) -> None:
    """A DiT source's names and logical shapes (GGUF blocks, per-expert stacks) against its config."""
    entries = resolved.open().entries
    problems = checks.tensor_set_problems({k: e.shape for k, e in entries.items()}, expected)
    if problems:
        raise CheckpointError(f"{resolved.component}: the weights in {resolved.where} do not match its config: "
                              f"{'; '.join(problems)}. The file is incomplete or from another model; re-download "
                              "or re-create it.")


# -- student transformers -----------------------------------------------------------------------

# Config keys that record where or with what a model was saved, not what it is.
_PROVENANCE_KEYS = ("_name_or_path", "_diffusers_version", "_commit_hash", "_use_default_values")


def inspect_student(folder: str | os.PathLike, base: CheckpointInfo) -> tuple[Path, str, ComponentSource]:
    """Validate a student DiT (e.g. a DMD-distilled one) that replaces `base`'s `transformer/`.

    `folder` is either a checkpoint-like folder with a `transformer/` subfolder (the other
    components, if present, are ignored: the base's are used) or the transformer folder itself.
    Its config must describe the same architecture as the base transformer; anything else is not a
    student of this checkpoint. Returns (root, subfolder, its resolved weights source).
    """
    path = Path(folder).expanduser()
    if not path.is_dir():
        raise CheckpointError(f"student transformer folder {path} does not exist")
    if (path / TRANSFORMER / "config.json").is_file():
        root, sub = path, TRANSFORMER
    elif (path / "config.json").is_file():
        root, sub = path.parent, path.name
    else:
        raise CheckpointError(f"{path} holds no transformer: expected {path / 'transformer' / 'config.json'} "
                              f"(a student checkpoint folder) or {path / 'config.json'} (its transformer folder)")
    config = _check_config_class(root / sub, TRANSFORMER)
    differs = sorted(k for k in set(config) | set(base.transformer_config)
                     if k not in _PROVENANCE_KEYS and config.get(k) != base.transformer_config.get(k))
    if differs:
        k = differs[0]
        raise CheckpointError(
            f"the student transformer in {root / sub} is not the base checkpoint's architecture "
            f"({len(differs)} config fields differ, e.g. {k}: {config.get(k)!r} vs {base.transformer_config.get(k)!r} "
            f"in {base.folder / 'transformer'}); load it with its own base checkpoint")
    source = folder_source(root / sub, TRANSFORMER)
    check_dit_entries(source, checks.dit_shapes(config, str(root / sub / "config.json")))
    if sub == TRANSFORMER and (root / "model_index.json").is_file():  # a whole root, such as the DMD student's
        import logging

        logging.getLogger("lingbot_core.checkpoints.inspection").info(
            "transformer_path %s is a checkpoint root: its transformer/ runs in place of %s's; the base's text "
            "encoder, VAE, processor%s are used, the root's own are not read", root, base.folder,
            " and refiner" if base.has_refiner else "")
    return root, sub, source
