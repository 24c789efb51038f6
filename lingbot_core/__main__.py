"""`python -m lingbot_core`: generate one video (or image) without a node graph.

With no options it builds the tiny random-weight checkpoint (first use only) and writes a short
T2V mp4 (output/lingbot/core_00001_.mp4, numbered like `lingbot-run`), which makes it a smoke test
of the whole core on any machine. Progress goes to stderr (--quiet: none), written files to stdout.
Exit codes as `lingbot-run`: 0 done, 1 a failure while running, 2 bad input (incl. a bad
checkpoint), 130 interrupted.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _positive(kind: type):
    """An argparse type: a number of `kind` above zero (0 would silently mean "the default")."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a {kind.__name__}, got {text!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be above 0, got {text}")
        return value

    parse.__name__ = f"positive {kind.__name__}"
    return parse


def _non_negative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def _sparse_settings(args: argparse.Namespace):
    """The --sparse-* options as sparse attention's settings (None: its defaults); a bad one is refused."""
    from .errors import RefusedInput
    from .models.sparse_attention import SparseSettings

    given = {name: value for name, value in (("tau", args.sparse_tau), ("density", args.sparse_density),
                                             ("min_tokens", args.sparse_min_tokens)) if value is not None}
    if not given:
        return None
    if args.attention != "sparse":
        raise RefusedInput("--sparse-tau/--sparse-density/--sparse-min-tokens need --attention sparse")
    try:
        return SparseSettings(**given)
    except ValueError as err:
        raise RefusedInput(str(err)) from None


