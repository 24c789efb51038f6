"""Denoise and refine: the sampling nodes. They output raw Wan-VAE latents (ComfyUI LATENT)."""

from __future__ import annotations

from . import runtime
from .notices import on_node
from .preview import previewer_for
from .types import (
    CATEGORY,
    FRAMES_GRID,
    MAX_FRAMES,
    MAX_SIZE,
    MAX_STEPS,
    SIZE_GRID,
    Choice,
    Cond,
    ImageCond,
    Pipe,
    latent_in,
    latent_out,
)
from .v3 import io
from .video_input import video_frames, video_input

SEED_MAX = 0xFFFFFFFFFFFFFFFF
SAMPLERS = ["flow_unipc", "euler", "dmd_student"]  # lingbot_core.sampling.SAMPLERS, listed without importing torch
CFG_BATCH = ["off", "on", "auto"]  # lingbot_core.sampling.guidance.CFG_BATCH (a test compares them)
STEP_CACHE = ["off", "first_block", "magcache", "magcache_calibrate"]  # lingbot_core.sampling.step_cache.STEP_CACHE
STEP_CACHE_TIP = ("Skip DiT blocks on steps the previous step predicts (40-step CFG runs; refused for dmd_student "
                  "and 8 steps or fewer). first_block: skip blocks 1.. while block 0's residual barely changes. "
                  "magcache: skip the whole DiT by calibrated magnitude ratios; run magcache_calibrate once with "
                  "the same model, sampler, shift and steps first (output equals off; writes a small file "
                  "in ComfyUI's user folder)")


def cache_inputs() -> list:
    """The step-cache widgets shared by Denoise and Refine."""
    return [
        Choice("step_cache", options=STEP_CACHE, default="off", optional=True, tooltip=STEP_CACHE_TIP),
        io.Float.Input("cache_threshold", default=0.0, min=0.0, max=10.0, step=0.01, optional=True,
                       tooltip="Skip while the measured change stays below this (0: the method's default, "
                               "first_block 0.05, magcache 0.06); higher skips more and drifts more"),
        io.Int.Input("cache_warmup_steps", default=-1, min=-1, max=MAX_STEPS, optional=True,
                     tooltip="Always compute the first steps (-1: the default, first_block 4, magcache 20%)"),
        io.Int.Input("cache_max_skips", default=-1, min=-1, max=50, optional=True,
                     tooltip="Most consecutive skipped steps (-1: the default, 3)"),
    ]


def cache_settings(step_cache: str, threshold: float, warmup: int, max_skips: int):
    """The node widgets as core StepCacheSettings (calibrations inside ComfyUI's user folder)."""
    from lingbot_core.sampling.step_cache import StepCacheSettings

    from .paths import calibration_dir

    return StepCacheSettings(step_cache, threshold=float(threshold) or None,
                             warmup_steps=None if int(warmup) < 0 else int(warmup),
                             max_skips=None if int(max_skips) < 0 else int(max_skips),
                             calibration_dir=calibration_dir())


DENOISE_RANGE = (0.01, 1.0)  # Denoise's `denoise` widget (checked by its validate_inputs, which names it)
CFG_BATCH_TIP = ("CFG's two passes as one batch-2 DiT pass: faster (quantized weights decode once, offloaded "
                 "weights move once per step) for about twice the DiT activation memory; equal to 'off' up to "
                 "float rounding; slower on a CPU with plain weights. auto: batch on a GPU, with quantized weights or "
                 "disk streaming, when the memory estimate says it fits")


def _sigmas_with_choices(custom: list[float], sampler, denoise, step_cache, known: dict) -> dict[str, str]:
    """What the other choices say about a readable custom sigma list (only those that are valid)."""
    from lingbot_core.sampling import get_sampler
    from lingbot_core.sampling.step_cache import StepCacheSettings, check_step_cache

    if denoise is not None and "denoise" not in known and float(denoise) < 1.0:
        return {"sigmas": "custom sigmas and denoise below 1 both choose the schedule: clear the sigmas, or "
                          "set denoise to 1"}
    steps = len(custom) - (custom[-1] == 0.0)
    chosen = get_sampler(sampler if sampler is not None and "sampler" not in known else None)
    try:
        chosen.check(steps=steps, shift=1.0, sigmas=custom)  # shift does not apply to a custom list
        if step_cache is not None and "step_cache" not in known:
            check_step_cache(StepCacheSettings(step_cache), steps=steps, sampler_name=chosen.name)
    except ValueError as err:
        return {"sigmas": str(err)}
    return {}


