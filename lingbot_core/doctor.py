"""`python -m lingbot_core.doctor`: check this machine the way the pack will use it, and write it down.

    python -m lingbot_core.doctor                           # the first CUDA device, else the CPU
    python -m lingbot_core.doctor --device cuda:1 --json doctor.json
    python -m lingbot_core.doctor --device cpu --quick      # a fast pass (smaller sizes, one step)

What it checks, in order (`SECTIONS`):
- versions: Python, torch and its CUDA build, the driver (nvidia-smi), the device, diffusers,
  transformers and the other libraries, ComfyUI when it is importable;
- dit: a DiT at the published width (dense and MoE; 1-2 blocks, random weights) under every offload
  mode, with the step time and, on CUDA, the measured peak memory against the estimate `auto` uses;
- kernels: each optional fast kernel's verdict on this device (fast / refused / mismatch): those the
  DiT's real calls reached, and a probe of every registered kernel;
- cfg_batch: CFG as one batch-2 forward against two forwards (dense, plain weights), and whether
  `cfg_batch="auto"` batches plain weights on this device (the GPU figure behind that rule);
- bandwidth: host-to-device copy speed from pinned and from ordinary (pageable) memory (CUDA);
- disk: how fast a file is read back with the page cache dropped (what `offload_to: disk` reads at);
- recipe: the README-style recipe for this GPU and RAM, as the estimate gives it, confirmed or corrected
  by the peaks measured here (CUDA).

On a CPU the CUDA-only parts say so (`cuda_only` in the report). A table goes to stdout; `--json` writes
the whole report (attach it to a bug report). Exit codes: 0 every section ran or does not apply here,
1 a section failed (its error is in the table and the report), 2 bad arguments.

The doctor uses lingbot_core's public API only: what it measures is what a user's run goes through.
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

REPORT_VERSION = 1
MiB = 1024**2
GiB = 1024**3
LIBRARIES = ("torchvision", "diffusers", "transformers", "accelerate", "safetensors", "tokenizers", "gguf", "numpy",
             "av", "triton", "flash-attn", "flash-attn-3", "sageattention", "xformers", "lingbot-nodes")
"""Distributions whose installed version the report lists (read from their metadata, never imported)."""
VARIANTS = ("dense", "moe")
CPU_EXPERTS = 16
"""Experts per MoE block on a CPU (the published 128 at full width would take ~2.4 GB and most of the
time budget per block); width, expert width and experts per token stay the published ones."""


# -- the accelerator's counters ----------------------------------------------------------------------

class Accelerator:
    """What the doctor reads from and does on its device: CUDA's counters and copies, or nothing on a CPU.

    Every CUDA call of the doctor goes through here, so a test can stand in a fake accelerator (a
    subclass whose `measures` is True, over CPU tensors) and run the CUDA-only sections' code.
    """

    def __init__(self, device: torch.device):
        self.device = device

    @property
    def measures(self) -> bool:
        """Whether this device has memory counters and a host link (a CUDA device)."""
        return self.device.type == "cuda"

    def synchronize(self) -> None:
        if self.measures:
            torch.cuda.synchronize(self.device)

    def clear(self) -> None:
        """Free what can be freed and start a new peak."""
        gc.collect()
        if self.measures:
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)

    def allocated(self) -> int | None:
        return torch.cuda.memory_allocated(self.device) if self.measures else None

    def peak_allocated(self) -> int | None:
        return torch.cuda.max_memory_allocated(self.device) if self.measures else None

    def peak_reserved(self) -> int | None:
        return torch.cuda.max_memory_reserved(self.device) if self.measures else None

    def total_bytes(self) -> int | None:
        return torch.cuda.get_device_properties(self.device).total_memory if self.measures else None

    def describe(self) -> dict[str, Any]:
        if not self.measures:
            return {"name": platform.processor() or platform.machine(), "threads": torch.get_num_threads()}
        props = torch.cuda.get_device_properties(self.device)
        return {"name": props.name, "capability": f"{props.major}.{props.minor}", "total_bytes": props.total_memory,
                "multiprocessors": props.multi_processor_count}

    def host_buffer(self, nbytes: int, pinned: bool) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)

    def device_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)


# -- the run's settings and the report ---------------------------------------------------------------

@dataclass
class Settings:
    """What one doctor run measures, derived from the device and `--quick`."""

    device: torch.device
    quick: bool
    dtype: torch.dtype
    blocks: int
    height: int
    width: int
    num_frames: int
    text_tokens: int
    steps: int
    experts: int | None  # experts per MoE block (None: the published count)
    copy_bytes: int
    disk_bytes: int
    disk_dir: Path
    sections: tuple[str, ...]

    @classmethod
    def make(cls, device: torch.device, *, quick: bool = False, disk_dir: str | None = None,
             sections: tuple[str, ...] | None = None, accelerator: Accelerator | None = None) -> Settings:
        from .placement.estimate import TEXT_TOKENS

        on_gpu = (accelerator or Accelerator(device)).measures
        if on_gpu:
            size = (480, 832, 17) if quick else (480, 832, 49)  # the README's base size, fewer frames
            text, steps, blocks = TEXT_TOKENS, 1 if quick else 3, 1 if quick else 2
        else:  # a CPU: a few dozen tokens keep a full-width block under a second
            size, text, steps, blocks = ((32, 32, 1), 16, 1, 1) if quick else ((64, 64, 5), 32, 1, 1)
        return cls(device=device, quick=quick, dtype=torch.bfloat16 if on_gpu else torch.float32, blocks=blocks,
                   height=size[0], width=size[1], num_frames=size[2], text_tokens=text, steps=steps,
                   experts=None if on_gpu else CPU_EXPERTS,
                   copy_bytes=(64 if quick else 256) * MiB if on_gpu else 0,
                   disk_bytes=(16 if quick else 256 if on_gpu else 64) * MiB,
                   disk_dir=Path(disk_dir) if disk_dir else Path(tempfile.gettempdir()),
                   sections=sections or tuple(SECTIONS))


@dataclass
class Doctor:
    """One run: its settings, accelerator and the report it fills section by section."""

    settings: Settings
    accelerator: Accelerator
    report: dict[str, Any] = field(default_factory=dict)

    @property
    def device(self) -> torch.device:
        return self.settings.device


def _not_applicable(why: str) -> dict[str, Any]:
    return {"status": "not applicable", "note": why}


def _timed(fn: Callable[[], Any], accelerator: Accelerator) -> tuple[float, Any]:
    accelerator.synchronize()
    start = time.perf_counter()
    out = fn()
    accelerator.synchronize()
    return time.perf_counter() - start, out


# -- versions ----------------------------------------------------------------------------------------

def _distribution(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


VERSION_LINE = re.compile(r"""^__version__\s*=\s*["']([^"']+)["']""", re.M)


def comfyui_version() -> str | None:
    """ComfyUI's version, read from its `comfyui_version.py` (never imported, nothing else of ComfyUI is
    touched): the one this Python can import, else the one of the ComfyUI folder this pack sits in
    (`ComfyUI/custom_nodes/<pack>/lingbot_core`). None when there is none."""
    candidates = []
    try:
        spec = importlib.util.find_spec("comfyui_version")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.origin:
        candidates.append(Path(spec.origin))
    pack = Path(__file__).resolve().parents[1]
    if pack.parent.name == "custom_nodes":
        candidates.append(pack.parent.parent / "comfyui_version.py")
    for path in candidates:
        try:
            found = VERSION_LINE.search(path.read_text(encoding="utf-8", errors="replace")[:4096])
        except OSError:
            continue
        if found:
            return found.group(1)
    return None


def driver_version() -> str | None:
    """The NVIDIA driver's version from nvidia-smi (None without it)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    lines = [line.strip() for line in out.splitlines() if line.strip()]
    return lines[0] if lines else None


