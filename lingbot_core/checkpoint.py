"""Load a LingBot-Video checkpoint folder (diffusers layout) into our components.

`model_index.json` names the reference's own modules for the transformer and the scheduler; we map
those names to our classes instead of importing anything from the checkpoint (never
`trust_remote_code`). Weights are read from safetensors only. Before anything heavy is loaded,
`inspect_checkpoint` checks the whole layout (folders, configs, class names, safetensors headers and
sizes) so a broken download fails in a second with one message naming the file and the fix.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from . import checkpoint_checks as checks
from .errors import CheckpointError

COMPONENTS = ("transformer", "vae", "text_encoder", "processor", "scheduler")

# (library, class) as written in model_index.json -> the name we load it as.
KNOWN_CLASSES: dict[str, dict[tuple[str, str], str]] = {
    "transformer": {
        ("lingbot_video.transformer_lingbot_video", "LingBotVideoTransformer3DModel"): "LingBotVideoTransformer3DModel",
    },
    "scheduler": {
        ("lingbot_video.scheduling_flow_unipc", "FlowUniPCMultistepScheduler"): "FlowUniPCMultistepScheduler",
    },
    "text_encoder": {("transformers", "Qwen3VLForConditionalGeneration"): "Qwen3VLForConditionalGeneration"},
    "processor": {("transformers", "Qwen3VLProcessor"): "Qwen3VLProcessor"},
    "vae": {("diffusers", "AutoencoderKLWan"): "AutoencoderKLWan"},
}

# config.json `_class_name` (diffusers) or `architectures`/`model_type` (transformers) we accept.
CONFIG_CLASS: dict[str, str | tuple[str, ...]] = {
    "transformer": "LingBotVideoTransformer3DModel",
    "refiner": "LingBotVideoTransformer3DModel",
    "vae": "AutoencoderKLWan",
    "scheduler": ("FlowUniPCMultistepScheduler", "FlowUniPCScheduler"),  # the reference's name, and ours
}
WEIGHT_FILES = {
    "transformer": "diffusion_pytorch_model",
    "refiner": "diffusion_pytorch_model",
    "vae": "diffusion_pytorch_model",
    "text_encoder": "model",
}
QUANTIZABLE = ("transformer", "refiner")  # components that may be stored as fp8 or GGUF
CONFIG_FILES = {
    "transformer": "config.json",
    "refiner": "config.json",
    "vae": "config.json",
    "text_encoder": "config.json",
    "scheduler": "scheduler_config.json",
}


@dataclass
class CheckpointInfo:
    """What `inspect_checkpoint` found: enough to plan loading without touching the weights."""

    folder: Path
    variant: str  # "dense" or "moe"
    has_refiner: bool
    transformer_config: dict[str, Any]
    weight_files: dict[str, list[Path]] = field(default_factory=dict)

    def component_bytes(self, name: str) -> int:
        """Bytes of weights on disk for a component (an estimate of its RAM in the stored dtype)."""
        return sum(p.stat().st_size for p in self.weight_files.get(name, []))


def default_dtypes(device: torch.device | str) -> dict[str, torch.dtype]:
    """bf16 DiT and text encoder with an fp32 VAE on CUDA; everything fp32 elsewhere (bf16 is slow on CPU)."""
    if torch.device(device).type == "cuda":
        return {"transformer": torch.bfloat16, "refiner": torch.bfloat16, "text_encoder": torch.bfloat16,
                "vae": torch.float32}
    return {"transformer": torch.float32, "refiner": torch.float32, "text_encoder": torch.float32,
            "vae": torch.float32}


# -- validation ---------------------------------------------------------------------------------

def _read_json(path: Path, what: str) -> dict[str, Any]:
    if not path.is_file():
        raise CheckpointError(f"{what}: missing file {path}. Re-download the checkpoint or point the loader at the "
                              "folder that holds model_index.json.")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{what}: cannot read {path} ({err}). The file is corrupt; re-download it.") from err
    data = checks.parse_json_text(text, f"{what}: {path}")
    if not isinstance(data, dict):
        raise CheckpointError(f"{what}: {path} does not hold a JSON object; re-download it.")
    return data


def check_safetensors(path: Path) -> None:
    """Verify a safetensors file's header (entries, dtypes, shapes, byte ranges) against the file (cheap)."""
    checks.read_safetensors_entries(path)


