"""LingBot Extend Video: a video continued by N segments (the core is `lingbot_core.extend`)."""

from __future__ import annotations

from . import runtime
from .preview import previewer_for
from .sampling import SAMPLERS, SEED_MAX
from .types import CATEGORY, FRAMES_GRID, MAX_FRAMES, MAX_STEPS, Choice, Cond, Pipe
from .v3 import io
from .video_input import video_frames, video_input

MAX_SEGMENTS = 64  # lingbot_core.extend.MAX_SEGMENTS (a test compares them; listed without importing torch)
OVERLAP_MODES = ["drop", "blend"]  # lingbot_core.extend.OVERLAP_MODES (the same test compares them)
SEGMENT_FOLDER = "lingbot/extend_segments"  # under the output folder


class LingBotExtendVideo(io.ComfyNode):
    """Continue a video by N segments, each conditioned on the last k latent frames of what came before."""

    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="LingBotExtendVideo",
            display_name="LingBot Extend Video",
            category=CATEGORY,
            description="Continues a video segment by segment: each segment is sampled with the previous frames' "
                        "last k latent frames pinned (the last 4(k-1)+1 frames, VAE-encoded; k=1 is the TI2V "
                        "first-frame condition) and joined without the frames it repeats. Holds one segment's "
                        "latents at a time; finished segments are saved as they finish and reused by a rerun "
                        "with the same input, prompts and settings. There is no end-frame conditioning.",
            inputs=[
                Pipe.Input("pipe", tooltip="From LingBot Loader or LingBot Offload (not LingBot Parallel)"),
                Cond.Input("conditioning", tooltip="From LingBot Text Encode: the prompt of every segment, unless "
                                                   "`prompts` gives one per segment"),
                video_input("video", tooltip="The video to continue: frames (LingBot Load Video, a Decode) or a "
                                             "core VIDEO; its size is the segments' size"),
                io.Int.Input("segments", default=3, min=1, max=MAX_SEGMENTS, tooltip="New segments to add"),
                io.Int.Input("overlap", default=1, min=1, max=(MAX_FRAMES - 1) // 4,
                             tooltip="k: latent frames each segment is conditioned on (the last 4(k-1)+1 frames). "
                                     "1: one frame, the TI2V case the model was trained for; more hands over "
                                     "more motion, quality unknown"),
                io.Int.Input("frames", default=121, max=MAX_FRAMES, **FRAMES_GRID,
                             tooltip="Frames per segment, 4n+1, the overlap included (each adds frames - "
                                     "(4(k-1)+1) new ones)"),
                io.Int.Input("steps", default=40, min=1, max=MAX_STEPS, tooltip="Sampling steps per segment"),
                io.Float.Input("cfg", default=3.0, min=0.0, max=30.0, step=0.1,
                               tooltip="Classifier-free guidance scale; 1 or less skips the negative pass"),
                io.Float.Input("shift", default=3.0, min=0.01, max=100.0, step=0.1,
                               tooltip="Timestep shift of the flow-matching schedule"),
                io.Int.Input("seed", default=42, min=0, max=SEED_MAX, control_after_generate=True,
                             tooltip="Noise seed of the first segment (segment i uses seed + i)"),
                io.String.Input("prompts", default="", multiline=True, optional=True,
                                tooltip="Per-segment prompts, encoded with `conditioning`'s negative: one per line "
                                        "or a JSON list (the last repeats), or a LingBot Caption with timed actions "
                                        "(seconds from where segment 1 starts, at 24 fps): each segment gets the "
                                        "actions in its span. Empty: `conditioning` for every segment"),
                Choice("sampler", options=SAMPLERS, default="flow_unipc", optional=True, tooltip="As Denoise's sampler"),
                io.Boolean.Input("save_segments", default=True, optional=True,
                                 tooltip=f"Write each finished segment to the output folder's {SEGMENT_FOLDER} "
                                         "(8-bit frames) so an interrupted run continues from them"),
                Choice("overlap_mode", options=OVERLAP_MODES, default=OVERLAP_MODES[0], optional=True,
                       tooltip="A segment's first 4(k-1)+1 frames re-decode the frames before it: drop them (the "
                               "video before the seam stays as it was) or blend (a linear cross-fade from the old "
                               "frames to the segment's, easing a step at the seam); the length is the same"),
            ],
            outputs=[io.Image.Output(display_name="frames", tooltip="The input followed by the new segments"),
                     io.Int.Output(display_name="frame_count", tooltip="Frames of the joined video")],
        )

    @classmethod
    def execute(cls, pipe, conditioning, video, segments, overlap, frames, steps, cfg, shift, seed, prompts="",
                sampler="flow_unipc", save_segments=True, overlap_mode=OVERLAP_MODES[0]):
        from lingbot_core import extend, stages
        from lingbot_core.errors import RefusedInput
        from lingbot_core.worker_pool.pool import pool_of

        if pool_of(pipe) is not None:
            raise RefusedInput("LingBot Extend Video runs in this process: connect the pipe from before LingBot "
                               "Parallel")
        video = video_frames(video)
        if hasattr(video, "ndim") and video.ndim == 4:  # shapes and counts refused before any prompt is encoded
            extend.check_extend_request(video, segments=int(segments), k=int(overlap), num_frames=int(frames),
                                        height=int(video.shape[1]), width=int(video.shape[2]))
        lines = extend.segment_prompts(prompts, segments=int(segments), num_frames=int(frames), k=int(overlap))
        with runtime.node_work(int(steps) * int(segments), "extend", previewer_for("extend")) as on_step:
            conds = [conditioning]
            if lines:
                conds = [stages.Conditioning(stages.encode_prompt(pipe, line, None).positive, conditioning.negative,
                                             prompt=line) for line in lines]
            done = [0]

            def on_segment(index, new_frames, reused):
                done[0] = index + 1

            def callback(step, total, latents):
                on_step(done[0] * int(steps) + step, int(steps) * int(segments), latents)

            folder = runtime.output_dir() / SEGMENT_FOLDER if save_segments else None
            out = extend.extend_video(pipe, video, conds, segments=int(segments), k=int(overlap),
                                      num_frames=int(frames), steps=int(steps), guidance_scale=float(cfg),
                                      shift=float(shift), seed=int(seed), sampler=sampler, folder=folder,
                                      callback=callback, on_segment=on_segment, overlap_mode=overlap_mode)
        return io.NodeOutput(out, int(out.shape[0]))