def versions(doctor: Doctor) -> dict[str, Any]:
    accel = doctor.accelerator
    cuda = {"build": torch.version.cuda, "available": torch.cuda.is_available(),
            "devices": torch.cuda.device_count() if torch.cuda.is_available() else 0}
    if accel.measures:
        cuda["cudnn"] = torch.backends.cudnn.version()
        cuda["driver"] = driver_version() or "unknown (no nvidia-smi)"
    else:
        cuda["driver"] = "not applicable (CPU run)"
    return {
        "status": "ran",
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cuda": cuda,
        "hip": getattr(torch.version, "hip", None),
        "device": {"label": str(doctor.device), **accel.describe()},
        "libraries": {name: _distribution(name) for name in LIBRARIES},
        "comfyui": comfyui_version() or "not importable from this Python",
    }


# -- fast kernels ------------------------------------------------------------------------------------

def _kernels_module() -> Any:
    """`lingbot_core.kernels` when this build has it (the fast-kernel verdicts), else None."""
    try:
        from . import kernels
    except ImportError:
        return None
    return kernels if callable(getattr(kernels, "verdicts", None)) and callable(getattr(kernels, "probe", None)) \
        else None


def attention_probes() -> list[str]:
    """The attention backends the Loaders offer besides PyTorch SDPA itself (diffusers' names, from its
    registry: `models.transformer.attention_backends`): each is probed with and without a key mask
    (`attention/<name>`, `attention/<name>+mask`)."""
    from .models.transformer import SDPA_BACKENDS, attention_backends

    return [b for b in attention_backends() if b not in SDPA_BACKENDS]