def build_parser() -> argparse.ArgumentParser:
    """The command's options (the README's commands are parsed with this in the tests)."""
    from .handle import settings_flags

    parser = argparse.ArgumentParser(prog="python -m lingbot_core", description=__doc__)
    parser.add_argument("--model", help="checkpoint folder (default: the tiny built-in checkpoint)")
    parser.add_argument("--mode", choices=("t2v", "t2i", "ti2v"), default="t2v")
    parser.add_argument("--prompt", default='{"comprehensive_description":{"scene_content_description":'
                        '"A small red paper boat drifts along a canal at dawn."}}')
    parser.add_argument("--negative-prompt", default="", help="empty: the reference default")
    parser.add_argument("--image", help="first frame for ti2v")
    parser.add_argument("--video", help="video-to-video: an input video file (its first --frames frames, resized "
                        "to the output size)")
    parser.add_argument("--denoise", type=float, default=None,
                        help="video-to-video strength in (0, 1]: the share of the steps run from the re-noised "
                             "input (default 0.6 with --video; 1 is plain text-to-video)")
    extend = parser.add_argument_group("extending a video (segment by segment, each conditioned on the last k latent "
                                       "frames of what came before; no end-frame conditioning)")
    extend.add_argument("--extend", metavar="VIDEO", help="continue this video file (the whole clip, up to 1025 "
                        "frames, at its size floored to 16 unless --width/--height) by --segments segments of "
                        "--frames frames each")
    extend.add_argument("--segments", type=_positive(int), default=None, help="segments to add (default 3)")
    extend.add_argument("--k", type=_positive(int), default=1,
                        help="latent frames each segment is conditioned on: the last 4(k-1)+1 frames (default 1, the "
                             "TI2V first-frame case)")
    extend.add_argument("--overlap-mode", default="drop", help="the re-decoded overlap frames: drop (default) or blend")
    extend.add_argument("--segment-prompts", metavar="TEXT|@FILE",
                        help="per-segment prompts instead of --prompt: one per line, a JSON list, or a caption with "
                             "timed actions cut by segment; @FILE reads a file")
    parser.add_argument("--height", type=_positive(int))
    parser.add_argument("--width", type=_positive(int))
    parser.add_argument("--frames", type=_positive(int))
    parser.add_argument("--steps", type=_positive(int))
    parser.add_argument("--cfg", type=_non_negative, default=None,
                        help="guidance scale (default 3; with --sampler dmd_student its recipe's 1)")
    parser.add_argument("--shift", type=_positive(float), default=3.0)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--fps", type=_positive(float), default=24.0)
    parser.add_argument("--refine", action="store_true", help="run the MoE refiner too")
    parser.add_argument("--refine-width", type=_positive(int), help="refiner output width (default 1920)")
    parser.add_argument("--refine-height", type=_positive(int), help="refiner output height (default 1088)")
    parser.add_argument("--device", help="execution device (default: cuda if available)")
    parser.add_argument("--offload", choices=("auto", "none", "model", "sequential", "group"), default="auto",
                        help="where components live while stages run (default auto: the fastest mode expected "
                             "to fit; on the CPU: none)")
    parser.add_argument("--offload-to", choices=("ram", "disk"), default="ram",
                        help="the offloaded DiT's home: ram, or disk (streamed from its file)")
    parser.add_argument("--tiling", action="store_true", help="tiled VAE decode (much less memory)")
    parser.add_argument("--light-vae", metavar="FILE",
                        help="decode with this light decoder (taew2_1 / lighttaew2_1 .safetensors, as in ComfyUI's "
                             "models/vae_approx) instead of the Wan 2.1 VAE: much faster and smaller, lower quality")
    parser.add_argument("--sampler", default=None,
                        help="flow_unipc (default), euler or dmd_student (a DMD student checkpoint such as "
                             "robbyant/lingbot-video-moe-dmd-30b-a3b: --steps and --cfg then default to its "
                             "recipe, 8 and 1)")
    parser.add_argument("--cfg-batch", default="off",
                        help="CFG's two passes as one batch-2 pass: off (default), on, or auto (on a GPU, with "
                             "quantized weights or disk streaming, when the memory estimate fits; not on a CPU "
                             "with plain weights, where it is slower)")
    parser.add_argument("--step-cache", default="off",
                        help="skip DiT blocks on near-duplicate steps: off (default), first_block, magcache "
                             "(after one run with magcache_calibrate); more than 8 steps only")
    parser.add_argument("--cache-threshold", type=_non_negative, default=None,
                        help="the step cache's threshold (default: the method's)")
    for flag, options in settings_flags():  # the handle's settings (lingbot_core.handle.HandleSettings)
        parser.add_argument(flag, **options)
    parser.add_argument("--sparse-tau", type=_non_negative, default=None,
                        help="sparse attention: routing threshold in score deviations (default 1.0; higher: sparser)")
    parser.add_argument("--sparse-density", type=_positive(float), default=None,
                        help="sparse attention: fraction of key blocks computed exactly (instead of --sparse-tau)")
    parser.add_argument("--sparse-min-tokens", type=int, default=None,
                        help="sparse attention: sequences shorter than this run dense (default 12288)")
    parser.add_argument("--output", default="output", help="output folder (default ./output)")
    parser.add_argument("--prefix", default="lingbot/core",
                        help="file name prefix inside the output folder; files are numbered prefix_00001_.mp4")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    return parser


def main(argv: list[str] | None = None) -> int:
    # light: nothing heavy is imported
    from .exit_codes import BAD_INPUT, INTERRUPTED, exit_code, interrupted_code, one_line, sigterm_interrupts

    args = build_parser().parse_args(argv)
    with sigterm_interrupts() as terms:  # SIGTERM (a container stop) ends the run as Ctrl-C does
        try:  # everything heavy (torch included) is imported inside: Ctrl-C is clean from the first instant
            return _generate(args)
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            return interrupted_code(terms)
        except Exception as err:
            code = exit_code(err)
            kind = "" if code == BAD_INPUT else f"{type(err).__name__}: "
            print("interrupted" if code == INTERRUPTED else f"error: {kind}{one_line(err)}", file=sys.stderr)
            return interrupted_code(terms) if code == INTERRUPTED else code


def _check_writable(folder: Path) -> None:
    """The output folder (or its nearest existing parent) must be a folder we can write in; checked first."""
    from .save_path import check_output_folder

    check_output_folder(folder)