def _stored_shapes(files: list[Path]) -> dict[str, tuple[int, ...]]:
    return {name: t.shape for name, t in checks.stored_tensors(files).items()}


def check_state_dict(component: str, files: list[Path], expected: dict[str, tuple[int, ...]],
                     ignore_missing: Iterable[str] = ()) -> None:
    """Compare stored tensor names and shapes with what the model expects.

    The libraries only warn on missing keys and leave those weights uninitialised; a partial or
    mismatched checkpoint must fail loudly instead.
    """
    stored = _stored_shapes(files)
    problems = checks.tensor_set_problems(stored, expected, ignore_missing=ignore_missing)
    if problems:
        where = files[0].parent
        raise CheckpointError(f"{component}: the weights in {where} do not match its config.json: "
                              f"{'; '.join(problems)}. The folder is incomplete or from another model; re-download it.")


def _weight_files(folder: Path, component: str) -> list[Path]:
    stem = WEIGHT_FILES[component]
    single = folder / f"{stem}.safetensors"
    index = folder / f"{stem}.safetensors.index.json"
    if single.is_file():
        files = [single]
    elif index.is_file():
        weight_map = _read_json(index, component).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{component}: {index} has no weight_map; re-download it.")
        files = [folder / name for name in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise CheckpointError(f"{component}: shard {f} listed in {index.name} is missing; re-download it.")
    elif component in QUANTIZABLE and list(folder.glob("*.gguf")):
        from .weights.loader import find_gguf
        from .weights.sources import GGUFSource

        files = [find_gguf(folder)]
        GGUFSource(files[0])  # header and tensor types, checked now (the tensors stay on disk)
        return files
    else:
        pickled = [p.name for p in folder.glob("*.bin")] + [p.name for p in folder.glob("*.pt*")]
        hint = (f" Found only {', '.join(sorted(pickled))}: pickled weights are never loaded; convert them to "
                "safetensors.") if pickled else " Re-download the checkpoint."
        raise CheckpointError(f"{component}: missing weights {single} (or a sharded {index.name}).{hint}")
    for f in files:
        check_safetensors(f)
    if component not in QUANTIZABLE:
        _refuse_quantized(component, folder, files)
    return files


def _refuse_quantized(component: str, folder: Path, files: list[Path]) -> None:
    """fp8 / GGUF weights are for the DiTs only; the VAE and text encoder must be plain safetensors."""
    from .weights.sources import read_safetensors_header

    stray = sorted(p.name for p in folder.glob("*.gguf"))
    fp8 = [k for f in files for k, v in read_safetensors_header(f).items()
           if k != "__metadata__" and str(v.get("dtype", "")).startswith("F8")]
    if stray or fp8:
        what = f"GGUF file {stray[0]}" if stray else f"fp8 tensor {fp8[0]}"
        raise CheckpointError(f"{component}: {folder} holds quantized weights ({what}); lingbot-nodes quantizes only "
                              "the transformer and refiner. Use the checkpoint's original bf16/fp32 "
                              f"{component} folder.")


def _check_config_class(folder: Path, component: str) -> dict[str, Any]:
    config = _read_json(folder / CONFIG_FILES[component], component)
    expected = CONFIG_CLASS.get(component)
    accepted = (expected,) if isinstance(expected, str) else expected
    if expected is not None and config.get("_class_name") not in accepted:
        raise CheckpointError(
            f"{component}: {folder / CONFIG_FILES[component]} declares class {config.get('_class_name')!r}, "
            f"but lingbot-nodes only knows {' or '.join(map(repr, accepted))} here. Is this a LingBot-Video checkpoint?"
        )
    if component == "text_encoder" and config.get("model_type") != "qwen3_vl":
        raise CheckpointError(
            f"text_encoder: {folder / 'config.json'} has model_type {config.get('model_type')!r}; "
            "LingBot-Video needs a Qwen3-VL text encoder ('qwen3_vl')."
        )
    return config


def inspect_checkpoint(folder: str | os.PathLike) -> CheckpointInfo:
    """Validate a checkpoint folder without loading any weights; raise CheckpointError on the first problem."""
    root = Path(folder).expanduser()
    if not root.is_dir():
        raise CheckpointError(f"checkpoint folder {root} does not exist. Pass the folder that holds model_index.json.")
    index = _read_json(root / "model_index.json", "model_index.json")
    checks.refuse_remote_code(root, (*COMPONENTS, "refiner"))
    for name in COMPONENTS:
        entry = index.get(name)
        if not (isinstance(entry, list) and len(entry) == 2 and all(isinstance(e, str) for e in entry)):
            shown = json.dumps(entry)[:80] if isinstance(entry, (list, str, int, float, type(None))) else "?"
            raise CheckpointError(f"{root / 'model_index.json'} has no usable '{name}' entry (got {shown}); "
                                  "a LingBot-Video checkpoint lists transformer, vae, text_encoder, processor, scheduler "
                                  "as [library, class] pairs.")
        if tuple(entry) not in KNOWN_CLASSES[name]:
            known = ", ".join(f"{lib}.{cls}" for lib, cls in KNOWN_CLASSES[name])
            raise CheckpointError(f"{root / 'model_index.json'}: '{name}' is {entry[0]}.{entry[1]}, which lingbot-nodes "
                                  f"does not know; expected {known}.")
        if not (root / name).is_dir():
            raise CheckpointError(f"{name}: missing folder {root / name}. Re-download the checkpoint.")

    files: dict[str, list[Path]] = {}
    configs: dict[str, dict[str, Any]] = {}
    for name in ("transformer", "vae", "text_encoder"):
        configs[name] = _check_config_class(root / name, name)
        files[name] = _weight_files(root / name, name)
    transformer_config = configs["transformer"]
    configs["scheduler"] = _check_config_class(root / "scheduler", "scheduler")
    processor = root / "processor"
    if not (processor / "tokenizer.json").is_file() and not (processor / "tokenizer_config.json").is_file():
        raise CheckpointError(f"processor: no tokenizer in {processor} (tokenizer.json); re-download the checkpoint.")
    if not any((processor / f).is_file() for f in ("processor_config.json", "preprocessor_config.json")):
        raise CheckpointError(f"processor: no processor_config.json or preprocessor_config.json in {processor}; "
                              "re-download the checkpoint.")

    has_refiner = (root / "refiner").is_dir()
    if has_refiner:
        configs["refiner"] = _check_config_class(root / "refiner", "refiner")
        files["refiner"] = _weight_files(root / "refiner", "refiner")
    check_values_and_shapes(root, configs, files)
    variant = "moe" if int(transformer_config.get("num_experts") or 0) > 0 else "dense"
    return CheckpointInfo(root, variant, has_refiner, transformer_config, files)


def check_values_and_shapes(root: Path, configs: dict[str, dict[str, Any]], files: dict[str, list[Path]]) -> None:
    """Config values of every component, then every stored tensor's shape against its config.

    Shapes come from the safetensors headers and a meta-device skeleton of each model, so a
    mismatched refiner is refused when the checkpoint opens, not after the base video sampled.
    """
    for name in ("transformer", "refiner"):
        if name in configs:
            checks.check_transformer_config(configs[name], str(root / name / "config.json"))
    checks.check_vae_config(configs["vae"], str(root / "vae" / "config.json"))
    checks.check_scheduler_config(configs["scheduler"], str(root / "scheduler" / "scheduler_config.json"))
    checks.check_text_encoder_config(configs["text_encoder"], str(root / "text_encoder" / "config.json"),
                                     configs["transformer"].get("text_dim"))
    vae_dim, dit_in = configs["vae"]["z_dim"], configs["transformer"]["in_channels"]
    if vae_dim != dit_in:
        raise CheckpointError(f"{root}: the VAE's z_dim is {vae_dim} but the transformer takes {dit_in} channels; "
                              "the folders come from different models. Re-download the checkpoint.")
    for name in ("transformer", "refiner", "vae", "text_encoder"):
        if name not in files or any(f.suffix != ".safetensors" for f in files[name]):
            continue  # GGUF stores are checked by their own reader
        where = root / name
        stored = checks.stored_tensors(files[name])
        if name in ("transformer", "refiner"):
            expected = checks.dit_shapes(configs[name], str(where / "config.json"))
            quantized = any(t.dtype.startswith("F8") for t in stored.values())
            checks.compare_shapes(name, where, stored, expected, strict_names=not quantized)
        elif name == "vae":
            checks.compare_shapes(name, where, stored, checks.vae_shapes(configs[name], str(where / "config.json")))
        else:  # transformers may rename stored keys on load: here only shapes, names at load time
            expected = checks.text_encoder_shapes(where, configs[name], str(where / "config.json"))
            checks.compare_shapes(name, where, stored, expected, strict_names=False)


# -- loading ------------------------------------------------------------------------------------

def load_transformer(folder: str | os.PathLike, subfolder: str = "transformer", *,
                     dtype: torch.dtype | None = None, weights: str = "auto",
                     streamed: bool = False) -> torch.nn.Module:
    """A DiT, tensor by tensor from its mapped files (`weights.loader.load_dit`).

    dtype None keeps the stored dtype (fp32-kept modules in fp32); `weights` "fp8_e4m3" quantizes
    the linear and expert weights on load. A `*.gguf` file in the folder loads as GGUF. `streamed`:
    for disk-backed offload, the tensors kept as stored stay in the file (on `meta`).
    """
    from .weights.loader import load_dit

    path = Path(folder) / subfolder
    files = _weight_files(path, subfolder if subfolder in WEIGHT_FILES else "transformer")
    if files[0].suffix == ".gguf":
        return load_dit(folder, subfolder, dtype=dtype, weights=weights, gguf=files[0], streamed=streamed)
    return load_dit(folder, subfolder, dtype=dtype, weights=weights, files=files, streamed=streamed)


def load_refiner(folder: str | os.PathLike, *, dtype: torch.dtype | None = None,
                 weights: str = "auto", streamed: bool = False) -> torch.nn.Module:
    """The MoE refiner DiT, loaded only when asked for; a dense checkpoint gets a clear error."""
    info = inspect_checkpoint(folder)
    if not info.has_refiner:
        raise CheckpointError(
            f"{info.folder} has no refiner/ folder: the refiner ships only with the MoE checkpoint "
            "(robbyant/lingbot-video-moe-30b-a3b). Load that checkpoint, or disable refinement."
        )
    return _finite(load_transformer(info.folder, "refiner", dtype=dtype, weights=weights, streamed=streamed),
                   "refiner", info.folder)


def _finite(module: Any, name: str, folder: Path) -> Any:
    """Weights with NaN/inf are refused when the component loads (a sum per tensor: cheap)."""
    if os.environ.get("LINGBOT_SKIP_WEIGHT_SCAN") != "1" and isinstance(module, torch.nn.Module):
        checks.scan_non_finite(module, name, Path(folder) / name)
    return module


def load_component(folder: Path, name: str, *, dtype: torch.dtype | None = None,
                   attn_implementation: str = "sdpa", weights: str = "auto", streamed: bool = False) -> Any:
    """Load one component from a validated folder (CPU). dtype None: as stored (the DiT) or float32.
    `streamed` (the DiT only): its stored tensors stay in the file, for disk-backed offload."""
    if name == "transformer":
        return _finite(load_transformer(folder, dtype=dtype, weights=weights, streamed=streamed), name, folder)
    if name == "vae":
        from diffusers import AutoencoderKLWan

        with torch.device("meta"):
            skeleton = AutoencoderKLWan.from_config(AutoencoderKLWan.load_config(folder / "vae"))
        check_state_dict("vae", _weight_files(folder / "vae", "vae"),
                         {k: tuple(v.shape) for k, v in skeleton.state_dict().items()})
        vae = AutoencoderKLWan.from_pretrained(folder, subfolder="vae", torch_dtype=dtype or torch.float32,
                                               use_safetensors=True, local_files_only=True)
        return _finite(vae.eval().requires_grad_(False), name, folder)
    if name == "text_encoder":
        from transformers import Qwen3VLForConditionalGeneration
        from transformers.utils import logging as hf_logging

        # Stored key names may predate transformers' renaming, so check what it reports after loading.
        bars = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()  # one bar per load is noise in a node graph's log
        try:
            model, report = Qwen3VLForConditionalGeneration.from_pretrained(
                folder / "text_encoder", dtype=dtype or torch.float32, attn_implementation=attn_implementation,
                use_safetensors=True, local_files_only=True, output_loading_info=True, trust_remote_code=False,
            )
        finally:
            if bars:
                hf_logging.enable_progress_bar()
        missing = sorted(k for k in report.get("missing_keys", ()) if k != "lm_head.weight")
        if missing or report.get("mismatched_keys"):
            raise CheckpointError(
                f"text_encoder: the weights in {folder / 'text_encoder'} do not match its config.json "
                f"(missing: {missing[:3]}, mismatched: {list(report.get('mismatched_keys') or [])[:3]}). "
                "Re-download it."
            )
        return _finite(model.eval().requires_grad_(False), name, folder)
    if name == "processor":
        from transformers import Qwen3VLProcessor

        try:
            return Qwen3VLProcessor.from_pretrained(folder / "processor", local_files_only=True,
                                                    trust_remote_code=False)
        except Exception as err:  # transformers' and tokenizers' own errors (tokenizers raises bare Exception)
            raise CheckpointError(f"processor: {folder / 'processor'} cannot be loaded ({type(err).__name__}: "
                                  f"{str(err)[:300]}). The tokenizer/processor files are corrupt; re-download "
                                  "them.") from err
    if name == "scheduler":
        from .scheduler import FlowUniPCScheduler

        return FlowUniPCScheduler.from_pretrained(folder, subfolder="scheduler", local_files_only=True)
    raise ValueError(f"unknown component {name!r}; expected one of {COMPONENTS}")


@dataclass
class LoadedCheckpoint:
    info: CheckpointInfo
    components: dict[str, Any]

    def __getattr__(self, name: str) -> Any:
        try:
            return self.__dict__["components"][name]
        except KeyError:
            raise AttributeError(name) from None


def load_checkpoint(
    folder: str | os.PathLike,
    *,
    device: torch.device | str = "cpu",
    dtypes: dict[str, torch.dtype] | None = None,
    components: Iterable[str] = COMPONENTS,
    attn_implementation: str = "sdpa",
) -> LoadedCheckpoint:
    """Validate `folder`, then load the requested components on CPU in their per-device dtypes.

    `device` only selects the dtype policy; placing components is the offload manager's job. The
    refiner is never loaded here: call `load_refiner` when a refine stage needs it.
    """
    info = inspect_checkpoint(folder)
    wanted = list(components)
    for name in wanted:
        if name not in COMPONENTS:
            raise ValueError(f"unknown component {name!r}; expected some of {COMPONENTS}")
    chosen = {**default_dtypes(device), **(dtypes or {})}
    loaded = {name: load_component(info.folder, name, dtype=chosen.get(name),
                                   attn_implementation=attn_implementation) for name in wanted}
    return LoadedCheckpoint(info, loaded)


# -- student transformers -----------------------------------------------------------------------

# Config keys that record where or with what a model was saved, not what it is.
_PROVENANCE_KEYS = ("_name_or_path", "_diffusers_version", "_commit_hash", "_use_default_values")


def inspect_student(folder: str | os.PathLike, base: CheckpointInfo) -> tuple[Path, str, list[Path]]:
    """Validate a student DiT (e.g. a DMD-distilled one) that replaces `base`'s `transformer/`.

    `folder` is either a checkpoint-like folder with a `transformer/` subfolder (the other
    components, if present, are ignored: the base's are used) or the transformer folder itself.
    Its config must describe the same architecture as the base transformer; anything else is not a
    student of this checkpoint. Returns (root, subfolder, weight files) for `load_transformer`.
    """
    path = Path(folder).expanduser()
    if not path.is_dir():
        raise CheckpointError(f"student transformer folder {path} does not exist")
    if (path / "transformer" / "config.json").is_file():
        root, sub = path, "transformer"
    elif (path / "config.json").is_file():
        root, sub = path.parent, path.name
    else:
        raise CheckpointError(f"{path} holds no transformer: expected {path / 'transformer' / 'config.json'} "
                              f"(a student checkpoint folder) or {path / 'config.json'} (its transformer folder)")
    config = _check_config_class(root / sub, "transformer")
    differs = sorted(k for k in set(config) | set(base.transformer_config)
                     if k not in _PROVENANCE_KEYS and config.get(k) != base.transformer_config.get(k))
    if differs:
        k = differs[0]
        raise CheckpointError(
            f"the student transformer in {root / sub} is not the base checkpoint's architecture "
            f"({len(differs)} config fields differ, e.g. {k}: {config.get(k)!r} vs {base.transformer_config.get(k)!r} "
            f"in {base.folder / 'transformer'}); load it with its own base checkpoint")
    return root, sub, _weight_files(root / sub, "transformer")