COMPILING_PROBES = ("compiled_decoder",)
"""Kernels whose probe compiles (seconds to a minute): not probed with --quick."""


def kernel_names(kernels: Any) -> list[str]:
    """What to probe: every kernel of the registry (`kernels.KERNELS`), the attention family once per
    backend the Loaders offer, with and without a mask."""
    names = []
    for name in getattr(kernels, "KERNELS", None) or ():
        if name == "attention":
            names += [f"attention/{b}{mask}" for b in attention_probes() for mask in ("", "+mask")]
        else:
            names.append(name)
    return names


def kernel_verdicts(doctor: Doctor) -> dict[str, Any]:
    kernels = _kernels_module()
    if kernels is None:
        return {"status": "not available in this build",
                "note": "this version of lingbot-nodes has no fast-kernel verdicts (lingbot_core.kernels)"}
    dtypes = [doctor.settings.dtype] + ([torch.float16] if doctor.accelerator.measures else [])
    probes = []
    for name in kernel_names(kernels):
        for dtype in dtypes:
            if doctor.settings.quick and name.split("/")[0] in COMPILING_PROBES:
                probes.append({"kernel": name, "device": doctor.device.type, "dtype": str(dtype).replace("torch.", ""),
                               "verdict": "not probed", "reason": "--quick skips probes that compile"})
                continue
            try:
                probes.append(dict(kernels.probe(name, doctor.device, dtype)))
            except Exception as err:  # a probe that cannot even run is a verdict too
                probes.append({"kernel": name, "device": doctor.device.type, "dtype": str(dtype).replace("torch.", ""),
                               "verdict": "refused", "reason": f"probe failed: {type(err).__name__}: {err}"})
    rows = [dict(v) for v in kernels.verdicts()]
    seen = {(r.get("kernel"), str(r.get("device")), str(r.get("dtype"))) for r in rows}
    rows += [p for p in probes if (p.get("kernel"), str(p.get("device")), str(p.get("dtype"))) not in seen]
    return {"status": "ran", "rows": rows,
            "note": "fast: used; refused: it raised, the plain path is used; mismatch: it differed from the plain "
                    "path, which is used. A good probe is not kept: the first real call is the kernel's trial"}


# -- a real-width DiT under every offload mode -------------------------------------------------------

def dit_config(variant: str, blocks: int, experts: int | None = None) -> dict[str, Any]:
    """The published DiT config of `variant` with `blocks` blocks (and `experts` experts per MoE block)."""
    from .placement.recipes import DIT_CONFIGS

    config = {k: v for k, v in json.loads(DIT_CONFIGS[variant].read_text(encoding="utf-8")).items()
              if not k.startswith("_")}
    config["depth"] = blocks
    if experts is not None and config.get("num_experts"):
        config["num_experts"] = experts
    return config


