"""Reading a video (LingBot Load Video, video-to-video, extend) with frames converted to RGB on one thread,
as `lingbot_core.video_input` does (so that a process forked after a read does not hang on PyAV 17+),
against PyAV's default multi-threaded conversion, in one process, alternating (A B A B ...).

A clip of `--frames` frames at `--width`x`--height` (a smooth moving pattern, H.264) is written once; each
side reads it whole at its own size through `read_video_frames` (`--repeats` times per pair, best
reported). The ratio is one-thread time / default time (above 1: one thread is slower). PyAV older than
17 has no such option: both sides are then the same.

    python bench/video_read.py --frames 81 --width 1280 --height 720 --pairs 3
    python bench/video_read.py --quick
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python bench/x.py` from a plain checkout

SIDES = ("one_thread", "pyav_default")


def _clip(path: Path, frames: int, height: int, width: int) -> Path:
    import torch

    from lingbot_core.video import save_mp4

    t = torch.linspace(0, 1, frames)[:, None, None, None]
    y = torch.linspace(0, 1, height)[None, :, None, None]
    x = torch.linspace(0, 1, width)[None, None, :, None]
    shape = (frames, height, width, 1)
    rgb = torch.cat([((x + t) % 1).expand(shape), ((y + 0.5 * t) % 1).expand(shape),
                     (((x + y) / 2 + t) % 1).expand(shape)], dim=-1)
    return save_mp4(rgb, path)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frames", type=int, default=81)
    parser.add_argument("--width", type=int, default=1280)
    parser.add_argument("--height", type=int, default=720)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="9 frames at 128x96, one pair")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.frames, args.width, args.height, args.pairs, args.repeats = 9, 128, 96, 1, 1
    import av

    from bench._common import environment, print_machine
    from lingbot_core import video_input

    print_machine()

    shipped = video_input._scale_options
    options = {"one_thread": shipped, "pyav_default": lambda _av: {}}
    best = dict.fromkeys(SIDES, float("inf"))
    with tempfile.TemporaryDirectory() as folder:
        path = _clip(Path(folder) / "clip.mp4", args.frames, args.height, args.width)
        try:
            for _ in range(args.pairs):
                for side in SIDES:
                    video_input._scale_options = options[side]
                    for _ in range(args.repeats):
                        start = time.perf_counter()
                        frames, _fps = video_input.read_video_frames(path)
                        best[side] = min(best[side], time.perf_counter() - start)
        finally:
            video_input._scale_options = shipped
    result = {"environment": environment(), "pyav": av.__version__, "frames": int(frames.shape[0]), "size": [args.width, args.height],
              "seconds": best, "ratio_one_thread_over_default": best["one_thread"] / best["pyav_default"]}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"PyAV {result['pyav']}, {result['frames']} frames at {args.width}x{args.height}: one thread "
              f"{best['one_thread']:.3f} s, PyAV default {best['pyav_default']:.3f} s, ratio "
              f"{result['ratio_one_thread_over_default']:.3f}")
    return result


if __name__ == "__main__":
    main()