def _say(quiet: bool, text: str) -> None:
    if not quiet:
        print(text, file=sys.stderr, flush=True)


def _generate(args: argparse.Namespace) -> int:
    """The run with the library's log lines on stderr (what auto picked, what loaded, the fit), from the
    first check on; with --quiet none (a handler that drops them: else Python prints warnings itself)."""
    import logging

    core = logging.getLogger("lingbot_core")
    level = core.level
    if args.quiet:
        handler: logging.Handler = logging.NullHandler()
    else:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("  %(message)s"))
        core.setLevel(min(core.getEffectiveLevel(), logging.INFO))
    core.addHandler(handler)
    try:
        return _checked_run(args)
    finally:
        core.removeHandler(handler)
        core.setLevel(level)


def _checked_run(args: argparse.Namespace) -> int:
    """Every argument checked (before any load), then the run."""
    from .sampling import get_sampler
    from .save_path import check_prefix

    if args.mode == "ti2v" and not args.image:
        from .errors import RefusedInput

        raise RefusedInput("--mode ti2v starts from a first frame: add --image FILE (an image file)")
    if args.denoise is not None and not args.video:
        from .errors import RefusedInput

        raise RefusedInput("--denoise is the video-to-video strength: add --video FILE (a video file)")
    _check_extend_flags(args)
    if args.video:
        from .errors import RefusedInput

        if args.mode == "t2i":
            raise RefusedInput("--video makes a video from a video: use --mode t2v or ti2v")
        if args.denoise is None:
            args.denoise = 0.6
        if not 0.0 < args.denoise <= 1.0:
            raise RefusedInput(f"--denoise must be in (0, 1], got {args.denoise:g}")
    output = Path(args.output)
    _check_writable(output)
    check_prefix(args.prefix, output)
    recommended = get_sampler(args.sampler).recommended or {}  # an unknown sampler is bad input, before any load
    if args.cfg is None:  # a sampler's own recipe (the DMD student's cfg 1) unless --cfg says otherwise
        args.cfg = float(recommended.get("guidance_scale", 3.0))
    args.recommended_steps = recommended.get("steps")
    from .sampling.step_cache import StepCacheSettings
    from .stage_inputs import check_cfg_batch

    check_cfg_batch(args.cfg_batch)
    args.step_cache = StepCacheSettings(args.step_cache, threshold=args.cache_threshold)
    if args.light_vae:  # a wrong file is refused now, before any model loads
        from .checkpoints.light_vae_file import inspect_light_vae_file

        inspect_light_vae_file(args.light_vae)
    return _run(args, output)


def _check_extend_flags(args: argparse.Namespace) -> None:
    """--extend and its options: refused in one line where they do not go together."""
    from .errors import RefusedInput
    from .extend import OVERLAP_MODES

    if not args.extend:
        given = [flag for flag, value in (("--segments", args.segments), ("--segment-prompts", args.segment_prompts))
                 if value is not None]
        if given or args.k != 1 or args.overlap_mode != OVERLAP_MODES[0]:
            raise RefusedInput(f"{', '.join(given) or '--k/--overlap-mode'} belong to extending a video: add "
                               "--extend VIDEO")
        return
    clash = [flag for flag, on in (("--video", args.video), ("--image", args.image), ("--refine", args.refine),
                                   ("--denoise", args.denoise is not None), ("--mode " + args.mode, args.mode != "t2v"))
             if on]
    if clash:
        raise RefusedInput(f"--extend continues a video from its own last frames (text to video): leave out "
                           f"{', '.join(clash)}")
    if args.overlap_mode not in OVERLAP_MODES:
        raise RefusedInput(f"--overlap-mode must be one of {', '.join(OVERLAP_MODES)}, got {args.overlap_mode[:40]}")
    if args.segment_prompts and args.segment_prompts.startswith("@"):
        try:
            args.segment_prompts = Path(args.segment_prompts[1:]).read_text(encoding="utf-8-sig")
        except (OSError, UnicodeDecodeError) as err:
            raise RefusedInput(f"--segment-prompts {args.segment_prompts[:80]}: cannot read it "
                               f"({getattr(err, 'strerror', None) or err})") from None
    args.segments = args.segments or 3


