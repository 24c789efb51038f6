"""The offload issue's GPU benchmark: TI2V at full model size under every offload mode, one table.

The quick GPU check of a machine (every mode's peak against the estimate on a real-width DiT, kernels,
bandwidth, disk, the recipe row) is `python -m lingbot_core.doctor`; run it first. This script is the
longer end-to-end benchmark: the whole pipeline at full size against the published figures.

Why: CPU runs prove offload is correct (identical frames, hooks in place) but not that it saves
memory or time; that needs an accelerator and full-size weights. This script builds random-weight
components from the real configs (dense DiT 1.36 B from `lingbot_core/configs/dense-1.3b.transformer.json`,
Qwen3-VL-4B from the geometry in `reference-model.md` §7, the diffusers-default Wan VAE), wraps them
in one handle, and runs TI2V 320x192x49 (W x H x frames) under none / model / sequential / group on
views of the SAME components (nothing is released between modes). It reports wall time, peak
accelerator memory, ratios to `none`, the pixel difference to `none`, the published baseline and
the issue's targets, each marked PASS/FAIL. After each mode (on CUDA, or with --fault-checks) it
cancels one run and breaks another inside a DiT block, and checks that the allocated memory is back
at the mode's clean level and that a rerun gives the same frames.

Nothing is downloaded: the processor (tokenizer + image processor) and the scheduler come from the
tiny checkpoint built locally (its ids stay below Qwen's 151936-token vocabulary).

Weights are built on the `meta` device and materialised with `to_empty` on the execution device,
then filled in place with small seeded normal values (bf16 DiT and text encoder, fp32 VAE on CUDA,
as `checkpoint.default_dtypes`); the text encoder's rotary tables (non-persistent buffers) are
recomputed by transformers' own `_init_weights`.

    python bench/offload_gpu.py                       # CUDA, 40 steps, all modes (estimated 2-4 min on an H200; never run yet: no GPU so far)
    python bench/offload_gpu.py --steps 10 --modes none,group
    python bench/offload_gpu.py --tiny                # CPU, tiny checkpoint sizes (< 30 s)
    python bench/offload_gpu.py --dit-weights bf16,fp8,gguf-q8_0,gguf-q4_0   # + a row per mode x DiT format (never run on a GPU yet)

`--dit-weights`: each mode also runs with the DiT held as fp8 or GGUF. The random DiT is saved once
to a temporary safetensors folder, each format is written from it by `lingbot_core.quantize`'s
writers and loaded by `weights.loader.load_dit`, then swapped into the same handle (text encoder and
VAE stay the same objects). Those rows report time and peak relative to the bf16 row of the same
mode, the pixel difference to the same format's `none` row (must be 0) and to bf16 `none`; for the
quantized formats, sequential and group also run with `offload_to=disk` (the DiT loaded streamed,
its weights left in the quantized file).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import json
import math
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python bench/x.py` from a plain checkout
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never download: everything is built here
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch

from bench._common import environment, fmt, max_abs_diff, print_machine, table, write_json
from lingbot_core.placement.modes import MODE_ORDER

ROOT = Path(__file__).resolve().parents[1]
DENSE_CONFIG = ROOT / "lingbot_core" / "configs" / "dense-1.3b.transformer.json"
MODES = tuple(MODE_ORDER)  # every registered offload mode, fastest first
DIT_WEIGHTS = ("bf16", "fp8", "gguf-q8_0", "gguf-q4_0")
DISK_MODES = ("sequential", "group")  # the modes whose CPU home can be the checkpoint file

# The published LingBot offload fix (offload.md §5): 24 GB card, TI2V 320x192x49, 40 steps.
PUBLISHED = {"none": (56.5, 14.3), "model": (68.0, 9.9), "sequential": (96.0, 1.78)}  # seconds, GB
GROUP_PEAK_VS_SEQUENTIAL = 1.5
GROUP_TIME_VS_NONE = 1.15

# Qwen3-VL-4B geometry (reference-model.md §7); token ids come from the processor's tokenizer.
QWEN3_VL_4B_TEXT = {
    "vocab_size": 151936, "hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "hidden_act": "silu",
    "max_position_embeddings": 262144, "rms_norm_eps": 1e-6, "attention_bias": False, "tie_word_embeddings": True,
    "rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [24, 20, 20],
                        "mrope_interleaved": True},
}
QWEN3_VL_4B_VISION = {
    "depth": 24, "hidden_size": 1024, "intermediate_size": 4096, "num_heads": 16, "in_channels": 3,
    "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2, "out_hidden_size": 2560,
    "num_position_embeddings": 2304, "deepstack_visual_indexes": [5, 11, 17], "hidden_act": "gelu_pytorch_tanh",
}
# diffusers AutoencoderKLWan defaults = the Wan 2.1 VAE (reference-model.md §9); about 127 M parameters.
WAN_VAE = {"base_dim": 96, "z_dim": 16, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2,
           "temperal_downsample": [False, True, True]}

PROMPT = ('{"caption": {"comprehensive_description": {"scene_content_description": "A small red boat drifts on a '
          'calm lake at dawn, mist over the water, pine forest on the far shore.", "camera_movement_description": '
          '"slow pan left"}, "camera_info": {"shot": "wide shot", "lens": "35mm"}}, "duration": 5}')
FULL_GEOMETRY = {"height": 192, "width": 320, "num_frames": 49}
TINY_GEOMETRY = {"height": 32, "width": 64, "num_frames": 9}


# -- building random-weight components ---------------------------------------------------------------

def _seed(seed: int, component: str, name: str) -> int:
    digest = hashlib.sha256(f"bench-offload/{seed}/{component}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


@torch.no_grad()
def fill_random_(model: torch.nn.Module, seed: int, component: str) -> None:
    """Fill every parameter (and persistent float buffer) in place, on its own device, seeded per tensor.

    The tiny checkpoint's rules: matrices normal/sqrt(fan_in), embeddings 0.5*normal, norm gains
    1+0.1*normal, biases and the DiT's scale_shift_table 0.1/0.05*normal. Noise is drawn in fp32 on
    the tensor's device (fast on a GPU) and cast into the parameter's dtype.
    """
    nn = torch.nn
    seen: set[int] = set()
    for module_name, module in model.named_modules():
        prefix = f"{module_name}." if module_name else ""
        for name, param in module.named_parameters(recurse=False):
            if id(param) in seen:  # tied weights
                continue
            seen.add(id(param))
            full = prefix + name
            g = torch.Generator(device=param.device).manual_seed(_seed(seed, component, full))
            noise = torch.randn(param.shape, generator=g, device=param.device, dtype=torch.float32)
            if name == "scale_shift_table":
                value = 0.1 * noise
            elif name == "bias":
                value = 0.05 * noise
            elif name in ("gamma",) or (name == "weight" and param.ndim == 1):
                value = 1.0 + 0.1 * noise
            elif isinstance(module, nn.Embedding):
                value = 0.5 * noise
            else:
                fan_in = math.prod(param.shape[1:]) if isinstance(module, nn.modules.conv._ConvNd) else param.shape[-1]
                value = noise / math.sqrt(fan_in)
            param.copy_(value)
            del noise, value
        for name, buf in module.named_buffers(recurse=False):
            if name == "e_score_correction_bias":
                g = torch.Generator(device=buf.device).manual_seed(_seed(seed, component, prefix + name))
                buf.copy_(0.1 * torch.randn(buf.shape, generator=g, device=buf.device, dtype=torch.float32))


def materialise(model: torch.nn.Module, device: torch.device, seed: int, component: str) -> torch.nn.Module:
    """meta -> `device` without a CPU copy or an init pass, then random values in place."""
    if device.type != "meta":
        model.to_empty(device=device)
        fill_random_(model, seed, component)
    return model.eval().requires_grad_(False)


def _cast_params_(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Cast parameters only (on meta: free); buffers such as rotary tables keep float32, as from_pretrained does."""
    for p in model.parameters():
        if p.is_floating_point():
            p.data = p.data.to(dtype)