class LingBotDenoise(io.ComfyNode):
    """Flow-matching sampling from noise (or given latents) to video latents."""

    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="LingBotDenoise",
            display_name="LingBot Denoise",
            category=CATEGORY,
            description="Samples a video (or one image with frames=1) with the LingBot DiT: flow-matching UniPC "
                        "(the reference), flow Euler, or the DMD student sampler for distilled few-step checkpoints. "
                        "Outputs raw Wan 2.1 VAE latents as a LATENT, so core latent nodes and previews understand "
                        "them.",
            inputs=[
                Pipe.Input("pipe", tooltip="From LingBot Loader or LingBot Offload"),
                Cond.Input("conditioning", tooltip="From LingBot Text Encode"),
                io.Int.Input("width", default=832, max=MAX_SIZE, **SIZE_GRID,
                             tooltip="Video width in pixels, a multiple of 16"),
                io.Int.Input("height", default=480, max=MAX_SIZE, **SIZE_GRID,
                             tooltip="Video height in pixels, a multiple of 16"),
                io.Int.Input("frames", default=121, max=MAX_FRAMES, **FRAMES_GRID,
                             tooltip="Frame count: 1 (an image) or 4n+1; 121 is 5 s at 24 fps"),
                io.Int.Input("steps", default=40, min=1, max=MAX_STEPS, tooltip="Sampling steps"),
                io.Float.Input("cfg", default=3.0, min=0.0, max=30.0, step=0.1,
                               tooltip="Classifier-free guidance scale; 1 or less skips the negative pass"),
                io.Float.Input("shift", default=3.0, min=0.01, max=100.0, step=0.1,
                               tooltip="Timestep shift of the flow-matching schedule"),
                io.Int.Input("seed", default=42, min=0, max=SEED_MAX, control_after_generate=True,
                             tooltip="Noise seed (a CPU generator: the same seed gives the same noise on any device)"),
                ImageCond.Input("image_cond", optional=True,
                                tooltip="TI2V: the first frame from LingBot VAE Encode, at the same size"),
                io.Latent.Input("latent", optional=True, tooltip="Start from these latents instead of fresh noise"),
                Choice("sampler", options=SAMPLERS, default="flow_unipc", optional=True,
                       tooltip="flow_unipc: the reference (40 steps, cfg 3). euler: flow Euler (4 steps, cfg 1 "
                               "is the LightLingBot LoRA's trained grid). dmd_student: DMD-distilled student "
                               "checkpoints such as robbyant/lingbot-video-moe-dmd-30b-a3b (8 steps, cfg 1, "
                               "shift 3; the files do not mark a student, so this choice is how the pack "
                               "knows)"),
                io.String.Input("sigmas", default="", optional=True,
                                tooltip="A custom sigma list, e.g. 1.0, 0.9, 0.75, 0.5 (used as given: shift does not "
                                        "apply; it sets the step count). Empty: the sampler's own grid. "
                                        "dmd_student refuses one"),
                Choice("cfg_batch", options=CFG_BATCH, default="off", optional=True, tooltip=CFG_BATCH_TIP),
                *cache_inputs(),
                video_input("video", optional=True,
                            tooltip="Video-to-video: the input frames (LingBot Load Video) or a core VIDEO, re-noised "
                                    "to `denoise`; its first `frames` frames are used, resized to the video size "
                                    "like a first frame"),
                io.Float.Input("denoise", default=1.0, min=DENOISE_RANGE[0], max=DENOISE_RANGE[1], step=0.01,
                               optional=True,
                               tooltip="Video-to-video strength: how far the input (`video`, or `latent` as clean "
                                       "latents) is re-noised along the schedule; runs that share of the steps "
                                       "(0.6 of 40: the last 24). 1: from pure noise, the input unused. "
                                       "flow_unipc and euler"),
            ],
            outputs=[io.Latent.Output(display_name="latent", tooltip="Raw Wan 2.1 VAE latents (1,16,T,H/8,W/8)")],
        )

    @classmethod
    def validate_inputs(cls, sigmas=None, sampler=None, denoise=None, step_cache=None):
        """Sigma problems are refused with the graph (at ComfyUI's /prompt, a jobs file's bad line before
        any job runs), not when Denoise starts after the text encoder: a list that cannot be read, and one
        the sampler, `denoise` or `step_cache` chosen beside it cannot take. ComfyUI skips its own checks of
        the inputs named here, so their choices and range are checked here too. A linked input is None."""
        from .types import problems_or_true

        problems: dict[str, str] = {}
        # (in the words of the engine's and ComfyUI's own checks, which these replace)
        for name, value, choices in (("sampler", sampler, SAMPLERS), ("step_cache", step_cache, STEP_CACHE)):
            if value is not None and value not in choices:
                problems[name] = f"value {str(value)[:40]!r} is not one of {choices}"
        if denoise is not None:
            if isinstance(denoise, bool) or not isinstance(denoise, (int, float)):
                problems["denoise"] = f"expected a number, got {str(denoise)[:40]!r}"
            elif not denoise >= DENOISE_RANGE[0]:
                problems["denoise"] = f"value {denoise} is smaller than the minimum {DENOISE_RANGE[0]}"
            elif denoise > DENOISE_RANGE[1]:
                problems["denoise"] = f"value {denoise} is bigger than the maximum {DENOISE_RANGE[1]}"
        custom = None
        if isinstance(sigmas, str):
            from lingbot_core.sampling import parse_sigmas

            try:
                custom = parse_sigmas(sigmas)
            except ValueError as err:
                problems["sigmas"] = str(err)
        if custom is not None and "sigmas" not in problems:
            problems.update(_sigmas_with_choices(custom, sampler, denoise, step_cache, problems))
        return problems_or_true(problems)

    @classmethod
    def execute(cls, pipe, conditioning, width, height, frames, steps, cfg, shift, seed, image_cond=None,
                latent=None, sampler="flow_unipc", sigmas="", cfg_batch="off", step_cache="off", cache_threshold=0.0,
                cache_warmup_steps=-1, cache_max_skips=-1, video=None, denoise=1.0):
        from lingbot_core.latents import dit_to_vae, vae_to_dit
        from lingbot_core.sampling import parse_sigmas
        from lingbot_core.worker_pool.pool import stages_for  # the pipe's pool (LingBot Parallel), or here

        custom = parse_sigmas(sigmas)
        if custom is not None:
            steps = len(custom) - (custom[-1] == 0.0)
        from lingbot_core.notices import cfg_batch_notice, few_step_notice

        notice = few_step_notice(pipe, sampler, int(steps), float(cfg), float(shift))  # before the DiT loads
        start = vae_to_dit(latent_in(latent), pipe.vae_config()) if latent is not None else None
        v2v_notice = None
        video = video_frames(video)
        if float(denoise) < 1.0:  # video-to-video: the input re-noised part-way, the schedule's tail sampled
            from lingbot_core.video_to_video import prepare_video_start

            if custom is not None:
                raise ValueError("custom sigmas and denoise below 1 both choose the schedule: clear the sigmas, "
                                 "or set denoise to 1")
            begin = prepare_video_start(pipe, height=int(height), width=int(width), num_frames=int(frames),
                                        steps=int(steps), shift=float(shift), strength=float(denoise),
                                        seed=int(seed), video=video, latents=start, sampler=sampler,
                                        image_cond=image_cond)
            start, custom, steps = begin.initial, begin.sigmas, len(begin.sigmas)
        elif video is not None:
            v2v_notice = ("Denoise: denoise is 1, so the connected video is not used (pure noise, as text-to-"
                          "video); lower denoise (0.5 to 0.8) to keep some of it.")
        with runtime.node_work(steps, "denoise", previewer_for("denoise")) as on_step:
            out = stages_for(pipe).denoise(
                pipe, conditioning, height=int(height), width=int(width), num_frames=int(frames), steps=int(steps),
                guidance_scale=float(cfg), shift=float(shift), seed=int(seed), image_cond=image_cond, latents=start,
                callback=on_step, sampler=sampler, sigmas=custom, cfg_batch=cfg_batch,
                step_cache=cache_settings(step_cache, cache_threshold, cache_warmup_steps, cache_max_skips))
        return io.NodeOutput(latent_out(dit_to_vae(out, pipe.vae_config())),
                             ui=on_node(notice, cfg_batch_notice(cfg_batch, float(cfg)), v2v_notice))


