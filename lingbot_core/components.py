"""The component table: what each part of a LingBot-Video checkpoint is, read by everything that
needs to know (the folder checks, the resolver, the loaders, the handle, the estimates).

A leaf module: it names things and imports nothing of the package. A new component is one row.

Each row says where the component lives in a diffusers checkpoint folder (its subfolder, config
file and the stem of its weights files), what `model_index.json` may call it, whether its weights
may be stored quantized (fp8 / GGUF: the DiTs only), whether disk-backed offload may leave it in its
file, the prefix a LoRA file uses to name it, and which single files can stand in for it
(`PipelineHandle.open(files=...)`, `resolve`). `loader` is the role a loading function is
registered under (`checkpoints.inspection.FILE_ROUTES`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from pathlib import Path


@dataclass(frozen=True)
class Component:
    name: str
    role: str  # "dit", "vae", "text_encoder", "processor", "scheduler": which loader builds it
    config_file: str | None  # inside its subfolder; None: it has no config of its own
    config_classes: tuple[str, ...] = ()  # accepted `_class_name` of that config (empty: not checked)
    weight_stem: str | None = None  # `<stem>.safetensors` / `<stem>.safetensors.index.json`; None: no weights
    index_classes: tuple[tuple[str, str], ...] = ()  # (library, class) model_index.json may list it as
    in_model_index: bool = True  # the refiner is not listed there: it is found by its folder
    quantizable: bool = False  # may be stored as pre-quantized fp8 or GGUF, or quantized on load
    may_stream: bool = False  # disk-backed offload may leave its stored tensors in the file
    lora_prefix: str | None = None  # the key prefix a LoRA file names it with
    cuda_dtype: str = "float32"  # its default dtype on a CUDA device (everything is float32 on CPU)
    file_suffixes: tuple[str, ...] = ()  # single files that may stand in for its folder
    loader: str = ""  # the role a loading function is registered under

    @property
    def is_dit(self) -> bool:
        return self.role == "dit"


# The component names, for code that means one component (the table's rows are named with them).
TRANSFORMER = "transformer"  # the base DiT
REFINER = "refiner"  # the MoE refiner DiT
VAE = "vae"
TEXT_ENCODER = "text_encoder"
PROCESSOR = "processor"
SCHEDULER = "scheduler"

_DIT_CLASS = "LingBotVideoTransformer3DModel"

TABLE: dict[str, Component] = {c.name: c for c in (
    Component(TRANSFORMER, "dit", "config.json", (_DIT_CLASS,), "diffusion_pytorch_model",
              (("lingbot_video.transformer_lingbot_video", _DIT_CLASS),), quantizable=True, may_stream=True,
              lora_prefix="transformer.", cuda_dtype="bfloat16", file_suffixes=(".safetensors", ".gguf"),
              loader="dit"),
    Component(VAE, "vae", "config.json", ("AutoencoderKLWan",), "diffusion_pytorch_model",
              (("diffusers", "AutoencoderKLWan"),), loader="vae"),
    Component(TEXT_ENCODER, "text_encoder", "config.json", (), "model",
              (("transformers", "Qwen3VLForConditionalGeneration"),), cuda_dtype="bfloat16", loader="text_encoder"),
    Component(PROCESSOR, "processor", None, index_classes=(("transformers", "Qwen3VLProcessor"),),
              loader="processor"),
    Component(SCHEDULER, "scheduler", "scheduler_config.json",
              ("FlowUniPCMultistepScheduler", "FlowUniPCScheduler"),  # the reference's name, and ours
              index_classes=(("lingbot_video.scheduling_flow_unipc", "FlowUniPCMultistepScheduler"),),
              loader="scheduler"),
    Component(REFINER, "dit", "config.json", (_DIT_CLASS,), "diffusion_pytorch_model", in_model_index=False,
              quantizable=True, may_stream=True, lora_prefix="refiner.", cuda_dtype="bfloat16",
              file_suffixes=(".safetensors", ".gguf"), loader="dit"),
)}

# Read from the table, never retyped.
INDEXED = tuple(n for n, c in TABLE.items() if c.in_model_index)  # what model_index.json must list
DITS = tuple(n for n, c in TABLE.items() if c.is_dit)
WEIGHTED = tuple(n for n, c in TABLE.items() if c.weight_stem is not None)  # components with weights files
ALL = tuple(TABLE)


def component(name: str) -> Component:
    """The row of `name`; an unknown name is a ValueError listing the known ones."""
    try:
        return TABLE[name]
    except KeyError:
        raise ValueError(f"unknown component {name!r}; expected one of {', '.join(TABLE)}") from None


@dataclass(frozen=True)
class ComponentFiles:
    """Single files standing in for components (`PipelineHandle.open(folder, files=...)`).

    With a checkpoint folder, each file given overrides that folder's component; without one, every
    component a run needs must be given. `transformer` / `refiner`: a DiT `.safetensors` or `.gguf`
    (`checkpoints.dit_file`). `vae`, `text_encoder`: single files, resolved by the route registered for
    their role in `checkpoints.inspection.FILE_ROUTES` (one row each). `processor`: a folder holding the
    tokenizer and processor configs.
    """

    transformer: str | os.PathLike | None = None
    refiner: str | os.PathLike | None = None
    vae: str | os.PathLike | None = None
    text_encoder: str | os.PathLike | None = None
    processor: str | os.PathLike | None = None

    def given(self) -> dict[str, Path]:
        """Component name -> path, for the slots that hold one (empty strings count as not given)."""
        out = {}
        for slot in fields(self):
            name, value = slot.name, getattr(self, slot.name)
            if value is not None and str(value).strip():
                out[name] = Path(value).expanduser()
        return out
