"""Extending a video past one clip: each new segment is sampled with the previous frames' last `k`
latent frames pinned as its condition (LingBot's inpainting condition, as TI2V pins one first frame),
then decoded and joined without the frames it shares with what came before.

The Wan VAE packs time 4x except for its first latent frame, which is one frame: `k` latent frames
are `4(k-1)+1` video frames. A segment of `num_frames` frames therefore starts with the
`overlap_frames(k)` frames it was conditioned on (their re-decode) and adds
`num_frames - overlap_frames(k)` new ones; the joined video holds each frame once, the re-decoded
ones dropped or blended (below). There is no end-frame (first-last-frame) conditioning in this model.

`k` defaults to 1: the condition is then one clean frame encoded as an image, exactly the TI2V
first-frame case the model was trained for; a larger `k` hands more motion over but asks the model
to continue from several pinned latent frames, a condition it was not trained on (quality unknown).

Where a segment meets what came before, its re-decoded overlap frames are dropped (`overlap_mode="drop"`,
the default: the frames before the seam stay exactly as they were) or cross-faded into the frames they
re-decode (`"blend"`: a linear ramp from the old frames to the segment's over the overlap, which eases
a colour or detail step at the seam at the cost of changing the last frames before it). Both keep the
joined length at `extended_length`.

Each segment may have its own prompt: `segment_prompts` reads one prompt, one per line or JSON list
item, or one caption with timed actions, which it cuts into one caption per segment's time span.

RNG per segment `i` (one CPU generator seeded with `seed + i`): the condition's posterior sample,
then the noise, TI2V's order. Every segment's frames are rounded to 8-bit levels (as they are
written), so a run that continues from segments saved earlier equals an uninterrupted one.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from . import caption_schema, stages
from . import image as image_ops
from . import stage_inputs as checks
from .distributed import stage as parallel_stage
from .errors import RefusedInput
from .placement.door import stage
from .sampling.guidance import StepCallback

__all__ = ["MAX_SEGMENTS", "MODEL_FPS", "OVERLAP_MODES", "check_extend_request", "condition_latent", "extend_video",
           "extended_length", "join_segment", "overlap_frames", "segment_frames", "segment_prompts", "segment_spans",
           "to_8bit"]

VAE_TEMPORAL = 4  # video frames per latent frame after the first (the Wan VAE)
MAX_SEGMENTS = 64
MODEL_FPS = 24.0  # LingBot-Video's frame rate (trained at 24 fps): a segment's seconds in a timed caption
OVERLAP_MODES = ("drop", "blend")
"""What happens to a segment's re-decoded overlap frames; the first is the default."""


def overlap_frames(k: int) -> int:
    """Video frames behind `k` latent frames: the first latent frame is one frame, each next one 4."""
    return VAE_TEMPORAL * (k - 1) + 1


def extended_length(input_frames: int, segments: int, num_frames: int, k: int) -> int:
    """Frames of the joined video: the input, then each segment's frames less the overlap."""
    return input_frames + segments * (num_frames - overlap_frames(k))


def segment_spans(segments: int, num_frames: int, k: int, fps: float = MODEL_FPS) -> list[tuple[float, float]]:
    """Each segment's (start, end) seconds on the extension's timeline, whose 0 is the first frame the
    first segment is conditioned on (with k=1 the input's last frame): segment `i` runs from frame
    `i * (num_frames - overlap_frames(k))` over its `num_frames` frames."""
    step = num_frames - overlap_frames(k)
    return [(i * step / fps, (i * step + num_frames - 1) / fps) for i in range(segments)]


def _one_per_segment(items: list[str], segments: int, what: str) -> list[str]:
    if len(items) > segments:
        raise RefusedInput(f"the segment prompts are {len(items)} {what} for {segments} segments: one per segment "
                           "(the last repeats), or add segments")
    return items