class LingBotRefine(io.ComfyNode):
    """The MoE refiner (SDEdit at t_thresh) on base frames or a base LATENT."""

    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="LingBotRefine",
            display_name="LingBot Refine (MoE)",
            category=CATEGORY,
            description="MoE only: upscales the base video and re-noises it to t_thresh, then denoises it with "
                        "the refiner DiT (SDEdit), for a sharper high-resolution result. Outputs a LATENT.",
            inputs=[
                Pipe.Input("pipe", tooltip="A MoE pipe (the checkpoint has a refiner/ folder)"),
                Cond.Input("conditioning", tooltip="Text-only conditioning (no image)"),
                io.Int.Input("width", default=1920, max=MAX_SIZE, **SIZE_GRID,
                             tooltip="Output width, a multiple of 16"),
                io.Int.Input("height", default=1088, max=MAX_SIZE, **SIZE_GRID,
                             tooltip="Output height, a multiple of 16"),
                io.Int.Input("steps", default=8, min=1, max=MAX_STEPS, tooltip="Refiner steps"),
                io.Float.Input("t_thresh", default=0.85, min=0.01, max=1.0, step=0.01,
                               tooltip="How far the base video is re-noised (1: from pure noise)"),
                io.Float.Input("cfg", default=3.0, min=0.0, max=30.0, step=0.1, tooltip="Guidance scale"),
                io.Float.Input("shift", default=3.0, min=0.01, max=100.0, step=0.1, tooltip="Timestep shift"),
                io.Int.Input("seed", default=42, min=0, max=SEED_MAX, control_after_generate=True,
                             tooltip="Noise seed"),
                io.Latent.Input("latent", optional=True, tooltip="Base latents (decoded here), or give images"),
                video_input("images", optional=True, tooltip="Base frames [T,H,W,3] or a core VIDEO, instead of latent"),
                io.Image.Input("first_frame", optional=True, tooltip="TI2V: the original input image"),
                io.Boolean.Input("tiling", default=True, optional=True,
                                 tooltip="Tiled VAE for the base decode and the refined encode (less memory)"),
                Choice("release_base", options=["auto", "on", "off"], default="auto", optional=True,
                       tooltip="Drop the base DiT before the refiner loads (auto: whenever offload is "
                               "not 'none')"),
                Choice("cfg_batch", options=CFG_BATCH, default="off", optional=True, tooltip=CFG_BATCH_TIP),
                *cache_inputs(),
            ],
            outputs=[io.Latent.Output(display_name="latent", tooltip="Refined raw Wan 2.1 VAE latents")],
        )

    @classmethod
    def execute(cls, pipe, conditioning, width, height, steps, t_thresh, cfg, shift, seed, latent=None, images=None,
                first_frame=None, tiling=True, release_base="auto", cfg_batch="off", step_cache="off",
                cache_threshold=0.0, cache_warmup_steps=-1, cache_max_skips=-1):
        from lingbot_core import stages
        from lingbot_core.latents import dit_to_vae
        from lingbot_core.worker_pool.pool import stages_for  # refiner sampling on the pipe's pool, or here

        if (latent is None) == (images is None):
            raise ValueError("connect exactly one of `latent` or `images` as the base video")
        images = video_frames(images, "images")
        with runtime.node_work(steps, "refine", previewer_for("refine")) as on_step:
            frames = images if images is not None else stages.decode_vae_latents(pipe, latent_in(latent))
            out = stages_for(pipe).refine(
                pipe, frames, conditioning, height=int(height), width=int(width), steps=int(steps),
                t_thresh=float(t_thresh), guidance_scale=float(cfg), shift=float(shift), seed=int(seed),
                first_frame=first_frame, tiling=bool(tiling), decode_output=False,
                release_base={"auto": None, "on": True, "off": False}[release_base], callback=on_step,
                cfg_batch=cfg_batch,
                step_cache=cache_settings(step_cache, cache_threshold, cache_warmup_steps, cache_max_skips))
        from lingbot_core.stage_inputs import refine_frames_notice

        notice = refine_frames_notice(int(frames.shape[0])) if hasattr(frames, "shape") else None
        return io.NodeOutput(latent_out(dit_to_vae(out, pipe.vae_config())), ui=on_node(notice))