@torch.no_grad()
def random_dit(config: dict[str, Any], dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    """A DiT of `config` on the CPU in `dtype` (its float32-kept modules in float32) with random weights
    of the usual scale: built on `meta`, then filled in place (no initialisation pass)."""
    from .models.transformer import LingBotVideoTransformer3DModel

    with torch.device("meta"):
        model = LingBotVideoTransformer3DModel.from_config(config)
    if dtype != torch.float32:
        model.to(dtype)
    model.to_empty(device="cpu")
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
        if name.endswith("scale_shift_table"):
            value = 0.1 * noise
        elif name.endswith("bias"):
            value = 0.05 * noise
        elif p.ndim == 1:
            value = 1.0 + 0.1 * noise
        else:
            value = noise / math.sqrt(p.shape[-1])
        p.copy_(value)
    for _name, buf in model.named_buffers():
        if buf.is_floating_point():
            buf.zero_()
    return model.eval().requires_grad_(False)


def _inputs(settings: Settings, config: Any, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Latents of the settings' video size (the Wan VAE's 4x time, 8x space), prompt embeddings of
    `text_tokens` tokens and a mid-schedule timestep, on the device."""
    latent_frames = (settings.num_frames - 1) // 4 + 1
    g = torch.Generator().manual_seed(seed)
    latents = torch.randn(1, config.in_channels, latent_frames, settings.height // 8, settings.width // 8, generator=g)
    text = torch.randn(1, settings.text_tokens, config.text_dim, generator=g)
    device = settings.device
    return latents.to(device), text.to(device, settings.dtype), torch.tensor([500.0], device=device)


def measure_mode(doctor: Doctor, handle: Any, mode: str, geometry: Any) -> tuple[dict[str, Any], torch.Tensor]:
    """`mode` installed on `handle`'s DiT: a warm-up call (on CUDA), then `steps` steps (two DiT forwards
    each, as CFG runs) inside one stage. The stage's times and peaks, and the last output (on the CPU)."""
    from .placement.door import configure_offload, stage

    settings, accel = doctor.settings, doctor.accelerator
    accel.clear()
    view = configure_offload(handle, mode)
    latents, text, t = _inputs(settings, handle.shared.loaded["transformer"].config)

    def forward(dev: torch.device) -> torch.Tensor:
        model = view.shared.loaded["transformer"]
        return model(latents.to(dev), t.to(dev), text.to(dev)).sample

    # the door measures each stage on CUDA itself and files measured/estimated in the calibration file
    # (`placement.calibration`): the phase and geometry give it the same estimate as the row's
    def entered() -> Any:
        return stage(view, "transformer", label="doctor denoise", phase="denoise", geometry=geometry)

    if accel.measures:  # warm-up: kernel trials, cuBLAS and the allocator, the first transfer
        with entered() as dev:
            forward(dev)
    accel.clear()
    row: dict[str, Any] = {"start_allocated_bytes": accel.allocated()}
    steps: list[float] = []
    out = None
    accel.synchronize()
    began = time.perf_counter()
    with entered() as dev:
        row["enter_s"] = time.perf_counter() - began
        for _ in range(settings.steps):
            step_s, out = _timed(lambda: (forward(dev), forward(dev))[1], accel)
            steps.append(step_s)
    accel.synchronize()
    row.update(stage_s=time.perf_counter() - began, step_s=statistics.median(steps),
               peak_bytes=accel.peak_allocated(), peak_reserved_bytes=accel.peak_reserved())
    return row, out.float().cpu()


def run_modes(doctor: Doctor, variant: str) -> list[dict[str, Any]]:
    """One variant (its published width, `settings.blocks` blocks, random weights) under every offload
    mode, each row with the estimate of the same model and geometry (the 'denoise' phase)."""
    from .handle import PipelineHandle
    from .placement import calibration, estimate
    from .placement.door import configure_offload
    from .placement.modes import MODE_ORDER

    settings = doctor.settings
    config = dit_config(variant, settings.blocks, settings.experts)
    built_s, dit = _timed(lambda: random_dit(config, settings.dtype), Accelerator(torch.device("cpu")))
    sizes = estimate.ModelSizes.from_modules({"transformer": dit})
    geometry = estimate.Geometry(height=settings.height, width=settings.width, num_frames=settings.num_frames, cfg=True)
    handle = PipelineHandle.from_components({"transformer": dit}, device=settings.device)
    shape = {"variant": variant, "blocks": settings.blocks, "hidden": config["hidden_size"],
             "experts": config.get("num_experts") or 0, "weights_bytes": sizes.transformer, "build_s": built_s}
    rows: list[dict[str, Any]] = []
    reference = None
    for mode in MODE_ORDER:
        row: dict[str, Any] = {**shape, "mode": mode,
                               "estimate_bytes": estimate.estimate_peak(mode, sizes, geometry, ("denoise",))}
        try:
            measured, out = measure_mode(doctor, handle, mode, geometry)
        except Exception as err:  # one mode's failure must not cost the others' rows
            row.update(status="failed", error=f"{type(err).__name__}: {err}", traceback=traceback.format_exc(limit=6))
            rows.append(row)
            continue
        row.update(measured, status="ran", finite=bool(torch.isfinite(out).all()))
        if row["peak_bytes"] is not None and row["estimate_bytes"]:
            row["measured_vs_estimate"] = row["peak_bytes"] / row["estimate_bytes"]
        reference = out if reference is None else reference
        row["max_abs_diff_vs_first_mode"] = float((out - reference).abs().max())
        if doctor.accelerator.measures:  # what later estimates for this mode on this device are scaled by
            row["calibration_factor"] = calibration.factor(calibration.device_name(settings.device), mode)
        rows.append(row)
    configure_offload(handle, MODE_ORDER[-1])  # the weights back in their CPU home before they are dropped
    return rows