def segment_prompts(text: str, *, segments: int, num_frames: int, k: int, fps: float = MODEL_FPS) -> list[str]:
    """The prompt of each segment from one text (empty: [], every segment takes the given conditioning):

    - a JSON caption with timed actions: one caption per segment, each with the actions in that
      segment's time span (`segment_spans`; time 0 is where the first segment starts), timed from the
      segment's start (`caption_schema.caption_window`); a segment the actions do not reach is refused;
    - any other JSON object (a caption without timed actions): that one prompt for every segment;
    - a JSON list: one item per segment (text, or a caption object);
    - else one prompt per non-empty line.
    A list or lines give at most `segments` prompts; the last repeats for the segments after it.
    """
    text = (text or "").strip()
    if not text:
        return []
    parsed: Any = None
    if text[0] in "[{":
        try:
            parsed = json.loads(text)
        except (ValueError, RecursionError):
            parsed = None  # e.g. one caption per line: read as lines
    if isinstance(parsed, dict):
        if not caption_schema.timed_actions(parsed):
            return [text]
        windows = []
        last_end = max(end for _start, end in caption_schema.timed_actions(parsed))
        for i, (start, end) in enumerate(segment_spans(segments, num_frames, k, fps)):
            window = caption_schema.caption_window(parsed, start, end)
            if not caption_schema.timed_actions(window):
                raise RefusedInput(f"segment {i + 1} runs from {start:.1f} s to {end:.1f} s of the caption's timeline, "
                                   f"but its timed actions end at {last_end:g} s: write actions up to {end:.1f} s "
                                   "or extend by fewer segments")
            windows.append(json.dumps(window, ensure_ascii=False, separators=(",", ":")))
        return windows
    if isinstance(parsed, list):
        items = [item.strip() if isinstance(item, str) else json.dumps(item, ensure_ascii=False, separators=(",", ":"))
                 for item in parsed]
        if not items or not all(items):
            raise RefusedInput("a JSON list of segment prompts must hold one non-empty prompt per segment")
        return _one_per_segment(items, segments, "list items")
    return _one_per_segment([line.strip() for line in text.splitlines() if line.strip()], segments, "lines")


def join_segment(joined: torch.Tensor, frames: torch.Tensor, overlap: int, mode: str = OVERLAP_MODES[0]) -> torch.Tensor:
    """`joined` [F,H,W,3] followed by a segment's `frames` [N,H,W,3] whose first `overlap` frames
    re-decode `joined`'s last ones: those dropped, or (`blend`) cross-faded into them with weights
    (j+1)/(overlap+1), j = 0..overlap-1, for the segment (8-bit levels). F + N - overlap frames."""
    if mode not in OVERLAP_MODES:
        raise ValueError(f"overlap mode must be one of {', '.join(OVERLAP_MODES)}, got {str(mode)[:40]}")
    if mode == "blend":
        weight = torch.arange(1, overlap + 1, dtype=torch.float32).div(overlap + 1).view(-1, 1, 1, 1)
        seam = to_8bit(torch.lerp(joined[-overlap:].float(), frames[:overlap].float(), weight))
        return torch.cat([joined[:-overlap], seam, frames[overlap:]])
    return torch.cat([joined, frames[overlap:]])


