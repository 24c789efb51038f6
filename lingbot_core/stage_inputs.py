"""What a stage accepts: checks that run at stage entry, before any model loads or computes.

This is the one home of stage-input validation: scalars, geometry, images, latents, the size of a
request against memory, and each stage's whole request (`check_denoise`,
`check_refine_request`, `validate_request` for `generate`). Sigma lists and shifts are checked by
the sigma rules (`sampling.sigmas`), which these call.

The Python API is as exposed as a workflow: a seed of ``True``, a 0x0 picture, 0..255 integers
where 0..1 floats belong, NaN pixels, a request a thousand times too big. Each gets a ValueError
that names the argument and the fix, raised before the text encoder or the DiT is touched (the
expensive part, and the part that leaves memory behind when it fails half way).
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image

from . import sampling
from .components import REFINER
from .errors import surrogate_problem
from .latents import SIZE_MULTIPLE, VAE_TEMPORAL, latent_shape
from .placement import plan
from .sampling.guidance import CFG_BATCH
from .sampling.sigmas import check_shift
from .sampling.step_cache import MIN_STEPS, Keyed, StepCacheSettings, check_step_cache, keyed

log = logging.getLogger(__name__)

GiB = 1 << 30
MODES = ("t2v", "t2i", "ti2v")
MAX_IMAGE_SIDE = 16384  # a picture side we accept at all (the conditioning image is resized anyway)
MAX_SIZE = 4096  # a video's height or width (pixels)
MAX_FRAMES = 1025  # frames of one video (4n+1)
MAX_STEPS = 200  # sampling steps of one stage (base or refine, tail steps included)
LIMITS = {"size": MAX_SIZE, "frames": MAX_FRAMES, "steps": MAX_STEPS}
"""The one registry of request limits: the nodes' input ranges and the Python API's checks read it, so
`steps=10**9` is refused by the API as the node's range refuses it (it used to allocate for minutes)."""


# -- scalars ---------------------------------------------------------------------------------------

def check_seed(seed: Any) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64:
        raise ValueError(f"seed must be an integer in [0, 2**64), got {_short(seed)}")
    return seed


def check_negative_prompt(negative_prompt: Any) -> None:
    if negative_prompt is not None and not isinstance(negative_prompt, str):
        raise ValueError("negative_prompt must be a string ('' for the default negative, None for none), "
                         f"got {type(negative_prompt).__name__}")
    problem = surrogate_problem(negative_prompt, "negative_prompt")
    if problem:
        raise ValueError(problem)