def _extend(handle, args: argparse.Namespace, video, *, frames: int, steps: int, output: Path, callback):
    """--extend: the video continued by --segments segments (finished ones saved under the output folder, so
    an interrupted run continues from them)."""
    from . import extend, stages

    tiling = True if args.tiling else None
    negative = args.negative_prompt if args.cfg > 1.0 else None
    prompts = args.segment_list
    base = stages.encode_prompt(handle, args.prompt if not prompts else prompts[0], negative)
    conds = [base] + [stages.Conditioning(stages.encode_prompt(handle, text, None).positive, base.negative,
                                          prompt=text) for text in prompts[1:]]
    joined = extend.extend_video(handle, video, conds, segments=args.segments, k=args.k, num_frames=frames,
                                 steps=steps, guidance_scale=args.cfg, shift=args.shift, seed=args.seed, tiling=tiling,
                                 folder=output / "lingbot" / "extend_segments", callback=callback,
                                 overlap_mode=args.overlap_mode, sampler=args.sampler, cfg_batch=args.cfg_batch,
                                 step_cache=args.step_cache)
    return stages.GenerateResult(joined, None, None)


def _run(args: argparse.Namespace, output: Path) -> int:
    import time

    from .handle import PipelineHandle, settings_from_flags
    from .placement.door import check_handle, configure_offload, require_refiner
    from .placement.estimate import Geometry
    from .save_path import save_target
    from .stage_inputs import validate_geometry
    from .stages import generate
    from .tiny import ensure_tiny_checkpoint
    from .video import save_frames

    tiny = args.model is None
    folder = ensure_tiny_checkpoint("moe" if args.refine else "dense") if tiny else args.model
    small = dict(height=64, width=64, frames=9, steps=4) if tiny else dict(height=480, width=832, frames=121, steps=40)
    small["steps"] = getattr(args, "recommended_steps", None) or small["steps"]
    height, width = args.height or small["height"], args.width or small["width"]
    frames = args.frames or (1 if args.mode == "t2i" else small["frames"])
    steps = args.steps or small["steps"]
    video = None
    if args.extend:  # the whole clip (bounded by Load Video's limits), refused before any model loads
        from .errors import RefusedInput
        from .extend import check_extend_request
        from .video_input import read_video_frames

        try:
            video, _fps = read_video_frames(args.extend, width=args.width or 0, height=args.height or 0)
        except ValueError as err:
            raise RefusedInput(f"--extend: {err}") from None
        height, width = int(video.shape[1]), int(video.shape[2])
        try:
            check_extend_request(video, segments=args.segments, k=args.k, num_frames=frames, height=height,
                                 width=width)
        except ValueError as err:
            raise RefusedInput(f"--extend: {err}") from None
        from .extend import segment_prompts

        args.segment_list = segment_prompts(args.segment_prompts or "", segments=args.segments, num_frames=frames,
                                            k=args.k)
    validate_geometry(height, width, frames)
    if args.video:  # read (bounded: only the frames used) and refused before any model loads
        from .errors import RefusedInput
        from .video_input import read_video_frames

        try:
            video, _fps = read_video_frames(args.video, frame_count=frames, width=width, height=height)
        except ValueError as err:
            raise RefusedInput(f"--video: {err}") from None
    refine = None
    if args.refine:
        refine = (args.refine_height or (2 * height if tiny else 1088), args.refine_width or (2 * width if tiny else 1920))
    handle = PipelineHandle.open(folder, device=args.device, **settings_from_flags(args),
                                 sparse=_sparse_settings(args))
    import logging

    from .allocator import tune_for_cpu

    # lazy: nothing is loaded yet, so the allocator is set before the models' tensors
    logging.getLogger("lingbot_core").debug("CPU allocator: %s", tune_for_cpu(str(handle.device)))
    require_refiner(handle, refine)
    handle = configure_offload(handle, args.offload, offload_to=args.offload_to,
                               **(dict(height=height, width=width, num_frames=frames, refine=refine,
                                       vae_tiling=args.tiling, cfg=args.cfg > 1.0) if args.offload == "auto" else {}))
    check_handle(handle, Geometry(height, width, frames, cfg=args.cfg > 1.0, refine=refine, vae_tiling=args.tiling))
    started = time.perf_counter()
    what = f"extend {video.shape[0]} frames by {args.segments} x" if args.extend else args.mode
    _say(args.quiet, f"lingbot: {what} {width}x{height}x{frames}, {steps} steps, cfg {args.cfg:g}, "
                     f"offload {args.offload}" + (f", refine to {refine[1]}x{refine[0]}" if refine else ""))

    def on_step(index: int, total: int, _latents) -> None:
        _say(args.quiet, f"  step {index}/{total} ({time.perf_counter() - started:.1f}s)")

    if args.extend:
        result = _extend(handle, args, video, frames=frames, steps=steps, output=output, callback=on_step)
    elif video is not None:
        result = _video_to_video(handle, args, video, height=height, width=width, frames=frames, steps=steps,
                                 refine=refine, callback=on_step)
    else:
        result = generate(handle, args.prompt, mode=args.mode, image=args.image, negative_prompt=args.negative_prompt,
                          height=height, width=width, num_frames=frames, steps=steps,
                          guidance_scale=args.cfg, shift=args.shift, seed=args.seed, refine_output=args.refine,
                          refine_options=dict(height=refine[0], width=refine[1]) if refine else None,
                          tiling=True if args.tiling else None, callback=on_step, sampler=args.sampler,
                          cfg_batch=args.cfg_batch, step_cache=args.step_cache, light_vae=args.light_vae)
    _say(args.quiet, f"lingbot: done in {time.perf_counter() - started:.1f}s")
    for frames_out, suffix in ((result.frames, ""), (result.refined, "_refined")):
        if frames_out is None:
            continue
        target = save_target(args.prefix + suffix, output, width=int(frames_out.shape[2]), height=int(frames_out.shape[1]))
        print(save_frames(frames_out, target.path("mp4").with_suffix(""), args.fps))
    return 0