def _count(value: Any, name: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{name} must be a whole number from {low} to {high}, got {str(value)[:40]}")
    return value


def check_extend_request(video: Any, *, segments: int, k: int, num_frames: int, height: int, width: int,
                         prompts: int = 1) -> None:
    """Every extension input, in one line each, before any model work."""
    _count(segments, "segments", 1, MAX_SEGMENTS)
    stages.validate_geometry(height, width, num_frames)
    latent_frames = (num_frames - 1) // VAE_TEMPORAL + 1
    if num_frames == 1:
        raise ValueError("a segment of 1 frame adds nothing: extend with segments of 4n+1 frames (5, 9, ... 121)")
    _count(k, "overlap (condition latent frames k)", 1, latent_frames - 1)
    if not isinstance(video, torch.Tensor) or video.ndim != 4 or video.shape[-1] != 3:
        shape = tuple(video.shape) if isinstance(video, torch.Tensor) else type(video).__name__
        raise ValueError(f"the video to extend must be frames shaped [F,H,W,3] (an IMAGE batch), got {shape}")
    need = overlap_frames(k)
    if video.shape[0] < need:
        raise ValueError(f"the video to extend has {video.shape[0]} frames; k={k} conditions on its last {need}: "
                         f"load more frames or lower k")
    if prompts < 1:
        raise ValueError("give at least one prompt for the segments")


def _pixels(frames: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """[F,H,W,3] in [0,1] -> (1,3,F,height,width), resized like a first frame when the size differs."""
    checks.checked_pixels(frames, "video", unit_range_only=True)
    x = frames.float().permute(0, 3, 1, 2)
    if tuple(x.shape[-2:]) != (height, width):
        x = image_ops.cover_crop(x, height, width).clamp(0, 1)
    return x.permute(1, 0, 2, 3).unsqueeze(0).contiguous()


def to_8bit(frames: torch.Tensor) -> torch.Tensor:
    """Frames rounded to the 8-bit levels a saved video holds (float32 in [0,1])."""
    return frames.float().clamp(0, 1).mul(255).round().div(255)


def condition_latent(handle, video: torch.Tensor, *, k: int, height: int, width: int,
                     generator: torch.Generator, tiling: dict | bool | None = None) -> torch.Tensor:
    """The DiT-space condition (1,C,k,h,w): the VAE posterior sample of the video's last
    `overlap_frames(k)` frames (draws from `generator`)."""
    pixels = _pixels(video[-overlap_frames(k):], height, width)
    with stage(handle, "vae") as device:
        vae = handle.component("vae")
        with stages._vae_tiling(vae, tiling):
            return stages.encode_sample(vae, pixels, device, generator)


def segment_frames(handle, cond: stages.Conditioning, previous: torch.Tensor, *, k: int, height: int, width: int,
                   num_frames: int, seed: int, steps: int = 40, guidance_scale: float = 3.0, shift: float = 3.0,
                   tiling: dict | bool | None = None, callback: StepCallback | None = None, all_frames: bool = False,
                   **denoise_options: Any) -> torch.Tensor:
    """One segment continuing `previous` [F,H,W,3]: its `num_frames - overlap_frames(k)` new frames
    (float32 in [0,1], 8-bit levels, CPU); with `all_frames`, all `num_frames` of them, the re-decoded
    overlap first. `denoise_options` go to `stages.denoise` (sampler, cfg_batch, step_cache)."""
    g = torch.Generator("cpu").manual_seed(checks.check_seed(seed))
    cond_latent = condition_latent(handle, previous, k=k, height=height, width=width, generator=g, tiling=tiling)
    latents = stages.denoise(handle, cond, height=height, width=width, num_frames=num_frames, steps=steps,
                             guidance_scale=guidance_scale, shift=shift, generator=g, cond_latent=cond_latent,
                             callback=callback, **denoise_options)
    del cond_latent
    frames = stages.decode(handle, latents, tiling=tiling)
    del latents
    return to_8bit(frames if all_frames else frames[overlap_frames(k):])


# -- segments written as they finish ------------------------------------------------------------

def model_identity(handle) -> dict[str, Any]:
    """What the DiT that samples a segment is, for a saved segment's name: its files (path, size, mtime;
    the folder where the handle has no file list), how its weights are held and multiplied, and the
    view's LoRA stack. A swapped DiT, a transformer_path, a quantized copy or a LoRA never reuses
    segments another model sampled."""
    from .lora import lora_stack

    shared = handle.shared
    info = handle.info
    source = info.sources.get(stages.TRANSFORMER) if info is not None else None
    files = []
    for path in getattr(source, "files", None) or []:
        try:
            st = os.stat(path)
            files.append((str(path), st.st_size, st.st_mtime_ns))
        except OSError:
            files.append((str(path), None, None))
    return {"folder": str(handle.folder or ""), "files": files, "student": str(shared.transformer_source),
            "weights": shared.weights, "dtype": str(shared.dtypes.get(stages.TRANSFORMER)),
            "fp8_matmul": shared.fp8_matmul, "attention": str(shared.attention_backend),
            "sparse": repr(shared.sparse) if shared.attention_backend == "sparse" else None,
            "loras": [(repr(item.lora.fingerprint), item.strength, item.apply_to)
                      for item in lora_stack(handle).items]}


def _digest(video: torch.Tensor, conds: Sequence[stages.Conditioning], settings: dict) -> str:
    """What a saved segment depends on: the input frames (8-bit), the encoded prompts, the settings."""
    h = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode())
    h.update((to_8bit(video) * 255).to(torch.uint8).numpy().tobytes())
    for cond in conds:
        for embeds in (cond.positive, cond.negative):
            if embeds is not None:
                h.update(embeds.embeds.float().numpy().tobytes())
    return h.hexdigest()[:16]


def _segment_file(folder: Path, digest: str, index: int) -> Path:
    return folder / f"extend_{digest}_{index:03d}.npy"


def _load_segment(path: Path, expected: tuple[int, ...]) -> torch.Tensor | None:
    try:
        array = np.load(path, allow_pickle=False)
    except (OSError, ValueError):
        return None
    if array.dtype != np.uint8 or tuple(array.shape) != expected:
        return None
    return torch.from_numpy(array.astype(np.float32) / 255.0)


def _save_segment(path: Path, frames: torch.Tensor) -> None:
    part = path.with_suffix(".part.npy")
    np.save(part, (frames * 255).round().to(torch.uint8).numpy())
    os.replace(part, path)  # a segment is there whole or not at all


def extend_video(handle, video: torch.Tensor, conds: stages.Conditioning | Sequence[stages.Conditioning], *,
                 segments: int, k: int = 1, num_frames: int = 121, steps: int = 40, guidance_scale: float = 3.0,
                 shift: float = 3.0, seed: int = 42, tiling: dict | bool | None = None,
                 folder: str | Path | None = None, callback: StepCallback | None = None,
                 on_segment: Callable[[int, torch.Tensor, bool], None] | None = None, keep: bool = False,
                 overlap_mode: str = OVERLAP_MODES[0], **denoise_options: Any) -> torch.Tensor:
    """`video` [F,H,W,3] followed by `segments` new segments; returns the joined frames [F',H,W,3]
    (`extended_length` frames), at the input's size (a multiple of 16).

    `conds`: one conditioning for every segment, or one per segment (the last repeats). `overlap_mode`: what
    becomes of each segment's re-decoded overlap frames (`OVERLAP_MODES`, see `join_segment`). Segment `i`
    uses seed `seed + i`. Only one segment's latents and decode are alive at a time; the joined
    frames grow on the CPU. With `folder`, each finished segment is written there (8-bit .npy,
    named by a digest of the input, prompts and settings) and a rerun with the same ones loads it
    instead of sampling it again (an interrupted run loses only the segment it was in); the files are
    removed once the whole extension is done, unless `keep`. `on_segment(i, frames, reused)` hears
    each segment as it is done.
    """
    conds = [conds] if isinstance(conds, stages.Conditioning) else list(conds)
    if overlap_mode not in OVERLAP_MODES:
        raise RefusedInput(f"overlap_mode must be one of {', '.join(OVERLAP_MODES)}, got {str(overlap_mode)[:40]}")
    if parallel_stage.active_layout(handle) is not None:  # only rank 0 decodes: the others would
        # condition the next segment on placeholder frames
        raise RefusedInput("extending a video runs in one process: run it without --parallel / torchrun "
                           "(or connect the pipe from before LingBot Parallel)")
    if not isinstance(video, torch.Tensor) or video.ndim != 4:
        check_extend_request(video, segments=segments, k=k, num_frames=num_frames, height=16, width=16)
    height, width = int(video.shape[1]), int(video.shape[2])
    check_extend_request(video, segments=segments, k=k, num_frames=num_frames, height=height, width=width,
                         prompts=len(conds))
    checks.check_seed(seed)
    checks.check_seed(seed + segments - 1)
    checks.checked_pixels(video, "video", unit_range_only=True)
    checks.check_request_fits(handle, height=height, width=width, num_frames=num_frames,
                              cfg=guidance_scale > 1.0, what="one extension segment")
    target = Path(folder) if folder is not None else None
    if target is not None:
        target.mkdir(parents=True, exist_ok=True)
    settings = dict(k=k, num_frames=num_frames, steps=steps, guidance_scale=guidance_scale, shift=shift, seed=seed,
                    tiling=tiling, options=sorted((n, repr(v)) for n, v in denoise_options.items()),
                    model=model_identity(handle))
    joined = to_8bit(video)
    written = []
    for i in range(segments):
        cond = conds[min(i, len(conds) - 1)]
        digest = _digest(joined[-overlap_frames(k):], [cond], settings | {"segment": i})
        path = _segment_file(target, digest, i) if target is not None else None
        frames = _load_segment(path, (num_frames, height, width, 3)) if path is not None and path.is_file() else None
        reused = frames is not None
        if path is not None:
            written.append(path)
        if frames is None:  # all its frames: a rerun may join it either way
            frames = segment_frames(handle, cond, joined, k=k, height=height, width=width, num_frames=num_frames,
                                    seed=seed + i, steps=steps, guidance_scale=guidance_scale, shift=shift,
                                    tiling=tiling, callback=callback, all_frames=True, **denoise_options)
            if path is not None:
                _save_segment(path, frames)
        joined = join_segment(joined, frames, overlap_frames(k), overlap_mode)
        if on_segment is not None:
            on_segment(i, frames[overlap_frames(k):], reused)
        del frames
    if not keep:
        for path in written:
            path.unlink(missing_ok=True)
    return joined

