"""The pipeline as separate stages over one handle: what nodes call, one at a time, in any order.

Each stage is a plain function: a handle plus explicit inputs in, plain CPU tensors or dataclasses
out. Nothing is carried between stages except the handle, and every stage enters through
the stage door (`placement.door.stage`). `generate()` chains them the way the reference pipeline does.

RNG order (reference): TI2V draws the first frame's VAE posterior sample, then the initial noise,
from one CPU generator seeded with `seed`. The refiner uses a fresh generator from the same seed:
posterior sample of the upscaled video, then (TI2V) of the first-frame image, then the noise.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from . import image as image_ops
from . import prompt as prompt_ops
from . import sampling
from . import stage_inputs as checks
from .components import REFINER, TRANSFORMER
from .distributed import stage as parallel_stage
from .latents import dit_to_vae, vae_to_dit
from .placement import plan
from .placement.door import effective_mode, oom_fallback, release, sampling_figures, stage
from .placement.estimate import Geometry
from .prompt import PromptEmbeds
from .sampling.guidance import Guidance, StepCallback, pin_first_frames, sample
from .sampling.sigmas import compute_refiner_sigmas
from .sampling.step_cache import StepCache, StepCacheSettings, check_step_cache
from .stage_inputs import MODES, validate_geometry, validate_request  # noqa: F401  (MODES: part of the stage API)
from .weights.modules import stored_formats

log = logging.getLogger(__name__)

REFINER_DEFAULTS = dict(height=1088, width=1920, steps=8, shift=3.0, guidance_scale=3.0, t_thresh=0.85,
                        tail_steps=2)
REFINER_TILING = dict(tile_sample_min_height=384, tile_sample_min_width=640, tile_sample_stride_height=288,
                      tile_sample_stride_width=480)


# -- data passed between stages -------------------------------------------------------------------

@dataclass
class Conditioning:
    """Encoded prompts (CPU). `negative` None: no CFG possible unless `zero_negative` (the refiner's)."""

    positive: PromptEmbeds
    negative: PromptEmbeds | None = None
    zero_negative: bool = False
    prompt: str = ""
    with_image: bool = False

    def negative_for_cfg(self) -> PromptEmbeds:
        if self.zero_negative:
            return PromptEmbeds(torch.zeros_like(self.positive.embeds), self.positive.mask.clone(),
                                self.positive.input_ids)
        if self.negative is None:
            raise ValueError("guidance_scale > 1 needs a negative prompt: encode one, or set guidance_scale to 1")
        return self.negative


@dataclass
class ImageCondition:
    """The TI2V first frame: conditioning pixels, the picture the vision tower sees, and the VAE posterior.

    The posterior is kept as mean/std (VAE space) so the *sample* is drawn by the denoise stage from
    its own seeded generator, in the reference's order.
    """

    pixels: torch.Tensor  # (1,3,1,H,W) in [0,1]
    vision_image: Image.Image
    latent_mean: torch.Tensor | None = None  # (1,16,1,h,w) VAE space, float32
    latent_std: torch.Tensor | None = None
    vae_config: Any = field(default=None, repr=False)

    @property
    def height(self) -> int:
        return int(self.pixels.shape[-2])

    @property
    def width(self) -> int:
        return int(self.pixels.shape[-1])

    def sample_latent(self, generator: torch.Generator | None) -> torch.Tensor:
        """A posterior sample in DiT space (draws from `generator`)."""
        if self.latent_mean is None:
            raise ValueError("this image condition has no VAE latent; run the VAE-encode stage on it first")
        noise = torch.randn(self.latent_mean.shape, generator=generator, dtype=torch.float32)
        return vae_to_dit(self.latent_mean + self.latent_std * noise, self.vae_config)


# -- shared helpers --------------------------------------------------------------------------------

def _generator(seed: int | None, generator: torch.Generator | None) -> torch.Generator:
    if generator is not None:
        return generator
    if seed is None:
        raise ValueError("give a seed (or a torch.Generator)")
    return torch.Generator("cpu").manual_seed(checks.check_seed(seed))


# -- text ------------------------------------------------------------------------------------------

@oom_fallback
def encode_prompt(
    handle,
    prompt: str | dict | list,
    negative_prompt: str | None = "",
    *,
    image: ImageCondition | torch.Tensor | None = None,
    mode: str = "t2v",
) -> Conditioning:
    """Encode a prompt and its negative with the Qwen3-VL encoder.

    `negative_prompt=""` picks the reference default (the image one for T2I); None skips the
    negative (no CFG). For TI2V pass the image condition (or its pixels): both prompts then see it.
    """
    checks.check_mode(mode)
    checks.check_negative_prompt(negative_prompt)
    text = prompt_ops.caption_to_text(prompt)
    if not text.strip():
        raise ValueError("the prompt is empty")
    if negative_prompt == "":
        negative_prompt = prompt_ops.DEFAULT_NEGATIVE_PROMPT_IMAGE if mode == "t2i" else prompt_ops.DEFAULT_NEGATIVE_PROMPT
    picture = None
    if image is not None:
        pixels = image.pixels if isinstance(image, ImageCondition) else image
        picture = image.vision_image if isinstance(image, ImageCondition) else None
        if picture is None:  # raw pixels: checked here, before the encoder loads
            checks.check_first_frame_pixels(pixels)
        if handle.info is not None:  # a text-only encoder file: refused from its header, before it loads
            from .checkpoints.text_encoder_file import require_vision_file

            require_vision_file(handle.info.file_sources.get("text_encoder"))

    def encode() -> Conditioning:
        nonlocal picture
        with stage(handle, "text_encoder", "processor", phase="text") as device:
            encoder, processor = handle.component("text_encoder"), handle.component("processor")
            if image is not None and picture is None:
                picture = image_ops.vision_image(pixels, image_ops.vision_patch_size(encoder, processor))
            state = handle.shared.states.get("text_encoder")  # what its load found (a text-only file)
            positive = prompt_ops.encode_text(encoder, processor, text, image=picture, device=device,
                                              state=state).to("cpu")
            negative = None
            if negative_prompt is not None:
                negative = prompt_ops.encode_text(encoder, processor, negative_prompt, image=picture,
                                                  device=device, state=state).to("cpu")
        return Conditioning(positive, negative, prompt=text, with_image=picture is not None)

    # on a parallel view rank 0 encodes and the other ranks receive the embeddings
    return parallel_stage.from_rank0(handle, encode, _pack_conditioning, _unpack_conditioning, _CONDITIONING_PARTS)


_CONDITIONING_PARTS = ("pos_embeds", "pos_mask", "pos_ids", "neg_embeds", "neg_mask", "neg_ids", "flags", "prompt")


def _pack_conditioning(cond: Conditioning) -> dict[str, torch.Tensor | None]:
    pos, neg = cond.positive, cond.negative
    return {"pos_embeds": pos.embeds, "pos_mask": pos.mask, "pos_ids": pos.input_ids,
            "neg_embeds": None if neg is None else neg.embeds, "neg_mask": None if neg is None else neg.mask,
            "neg_ids": None if neg is None else neg.input_ids,
            "flags": torch.tensor([int(cond.zero_negative), int(cond.with_image)]),
            "prompt": parallel_stage.text_tensor(cond.prompt)}


def _unpack_conditioning(got: dict[str, torch.Tensor | None]) -> Conditioning:
    negative = None
    if got["neg_embeds"] is not None:
        negative = PromptEmbeds(got["neg_embeds"], got["neg_mask"], got["neg_ids"])
    zero_negative, with_image = (bool(v) for v in got["flags"].tolist())
    return Conditioning(PromptEmbeds(got["pos_embeds"], got["pos_mask"], got["pos_ids"]), negative,
                        zero_negative=zero_negative, prompt=parallel_stage.tensor_text(got["prompt"]),
                        with_image=with_image)


# -- image / VAE encode ----------------------------------------------------------------------------

@contextmanager
def _vae_tiling(vae, tiling: dict[str, int] | bool | None):
    """Apply tiling settings to the shared VAE for one stage and restore them afterwards."""
    if tiling is None:
        yield
        return
    keys = ("use_tiling", *REFINER_TILING)
    saved = {k: getattr(vae, k) for k in keys if hasattr(vae, k)}
    try:
        if tiling is False:
            vae.use_tiling = False
        else:
            params = {} if tiling is True else dict(tiling)
            for k, v in params.items():
                if k not in REFINER_TILING or not isinstance(v, int) or v <= 0:
                    raise ValueError(f"bad VAE tiling option {k}={v!r}; options: {', '.join(REFINER_TILING)}")
            for kind in ("height", "width"):
                tile = params.get(f"tile_sample_min_{kind}", getattr(vae, f"tile_sample_min_{kind}"))
                stride = params.get(f"tile_sample_stride_{kind}", getattr(vae, f"tile_sample_stride_{kind}"))
                if stride > tile:
                    raise ValueError(f"VAE tile stride {stride} exceeds tile size {tile} ({kind})")
            vae.enable_tiling(**params)
        yield
    finally:
        for k, v in saved.items():
            setattr(vae, k, v)


def _encode_posterior(vae, pixels: torch.Tensor, device: torch.device):
    """VAE posterior of (B,3,T,H,W) pixels in [0,1]; the reference encodes under bf16 autocast on CUDA."""
    x = ((pixels.to(device=device, dtype=torch.float32) - 0.5) / 0.5)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()
    with torch.no_grad(), autocast:
        dist = vae.encode(x).latent_dist
    return dist.mean.float(), dist.std.float()


def encode_sample(vae, pixels: torch.Tensor, device: torch.device, generator: torch.Generator) -> torch.Tensor:
    """A VAE posterior sample of (1,3,F,H,W) pixels in [0,1], in DiT space on the CPU (draws from `generator`)."""
    mean, std = _encode_posterior(vae, pixels, device)
    return vae_to_dit(mean.cpu() + std.cpu() * torch.randn(mean.shape, generator=generator), vae.config)


def renoise(clean: torch.Tensor, noise: torch.Tensor, sigma: float) -> torch.Tensor:
    """Clean latents moved to noise level `sigma` of the flow (SDEdit): the refiner's start at t_thresh,
    video-to-video's at its strength's point of the schedule."""
    return (1.0 - sigma) * clean + sigma * noise


@oom_fallback
def encode_image(handle, image: Any, height: int, width: int, *, tiling: dict | bool | None = None) -> ImageCondition:
    """TI2V first frame: reference pixel preparation, the vision-tower picture, and the VAE posterior."""
    validate_geometry(height, width, 1)
    checks.check_request_fits(handle, height=height, width=width, num_frames=1, phase="decode",
                              what="encoding the first frame")
    picture = image_ops.load_image(checks.checked_image(image))
    checks.check_picture(picture)
    pixels = image_ops.prepare_image_pixels(picture, height, width)

    def posterior() -> tuple[torch.Tensor, torch.Tensor, Any]:
        with stage(handle, "vae") as device:
            vae = handle.component("vae")
            with _vae_tiling(vae, tiling):
                mean, std = _encode_posterior(vae, pixels, device)
            return mean, std, vae.config

    # on a parallel view rank 0 runs the VAE; the others receive the posterior and read the VAE's config
    mean, std, vae_config = parallel_stage.from_rank0(
        handle, posterior, lambda got: {"mean": got[0].cpu(), "std": got[1].cpu()},
        lambda got: (got["mean"], got["std"], handle.vae_config()), ("mean", "std"))
    with stage(handle, "processor"):
        patch = image_ops.vision_patch_size(handle.shared.loaded.get("text_encoder"), handle.component("processor"))
    return ImageCondition(pixels, image_ops.vision_image(pixels, patch), mean.cpu(), std.cpu(), vae_config)


# -- denoise ---------------------------------------------------------------------------------------

def prepare_latents(shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """Initial noise, float32, drawn on the CPU so every device gets the reference's numbers."""
    return torch.randn(shape, generator=generator, dtype=torch.float32)


@oom_fallback
def denoise(
    handle,
    cond: Conditioning,
    *,
    height: int,
    width: int,
    num_frames: int,
    steps: int = 40,
    guidance_scale: float = 3.0,
    shift: float = 3.0,
    seed: int | None = None,
    generator: torch.Generator | None = None,
    image_cond: ImageCondition | None = None,
    cond_latent: torch.Tensor | None = None,
    latents: torch.Tensor | None = None,
    sigmas: torch.Tensor | None = None,
    transformer: str = TRANSFORMER,
    callback: StepCallback | None = None,
    sampler: str | sampling.Sampler | None = None,
    trace: dict | None = None,
    cfg_batch: str = "off",
    step_cache: str | StepCacheSettings | None = "off",
) -> torch.Tensor:
    """Sample with `sampler` (default flow-UniPC); returns the final DiT-space latents (float32, CPU).

    `sampler` is a name from `sampling.SAMPLERS` or a `sampling.Sampler`. `latents` starts from given
    latents instead of noise; `sigmas` is an explicit schedule, used as given (shift does not apply,
    as for the refiner). guidance_scale <= 1 runs one DiT forward per step and needs no negative.
    The first-frame condition (`image_cond` or `cond_latent`) is written into latent frame 0 before
    the loop and after every step. `callback(step, total, latents)` runs after every step; raising
    from it cancels the run cleanly. `trace` (a dict) receives the run (`trace["run"]`: its
    timesteps, sigmas and, for stochastic samplers, what it drew). `cfg_batch` ("off", "on",
    "auto"): run CFG's two branches as one batch-2 forward ("auto": where it is expected to be faster, on a
    GPU, with quantized weights or a DiT streamed from disk, and the memory estimate says it fits the device
    under the installed offload mode); within float rounding of "off", not bit-equal.
    `step_cache`: a method name from `sampling.step_cache.STEP_CACHE` or `StepCacheSettings` (method
    and knobs); refused for dmd_student and for 8 steps or fewer.
    """
    request = checks.check_denoise(  # every check; the figures it decided are used below as given
        handle, cond, height=height, width=width, num_frames=num_frames, steps=steps,
        guidance_scale=guidance_scale, shift=shift, sigmas=sigmas, sampler=sampler, transformer=transformer,
        image_cond=image_cond, cond_latent=cond_latent, latents=latents, cfg_batch=cfg_batch,
        step_cache=step_cache)
    parallel = parallel_stage.sampling(  # on several processes: refused, agreed on, FSDP-sharded here
        handle, transformer, cond, cfg_batch=cfg_batch, step_cache=step_cache, guidance_scale=guidance_scale,
        job=dict(height=height, width=width, num_frames=num_frames, steps=steps, shift=shift, seed=seed,
                 generator=generator, cond_latent=cond_latent, latents=latents, sigmas=sigmas, sampler=sampler,
                 image_cond=image_cond))
    g = _generator(seed, generator)
    method, do_cfg = request.method, request.cfg
    latents, cond_latent = _starting_latents(request.shape, g, latents, cond_latent, image_cond)
    needs = (transformer, "scheduler") if method.uses_scheduler else (transformer,)
    with stage(handle, *needs, phase="refine" if transformer == REFINER else "denoise",
               geometry=Geometry(height, width, num_frames, cfg=do_cfg)) as device:
        cond_latent = _on(cond_latent, device)
        latents = pin_first_frames(latents.to(device=device, dtype=torch.float32), cond_latent)
        run = method.start(steps=steps, shift=shift, sigmas=sigmas, device=device, generator=g,
                           scheduler=handle.component("scheduler") if method.uses_scheduler else None,
                           record=trace is not None)
        if trace is not None:
            trace["run"] = run
        dit = handle.component(transformer)
        before = _chunk_on(dit)
        figures = sampling_figures(  # batching and chunking, decided at once under the installed mode
            handle, transformer, packed=bool(stored_formats(dit)), cfg_batch=cfg_batch, splits_cfg=parallel.splits_cfg,
            set_on_model=before)
        if figures.cfg_batch_why:
            log.info("%s", figures.cfg_batch_why)
        guidance = _guidance(parallel, dit, handle.dtype_of(transformer), cond, guidance_scale, device,
                             figures.cfg_batch)
        if request.step_cache.enabled:  # a fresh cache for this call, keyed as the request check found it
            guidance.cache = StepCache(request.step_cache, steps=len(run), key=request.key)
        with _ffn_chunk(transformer, dit, figures, before), parallel.loop(guidance) as status:
            latents = sample(run, guidance, latents, cond_latent=cond_latent, callback=callback, status=status)
        return latents.cpu()


def _chunk_on(dit: Any) -> int | None:
    """The FFN/MoE chunk set on the DiT itself (`set_ffn_chunk`), None when none is."""
    blocks = getattr(dit, "blocks", None)
    return getattr(blocks[0], "ffn_chunk", None) if blocks else None


@contextmanager
def _ffn_chunk(transformer: str, dit: Any, figures: plan.SamplingFigures, before: int | None):
    """Run the DiT's FFN/MoE over the chunk this call needs (`figures.ffn_chunk`, from
    `plan.sampling_figures`). The model's own setting is back afterwards."""
    chunk = figures.ffn_chunk
    if chunk:
        log.info("%s: FFN/MoE over %d-token chunks (%s)", transformer, chunk, figures.ffn_chunk_why)
    if not hasattr(dit, "set_ffn_chunk") or chunk == before:
        yield chunk
        return
    dit.set_ffn_chunk(chunk)
    try:
        yield chunk
    finally:
        dit.set_ffn_chunk(before)


def _starting_latents(shape: tuple[int, ...], g: torch.Generator, latents: torch.Tensor | None,
                      cond_latent: torch.Tensor | None, image_cond: ImageCondition | None):
    """(initial latents, first-frame condition or None), drawing from `g` in the reference's order:
    the image condition's posterior sample first, then the noise."""
    if cond_latent is None and image_cond is not None:
        cond_latent = image_cond.sample_latent(g)
    if latents is None:
        latents = prepare_latents(shape, g)
    return latents, cond_latent


def _on(tensor: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    return None if tensor is None else tensor.to(device=device, dtype=torch.float32)


def _guidance(parallel: parallel_stage.ParallelSampling, dit: Any, dit_dtype: torch.dtype, cond: Conditioning,
              guidance_scale: float, device: torch.device, batch_cfg: bool = False) -> Guidance:
    """The DiT's guided prediction for this call: prompts on the device in the DiT's dtype."""
    negative = cond.negative_for_cfg() if guidance_scale > 1.0 else None
    return parallel.guidance(dit, cond.positive.to(device, dit_dtype),
                             negative.to(device, dit_dtype) if negative is not None else None, guidance_scale,
                             dtype=dit_dtype, device=device, batch_cfg=batch_cfg)


# -- decode ----------------------------------------------------------------------------------------

@oom_fallback
def decode(handle, latents: torch.Tensor, *, tiling: dict | bool | None = None, light: Any = None) -> torch.Tensor:
    """DiT-space latents (1,16,T,h,w) -> frames [F,H,W,3] float32 in [0,1] on the CPU.

    `light`: a light decoder file (`checkpoints.light_vae_file`: TAEHV / LightTAE) to decode with instead
    of the Wan VAE: much faster and smaller, lower quality (drafts, previews); `tiling` is then unused."""
    _check_decode_input(handle, latents, light=light)
    if not parallel_stage.is_leader(handle):  # rank 0 decodes and saves; the others hold a placeholder
        return parallel_stage.placeholder_frames(*checks.decode_output_shape(latents))
    if light is not None:
        return _decode_light(handle, latents, light)
    frames, height, width = checks.decode_output_shape(latents)
    with stage(handle, "vae", phase="decode", geometry=Geometry(height, width, frames, vae_tiling=bool(tiling))) as device:
        vae = handle.component("vae")
        z = dit_to_vae(latents.to(device), vae.config).to(dtype=torch.float32)
        z = z.contiguous(memory_format=torch.channels_last_3d)
        vae_dtype = next(vae.parameters()).dtype
        autocast = (torch.autocast("cuda", dtype=vae_dtype)
                    if device.type == "cuda" and vae_dtype in (torch.bfloat16, torch.float16) else nullcontext())
        with _vae_tiling(vae, tiling), torch.no_grad(), autocast:
            video = vae.decode(z, return_dict=False)[0]
        frames = ((video.float().clamp(-1, 1) + 1.0) / 2.0)[0].permute(1, 2, 3, 0)
        return frames.cpu().contiguous()


def _decode_light(handle, latents: torch.Tensor, light: Any) -> torch.Tensor:
    from .checkpoints.light_vae_file import cached_light_vae
    from .interrupt import checkpoints
    from .models.light_vae import decode_frames

    model = cached_light_vae(light)  # a wrong file is refused here, before the stage
    config = handle.vae_config() if model.latent_space == "raw" else None
    with stage(handle, label="light vae") as device, checkpoints({"light_vae": model}):
        return decode_frames(model, latents, config, device)


def _check_decode_input(handle, latents: Any, light: Any = None) -> None:
    checks.checked_latents(latents, channels=checks.vae_channels(handle), finite=False)
    frames, height, width = checks.decode_output_shape(latents)
    if light is None:  # the fit check estimates the Wan VAE; the light decoder needs a small fraction of it
        checks.check_request_fits(handle, height=height, width=width, num_frames=frames, phase="decode",
                                  what="decoding these latents")
    checks.check_finite_latents(latents)  # after the size check: scanning an absurd tensor is slow too


def decode_vae_latents(handle, vae_latents: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """Decode raw Wan-VAE latents (ComfyUI's LATENT convention)."""
    _check_decode_input(handle, vae_latents, light=kwargs.get("light"))  # before the VAE config is read
    if not parallel_stage.is_leader(handle):
        return parallel_stage.placeholder_frames(*checks.decode_output_shape(vae_latents))
    if kwargs.get("light") is not None:  # the latent statistics only: the Wan VAE stays unloaded
        config = handle.vae_config()
    else:
        with stage(handle, "vae"):
            config = handle.component("vae").config
    return decode(handle, vae_to_dit(vae_latents, config), **kwargs)


# -- refine ----------------------------------------------------------------------------------------

def upscale_frames(frames: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Frames [F,H0,W0,3] in [0,1] -> (1,3,F,H,W), bicubic (no antialias), clamped."""
    if frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(f"expected frames shaped [F,H,W,3], got {tuple(frames.shape)}")
    video = frames.float().permute(0, 3, 1, 2)  # F,3,H,W
    video = F.interpolate(video, size=(height, width), mode="bicubic", align_corners=False).clamp(0, 1)
    return video.permute(1, 0, 2, 3).unsqueeze(0).contiguous()


def refiner_first_frame(image: Any, height: int, width: int, base_height: int, base_width: int) -> torch.Tensor:
    """TI2V refiner condition: centre-crop to the base video's aspect, PIL bicubic to the refiner size."""
    picture = image_ops.load_image(checks.checked_image(image, "first_frame"))
    checks.check_picture(picture, "first_frame")
    w, h = picture.size
    target = base_width / base_height
    if w / h > target:
        new_w = max(1, round(h * target))
        left = (w - new_w) // 2
        picture = picture.crop((left, 0, left + new_w, h))
    elif w / h < target:
        new_h = max(1, round(w / target))
        top = (h - new_h) // 2
        picture = picture.crop((0, top, w, top + new_h))
    picture = picture.resize((width, height), Image.BICUBIC)
    pixels = torch.from_numpy(np.asarray(picture, dtype=np.uint8).copy()).permute(2, 0, 1).float() / 255.0
    return pixels[:, None].unsqueeze(0)  # (1,3,1,H,W)


def _refiner_sigmas(handle, *, steps: int, shift: float, t_thresh: float, tail_steps: int) -> torch.Tensor:
    with stage(handle, "scheduler"):
        scheduler = handle.component("scheduler")
        return compute_refiner_sigmas(sigma_max=float(scheduler.sigma_max), sigma_min=float(scheduler.sigma_min),
                                      num_inference_steps=steps, shift=shift, t_thresh=t_thresh,
                                      tail_steps=tail_steps)


@dataclass
class RefineStart:
    """Everything the refiner's sampling starts from (CPU, DiT space); kept for tests and nodes."""

    video: torch.Tensor  # (1,3,F,H,W) upscaled base frames
    x_up: torch.Tensor  # posterior sample of `video`, first frame replaced when conditioned
    noise: torch.Tensor
    initial: torch.Tensor  # (1 - t) * x_up + t * noise
    sigmas: torch.Tensor
    cond_latent: torch.Tensor | None
    generator: torch.Generator
    num_frames: int


@oom_fallback
def prepare_refine(
    handle,
    frames: torch.Tensor,
    *,
    height: int = REFINER_DEFAULTS["height"],
    width: int = REFINER_DEFAULTS["width"],
    steps: int = REFINER_DEFAULTS["steps"],
    shift: float = REFINER_DEFAULTS["shift"],
    t_thresh: float = REFINER_DEFAULTS["t_thresh"],
    tail_steps: int = REFINER_DEFAULTS["tail_steps"],
    seed: int = 42,
    first_frame: Any = None,
    tiling: dict | bool | None = True,
) -> RefineStart:
    """Upscale, VAE-encode and re-noise the base frames to `t_thresh` (a fresh generator from `seed`)."""
    usable = checks.check_refine_request(handle, frames, height=height, width=width, steps=steps, shift=shift,
                                   t_thresh=t_thresh, tail_steps=tail_steps, seed=seed, first_frame=first_frame)
    frames = frames[:usable]
    if tiling is True:
        tiling = dict(REFINER_TILING)
    sigmas = _refiner_sigmas(handle, steps=steps, shift=shift, t_thresh=t_thresh, tail_steps=tail_steps)

    g = torch.Generator("cpu").manual_seed(seed)
    video = None

    def encoded() -> tuple[torch.Tensor, torch.Tensor | None]:
        nonlocal video
        video = upscale_frames(frames, height, width)
        cond_latent = None
        with stage(handle, "vae") as device:
            vae = handle.component("vae")
            with _vae_tiling(vae, tiling):
                x_up = encode_sample(vae, video, device, g)
                if first_frame is not None:
                    pixels = refiner_first_frame(first_frame, height, width, int(frames.shape[1]),
                                                 int(frames.shape[2]))
                    clean = encode_sample(vae, pixels, device, g)
                    cond_latent = clean[:, :, :1].contiguous()
                    x_up[:, :, :1] = cond_latent
        return x_up, cond_latent

    def received(got: dict[str, torch.Tensor | None]) -> tuple[torch.Tensor, torch.Tensor | None]:
        g.set_state(got["generator"])  # where rank 0's draws left it: the noise below is the same everywhere
        return got["x_up"], got["cond_latent"]

    # on a parallel view rank 0 runs the VAE; the others receive its latents and its generator state
    x_up, cond_latent = parallel_stage.from_rank0(
        handle, encoded, lambda got: {"x_up": got[0], "cond_latent": got[1], "generator": g.get_state()},
        received, ("x_up", "cond_latent", "generator"))
    if video is None:  # a rank that did not encode: the upscaled video's shape, no memory behind it
        video = torch.zeros(1, 1, 1, 1, 1).expand(1, 3, int(frames.shape[0]), height, width)
    noise = torch.randn(x_up.shape, generator=g, dtype=torch.float32)
    initial = renoise(x_up, noise, t_thresh)
    return RefineStart(video, x_up, noise, initial, sigmas, cond_latent, g, usable)


def refine(
    handle,
    frames: torch.Tensor,
    cond: Conditioning,
    *,
    height: int = REFINER_DEFAULTS["height"],
    width: int = REFINER_DEFAULTS["width"],
    steps: int = REFINER_DEFAULTS["steps"],
    shift: float = REFINER_DEFAULTS["shift"],
    guidance_scale: float = REFINER_DEFAULTS["guidance_scale"],
    t_thresh: float = REFINER_DEFAULTS["t_thresh"],
    tail_steps: int = REFINER_DEFAULTS["tail_steps"],
    seed: int = 42,
    first_frame: Any = None,
    tiling: dict | bool | None = True,
    decode_output: bool = True,
    release_base: bool | None = None,
    callback: StepCallback | None = None,
    sampler: str | sampling.Sampler | None = None,
    cfg_batch: str = "off",
    step_cache: str | StepCacheSettings | None = "off",
    sample_with: Callable[..., torch.Tensor] | None = None,
) -> torch.Tensor:
    """SDEdit refinement with the MoE refiner DiT: base frames [F,H0,W0,3] -> refined frames (or latents).

    Conditioning is text only, against a zero negative. `first_frame` (TI2V) is the original input
    image; it is kept clean in latent frame 0. Tiling (the reference's tiles) is on by default.
    `release_base` drops the base DiT (hooks first) before the refiner loads; by default it does so
    whenever the offload mode is not `none`. A later stage that needs the base reloads it.
    `cfg_batch` and `step_cache` as for `denoise` (caching needs a refiner list of more than 8 steps).
    `sample_with` runs the refiner's sampling in place of `denoise` (same arguments): LingBot
    Parallel's pool (`worker_pool.pool.WorkerPool.refine`) sends it to its workers.
    """
    # Everything that can refuse the request runs before the base DiT is released (it would be lost).
    checks.check_refine_request(handle, frames, height=height, width=width, steps=steps, shift=shift,
                                t_thresh=t_thresh, tail_steps=tail_steps, seed=seed, first_frame=first_frame,
                                cond=cond, guidance_scale=guidance_scale, sampler=sampler, cfg_batch=cfg_batch,
                                step_cache=step_cache)
    if StepCacheSettings.of(step_cache).enabled:  # its step count is the refiner list's length
        _check_refine_cache(handle, step_cache, steps=steps, shift=shift, t_thresh=t_thresh, tail_steps=tail_steps,
                            sampler=sampler, guidance_scale=guidance_scale)
    if release_base is None:
        release_base = handle.info is not None and effective_mode(handle) != "none"  # reloadable
    if release_base and TRANSFORMER in handle.shared.loaded:
        release(handle, [TRANSFORMER])
    start = prepare_refine(handle, frames, height=height, width=width, steps=steps, shift=shift, t_thresh=t_thresh,
                           tail_steps=tail_steps, seed=seed, first_frame=first_frame, tiling=tiling)
    refiner_cond = Conditioning(cond.positive, None, zero_negative=True, prompt=cond.prompt)
    latents = (sample_with or denoise)(handle, refiner_cond, height=height, width=width, num_frames=start.num_frames,
                      steps=len(start.sigmas), guidance_scale=guidance_scale, shift=1.0, generator=start.generator,
                      latents=start.initial, sigmas=start.sigmas, cond_latent=start.cond_latent,
                      transformer=REFINER, callback=callback, sampler=sampler, cfg_batch=cfg_batch,
                      step_cache=step_cache)
    if not decode_output:
        return latents
    return decode(handle, latents, tiling=REFINER_TILING if tiling is True else tiling)


def _check_refine_cache(handle, step_cache: Any, *, steps: int, shift: float, t_thresh: float, tail_steps: int,
                        sampler: Any, guidance_scale: float) -> None:
    """The refiner's step cache against its sigma list (what its denoise call will run): refused for
    few steps, and `magcache` without a calibration, before anything is released or loaded."""
    sigmas = _refiner_sigmas(handle, steps=steps, shift=shift, t_thresh=t_thresh, tail_steps=tail_steps)
    check_step_cache(StepCacheSettings.of(step_cache), steps=len(sigmas), sampler_name=sampling.get_sampler(sampler).name)
    checks.check_step_cache_ready(handle, step_cache, transformer=REFINER, sampler=sampler, steps=len(sigmas),
                                  shift=1.0, sigmas=sigmas, guidance_scale=guidance_scale)


# -- the whole pipeline ----------------------------------------------------------------------------

@dataclass
class GenerateResult:
    frames: torch.Tensor | None  # [F,H,W,3]
    latents: torch.Tensor  # DiT space
    refined: torch.Tensor | None = None


def generate(
    handle,
    prompt: str | dict | list,
    *,
    mode: str = "t2v",
    image: Any = None,
    negative_prompt: str | None = "",
    height: int = 480,
    width: int = 832,
    num_frames: int | None = None,
    steps: int = 40,
    guidance_scale: float = 3.0,
    shift: float = 3.0,
    seed: int = 42,
    tiling: dict | bool | None = None,
    refine_output: bool = False,
    refine_options: dict | None = None,
    output: str = "frames",
    callback: StepCallback | None = None,
    sampler: str | sampling.Sampler | None = None,
    cfg_batch: str = "off",
    step_cache: str | StepCacheSettings | None = "off",
    light_vae: Any = None,
) -> GenerateResult:
    """T2V, T2I or TI2V (plus the MoE refiner when asked), chaining the stages like the reference.

    `light_vae`: a light decoder file to decode with (`decode`'s `light`; the refiner still encodes
    and decodes with the Wan VAE).

    `cfg_batch` as for `denoise`, for the base pass and the refiner (`refine_options` may set its
    own); `step_cache` for the base pass (the refiner's comes from `refine_options`). Both are
    checked with everything else before any model work (`magcache` without its calibration too).
    """
    if num_frames is None:
        num_frames = 1 if mode == "t2i" else 121
    if output not in ("frames", "latent"):
        raise ValueError(f"output must be 'frames' or 'latent', got {output!r}")
    validate_request(mode, height=height, width=width, num_frames=num_frames, steps=steps, image=image,
                     refine_output=refine_output, guidance_scale=guidance_scale)
    sampling.get_sampler(sampler).check(steps=steps, shift=shift)
    checks.check_cfg_batch(cfg_batch)
    check_step_cache(StepCacheSettings.of(step_cache), steps=steps, sampler_name=sampling.get_sampler(sampler).name)
    checks.check_seed(seed)
    checks.check_negative_prompt(negative_prompt)
    prompt_ops.caption_to_text(prompt)  # broken JSON or a null caption fails here, before any model work
    if refine_output and not handle.has_refiner:
        raise ValueError("refine_output=True needs the MoE checkpoint (it has the refiner/); this one has none")
    refine_size = None
    if refine_output:
        options = refine_options or {}
        refine_size = (options.get("height", REFINER_DEFAULTS["height"]), options.get("width", REFINER_DEFAULTS["width"]))
    checks.check_request_fits(handle, height=height, width=width, num_frames=num_frames, cfg=guidance_scale > 1.0,
                              refine=refine_size, what="this generate request")
    checks.check_step_cache_ready(handle, step_cache, transformer=TRANSFORMER, sampler=sampler, steps=steps,
                                  shift=shift, sigmas=None, guidance_scale=guidance_scale)
    refine_kw = {"cfg_batch": cfg_batch, **(refine_options or {})}
    if refine_output and StepCacheSettings.of(refine_kw.get("step_cache")).enabled:
        r = {**REFINER_DEFAULTS, **refine_kw}
        _check_refine_cache(handle, r["step_cache"], steps=r["steps"], shift=r["shift"], t_thresh=r["t_thresh"],
                            tail_steps=r["tail_steps"], sampler=r.get("sampler", sampler), guidance_scale=r["guidance_scale"])
    picture = image_ops.load_image(checks.checked_image(image)) if image is not None else None
    if picture is not None:
        checks.check_picture(picture)

    image_cond = encode_image(handle, picture, height, width, tiling=tiling) if picture is not None else None
    negative = negative_prompt if guidance_scale > 1.0 else None
    cond = encode_prompt(handle, prompt, negative, image=image_cond, mode=mode)
    latents = denoise(handle, cond, height=height, width=width, num_frames=num_frames, steps=steps,
                      guidance_scale=guidance_scale, shift=shift, seed=seed, image_cond=image_cond,
                      callback=callback, sampler=sampler, cfg_batch=cfg_batch, step_cache=step_cache)
    if output == "latent" and not refine_output:
        return GenerateResult(None, latents)
    frames = decode(handle, latents, tiling=tiling, light=light_vae)
    refined = None
    if refine_output:
        text_cond = encode_prompt(handle, prompt, None, mode=mode) if cond.with_image else cond
        refined = refine(handle, frames, text_cond, seed=seed, first_frame=picture, callback=callback, **refine_kw)
    return GenerateResult(frames, latents, refined)