def dit_modes(doctor: Doctor) -> dict[str, Any]:
    s = doctor.settings
    rows = []
    for variant in VARIANTS:
        rows += run_modes(doctor, variant)
        doctor.accelerator.clear()
    out: dict[str, Any] = {
        "status": "failed" if any(r["status"] == "failed" for r in rows) else "ran",
        "geometry": {"height": s.height, "width": s.width, "num_frames": s.num_frames, "text_tokens": s.text_tokens,
                     "dtype": str(s.dtype).replace("torch.", ""), "blocks": s.blocks, "steps": s.steps},
        "rows": rows,
        "note": "a step is two DiT forwards (CFG) of this reduced-depth model; the estimate is the 'denoise' "
                "phase of lingbot_core.placement.estimate.estimate_peak for the same model and geometry",
    }
    if s.experts is not None:
        out["note"] += f"; {s.experts} experts per MoE block (the published model has more)"
    if doctor.accelerator.measures:
        from .placement.calibration import calibration_path

        path = calibration_path()
        out["calibration_file"] = str(path) if path is not None else "off"
        out["note"] += ("; as in any run, each stage's measured/estimated ratio is filed per device and mode in the "
                        "calibration file, and later estimates here are scaled by it (calibration_factor)")
    else:
        out["note"] += ("; on a CPU: no memory counters (peaks not measured) and a few dozen tokens, so the times "
                        "say little about a GPU")
    return out


# -- batched CFG -------------------------------------------------------------------------------------

def _two_forwards(model: torch.nn.Module, pos: tuple, neg: tuple) -> None:
    model(*pos)
    model(*neg)


def cfg_batch(doctor: Doctor) -> dict[str, Any]:
    """CFG as one batch-2 forward against two batch-1 forwards of a random dense DiT (plain weights, the
    dit section's geometry), median of `steps` pairs after a warm-up, and whether `cfg_batch="auto"`
    batches plain weights on this device (`placement.estimate.cfg_batch_gain`): the measurement behind
    that rule, which on GPUs had none."""
    from .placement.estimate import cfg_batch_gain

    s, accel = doctor.settings, doctor.accelerator
    model = random_dit(dit_config("dense", s.blocks), s.dtype).to(s.device)
    pos, neg = ((latents, t, text) for latents, text, t in (_inputs(s, model.config, seed=1),
                                                             _inputs(s, model.config, seed=2)))
    both = tuple(torch.cat([p, n]) for p, n in zip(pos, neg))
    two: list[float] = []
    one: list[float] = []
    with torch.no_grad():
        model(*both)  # warm-up
        for _ in range(max(1, s.steps)):
            two.append(_timed(partial(_two_forwards, model, pos, neg), accel)[0])
            one.append(_timed(partial(model, *both), accel)[0])
    two_s, one_s = statistics.median(two), statistics.median(one)
    return {"status": "ran", "two_forwards_s": two_s, "batched_s": one_s, "batched_x_two": one_s / two_s,
            "auto_batches_plain_weights": cfg_batch_gain(s.device.type, packed=False, streamed=False) is not None,
            "note": f"dense, {s.blocks} block(s), {s.width}x{s.height}x{s.num_frames}, {str(s.dtype).replace('torch.', '')}, "
                    "plain weights; below 1 the batch-2 forward is faster"
                    + ("" if accel.measures else "; on a CPU the doctor's few dozen tokens leave a batch-1 forward's "
                       "matmuls under-filled, where at real sizes (1,280 tokens and more, bf16) the batch-2 forward "
                       "measured slower (docs/speed.md)")}


# -- host-to-device bandwidth ------------------------------------------------------------------------

def copy_speed(accel: Accelerator, nbytes: int, repeats: int, pinned: bool) -> float:
    """GB/s of `repeats` host-to-device copies of `nbytes` from pinned or pageable memory (after a warm-up)."""
    source = accel.host_buffer(nbytes, pinned)
    target = accel.device_buffer(nbytes)
    source.fill_(1)
    target.copy_(source, non_blocking=pinned)

    def copies() -> None:
        for _ in range(repeats):
            target.copy_(source, non_blocking=pinned)

    seconds, _ = _timed(copies, accel)
    return nbytes * repeats / seconds / 1e9


def bandwidth(doctor: Doctor) -> dict[str, Any]:
    accel = doctor.accelerator
    if not accel.measures:
        return _not_applicable("host-to-device copies need a CUDA device")
    nbytes, repeats = doctor.settings.copy_bytes, 5
    out: dict[str, Any] = {"status": "ran", "bytes": nbytes, "repeats": repeats}
    for kind, pinned in (("pinned", True), ("pageable", False)):
        out[f"{kind}_GBps"] = copy_speed(accel, nbytes, repeats, pinned)
    return out


# -- disk read speed ---------------------------------------------------------------------------------

CHUNK = 8 * MiB


def _read_all(path: Path) -> float:
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    start = time.perf_counter()
    with open(path, "rb", buffering=0) as fh:
        while fh.readinto(view):
            pass
    return time.perf_counter() - start


