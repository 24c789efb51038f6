"""`lingbot-run` / `python -m lingbot_nodes`: run a saved workflow (UI or API format) headless.

With no arguments it runs the shipped T2V workflow on the built-in tiny checkpoint and writes an
mp4 under ./output/lingbot/.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

WORKFLOWS = Path(__file__).resolve().parent.parent / "workflows"
SHORT_NAMES = {"t2v": "lingbot_t2v_dense", "t2i": "lingbot_t2i_dense", "ti2v": "lingbot_ti2v_dense",
               "moe": "lingbot_t2v_moe_refine", "refine": "lingbot_t2v_moe_refine"}


def resolve_workflow(name: str) -> Path:
    path = Path(name)
    if path.is_file():
        return path
    stem = SHORT_NAMES.get(name, name)
    for candidate in (WORKFLOWS / "api" / f"{stem}.json", WORKFLOWS / f"{stem}.json"):
        if candidate.is_file():
            return candidate
    known = ", ".join(sorted(SHORT_NAMES))
    raise FileNotFoundError(f"workflow {name!r} not found (a file, or one of: {known})")


class TerminalProgress:
    """One line per node, a bar for nodes that report steps."""

    def __init__(self) -> None:
        self._bar = None
        self._node = None

    def __call__(self, node_id: str, value: float, total: float | None) -> None:
        from tqdm.auto import tqdm

        if node_id != self._node or self._bar is None:
            self.close()
            self._node = node_id
            self._bar = tqdm(total=total, desc=f"node {node_id}", leave=False, file=sys.stderr,
                             disable=not sys.stderr.isatty())
        self._bar.total = total
        self._bar.n = value
        self._bar.refresh()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lingbot-run", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workflow", nargs="?", default="t2v",
                        help="workflow file, or t2v / t2i / ti2v / moe (the shipped ones); default t2v")
    parser.add_argument("--model", help="checkpoint folder for every LingBot Loader (default: as saved)")
    parser.add_argument("--output", default="output", help="output folder (default ./output)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="NODE.INPUT=VALUE",
                        help="override an input; NODE is an id, a unique class type or a title")
    parser.add_argument("--shuffle", type=int, metavar="SEED",
                        help="pick among ready nodes in a seeded random order (the graph must not care)")
    args = parser.parse_args(argv)

    from lingbot_core.workflow import NodeExecutionError, RunInterrupted, WorkflowError, run_workflow_file

    from . import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS

    overrides = list(args.overrides)
    try:
        path = resolve_workflow(args.workflow)
        if args.model:
            from lingbot_core.workflow import load_workflow

            prompt = load_workflow(path, NODE_CLASS_MAPPINGS, display_names=NODE_DISPLAY_NAME_MAPPINGS)
            loaders = [nid for nid, node in prompt.nodes.items() if node["class_type"] == "LingBotLoader"]
            if not loaders:
                raise WorkflowError(f"--model given, but {path} has no LingBot Loader node")
            overrides += [f"{nid}.path={args.model}" for nid in loaders]
        os.environ["LINGBOT_OUTPUT_DIR"] = str(Path(args.output))
        progress = TerminalProgress()
        try:
            result = run_workflow_file(path, NODE_CLASS_MAPPINGS, overrides=overrides, seed_order=args.shuffle,
                                       progress=progress, display_names=NODE_DISPLAY_NAME_MAPPINGS)
        finally:
            progress.close()
    except NodeExecutionError as err:
        cause = err.__cause__ or err
        print(f"error: node {err.node_id} ({err.class_type}): {cause}", file=sys.stderr)
        return 1
    except RunInterrupted as err:
        print(f"interrupted: {err}", file=sys.stderr)
        return 130
    except (WorkflowError, FileNotFoundError, ValueError, OSError) as err:
        print(f"error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    except Exception as err:  # a bug, not bad input: still one line, and a non-zero exit
        print(f"error: {type(err).__name__}: {' '.join(str(err).split())}", file=sys.stderr)
        return 1
    for ui in result.ui.values():
        for entry in (ui or {}).get("images", []):
            print(Path(args.output) / entry.get("subfolder", "") / entry["filename"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