def _video_to_video(handle, args: argparse.Namespace, video, *, height: int, width: int, frames: int, steps: int,
                    refine: tuple[int, int] | None, callback):
    """--video: the stages `generate` chains, with the input video re-noised to --denoise for the base pass."""
    from . import stages
    from .video_to_video import strength_sigmas, video_to_video

    strength_sigmas(handle, steps=steps, shift=args.shift, strength=args.denoise, sampler=args.sampler)  # refusals first
    tiling = True if args.tiling else None
    image_cond = stages.encode_image(handle, args.image, height, width, tiling=tiling) if args.mode == "ti2v" else None
    cond = stages.encode_prompt(handle, args.prompt, args.negative_prompt if args.cfg > 1.0 else None,
                                image=image_cond, mode=args.mode)
    latents = video_to_video(handle, cond, video=video, strength=args.denoise, height=height, width=width,
                             num_frames=frames, steps=steps, shift=args.shift, seed=args.seed, sampler=args.sampler,
                             image_cond=image_cond, callback=callback, guidance_scale=args.cfg,
                             cfg_batch=args.cfg_batch, step_cache=args.step_cache)
    frames_out = stages.decode(handle, latents, tiling=tiling, light=args.light_vae)
    refined = None
    if refine:
        text_cond = stages.encode_prompt(handle, args.prompt, None, mode=args.mode) if cond.with_image else cond
        refined = stages.refine(handle, frames_out, text_cond, height=refine[0], width=refine[1], seed=args.seed,
                                first_frame=args.image, callback=callback, cfg_batch=args.cfg_batch)
    return stages.GenerateResult(frames_out, latents, refined)


if __name__ == "__main__":
    raise SystemExit(main())
