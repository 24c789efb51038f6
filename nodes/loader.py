"""Loader, offload and release: the nodes that make and manage the shared pipeline handle."""

from __future__ import annotations

from pathlib import Path

from . import runtime
from .types import ANY, PIPE

TINY = {"tiny (built-in dense)": "dense", "tiny (built-in moe)": "moe"}
DTYPES = {"auto": None, "bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
WEIGHTS = ["auto", "fp8_e4m3"]
ATTENTION = ["default", "native", "_native_math", "_native_flash", "_native_efficient", "flash", "sage",
             "xformers"]


def checkpoint_choices() -> list[str]:
    names = list(TINY)
    for root in runtime.model_roots():
        if root.is_dir():
            names += sorted(p.name for p in root.iterdir() if (p / "model_index.json").is_file())
    return list(dict.fromkeys(names))


def resolve_checkpoint(choice: str, path: str = "") -> Path:
    from lingbot_core.tiny import ensure_tiny_checkpoint

    if path.strip():
        return Path(path.strip()).expanduser()
    if choice in TINY:
        return ensure_tiny_checkpoint(TINY[choice])
    for root in runtime.model_roots():
        if (root / choice / "model_index.json").is_file():
            return root / choice
    raise ValueError(f"checkpoint {choice!r} not found under {', '.join(map(str, runtime.model_roots()))}")


class LingBotLoader:
    """Validates a checkpoint and returns a handle; components load when a stage first needs them."""

    CATEGORY = "LingBot-Video"
    RETURN_TYPES = (PIPE,)
    RETURN_NAMES = ("pipe",)
    FUNCTION = "load"

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "checkpoint": (checkpoint_choices(), {"default": next(iter(TINY))}),
                "variant": (["auto", "dense", "moe"], {"default": "auto"}),
                "dtype": (list(DTYPES), {"default": "auto", "tooltip": "auto: the DiT as stored (bf16 for the published "
                                                                       "checkpoints); text encoder bf16 on GPU, fp32 on CPU"}),
                "attention": (ATTENTION, {"default": "default"}),
            },
            "optional": {
                "path": ("STRING", {"default": "", "tooltip": "a checkpoint folder; overrides the combo"}),
                "device": (["auto", "cuda", "cpu"], {"default": "auto"}),
                "weights": (WEIGHTS, {"default": "auto", "tooltip": "auto: as stored (bf16, pre-quantized fp8, or a "
                                      "transformer/*.gguf); fp8_e4m3: quantize the DiT's weights on load"}),
            },
        }

    def load(self, checkpoint, variant, dtype, attention, path="", device="auto", weights="auto"):
        import torch

        from lingbot_core.handle import PipelineHandle

        runtime.install_memory_cooperation()
        folder = resolve_checkpoint(checkpoint, path)
        chosen = None if device == "auto" else device
        dtypes = {"transformer": None, "refiner": None}  # auto: the DiTs as stored
        if DTYPES[dtype] is not None:
            dt = getattr(torch, DTYPES[dtype])
            dtypes = {"transformer": dt, "refiner": dt, "text_encoder": dt}
        handle = PipelineHandle.open(folder, device=chosen, dtypes=dtypes, weights=weights,
                                     attention_backend=None if attention == "default" else attention)
        if variant != "auto" and handle.variant != variant:
            raise ValueError(f"{folder} is a {handle.variant} checkpoint, but the loader asks for {variant}")
        return (handle,)


class LingBotOffload:
    """Returns a view of the pipe with its own offload settings, applied when a stage enters."""

    CATEGORY = "LingBot-Video"
    RETURN_TYPES = (PIPE,)
    RETURN_NAMES = ("pipe",)
    FUNCTION = "configure"

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "pipe": (PIPE,),
                "mode": (["auto", "none", "model", "sequential", "group"], {
                    "default": "auto",
                    "tooltip": "auto: the fastest mode expected to fit the free GPU memory for the size below"}),
            },
            "optional": {
                "use_stream": ("BOOLEAN", {"default": True, "tooltip": "group: prefetch on a CUDA stream"}),
                "low_cpu_mem_usage": ("BOOLEAN", {"default": False, "tooltip": "group: pin on the fly"}),
                "num_blocks_per_group": ("INT", {"default": 1, "min": 1, "max": 64}),
                "plan_width": ("INT", {"default": 832, "min": 16, "max": 4096, "step": 16,
                                       "tooltip": "auto: the video size to plan for"}),
                "plan_height": ("INT", {"default": 480, "min": 16, "max": 4096, "step": 16}),
                "plan_frames": ("INT", {"default": 121, "min": 1, "max": 1025, "step": 4}),
                "plan_refine": ("BOOLEAN", {"default": True, "tooltip": "auto: include the 1088x1920 refiner (MoE)"}),
            },
        }

    def configure(self, pipe, mode, use_stream=True, low_cpu_mem_usage=False, num_blocks_per_group=1,
                  plan_width=832, plan_height=480, plan_frames=121, plan_refine=True):
        from lingbot_core.offload import configure_offload

        options = {}
        if mode == "group":
            options = dict(use_stream=bool(use_stream) and pipe.device.type == "cuda",
                           low_cpu_mem_usage=bool(low_cpu_mem_usage), num_blocks_per_group=int(num_blocks_per_group))
        elif mode == "auto":
            options = dict(width=int(plan_width), height=int(plan_height), num_frames=int(plan_frames),
                           refine=(1088, 1920) if plan_refine and pipe.variant == "moe" else None)
        return (configure_offload(pipe, mode, **options),)


class LingBotMemoryReport:
    """Where each component lives now (GPU, pinned CPU, CPU, meta, not loaded) and its size."""

    CATEGORY = "LingBot-Video"
    RETURN_TYPES = (ANY, "STRING")
    RETURN_NAMES = ("value", "report")
    FUNCTION = "report"
    OUTPUT_NODE = True

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"pipe": (PIPE,), "value": (ANY, {"tooltip": "report after this has been computed"})}}

    def report(self, pipe, value):
        from lingbot_core.memory import memory_report

        text = str(memory_report(pipe))
        return {"ui": {"text": [text]}, "result": (value, text)}


class LingBotRelease:
    """Frees the pipe's components (hooks first) after `value` is computed; passes `value` through."""

    CATEGORY = "LingBot-Video"
    RETURN_TYPES = (ANY,)
    RETURN_NAMES = ("value",)
    FUNCTION = "release"

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "pipe": (PIPE,),
                "value": (ANY, {"tooltip": "wire the last output here: release runs after it"}),
                "what": (["all", "base transformer", "refiner", "text encoder"], {"default": "all"}),
            }
        }

    def release(self, pipe, value, what="all"):
        from lingbot_core.offload import release

        names = {"all": None, "base transformer": ["transformer"], "refiner": ["refiner"],
                 "text encoder": ["text_encoder"]}[what]
        release(pipe, names)
        return (value,)