def disk_read(doctor: Doctor) -> dict[str, Any]:
    folder, nbytes = doctor.settings.disk_dir, doctor.settings.disk_bytes
    if not folder.is_dir():
        raise ValueError(f"--disk-dir {folder} is not a folder")
    free = shutil.disk_usage(folder).free
    if free < 2 * nbytes:
        return {"status": "not applicable", "note": f"{folder} has {free / MiB:.0f} MiB free; the test writes "
                                                    f"{nbytes / MiB:.0f} MiB"}
    can_drop = hasattr(os, "posix_fadvise")
    fd, name = tempfile.mkstemp(prefix="lingbot-doctor-", suffix=".bin", dir=folder)
    path = Path(name)
    try:
        with os.fdopen(fd, "wb") as fh:
            for _ in range(0, nbytes, CHUNK):
                fh.write(os.urandom(min(CHUNK, nbytes)))  # incompressible: a compressing filesystem cannot shortcut
            fh.flush()
            os.fsync(fh.fileno())
            if can_drop:  # ask the kernel to forget the cached pages, so the next read comes from the disk
                os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        cold = _read_all(path)
        warm = _read_all(path)
    finally:
        path.unlink(missing_ok=True)
    out = {"status": "ran", "folder": str(folder), "bytes": nbytes, "cold_read_MBps": nbytes / cold / 1e6,
           "cached_read_MBps": nbytes / warm / 1e6, "cache_dropped": "asked (posix_fadvise DONTNEED)" if can_drop
           else "not possible on this system: the cold read may come from memory"}
    if cold < 1.25 * warm:  # no slower than the cached read: the kernel kept (or re-read ahead) the pages
        out["note"] = ("the first read ran at nearly page-cache speed: this file system or a RAM disk kept it cached, "
                       "so this is not the disk's speed; pass --disk-dir a folder on the disk your models are on")
    else:
        out["note"] = "offload_to: disk reads the DiT's file at about the cold speed whenever the page cache lacks it"
    return out


# -- the recipe for this machine ---------------------------------------------------------------------

def host_total_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def measured_factor(rows: list[dict[str, Any]]) -> float | None:
    """The largest measured/estimated peak over the DiT rows (None: nothing measured)."""
    ratios = [r["measured_vs_estimate"] for r in rows if r.get("measured_vs_estimate")]
    return max(ratios) if ratios else None


def recipe_check(vram_total: int, host_total: int, factor: float | None) -> dict[str, Any]:
    """The recipe the estimate gives for this machine, and the one it gives when every peak is scaled by
    `factor` (measured/estimated here): the same recipe confirms the row, another corrects it."""
    from .placement.estimate import RESERVE_BYTES
    from .placement.recipes import DESKTOP_GIB, SYSTEM_GIB, recipe_for

    vram = int(vram_total - DESKTOP_GIB * GiB)
    host = int(host_total - SYSTEM_GIB * GiB)
    labels = {"vram_gb": round(vram_total / GiB, 1), "ram_gb": round(host_total / GiB, 1)}
    estimated = recipe_for(vram, host, **labels)
    out: dict[str, Any] = {"status": "ran", "vram_bytes": vram_total, "host_bytes": host_total,
                           "usable_vram_bytes": vram, "usable_host_bytes": host,
                           "estimated": estimated.settings(), "measured_factor": factor}
    if factor is None:
        out.update(verdict="not checked", note="no peak was measured here, so the estimate stands unchecked")
        return out
    # k x estimate + reserve <= vram  <=>  estimate + reserve <= (vram - reserve) / k + reserve
    scaled = int((vram - RESERVE_BYTES) / factor + RESERVE_BYTES)
    corrected = recipe_for(scaled, host, **labels)
    out["checked"] = corrected.settings()
    same = corrected.settings() == estimated.settings()
    out["verdict"] = "confirmed" if same else "corrected"
    out["note"] = (f"every estimated peak scaled by {factor:.2f} (the largest measured/estimated ratio of the DiT "
                   "rows above) " + ("gives the same recipe" if same else "changes the recipe: use 'checked'"))
    return out


def recipe(doctor: Doctor) -> dict[str, Any]:
    accel = doctor.accelerator
    if not accel.measures:
        return _not_applicable("the recipe is chosen for a GPU's memory; a CPU run has none")
    host = host_total_bytes()
    if host is None:
        return _not_applicable("this system does not say how much RAM it has")
    rows = doctor.report.get("sections", {}).get("dit", {}).get("rows", [])
    return recipe_check(accel.total_bytes(), host, measured_factor(rows))


# -- the registry of sections, the table, the command ------------------------------------------------