def build_transformer(config: dict[str, Any], device: torch.device, dtype: torch.dtype, seed: int):
    from lingbot_core.models.transformer import LingBotVideoTransformer3DModel

    with torch.device("meta"):
        model = LingBotVideoTransformer3DModel.from_config({k: v for k, v in config.items() if not k.startswith("_")})
    if dtype != torch.float32:
        model.to(dtype)  # our override keeps precision.FLOAT32_NAMES in float32 (on meta this only changes dtypes)
    return materialise(model, device, seed, "transformer")


def qwen_config(text: dict[str, Any], vision: dict[str, Any], tokenizer: Any):
    from transformers import Qwen3VLConfig

    ids = {k: tokenizer.convert_tokens_to_ids(t) for k, t in (
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"))}
    text = {**text, "pad_token_id": tokenizer.convert_tokens_to_ids("<|endoftext|>"),
            "eos_token_id": tokenizer.convert_tokens_to_ids("<|im_end|>"), "bos_token_id": None}
    return Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True, **ids)


def build_text_encoder(config: Any, device: torch.device, dtype: torch.dtype, seed: int):
    from transformers import Qwen3VLForConditionalGeneration

    with torch.device("meta"):
        model = Qwen3VLForConditionalGeneration(config)
    _cast_params_(model, dtype)
    if device.type == "meta":  # dry run
        return model.eval().requires_grad_(False)
    model.to_empty(device=device)
    # to_empty leaves the non-persistent rotary tables uninitialised: recompute them the way
    # transformers does after a meta-device load.
    for module in model.modules():
        if "RotaryEmbedding" in type(module).__name__ and hasattr(module, "original_inv_freq"):
            model._init_weights(module)
    fill_random_(model, seed, "text_encoder")
    if model.get_output_embeddings() is not None and model.config.tie_word_embeddings:
        model.tie_weights()
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation("sdpa")
    return model.eval().requires_grad_(False)


def build_vae(config: dict[str, Any], device: torch.device, dtype: torch.dtype, seed: int):
    from diffusers import AutoencoderKLWan

    with torch.device("meta"):
        vae = AutoencoderKLWan(**{k: v for k, v in config.items() if not k.startswith("_")})
    if dtype != torch.float32:
        vae.to(dtype)
    materialise(vae, device, seed, "vae")
    if device.type == "meta":
        return vae
    with torch.no_grad():  # posterior log-variance around -4, as the tiny checkpoint (encodes near their mean)
        z = vae.config.z_dim
        vae.quant_conv.bias[z:] = -4.0
    return vae


def check_buffers(built: torch.nn.Module, reference: torch.nn.Module) -> float:
    """Largest difference between the buffers of a meta-built model and a normally constructed one."""
    ref = dict(reference.named_buffers())
    worst = 0.0
    for name, buf in built.named_buffers():
        if name == "e_score_correction_bias":
            continue
        worst = max(worst, max_abs_diff(buf.detach().cpu().float(), ref[name].float()))
    return worst


def build_components(tiny: Path, *, full: bool, device: torch.device, seed: int,
                     dtypes: dict[str, torch.dtype]) -> tuple[dict[str, Any], dict[str, Any]]:
    """All five components (random weights) plus facts about them (sizes, build times, buffer check).

    On the `meta` device nothing is allocated: that is the dry run (sizes and config checks only).
    """
    from lingbot_core.checkpoints.loading import load_component

    info: dict[str, Any] = {"dtypes": {k: str(v).replace("torch.", "") for k, v in dtypes.items()}}
    processor = load_component(tiny, "processor")
    scheduler = load_component(tiny, "scheduler")
    if full:
        dit_config = json.loads(DENSE_CONFIG.read_text())
        te_config = qwen_config(QWEN3_VL_4B_TEXT, QWEN3_VL_4B_VISION, processor.tokenizer)
        vae_config = dict(WAN_VAE)
    else:
        from transformers import Qwen3VLConfig

        dit_config = json.loads((tiny / "transformer" / "config.json").read_text())
        te_config = Qwen3VLConfig.from_pretrained(tiny / "text_encoder")
        vae_config = json.loads((tiny / "vae" / "config.json").read_text())

    components: dict[str, Any] = {"processor": processor, "scheduler": scheduler}
    for name, build, config in (("transformer", build_transformer, dit_config),
                                ("text_encoder", build_text_encoder, te_config),
                                ("vae", build_vae, vae_config)):
        t0 = time.perf_counter()
        components[name] = build(config, device, dtypes[name], seed)
        if device.type == "cuda":
            torch.cuda.synchronize()
        module = components[name]
        info[name] = {"params": sum(p.numel() for p in module.parameters()),
                      "bytes": sum(p.numel() * p.element_size() for p in module.parameters()),
                      "build_s": time.perf_counter() - t0}
    if not full and device.type != "meta":  # cheap at tiny size: the meta path must give the buffers a normal construction gives
        from transformers import Qwen3VLForConditionalGeneration

        info["text_encoder"]["buffer_max_diff"] = check_buffers(
            components["text_encoder"], Qwen3VLForConditionalGeneration(te_config))
    return components, info


# -- running -----------------------------------------------------------------------------------------

def test_image(width: int, height: int):
    """A deterministic first frame: gradients plus a disc, so the VAE and vision tower see structure."""
    import numpy as np
    from PIL import Image

    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    r = np.clip(x / max(width - 1, 1), 0, 1)
    g = np.clip(y / max(height - 1, 1), 0, 1)
    b = ((x - width * 0.6) ** 2 + (y - height * 0.4) ** 2 < (min(width, height) * 0.25) ** 2).astype(np.float32)
    return Image.fromarray((np.stack([r, g, b], -1) * 255).astype(np.uint8))


@contextlib.contextmanager
def stage_timer(times: dict[str, float], device: torch.device) -> Iterator[None]:
    """Time the stages `stages.generate` calls, without changing what it calls (wrappers, restored after)."""
    from lingbot_core import stages

    names = {"encode_image": "image", "encode_prompt": "text", "denoise": "denoise", "decode": "decode"}
    originals = {n: getattr(stages, n) for n in names}

    def wrap(fn, key):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if device.type == "cuda":
                    torch.cuda.synchronize()
                times[key] = times.get(key, 0.0) + time.perf_counter() - start
        return timed

    try:
        for n, key in names.items():
            setattr(stages, n, wrap(originals[n], key))
        yield
    finally:
        for n, fn in originals.items():
            setattr(stages, n, fn)


def _clear(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def run_mode(base, mode: str, options: dict[str, Any], request: dict[str, Any], device: torch.device,
             offload_to: str = "ram") -> dict[str, Any]:
    from lingbot_core import stages
    from lingbot_core.placement.door import configure_offload

    t0 = time.perf_counter()
    view = configure_offload(base, mode, offload_to=offload_to, **options)
    install = time.perf_counter() - t0
    _clear(device)
    resident = torch.cuda.memory_allocated() if device.type == "cuda" else None
    times: dict[str, float] = {}
    t0 = time.perf_counter()
    with stage_timer(times, device):
        result = stages.generate(view, PROMPT, **request)
    if device.type == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
    reserved = torch.cuda.max_memory_reserved() if device.type == "cuda" else None
    return {"mode": mode, "options": options, "install_s": install, "time_s": wall, "stages_s": times,
            "peak_bytes": peak, "peak_reserved_bytes": reserved, "start_allocated_bytes": resident,
            "estimate_bytes": estimated_peak(base, mode, request), "frames": result.frames}


class InjectedFault(Exception):
    """Raised on purpose inside a run (a cancel from the step callback, an error in a DiT block)."""


def _allocated(device: torch.device) -> int | None:
    gc.collect()
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def fault_check(base, mode: str, options: dict[str, Any], request: dict[str, Any],
                device: torch.device) -> dict[str, Any]:
    """A cancel mid-denoise, then an error inside a DiT block: after each, the allocated device memory
    is back at the mode's clean level (what a finished run leaves), and a rerun gives the same frames."""
    from lingbot_core import stages
    from lingbot_core.placement.door import configure_offload

    view = configure_offload(base, mode, **options)
    short = {**request, "steps": min(int(request["steps"]), 2)}
    clean_frames = stages.generate(view, PROMPT, **short).frames
    clean = _allocated(device)
    out: dict[str, Any] = {"clean_allocated_bytes": clean}

    def cancel(step: int, total: int, latents: torch.Tensor) -> None:
        raise InjectedFault("cancelled at the first step")

    def fail(_module, _args):
        raise InjectedFault("error inside a DiT block")

    for kind in ("cancel", "error"):
        hook = base.component("transformer").blocks[0].register_forward_pre_hook(fail) if kind == "error" else None
        try:
            stages.generate(view, PROMPT, **short, callback=cancel if kind == "cancel" else None)
            raised = False
        except InjectedFault:
            raised = True
        finally:
            if hook is not None:
                hook.remove()
        after = _allocated(device)
        rerun = stages.generate(view, PROMPT, **short).frames
        out[kind] = {"raised": raised, "allocated_after_bytes": after,
                     "back_to_clean": None if after is None else after <= clean + 2**20,
                     "rerun_equal": bool(torch.equal(rerun, clean_frames))}
    return out


def estimated_peak(base, mode: str, request: dict[str, Any]) -> int:
    """lingbot_core.placement's estimate for this request (what `auto` decides with)."""
    from lingbot_core.placement.estimate import Geometry, ModelSizes, estimate_peak

    sizes = ModelSizes.from_modules(base.shared.loaded)
    geometry = Geometry(height=request["height"], width=request["width"], num_frames=request["num_frames"],
                        cfg=request.get("guidance_scale", 3.0) > 1)
    return estimate_peak(mode, sizes, geometry)


# -- the DiT in other weight formats ---------------------------------------------------------------

def save_plain_dit(dit: torch.nn.Module, folder: Path) -> Path:
    """`folder/transformer/` as a checkpoint's DiT folder (config + one safetensors file): the source
    every quantized copy is written from. Returns `folder`."""
    from safetensors.torch import save_file

    sub = folder / "transformer"
    sub.mkdir(parents=True, exist_ok=True)
    dit.save_config(sub)
    save_file({k: v.detach().to("cpu").contiguous() for k, v in dit.state_dict().items()},
              str(sub / "diffusion_pytorch_model.safetensors"))
    return folder


def write_format(plain: Path, fmt: str, folder: Path) -> Path:
    """`folder/transformer/` holding the plain DiT in `fmt`, written by the project's quantize writers."""
    import shutil

    from lingbot_core.quantize import write_fp8, write_gguf
    from lingbot_core.weights.sources import SafetensorsSource

    sub = folder / "transformer"
    sub.mkdir(parents=True, exist_ok=True)
    shutil.copy2(plain / "transformer" / "config.json", sub / "config.json")
    source = SafetensorsSource([plain / "transformer" / "diffusion_pytorch_model.safetensors"])
    try:
        if fmt == "fp8":
            write_fp8(source, sub / "diffusion_pytorch_model.safetensors")
        else:
            write_gguf(source, sub / "diffusion_pytorch_model.gguf", fmt.split("-", 1)[1].upper())
    finally:
        source.close()
    return folder


def load_format(folder: Path, dtype: torch.dtype, *, streamed: bool = False) -> tuple[torch.nn.Module, Any]:
    """The DiT of a `write_format` folder, loaded as the handle would (`checkpoint.load_transformer`), and
    its `ModelState` (disk homes and the like)."""
    from lingbot_core.checkpoints.loading import load_transformer
    from lingbot_core.weights.state import ModelState

    state = ModelState()
    return load_transformer(folder, "transformer", dtype=dtype, streamed=streamed, state=state), state


def use_dit(base, dit: torch.nn.Module, state: Any = None) -> None:
    """Make `dit` (and its `ModelState`) the handle's DiT: every placement taken off first (components back
    to the CPU), then the attention backend set as `SharedComponents.get` sets it on a loaded DiT."""
    shared = base.shared
    with shared.lock:
        shared.placement.uninstall_all(shared.loaded)
        dit.set_attention_backend(shared.attention_backend)
        shared.loaded["transformer"] = dit
        if state is not None:
            shared.states["transformer"] = state
        else:  # none known: a fresh one is made when something needs it
            shared.states.pop("transformer", None)


def weight_ratios(weight_rows: list[dict[str, Any]], rows: dict[str, dict[str, Any]], on_gpu: bool) -> None:
    """Each format row against the bf16 row of the same mode (time, peak) and its format's `none` row
    (pixels must match: offload never changes the arithmetic), in place."""
    for row in weight_rows:
        if "error" in row:
            row["checks"] = [("ran", False)]
            continue
        bf16 = rows.get(row["mode"])
        if bf16 is not None and "error" not in bf16:
            row["time_vs_bf16"] = row["time_s"] / bf16["time_s"]
            row["peak_vs_bf16"] = row["peak_bytes"] / bf16["peak_bytes"] if on_gpu else None
        row["checks"] = [("pixels == same-format none", None if row.get("max_abs_diff") is None
                          else row["max_abs_diff"] == 0.0)]


def parse_size(text: str) -> tuple[int, int, int]:
    try:
        h, w, f = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected HxWxFRAMES, got {text!r}") from None
    return h, w, f


def estimate(info: dict[str, Any], steps: int) -> dict[str, Any]:
    """What sequential offload has to stream (bytes) and the time that takes at typical host-link speeds."""
    forwards = 2 * steps  # CFG runs the DiT twice per step
    dit, te = info["transformer"]["bytes"], info["text_encoder"]["bytes"]
    streamed = forwards * dit + 2 * te  # two prompt encodes
    return {"dit_forwards": forwards, "sequential_stream_bytes": streamed,
            **{f"sequential_stream_s_at_{bw}GBps": streamed / (bw * 1e9) for bw in (5, 12, 25)}}


def verdicts(rows: dict[str, dict[str, Any]], on_gpu: bool) -> None:
    """Attach the issue's targets and PASS/FAIL to each measured row (in place)."""
    none = rows.get("none")
    for mode, row in rows.items():
        checks: list[tuple[str, bool | None]] = []
        if "error" in row:
            row["checks"] = [("ran", False)]
            continue
        if none is not None and "error" not in none:
            row["time_ratio"] = row["time_s"] / none["time_s"]
            row["peak_ratio"] = row["peak_bytes"] / none["peak_bytes"] if on_gpu else None
            checks.append(("pixels == none", row["max_abs_diff"] == 0.0))
        if mode in ("model", "sequential") and none is not None and "error" not in none:
            pub_t, pub_m = PUBLISHED[mode][0] / PUBLISHED["none"][0], PUBLISHED[mode][1] / PUBLISHED["none"][1]
            row["target"] = f"time x{pub_t:.3f}, peak x{pub_m:.3f} of none (published)"
            checks.append((f"time <= x{pub_t:.3f}", row["time_ratio"] <= pub_t if on_gpu else None))
            checks.append((f"peak <= x{pub_m:.3f}", row["peak_ratio"] <= pub_m if on_gpu else None))
        if mode == "group":
            seq = rows.get("sequential")
            row["target"] = (f"peak <= {GROUP_PEAK_VS_SEQUENTIAL}x sequential's, time <= {GROUP_TIME_VS_NONE}x none's")
            ok_peak = None
            if on_gpu and seq is not None and "error" not in seq:
                ok_peak = row["peak_bytes"] <= GROUP_PEAK_VS_SEQUENTIAL * seq["peak_bytes"]
            checks.append((f"peak <= {GROUP_PEAK_VS_SEQUENTIAL}x seq", ok_peak))
            ok_time = row["time_ratio"] <= GROUP_TIME_VS_NONE if on_gpu and "time_ratio" in row else None
            checks.append((f"time <= {GROUP_TIME_VS_NONE}x none", ok_time))
        row["checks"] = checks


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="CPU, tiny checkpoint sizes, small geometry (< 30 s)")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma list of {', '.join(MODES)}")
    p.add_argument("--steps", type=int, default=None, help="denoising steps (default 40; 2 with --tiny)")
    p.add_argument("--warmup-steps", type=int, default=2, help="untimed warm-up run (mode none) before timing; 0 = off")
    p.add_argument("--height", type=int, default=None)
    p.add_argument("--width", type=int, default=None)
    p.add_argument("--frames", type=int, default=None)
    p.add_argument("--budget-s", type=float, default=420.0,
                   help="skip a mode when the run so far plus its estimate would exceed this (seconds)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights (the sampling seed is 42)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: 1 with --tiny, where two OpenMP threads on a busy 2-core "
                        "machine stall for tenths of a second; torch's own otherwise)")
    p.add_argument("--workdir", help="where the tiny checkpoint (processor, scheduler) is built; default a temp folder")
    p.add_argument("--dry-run", action="store_true",
                   help="build the components on `meta` only: check the configs, print sizes and the estimate")
    p.add_argument("--gpu-dtypes", action="store_true",
                   help="with --tiny: use the CUDA dtype policy (bf16 DiT and text encoder) on the CPU")
    p.add_argument("--extra-sizes", default=None,
                   help="comma list of HxWxFRAMES: estimate vs measured peak per mode at more sizes (few steps); "
                        "default 480x832x49 on GPU, 64x64x9 with --tiny")
    p.add_argument("--extra-steps", type=int, default=2, help="steps for the extra sizes (peaks do not depend on it)")
    p.add_argument("--fault-checks", action=argparse.BooleanOptionalAction, default=None,
                   help="after each mode: cancel-then-rerun and error-then-rerun, allocated memory back at the "
                        "mode's clean level (default: on with CUDA, off with --tiny)")
    p.add_argument("--dit-weights", default="bf16",
                   help="comma list of " + ", ".join(DIT_WEIGHTS) + ": every mode also runs with the DiT held in each "
                        "quantized format (written by lingbot_core.quantize, loaded by load_dit); bf16 (the built "
                        "dtype: fp32 with --tiny unless --gpu-dtypes) always runs and is what their ratios use")
    p.add_argument("--disk-rows", action=argparse.BooleanOptionalAction, default=True,
                   help="for the quantized formats, also run sequential and group with offload_to=disk")
    p.add_argument("--out-json", "--json", dest="json", metavar="PATH", help="write the results as JSON")
    args = p.parse_args(argv)
    args.dit_weights = [w.strip() for w in args.dit_weights.split(",") if w.strip()]
    for w in args.dit_weights:
        if w not in DIT_WEIGHTS:
            p.error(f"unknown --dit-weights entry {w!r}; choose from {', '.join(DIT_WEIGHTS)}")
    args.dit_weights = [w for w in DIT_WEIGHTS if w in args.dit_weights and w != "bf16"]  # the quantized ones
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for m in args.modes:
        if m not in MODES:
            p.error(f"unknown mode {m!r}")
    if "none" in args.modes:  # the reference every ratio and diff is taken against runs first
        args.modes = ["none"] + [m for m in args.modes if m != "none"]
    geometry = TINY_GEOMETRY if args.tiny else FULL_GEOMETRY
    args.height = args.height or geometry["height"]
    args.width = args.width or geometry["width"]
    args.frames = args.frames or geometry["num_frames"]
    args.steps = args.steps or (2 if args.tiny else 40)
    extra = args.extra_sizes if args.extra_sizes is not None else ("64x64x9" if args.tiny else "480x832x49")
    args.extra_sizes = [parse_size(t) for t in extra.split(",") if t.strip()]
    if args.threads is None and args.tiny:
        args.threads = 1
    if args.fault_checks is None:
        args.fault_checks = not args.tiny and not args.dry_run
    return args


# A mode's expected time relative to `none`, for the budget guard (generous: H200 host links vary).
BUDGET_FACTOR = {"none": 1.0, "model": 2.0, "sequential": 8.0, "group": 2.0}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from diffusers.utils import logging as d_logging
    from transformers.utils import logging as t_logging

    from lingbot_core import stages
    from lingbot_core.checkpoints.inspection import default_dtypes
    from lingbot_core.handle import PipelineHandle
    from lingbot_core.placement.door import configure_offload
    from lingbot_core.tiny import build_tiny_checkpoint

    started = time.perf_counter()
    if args.threads:
        torch.set_num_threads(args.threads)
    print_machine()
    t_logging.disable_progress_bar()
    d_logging.disable_progress_bar()
    if args.dry_run:
        device = torch.device("meta")
    elif args.tiny:
        device = torch.device("cpu")
    elif torch.cuda.is_available():
        device = torch.device("cuda")
    else:
        raise SystemExit("offload_gpu.py needs CUDA at full size; pass --tiny for the CPU run (or --dry-run)")
    on_gpu = device.type == "cuda"
    dtypes = default_dtypes("cuda" if on_gpu or args.gpu_dtypes or args.dry_run else "cpu")
    options = {"group": {"use_stream": on_gpu}}
    request = dict(mode="ti2v", image=test_image(args.width, args.height), height=args.height, width=args.width,
                   num_frames=args.frames, steps=args.steps, guidance_scale=3.0, seed=42)

    with tempfile.TemporaryDirectory(prefix="lingbot-offload-") as tmp:
        tiny = build_tiny_checkpoint(Path(args.workdir or tmp) / "tiny-dense", "dense", seed=0)
        components, info = build_components(tiny, full=not args.tiny, device=device, seed=args.seed, dtypes=dtypes)
    plan = estimate(info, args.steps)
    print(f"built in {time.perf_counter() - started:.1f} s on {device}: "
          + ", ".join(f"{n} {info[n]['params'] / 1e6:.1f} M params ({info[n]['bytes'] / 1e9:.3f} GB)"
                      for n in ("transformer", "text_encoder", "vae"))
          + f"; sequential will stream ~{plan['sequential_stream_bytes'] / 1e9:.0f} GB "
          f"(~{plan['sequential_stream_s_at_12GBps']:.0f} s at 12 GB/s)", flush=True)
    if args.dry_run:
        return {"benchmark": "offload_gpu", "dry_run": True, "components": info, "estimate": plan,
                "environment": environment()}
    base = PipelineHandle.from_components(components, device=device)

    warmup_s: float | str | None = None
    if args.warmup_steps > 0:  # first CUDA kernels, cuBLAS/cuDNN set-up: not any mode's cost
        t0 = time.perf_counter()
        try:
            stages.generate(configure_offload(base, "none"), PROMPT, **{**request, "steps": args.warmup_steps})
            warmup_s = time.perf_counter() - t0
        except Exception as err:  # the modes below still run and report their own errors
            warmup_s = f"failed: {type(err).__name__}: {err}"
            print(f"warm-up {warmup_s}", flush=True)
            _clear(device)

    rows: dict[str, dict[str, Any]] = {}
    extra_rows: list[dict[str, Any]] = []
    weight_rows: list[dict[str, Any]] = []
    reference: torch.Tensor | None = None

    disk_modes = [m for m in args.modes if m in DISK_MODES] if args.disk_rows else []
    planned_weight_rows = len(args.dit_weights) * (len(args.modes) + len(disk_modes))

    def result() -> dict[str, Any]:
        """The results so far, verdicts included (written after every mode: a killed run keeps its numbers)."""
        done = {m: dict(r) for m, r in rows.items()}
        verdicts(done, on_gpu)
        by_format = [dict(r) for r in weight_rows]
        weight_ratios(by_format, done, on_gpu)
        for row in [*done.values(), *by_format]:
            row["checks"] = [{"check": name, "result": None if ok is None else ("PASS" if ok else "FAIL")}
                             for name, ok in row.get("checks", [])]
        return {
            "benchmark": "offload_gpu",
            "device": str(device), "tiny": args.tiny,
            "geometry": {"height": args.height, "width": args.width, "num_frames": args.frames, "steps": args.steps,
                         "mode": "ti2v", "guidance_scale": 3.0},
            "components": info, "estimate": plan, "warmup_s": warmup_s,
            "published": {m: {"time_s": t, "peak_gb": g} for m, (t, g) in PUBLISHED.items()},
            "rows": list(done.values()),
            "extra_sizes": extra_rows,
            "dit_weights": ["bf16", *args.dit_weights],
            "weight_rows": by_format,
            "complete": len(rows) == len(args.modes) and len(weight_rows) == planned_weight_rows,
            "total_s": time.perf_counter() - started,
            "environment": environment(),
        }

    for mode in args.modes:
        elapsed = time.perf_counter() - started
        if "none" in rows and "time_s" in rows["none"]:
            guess = rows["none"]["time_s"] * BUDGET_FACTOR[mode]
            if elapsed + guess > args.budget_s:
                rows[mode] = {"mode": mode, "error": f"skipped: {elapsed:.0f} s spent + ~{guess:.0f} s expected "
                                                     f"> budget {args.budget_s:.0f} s"}
                print(f"{mode}: {rows[mode]['error']}", flush=True)
                continue
        try:
            row = run_mode(base, mode, options.get(mode, {}), request, device)
        except Exception as err:  # one broken mode must not cost the other modes' numbers
            rows[mode] = {"mode": mode, "error": f"{type(err).__name__}: {err}",
                          "traceback": traceback.format_exc(limit=8)}
            print(f"{mode}: FAILED {rows[mode]['error']}", flush=True)
            _clear(device)
        else:
            frames = row.pop("frames")
            if args.fault_checks:
                try:
                    row["faults"] = fault_check(base, mode, options.get(mode, {}), request, device)
                except Exception as err:
                    row["faults"] = {"failed": f"{type(err).__name__}: {err}"}
                _clear(device)
            if mode == "none":
                reference = frames
            row["frames_finite"] = bool(torch.isfinite(frames).all())
            if reference is not None:
                row["max_abs_diff"] = max_abs_diff(frames, reference)
            rows[mode] = row
            peak = f", peak {row['peak_bytes'] / 1e9:.2f} GB" if row["peak_bytes"] is not None else ""
            print(f"{mode}: {row['time_s']:.1f} s{peak}", flush=True)
        write_json(args.json, result())

    for height, width, frames in args.extra_sizes:  # estimate vs measured peak at more sizes
        sized = {**request, "height": height, "width": width, "num_frames": frames, "steps": args.extra_steps,
                 "image": test_image(width, height)}
        for mode in args.modes:
            if time.perf_counter() - started > args.budget_s:
                extra_rows.append({"size": [height, width, frames], "mode": mode, "error": "skipped: time budget"})
                continue
            try:
                row = run_mode(base, mode, options.get(mode, {}), sized, device)
            except Exception as err:
                extra_rows.append({"size": [height, width, frames], "mode": mode, "error": f"{type(err).__name__}: {err}"})
                _clear(device)
                continue
            row.pop("frames")
            extra_rows.append({"size": [height, width, frames], "mode": mode, "time_s": row["time_s"],
                               "peak_bytes": row["peak_bytes"], "estimate_bytes": row["estimate_bytes"]})
            write_json(args.json, result())

    if args.dit_weights:
        run_formats(args, base, rows, weight_rows, reference, request, options, device, dtypes["transformer"], started,
                    lambda: write_json(args.json, result()))
    return result()


def run_formats(args: argparse.Namespace, base, rows: dict[str, dict[str, Any]], weight_rows: list[dict[str, Any]],
                reference: torch.Tensor | None, request: dict[str, Any], options: dict[str, dict[str, Any]],
                device: torch.device, dtype: torch.dtype, started: float, save) -> None:
    """Every mode again with the DiT in each quantized format (appended to `weight_rows`), loaded with
    compute dtype `dtype` (the built DiT's); the bf16 DiT is back in the handle afterwards."""
    from lingbot_core.placement.door import module_bytes

    plain_dit = base.shared.loaded["transformer"]
    plain_state = base.shared.states.get("transformer")
    with tempfile.TemporaryDirectory(prefix="lingbot-dit-weights-", dir=args.workdir) as tmp:
        use_dit(base, plain_dit, plain_state)  # placements off: the DiT is a plain module on the CPU
        plain = save_plain_dit(plain_dit, Path(tmp) / "bf16")
        disk_modes = [m for m in args.modes if m in DISK_MODES] if args.disk_rows else []
        try:
            for fmt in args.dit_weights:
                t0 = time.perf_counter()
                folder = write_format(plain, fmt, Path(tmp) / fmt)
                written_s = time.perf_counter() - t0
                fmt_reference: torch.Tensor | None = None
                for mode, offload_to in [*((m, "ram") for m in args.modes), *((m, "disk") for m in disk_modes)]:
                    head = {"mode": mode, "weights": fmt, "offload_to": offload_to, "write_s": written_s}
                    none = rows.get("none", {})
                    if "time_s" in none:
                        guess = none["time_s"] * BUDGET_FACTOR[mode]
                        elapsed = time.perf_counter() - started
                        if elapsed + guess > args.budget_s:
                            weight_rows.append({**head, "error": f"skipped: {elapsed:.0f} s spent + ~{guess:.0f} s "
                                                                 f"expected > budget {args.budget_s:.0f} s"})
                            continue
                    try:
                        t0 = time.perf_counter()
                        dit, state = load_format(folder, dtype, streamed=offload_to == "disk")
                        head.update(load_s=time.perf_counter() - t0, weights_format=state.format,
                                    dit_held_bytes=module_bytes(dit))
                        use_dit(base, dit, state)
                        del state
                        del dit
                        row = {**head, **run_mode(base, mode, options.get(mode, {}), request, device, offload_to)}
                    except Exception as err:  # one broken format/mode must not cost the others' numbers
                        weight_rows.append({**head, "error": f"{type(err).__name__}: {err}",
                                            "traceback": traceback.format_exc(limit=8)})
                        print(f"{mode} {fmt} {offload_to}: FAILED {weight_rows[-1]['error']}", flush=True)
                        _clear(device)
                        continue
                    frames = row.pop("frames")
                    row["options"] = options.get(mode, {})
                    if mode == "none" and offload_to == "ram":
                        fmt_reference = frames
                    row["frames_finite"] = bool(torch.isfinite(frames).all())
                    if fmt_reference is not None:
                        row["max_abs_diff"] = max_abs_diff(frames, fmt_reference)
                    if reference is not None:
                        row["max_abs_diff_vs_bf16"] = max_abs_diff(frames, reference)
                    weight_rows.append(row)
                    peak = f", peak {row['peak_bytes'] / 1e9:.2f} GB" if row["peak_bytes"] is not None else ""
                    print(f"{mode} {fmt} {offload_to}: {row['time_s']:.1f} s{peak}", flush=True)
                    save()
                    _clear(device)
        finally:
            use_dit(base, plain_dit, plain_state)


def report(result: dict[str, Any]) -> str:
    g = result["geometry"]
    where = result["environment"].get("cuda_device", result["device"]) if result["device"] == "cuda" else "cpu"
    head = (f"TI2V {g['width']}x{g['height']}x{g['num_frames']} (W x H x frames), {g['steps']} steps, CFG "
            f"{g['guidance_scale']}, on {where}{' (tiny sizes: time/memory targets n/a)' if result['tiny'] else ''}")
    pub_none = PUBLISHED["none"]
    rows = []
    for r in result["rows"]:
        pub = PUBLISHED.get(r["mode"])
        pub_cell = (f"{pub[0]:.1f}s/{pub[1]:.2f}GB (x{pub[0] / pub_none[0]:.2f}/x{pub[1] / pub_none[1]:.3f})"
                    if pub else "-")
        checks = " ".join(f"{c['check']}:{c['result'] or 'n/a'}" for c in r.get("checks", []))
        if "error" in r:
            rows.append([r["mode"], "-", "-", "-", "-", "-", "-", "-", pub_cell, f"ERROR {r['error'][:60]}"])
            continue
        st = r["stages_s"]
        stage_cell = "/".join(f"{st.get(k, 0.0):.2f}" for k in ("image", "text", "denoise", "decode"))
        peak = r.get("peak_bytes")
        rows.append([r["mode"], fmt(r["install_s"]), fmt(r["time_s"]), fmt(r.get("time_ratio")), stage_cell,
                     f"{peak / 1e9:.2f}" if peak is not None else "-", fmt(r.get("peak_ratio")),
                     fmt(r.get("max_abs_diff")), pub_cell, checks])
    lines = [head, table(["mode", "install s", "time s", "x none", "img/text/denoise/decode s", "peak GB",
                          "x none", "max|dpix|", "published (x none)", "checks"], rows)]
    if result.get("weight_rows"):
        w_rows = []
        for r in result["weight_rows"]:
            head = [r["mode"], r["weights"], r["offload_to"]]
            if "error" in r:
                w_rows.append([*head, "-", "-", "-", "-", "-", "-", "-", f"ERROR {r['error'][:60]}"])
                continue
            peak = r.get("peak_bytes")
            checks = " ".join(f"{c['check']}:{c['result'] or 'n/a'}" for c in r.get("checks", []))
            w_rows.append([*head, f"{r['dit_held_bytes'] / 1e9:.3g}", fmt(r["time_s"]), fmt(r.get("time_vs_bf16")),
                           f"{peak / 1e9:.2f}" if peak is not None else "-", fmt(r.get("peak_vs_bf16")),
                           fmt(r.get("max_abs_diff")), fmt(r.get("max_abs_diff_vs_bf16")), checks])
        bf16_gb = result["components"]["transformer"]["bytes"] / 1e9
        lines.append(f"DiT weight formats: each mode with the DiT held quantized (ratios to the bf16 row of the same "
                     f"mode; bf16 DiT {bf16_gb:.3g} GB; held = in host memory when loaded, 0 for disk: left in the file)")
        lines.append(table(["mode", "weights", "offload_to", "DiT held GB", "time s", "x bf16", "peak GB", "x bf16",
                            "max|dpix| vs fmt none", "vs bf16 none", "checks"], w_rows))
    sized = [r for r in result["rows"] if "error" not in r] + [
        {**r, "size": r["size"]} for r in result.get("extra_sizes", []) if "error" not in r]
    est_rows = []
    for r in sized:
        size = r.get("size") or [g["height"], g["width"], g["num_frames"]]
        peak, est = r.get("peak_bytes"), r.get("estimate_bytes")
        err = f"{(est - peak) / peak:+.0%}" if peak and est else "-"
        est_rows.append(["x".join(map(str, size)), r["mode"], f"{est / 1e9:.2f}" if est else "-",
                         f"{peak / 1e9:.2f}" if peak is not None else "-", err])
    fault_rows = []
    for r in result["rows"]:
        faults = r.get("faults")
        if not faults:
            continue
        if "failed" in faults:
            fault_rows.append([r["mode"], f"FAILED {faults['failed'][:60]}", "-", "-"])
            continue
        clean = faults["clean_allocated_bytes"]
        cells = []
        for kind in ("cancel", "error"):
            f = faults[kind]
            after = "-" if f["allocated_after_bytes"] is None else f"{f['allocated_after_bytes'] / 1e9:.3f}"
            ok = {True: "PASS", False: "FAIL", None: "n/a"}[f["back_to_clean"]]
            cells.append(f"{after} GB {ok}, rerun {'==' if f['rerun_equal'] else '!='}")
        fault_rows.append([r["mode"], "-" if clean is None else f"{clean / 1e9:.3f}", *cells])
    if fault_rows:
        lines.append("faults: allocated after a cancel / an error vs the clean level, and the rerun's frames")
        lines.append(table(["mode", "clean GB", "after cancel", "after error"], fault_rows))
    if est_rows:
        lines.append("auto offload: estimated vs measured peak (H x W x frames)")
        lines.append(table(["size", "mode", "estimate GB", "measured GB", "error"], est_rows))
    e = result["estimate"]
    lines.append(f"sequential streams ~{e['sequential_stream_bytes'] / 1e9:.0f} GB over {e['dit_forwards']} DiT "
                 f"forwards (+2 prompt encodes): ~{e['sequential_stream_s_at_25GBps']:.0f}/"
                 f"{e['sequential_stream_s_at_12GBps']:.0f}/{e['sequential_stream_s_at_5GBps']:.0f} s at 25/12/5 GB/s. "
                 f"Total {result['total_s']:.0f} s. Peak = torch.cuda.max_memory_allocated (GB = 1e9 B), reset per mode.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    result = run(args)
    if not result.get("dry_run"):
        print(report(result))
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
