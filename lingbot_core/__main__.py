"""`python -m lingbot_core`: generate one video (or image) without a node graph.

With no options it builds the tiny random-weight checkpoint (first use only) and writes a short
T2V mp4, which makes it a smoke test of the whole core on any machine. Exit codes as `lingbot-run`:
0 done, 1 a failure while running, 2 bad input (incl. a bad checkpoint), 130 interrupted.
"""

from __future__ import annotations

import argparse
import os
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


def build_parser() -> argparse.ArgumentParser:
    """The command's options (the README's commands are parsed with this in the tests)."""
    parser = argparse.ArgumentParser(prog="python -m lingbot_core", description=__doc__)
    parser.add_argument("--model", help="checkpoint folder (default: the tiny built-in checkpoint)")
    parser.add_argument("--mode", choices=("t2v", "t2i", "ti2v"), default="t2v")
    parser.add_argument("--prompt", default='{"comprehensive_description":{"scene_content_description":'
                        '"A small red paper boat drifts along a canal at dawn."}}')
    parser.add_argument("--negative-prompt", default="", help="empty: the reference default")
    parser.add_argument("--image", help="first frame for ti2v")
    parser.add_argument("--height", type=_positive(int))
    parser.add_argument("--width", type=_positive(int))
    parser.add_argument("--frames", type=_positive(int))
    parser.add_argument("--steps", type=_positive(int))
    parser.add_argument("--cfg", type=_non_negative, default=3.0)
    parser.add_argument("--shift", type=_positive(float), default=3.0)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--fps", type=_positive(float), default=24.0)
    parser.add_argument("--refine", action="store_true", help="run the MoE refiner too")
    parser.add_argument("--device", help="execution device (default: cuda if available)")
    parser.add_argument("--output", default="output/lingbot", help="file name without suffix")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    from .exit_codes import BAD_INPUT, INTERRUPTED, exit_code, one_line

    try:
        return _generate(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return INTERRUPTED
    except Exception as err:
        code = exit_code(err)
        kind = "" if code == BAD_INPUT else f"{type(err).__name__}: "
        print("interrupted" if code == INTERRUPTED else f"error: {kind}{one_line(err)}", file=sys.stderr)
        return code


def _check_writable(stem: Path) -> None:
    """The output's folder (or its nearest existing parent) must be a writable folder; checked first."""
    probe = stem.parent
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    if not probe.is_dir():
        raise NotADirectoryError(f"--output {stem}: {probe} exists and is not a folder")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise PermissionError(f"--output {stem}: {probe} is not writable")


def _generate(args: argparse.Namespace) -> int:
    from .handle import PipelineHandle
    from .stages import generate
    from .tiny import ensure_tiny_checkpoint
    from .video import save_frames

    _check_writable(Path(args.output))
    tiny = args.model is None
    folder = ensure_tiny_checkpoint("moe" if args.refine else "dense") if tiny else args.model
    small = dict(height=64, width=64, frames=9, steps=4) if tiny else dict(height=480, width=832, frames=121, steps=40)
    height, width = args.height or small["height"], args.width or small["width"]
    frames = args.frames or (1 if args.mode == "t2i" else small["frames"])
    handle = PipelineHandle.open(folder, device=args.device)
    result = generate(handle, args.prompt, mode=args.mode, image=args.image, negative_prompt=args.negative_prompt,
                      height=height, width=width, num_frames=frames, steps=args.steps or small["steps"],
                      guidance_scale=args.cfg, shift=args.shift, seed=args.seed, refine_output=args.refine,
                      refine_options=dict(height=2 * height, width=2 * width) if tiny else None)
    print(save_frames(result.frames, Path(args.output), args.fps))
    if result.refined is not None:
        print(save_frames(result.refined, Path(args.output + "_refined"), args.fps))
    return 0

if __name__ == "__main__":
    raise SystemExit(main())