SECTIONS: dict[str, Callable[[Doctor], dict[str, Any]]] = {
    "versions": versions,
    "dit": dit_modes,
    "kernels": kernel_verdicts,  # after the DiT: its real calls have tried the kernels they use
    "cfg_batch": cfg_batch,
    "bandwidth": bandwidth,
    "disk": disk_read,
    "recipe": recipe,
}
CUDA_ONLY = {"dit": "peak memory against the estimate", "bandwidth": "host-to-device bandwidth",
             "recipe": "the recipe row for this machine", "versions": "the driver's version"}


def run(settings: Settings, accelerator: Accelerator | None = None,
        on_section: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Every section of `settings.sections` in order; a failing section is reported, never fatal."""
    doctor = Doctor(settings, accelerator or Accelerator(settings.device))
    s = settings
    doctor.report = {
        "doctor": REPORT_VERSION, "device": str(s.device), "quick": s.quick,
        "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "sections": {},
        "cuda_only": [] if doctor.accelerator.measures else [f"{k}: {v}" for k, v in CUDA_ONLY.items()
                                                             if k in s.sections],
    }
    started = time.perf_counter()
    for name in s.sections:
        t0 = time.perf_counter()
        try:
            result = SECTIONS[name](doctor)
        except Exception as err:
            result = {"status": "failed", "error": f"{type(err).__name__}: {err}",
                      "traceback": traceback.format_exc(limit=8)}
        doctor.accelerator.clear()  # what a section allocated is gone before the next one measures
        result["seconds"] = time.perf_counter() - t0
        doctor.report["sections"][name] = result
        doctor.report["total_s"] = time.perf_counter() - started
        if on_section is not None:
            on_section(doctor.report)
    return doctor.report


def _gb(n: float | None) -> str:
    return "-" if n is None else f"{n / GiB:.2f}"


def _num(v: float | None, digits: int = 3) -> str:
    return "-" if v is None else f"{v:.{digits}g}"


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths)), "  ".join("-" * w for w in widths)]
    return "\n".join(lines + ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows])


def render(report: dict[str, Any]) -> str:
    """The report as the tables printed on stdout."""
    sections = report["sections"]
    out = [f"lingbot-nodes doctor on {report['device']}{' (quick)' if report['quick'] else ''}"]
    for name, sec in sections.items():
        head = f"\n[{name}] {sec['status']}" + (f" ({sec['seconds']:.1f} s)" if "seconds" in sec else "")
        out.append(head)
        if sec["status"] == "failed" and "rows" not in sec:
            out.append(f"  {sec.get('error')}")
            continue
        if sec["status"] in ("not applicable", "not available in this build"):
            out.append(f"  {sec.get('note', '')}")
            continue
        if name == "versions":
            cuda = sec["cuda"]
            libs = ", ".join(f"{k} {v}" for k, v in sec["libraries"].items() if v)
            dev = sec["device"]
            out += [f"  python {sec['python']}, torch {sec['torch']} (CUDA build {cuda['build'] or 'none'}), "
                    f"driver {cuda['driver']}",
                    f"  device {dev['label']}: {dev.get('name')}" + (f", sm {dev['capability']}, "
                                                                     f"{_gb(dev['total_bytes'])} GiB"
                                                                     if "capability" in dev else ""),
                    f"  {libs}", f"  ComfyUI: {sec['comfyui']}"]
        elif name == "kernels":
            rows = [[str(r.get(k, "-")) for k in ("kernel", "device", "capability", "dtype", "torch", "verdict")]
                    + [str(r.get("reason") or "")[:70]] for r in sec["rows"]]
            out.append(_table(["kernel", "device", "capability", "dtype", "torch", "verdict", "reason"], rows))
        elif name == "dit":
            g = sec["geometry"]
            out.append(f"  {g['width']}x{g['height']}x{g['num_frames']} (+{g['text_tokens']} text tokens), "
                       f"{g['dtype']}, {g['blocks']} block(s), median of {g['steps']} step(s)")
            rows = []
            for r in sec["rows"]:
                if r["status"] == "failed":
                    rows.append([r["variant"], r["mode"], "-", "-", _gb(r["estimate_bytes"]), "-",
                                 f"FAILED {r['error'][:60]}"])
                    continue
                rows.append([r["variant"], r["mode"], _num(r["step_s"]), _gb(r["peak_bytes"]), _gb(r["estimate_bytes"]),
                             _num(r.get("measured_vs_estimate")),
                             "same as first mode" if r["max_abs_diff_vs_first_mode"] == 0 else
                             f"differs by {r['max_abs_diff_vs_first_mode']:.2g}"])
            out.append(_table(["model", "mode", "step s", "peak GiB", "estimate GiB", "measured/est", "output"],
                              rows))
            out.append(f"  {sec['note']}")
        elif name == "cfg_batch":
            out.append(f"  batch-2 forward {sec['batched_s']:.3g} s, two forwards {sec['two_forwards_s']:.3g} s: "
                       f"{sec['batched_x_two']:.3g}x; auto batches plain weights here: "
                       f"{'yes' if sec['auto_batches_plain_weights'] else 'no'} ({sec['note']})")
        elif name == "bandwidth":
            out.append(f"  host to device, {sec['bytes'] / MiB:.0f} MiB x {sec['repeats']}: pinned "
                       f"{sec['pinned_GBps']:.1f} GB/s, pageable {sec['pageable_GBps']:.1f} GB/s")
        elif name == "disk":
            out.append(f"  {sec['bytes'] / MiB:.0f} MiB in {sec['folder']}: first read {sec['cold_read_MBps']:.0f} MB/s, "
                       f"cached {sec['cached_read_MBps']:.0f} MB/s (page cache {sec['cache_dropped']})")
            out.append(f"  {sec['note']}")
        elif name == "recipe":
            est = sec["estimated"]
            out.append(f"  {_gb(sec['vram_bytes'])} GiB GPU, {_gb(sec['host_bytes'])} GiB RAM: {est['model']}, "
                       f"{est['weights']}, offload {est['mode']} to {est['offload_to']}, up to {est['base']}, "
                       f"refine {est['refine']}")
            out.append(f"  {sec['verdict']}: {sec['note']}")
            if sec.get("verdict") == "corrected":
                c = sec["checked"]
                out.append(f"  checked: {c['model']}, {c['weights']}, offload {c['mode']} to {c['offload_to']}, "
                           f"up to {c['base']}, refine {c['refine']}")
    if report["cuda_only"]:
        out.append("\nCUDA only, not run on this device: " + "; ".join(report["cuda_only"]))
    out.append(f"\ntotal {report.get('total_s', 0):.1f} s")
    return "\n".join(out)


def _device(text: str) -> torch.device:
    from .placement.settings import device_index

    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}") from None
    if device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"the doctor checks cpu or cuda:N, not {device.type}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError(f"this torch ({torch.__version__}) sees no CUDA device; use --device cpu")
        index = device_index(device)
        if index >= torch.cuda.device_count():
            raise argparse.ArgumentTypeError(f"cuda:{index} does not exist: this machine has "
                                             f"{torch.cuda.device_count()} CUDA device(s)")
        device = torch.device("cuda", index)
    return device


def _sections(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in SECTIONS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown section(s) {', '.join(unknown) or '(none)'}; choose from "
                                         f"{', '.join(SECTIONS)}")
    return tuple(n for n in SECTIONS if n in names)  # always in the report's order


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m lingbot_core.doctor", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Sections: " + ", ".join(SECTIONS) + ". Attach the --json file to a bug report.")
    p.add_argument("--device", type=_device, default=None, help="cpu, cuda or cuda:N (default: cuda:0 if present)")
    p.add_argument("--json", metavar="FILE", help="write the report here (JSON)")
    p.add_argument("--quick", action="store_true", help="smaller sizes and one step: a fast pass")
    p.add_argument("--only", type=_sections, default=None, metavar="SECTIONS",
                   help="comma list of the sections to run (default: all)")
    p.add_argument("--disk-dir", default=None,
                   help="where the disk test writes its file (default: the temp folder; pass your models' folder)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    args = p.parse_args(argv)
    if args.device is None:
        args.device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if args.threads is not None and args.threads < 1:
        p.error(f"--threads must be 1 or more, got {args.threads}")
    if args.disk_dir is not None and not Path(args.disk_dir).is_dir():
        p.error(f"--disk-dir {args.disk_dir} is not a folder")
    if args.json is not None and not Path(args.json).resolve().parent.is_dir():
        p.error(f"--json {args.json}: its folder does not exist")
    return args


def _write(path: str | None, report: dict[str, Any]) -> None:
    if path is None:
        return
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(report, indent=1, default=str) + "\n", encoding="utf-8")
    tmp.replace(path)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    settings = Settings.make(args.device, quick=args.quick, disk_dir=args.disk_dir, sections=args.only)
    print(f"lingbot-nodes doctor: checking {', '.join(settings.sections)} on {settings.device} ...", file=sys.stderr,
          flush=True)
    report = run(settings, on_section=lambda r: _write(args.json, r))  # a killed run keeps what it measured
    _write(args.json, report)
    print(render(report))
    if args.json:
        print(f"\nreport written to {args.json}: attach it to a bug report")
    failed = [n for n, sec in report["sections"].items() if sec["status"] == "failed"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