def check_finite_number(name: str, value: Any, *, low: float | None = None, high: float | None = None,
                        low_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {_short(value)}")
    if low is not None and (value <= low if low_open else value < low):
        raise ValueError(f"{name} must be {'>' if low_open else '>='} {low}, got {value}")
    if high is not None and value > high:
        raise ValueError(f"{name} must be <= {high}, got {value}")
    return float(value)


def check_count(name: str, value: Any, *, low: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {_short(value)}")
    return value


def check_steps(steps: Any, name: str = "steps") -> None:
    if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= MAX_STEPS:
        raise ValueError(f"{name} must be an integer in [1, {MAX_STEPS}], got {_short(steps)}")


def check_guidance(guidance_scale: float) -> None:
    if not math.isfinite(guidance_scale) or guidance_scale < 0:
        raise ValueError(f"guidance_scale must be a finite number >= 0, got {guidance_scale!r}")


def check_cfg_batch(cfg_batch: Any) -> None:
    if cfg_batch not in CFG_BATCH:
        raise ValueError(f"cfg_batch must be one of {', '.join(CFG_BATCH)}, got {_short(cfg_batch)}")


def check_mode(mode: Any) -> None:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")


def check_t_thresh(t_thresh: Any) -> None:
    if (isinstance(t_thresh, bool) or not isinstance(t_thresh, (int, float)) or not math.isfinite(t_thresh)
            or not 0.0 < t_thresh <= 1.0):
        raise ValueError(f"t_thresh must lie in (0, 1], got {t_thresh!r}")


def validate_geometry(height: int, width: int, num_frames: int) -> None:
    """Raise a ValueError a user can act on for sizes the VAE and DiT cannot take."""
    for name, value, most in (("height", height, MAX_SIZE), ("width", width, MAX_SIZE),
                              ("num_frames", num_frames, MAX_FRAMES)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {_short(value)}")
        if value > most:
            raise ValueError(f"{name} must be at most {most}, got {value}")
    if height % SIZE_MULTIPLE or width % SIZE_MULTIPLE:
        def near(v: int) -> int:
            return max(SIZE_MULTIPLE, (v + SIZE_MULTIPLE // 2) // SIZE_MULTIPLE * SIZE_MULTIPLE)

        raise ValueError(f"height and width must be multiples of {SIZE_MULTIPLE}, got {height}x{width} "
                         f"(nearest valid: {near(height)}x{near(width)})")
    if num_frames != 1 and (num_frames - 1) % VAE_TEMPORAL:
        lower = (num_frames - 1) // VAE_TEMPORAL * VAE_TEMPORAL + 1
        raise ValueError(f"num_frames must be 1 or 4n+1 (5, 9, ..., 121), got {num_frames}; "
                         f"try {lower} or {lower + VAE_TEMPORAL}")


def _short(value: Any) -> str:
    text = repr(value) if not isinstance(value, int) or abs(value) < 10**30 else "a huge integer"
    return text if len(text) <= 80 else text[:80] + "..."


# -- images ----------------------------------------------------------------------------------------

def checked_image(image: Any, name: str = "image") -> Any:
    """The image as the stage may take it: a path, a PIL image, or a checked uint8/float tensor.

    Tensors and arrays must hold pixels: non-empty, finite, floats in [0, 1] or integers in
    [0, 255] (integers are converted to uint8, so 0..255 data is read as 0..255, not as 0..1
    clamped to white). A PIL image must have at least one pixel.
    """
    if image is None:
        return None
    if isinstance(image, np.ndarray):
        if image.dtype == object or image.dtype.kind not in "biuf":
            raise ValueError(f"{name}: an array of {image.dtype} is not an image; pass uint8 or float pixels")
        image = torch.from_numpy(np.ascontiguousarray(image))
    if isinstance(image, torch.Tensor):
        return checked_pixels(image, name)
    if isinstance(image, Image.Image):
        check_picture(image, name)
        return image
    if isinstance(image, (str, os.PathLike)):
        return image
    raise ValueError(f"{name}: expected a path, a PIL image or an image tensor, got {type(image).__name__}")


def checked_pixels(pixels: torch.Tensor, name: str = "image", *, unit_range_only: bool = False) -> torch.Tensor:
    """Pixels in a tensor: no empty side, no NaN/inf, a value range that matches the dtype."""
    if pixels.numel() == 0 or any(s == 0 for s in pixels.shape):
        raise ValueError(f"{name} is empty (shape {tuple(pixels.shape)}); it needs at least one pixel")
    if pixels.ndim >= 2 and max(pixels.shape[-3:-1] if pixels.ndim >= 3 else pixels.shape) > MAX_IMAGE_SIDE:
        raise ValueError(f"{name} has a side over {MAX_IMAGE_SIDE} pixels (shape {tuple(pixels.shape)})")
    if pixels.dtype == torch.bool or pixels.is_complex():
        raise ValueError(f"{name}: a {pixels.dtype} tensor is not an image; pass uint8 or float pixels")
    if pixels.dtype == torch.uint8:
        if unit_range_only:
            raise ValueError(f"{name} must be float pixels in [0, 1], got uint8")
        return pixels
    if not pixels.is_floating_point():
        low, high = int(pixels.min()), int(pixels.max())
        if unit_range_only or low < 0 or high > 255:
            raise ValueError(f"{name}: integer pixels must lie in [0, 255], got [{low}, {high}]")
        return pixels.to(torch.uint8)
    if not bool(torch.isfinite(pixels).all()):
        raise ValueError(f"{name} holds NaN or infinite values")
    low, high = float(pixels.min()), float(pixels.max())
    if low < -1e-3 or high > 1.0 + 1e-3:
        hint = " (it looks like 0..255 data: divide by 255, or pass uint8)" if high > 1.5 else ""
        raise ValueError(f"{name}: float pixels must lie in [0, 1], got [{low:.4g}, {high:.4g}]{hint}")
    return pixels


def check_first_frame_pixels(pixels: Any) -> None:
    """Raw first-frame pixels (1,3,1,H,W) in [0, 1], as the text encoder's image input."""
    if not isinstance(pixels, torch.Tensor) or pixels.ndim != 5 or tuple(pixels.shape[:3]) != (1, 3, 1):
        shape = tuple(pixels.shape) if isinstance(pixels, torch.Tensor) else type(pixels).__name__
        raise ValueError(f"expected first-frame pixels shaped (1,3,1,H,W), got {shape}")
    checked_pixels(pixels, "image", unit_range_only=True)


def check_picture(picture: Image.Image, name: str = "image") -> None:
    width, height = picture.size
    if width < 1 or height < 1:
        raise ValueError(f"{name} is {width}x{height}; it needs at least one pixel")
    if max(width, height) > MAX_IMAGE_SIDE:
        raise ValueError(f"{name} is {width}x{height}; sides over {MAX_IMAGE_SIDE} pixels are not accepted")


# -- latents ---------------------------------------------------------------------------------------

def checked_latents(latents: Any, name: str = "latents", *, channels: int = 16,
                    shape: tuple[int, ...] | None = None, finite: bool = True) -> torch.Tensor:
    """A (1, C, T, h, w) float latent with every side >= 1, C channels and only finite values."""
    if not isinstance(latents, torch.Tensor):
        raise ValueError(f"{name} must be a tensor shaped (1,{channels},T,h,w), got {type(latents).__name__}")
    got = tuple(latents.shape)
    if shape is not None and got != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {got}")
    if latents.ndim != 5 or got[0] != 1 or got[1] != channels or min(got[2:]) < 1:
        raise ValueError(f"{name} must be shaped (1,{channels},T,h,w) with T, h, w >= 1 (T latent frames = "
                         f"(frames - 1) / 4 + 1), got {got}")
    if not latents.is_floating_point():
        raise ValueError(f"{name} must be floating point, got {latents.dtype}")
    if finite:
        check_finite_latents(latents, name)
    return latents


def check_finite_latents(latents: torch.Tensor, name: str = "latents") -> None:
    if not bool(torch.isfinite(latents).all()):
        raise ValueError(f"{name} hold NaN or infinite values (a diverged run or a corrupt file)")


def vae_channels(handle: Any) -> int:
    """The VAE's latent channel count from its config (16 for Wan 2.1), without loading weights."""
    try:
        config = handle.vae_config()
        value = config["z_dim"] if isinstance(config, dict) else config.z_dim
        return int(value)
    except Exception:
        return 16


# -- size against memory -----------------------------------------------------------------------------

def check_request_fits(handle: Any, *, height: int, width: int, num_frames: int, cfg: bool = True,
                       refine: tuple[int, int] | None = None, phase: str | None = None,
                       what: str = "this request") -> None:
    """Refuse a size that cannot fit the execution device even under the most frugal offload mode.

    The need comes from the memory estimate (`plan.request_fit`: the smallest weight working set
    plus the request's activations, or one VAE pass for ``phase="decode"``); the limit is the
    device's whole memory. So only requests
    that cannot possibly run are refused, and they are refused before anything loads.

    Not on a view of several processes: each would set the one-process estimate against its own device
    (GPUs of two sizes, a rank that holds the encoders too), and a refusal on some ranks only leaves the
    others waiting in their first collective (30 minutes, then an error). A run too large fails on its
    out-of-memory error there, and every rank stops with it.
    """
    from .distributed.stage import active_layout

    if active_layout(handle) is not None:
        return
    fit = plan.request_fit(plan.facts(handle), height=height, width=width, num_frames=num_frames, cfg=cfg, refine=refine,
                           phase=phase)
    if fit is None or fit.needed <= fit.capacity:
        return
    needed, capacity = fit.needed, fit.capacity
    hint = (f"; at this aspect ratio and frame count about {fit.largest[1]}x{fit.largest[0]} fits" if fit.largest else
            "; fewer frames are needed first")
    raise ValueError(
        f"{what} ({width}x{height}, {num_frames} frames) needs about {needed / GiB:,.1f} GiB on {handle.device} "
        f"even with sequential offload (memory estimate), but the device has {capacity / GiB:,.1f} GiB: "
        f"that is the limit{hint}. Choose a smaller size.")


def check_step_cache_ready(handle: Any, step_cache: Any, *, transformer: str, sampler: Any, steps: int,
                           shift: float, sigmas: Any, guidance_scale: float) -> Keyed | None:
    """A calibrated method's key (`plan.step_cache_identity`, and for `magcache` the ratios of its calibration
    file), found once here for the stage; `magcache` without a calibration of exactly these settings is refused
    here (before any model work) with how to make one, not after the text encoder ran. None for the methods
    without a calibration."""
    settings = StepCacheSettings.of(step_cache)
    if not settings.calibrated:
        return None
    return keyed(settings, plan.step_cache_identity(handle, transformer=transformer, sampler=sampler, steps=steps,
                                                    shift=shift, sigmas=sigmas, guidance_scale=guidance_scale))


def decode_output_shape(latents: torch.Tensor) -> tuple[int, int, int]:
    """(frames, height, width) a Wan VAE decode of ``latents`` produces."""
    t, h, w = (int(s) for s in latents.shape[2:])
    return (t - 1) * 4 + 1, h * 8, w * 8


# -- whole stage requests ----------------------------------------------------------------------------

@dataclass(frozen=True)
class DenoiseRequest:
    """What `check_denoise` decided for one denoise call, used by the stage as given (not recomputed)."""

    method: Any  # the `sampling.Sampler`
    shape: tuple[int, ...]  # the latents' shape
    cfg: bool  # guidance_scale > 1: two branches per step
    step_cache: StepCacheSettings
    key: Keyed | None  # a calibrated method's key and ratios (`check_step_cache_ready`); None for other methods


def check_denoise(handle: Any, cond: Any, *, height: int, width: int, num_frames: int, steps: int,
                  guidance_scale: float, shift: float, sigmas: Any, sampler: Any, transformer: str,
                  image_cond: Any, cond_latent: Any, latents: Any,
                  cfg_batch: str = "off", step_cache: Any = None) -> DenoiseRequest:
    """Every denoise argument, before any model work (the one check a denoise stage calls); returns
    the figures it decided: the sampler, the latent shape, the step cache and its key."""
    validate_geometry(height, width, num_frames)
    check_steps(steps)
    check_guidance(guidance_scale)
    check_cfg_batch(cfg_batch)
    method = sampling.get_sampler(sampler)
    method.check(steps=steps, shift=shift, sigmas=sigmas, refine=transformer == REFINER)
    settings = StepCacheSettings.of(step_cache)
    check_step_cache(settings, steps=steps, sampler_name=method.name)
    key = check_step_cache_ready(handle, settings, transformer=transformer, sampler=method, steps=steps,
                                      shift=shift, sigmas=sigmas, guidance_scale=guidance_scale)
    if method.recommended and guidance_scale > 1.0 and method.recommended.get("guidance_scale") == 1.0:
        log.warning("%s: guidance %.2f on a CFG-distilled model applies guidance twice; its recipe is "
                    "guidance 1.0", method.name, guidance_scale)
    if image_cond is not None and (image_cond.height, image_cond.width) != (height, width):
        raise ValueError(f"the image condition was prepared for {image_cond.height}x{image_cond.width} "
                         f"but the video is {height}x{width}; encode the image at the video size")
    do_cfg = guidance_scale > 1.0
    if do_cfg:
        cond.negative_for_cfg()  # raises when there is no negative to guide against
    shape = latent_shape(height, width, num_frames)
    if latents is not None:
        checked_latents(latents, shape=shape)
    if cond_latent is not None:
        checked_latents(cond_latent, "cond_latent", channels=shape[1])
        if tuple(cond_latent.shape[3:]) != shape[3:] or cond_latent.shape[2] > shape[2]:
            raise ValueError(f"cond_latent {tuple(cond_latent.shape)} does not fit latents of shape {shape}")
    check_request_fits(handle, height=height, width=width, num_frames=num_frames, cfg=do_cfg, what="denoising")
    return DenoiseRequest(method=method, shape=shape, cfg=do_cfg, step_cache=settings, key=key)


def refine_frames_notice(n: int) -> str | None:
    """What the refiner says when it is given a frame count that is not 4n+1: it uses the first 4n+1."""
    usable = (n - 1) // VAE_TEMPORAL * VAE_TEMPORAL + 1
    if n <= 1 or usable == n:
        return None
    return (f"Refine: the base video has {n} frames; the refiner takes 4n+1 frames, so it refines the first "
            f"{usable} and drops the last {n - usable} (give {usable} or {usable + VAE_TEMPORAL} frames to keep them all).")


def check_refine_request(handle: Any, frames: Any, *, height: int, width: int, steps: int, shift: float,
                         t_thresh: float, tail_steps: int, seed: int, first_frame: Any, cond: Any = None,
                         guidance_scale: float | None = None, sampler: Any = None, cfg_batch: str = "off",
                         step_cache: Any = None) -> int:
    """Every refine argument, before anything is released or loaded; returns the usable frame count.

    `cond`, `guidance_scale` and `sampler` are checked when given (the `refine` stage gives them;
    `prepare_refine` does not sample).
    """
    if cond is not None and cond.with_image:
        raise ValueError("the refiner conditions on text only: encode the prompt without the image")
    if guidance_scale is not None:
        check_guidance(guidance_scale)
        check_cfg_batch(cfg_batch)
        method = sampling.get_sampler(sampler)
        method.check(steps=steps, shift=shift, refine=True)
        # the refiner's step count is known once its sigma list is (`check_refine_cache`)
        check_step_cache(StepCacheSettings.of(step_cache), steps=MIN_STEPS + 1, sampler_name=method.name)
    if not handle.has_refiner:
        raise ValueError("refinement needs the MoE checkpoint's refiner/ folder; this checkpoint has none")
    if not isinstance(frames, torch.Tensor) or frames.ndim != 4 or frames.shape[-1] != 3 or frames.shape[0] < 1:
        shape = tuple(frames.shape) if isinstance(frames, torch.Tensor) else type(frames).__name__
        raise ValueError(f"expected base frames shaped [F,H,W,3], got {shape}")
    checked_pixels(frames, "base frames", unit_range_only=True)
    n = int(frames.shape[0])
    if n == 1:
        raise ValueError("the refiner works on videos; a single frame (T2I) cannot be refined")
    usable = (n - 1) // 4 * 4 + 1
    if usable != n:
        log.warning("%s", refine_frames_notice(n))
    validate_geometry(height, width, usable)
    check_steps(steps)
    check_shift(shift)
    check_t_thresh(t_thresh)
    check_count("tail_steps", tail_steps)
    if tail_steps > MAX_STEPS:
        raise ValueError(f"tail_steps must be at most {MAX_STEPS}, got {tail_steps}")
    check_seed(seed)
    if first_frame is not None:
        picture = checked_image(first_frame, "first_frame")
        if isinstance(picture, Image.Image):
            check_picture(picture, "first_frame")
    check_request_fits(handle, height=height, width=width, num_frames=usable, what="refining")
    return usable


def validate_request(mode: str, *, height: int, width: int, num_frames: int, steps: int, image: Any,
                     refine_output: bool, guidance_scale: float = 3.0) -> None:
    """Every check that can fail a `generate` call without a model, run before any model work."""
    check_mode(mode)
    validate_geometry(height, width, num_frames)
    check_steps(steps)
    check_guidance(guidance_scale)
    if mode == "ti2v" and image is None:
        raise ValueError("TI2V needs a first-frame image")
    if mode != "ti2v" and image is not None:
        raise ValueError(f"an image was given but mode is {mode!r}; use mode='ti2v'")
    if mode == "t2i" and num_frames != 1:
        raise ValueError(f"T2I makes one frame; got num_frames={num_frames}")
    if mode == "t2i" and refine_output:
        raise ValueError("the refiner works on videos; it cannot refine T2I output")


__all__ = [
    "DenoiseRequest", "MODES", "check_step_cache_ready", "check_cfg_batch", "check_count", "check_denoise", "check_first_frame_pixels", "check_guidance", "check_mode",
    "check_refine_request", "check_steps", "check_t_thresh", "validate_geometry", "validate_request", "check_finite_number", "check_negative_prompt", "check_picture", "check_request_fits",
    "check_seed", "checked_image", "checked_latents", "checked_pixels", "decode_output_shape",
    "vae_channels",
]
