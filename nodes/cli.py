"""`lingbot-run` / `python -m lingbot_nodes`: run a saved workflow (UI or API format) headless.

With no arguments it runs the shipped T2V workflow on the built-in tiny checkpoint and writes an
mp4 under ./output/lingbot/. Written files are printed on stdout, one per line; progress, the
offload choice and Memory Report texts go to stderr.

Exit codes: 0 done, 1 a failure while running, 2 bad input (arguments, workflow, override,
checkpoint, output folder), 130 interrupted (Ctrl-C), 143 stopped by SIGTERM (handled as Ctrl-C).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .shipped import ALIASES

HERE = Path(__file__).resolve().parent
# An installed wheel carries the workflows inside the package (lingbot_nodes/workflows); a source
# checkout (editable install, ComfyUI's custom_nodes) has them beside nodes/.
WORKFLOW_DIRS = (HERE / "workflows", HERE.parent / "workflows")
SHORT_NAMES = ALIASES  # `t2v` -> `lingbot_t2v_dense` (the registry of shipped workflows, `shipped.py`)
# --flag -> the LingBot Loader (files) input it sets on every such node
FILE_FLAGS = {"dit": "dit_path", "refiner": "refiner_path", "vae": "vae_path", "text_encoder": "text_encoder_path",
              "processor": "processor_path"}
LOADERS = {"LingBotLoader": "path", "LingBotLoaderFiles": "checkpoint_path"}  # class -> where --model goes


def resolve_workflow(name: str) -> Path:
    """A file, or a shipped workflow by its short name (`t2v`), its API file's name (`lingbot_t2v_dense`,
    also as the old editor path `workflows/lingbot_t2v_dense.json`) or its template title (the editor file
    `workflows/<title>.json`)."""
    path = Path(name)
    if path.is_file():
        return path
    stem = SHORT_NAMES.get(name, path.stem if path.suffix == ".json" else name)
    for folder in WORKFLOW_DIRS:
        for candidate in (folder / "api" / f"{stem}.json", folder / f"{stem}.json"):
            if candidate.is_file():
                return candidate
    known = ", ".join(sorted(SHORT_NAMES))
    raise FileNotFoundError(f"workflow {name!r} not found (a file, or one of: {known})")


def check_output_dir(folder: Path) -> None:
    """Fail now, not after the generation, when `folder` cannot hold the outputs (a probe file is
    written in it, or in its nearest existing parent, and removed)."""
    from lingbot_core.save_path import check_output_folder

    check_output_folder(folder)


class Reporter:
    """Stage-by-stage progress on stderr, each line labelled with the node's title.

    A node's line appears when it finishes, with its time; nodes that report steps (Denoise,
    Refine) also show them: a live bar on a terminal, a line per step otherwise (logs, CI).
    """

    def __init__(self, labels: dict[str, str], stream=None, enabled: bool = True) -> None:
        self.labels = labels
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.tty = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.current: str | None = None
        self.started = 0.0
        self.steps: tuple[float, float | None] | None = None
        self._bar = None
        self.follower = False  # a rank above 0 of a parallel run: rank 0 speaks for the video
        self.said: set[str] = set()  # notes already shown (a log line, a node's text): each shown once

    def already_said(self, text: str) -> bool:
        """Every line of `text` was printed already (as a note, or inside a longer log line)."""
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        return all(line in self.said or any(line in said for said in self.said) for line in lines)

    def label(self, node_id: str | None) -> str:
        return self.labels.get(node_id or "", f"node {node_id}")

    def write(self, line: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(line, file=self.stream)
        else:
            print(line, file=self.stream, flush=True)

    # -- engine callbacks -------------------------------------------------------------------------------

    def node_started(self, ctx) -> None:
        if ctx.node_id == self.current:
            return  # a lazy node entered again (check_lazy_status, then its function)
        self.finish()
        self.current, self.started, self.steps = ctx.node_id, time.perf_counter(), None
        if self.tty:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=None, desc=self.label(ctx.node_id), leave=False, file=self.stream)

    def progress(self, node_id: str, value: float, total: float | None) -> None:
        if node_id != self.current:
            self.current, self.started = node_id, time.perf_counter()
        self.steps = (value, total)
        if self._bar is not None:
            self._bar.total = total
            self._bar.n = value
            self._bar.refresh()
        elif self.enabled:
            of = f"/{total:g}" if total else ""
            self.write(f"  {self.label(node_id)}: step {value:g}{of}")

    def finish(self) -> None:
        """Close the running node's line (called when the next node starts and at the end)."""
        self.close_bar()
        if self.current is None:
            return
        took = time.perf_counter() - self.started
        steps = ""
        if self.steps is not None:
            value, total = self.steps
            steps = f", {value:g}{f'/{total:g}' if total else ''} steps"
        self.write(f"  {self.label(self.current)}: done in {took:.2f}s{steps}")
        self.current = None

    def close_bar(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


NOTE_PREFIX = "lingbot: "  # how the nodes' one-time notes start in a log (ComfyUI's console)


def note_key(text: str) -> str:
    """What makes two notes the same: the text without the log prefix and outer spaces."""
    text = str(text).strip()
    return text[len(NOTE_PREFIX):] if text.startswith(NOTE_PREFIX) else text


class _ReporterLog(logging.Handler):
    """Our library's and nodes' INFO and WARNING lines (the mode `auto` picked, a note), printed through
    the reporter: nothing with --quiet or on a parallel run's ranks above 0, and a note once."""

    def __init__(self, reporter: Reporter) -> None:
        super().__init__(logging.INFO)
        self.reporter = reporter

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = record.getMessage()
            key = note_key(text)
            if record.levelno >= logging.WARNING:
                if key in self.reporter.said:
                    return
                text = key
            self.reporter.said.add(key)  # a node's text saying the same is not printed again at the end
            self.reporter.write(f"  {text}")
        except Exception:  # logging must never break the run
            self.handleError(record)


@contextmanager
def _library_log(reporter: Reporter) -> Iterator[None]:
    """Route the `lingbot_core` and `lingbot_nodes` loggers through `reporter` (without it, Python prints
    their warnings on stderr itself: also under --quiet, and again after the node's own text)."""
    handler = _ReporterLog(reporter)
    loggers = [logging.getLogger(name) for name in ("lingbot_core", "lingbot_nodes")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.addHandler(handler)
    if loggers[0].getEffectiveLevel() > logging.INFO:  # the library's INFO lines; the nodes' notes (WARNING) only
        loggers[0].setLevel(logging.INFO)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.removeHandler(handler)
            logger.setLevel(level)


def node_labels(prompt, display_names) -> dict[str, str]:
    """`title` (or the display name) of every node; the id is added where a label repeats."""
    names = {}
    for nid, node in prompt.nodes.items():
        class_type = node.get("class_type", "")
        names[nid] = (node.get("_meta") or {}).get("title") or display_names.get(class_type, class_type)
    counts = {}
    for name in names.values():
        counts[name] = counts.get(name, 0) + 1
    return {nid: name if counts[name] == 1 else f"{name} #{nid}" for nid, name in names.items()}


def report_texts(result, labels: dict[str, str], reporter: Reporter | None = None,
                 reports: set[str] | None = None) -> list[str]:
    """Texts that nodes show in the editor (the Memory Report, a node's note), as lines for the terminal.

    With a `reporter`: the texts of the `reports` nodes (output nodes: asked for by the graph) always,
    others (notes) only when it is not quiet and only once (not again per job, nor after the same
    note's log line); nothing on a parallel run's ranks above 0."""
    lines = []
    if reporter is not None and reporter.follower:
        return lines
    for nid, ui in result.ui.items():
        texts = (ui or {}).get("text") or []
        for text in texts if isinstance(texts, (list, tuple)) else [texts]:
            if not text:  # a node with nothing to say (its empty text clears the editor's box)
                continue
            if reporter is not None and (reports is None or nid not in reports):
                key = note_key(text)
                if not reporter.enabled or reporter.already_said(key):
                    continue
                reporter.said.add(key)
            lines.append(f"{labels.get(nid, f'node {nid}')}:")
            lines += [f"  {line}" for line in str(text).splitlines()]
    return lines


#: nodes whose text is a result of the run, not a note: printed even with --quiet (the caption a Rewrite used)
RESULT_TEXTS = ("LingBotRewrite",)


def output_nodes(prompt, classes) -> set[str]:
    """The ids of `prompt`'s output nodes (the Memory Report, Save) and of the `RESULT_TEXTS` nodes: their
    texts are the graph's report."""
    from lingbot_core.workflow.nodeinfo import NodeClassInfo

    found = {nid for nid, node in prompt.nodes.items() if node.get("class_type") in RESULT_TEXTS}
    for nid, node in prompt.nodes.items():
        cls = classes.get(node.get("class_type"))
        try:
            if cls is not None and NodeClassInfo(node["class_type"], cls).output_node:
                found.add(nid)
        except Exception:  # an odd class: its texts count as notes
            continue
    return found


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Help lines wrapped at spaces only: argparse breaks at hyphens too, which cut shipped names such as
    `ti2v-moe-dmd8` in two across lines."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        import textwrap

        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


def build_parser() -> argparse.ArgumentParser:
    from lingbot_core.workflow.runner import OVERRIDE_EXAMPLE

    parser = argparse.ArgumentParser(prog="lingbot-run", description=__doc__, formatter_class=_HelpFormatter)
    parser.add_argument("workflow", nargs="?", default="t2v",
                        help="workflow file, or a shipped one: " + ", ".join(SHORT_NAMES) + "; default t2v")
    parser.add_argument("--model", help="checkpoint folder for every LingBot Loader (default: as saved)")
    files = parser.add_argument_group("single files (LingBot Loader (files) nodes; with --model they replace that "
                                      "folder's components)")
    files.add_argument("--dit", metavar="FILE", help="the DiT: .safetensors or .gguf, dense or MoE")
    files.add_argument("--refiner", metavar="FILE", help="the MoE refiner DiT")
    files.add_argument("--vae", metavar="FILE", help="the Wan 2.1 VAE (.safetensors)")
    files.add_argument("--text-encoder", metavar="FILE", help="Qwen3-VL-4B (.safetensors: bf16 or ComfyUI fp8)")
    files.add_argument("--processor", metavar="DIR", help="a processor folder (a checkpoint's processor/)")
    parser.add_argument("--output", default="output", help="output folder (default ./output)")
    parser.add_argument("--video", metavar="FILE",
                        help="the input video of every LingBot Load Video node (v2v, extend); with Extend Video "
                             "the whole clip is loaded (up to Load Video's 1025-frame cap: set its start_frame for a longer "
                             "clip), to continue from its end")
    parser.add_argument("--segments", type=int, metavar="N", help="segments every LingBot Extend Video node adds")
    parser.add_argument("--segment-prompts", metavar="TEXT|@FILE",
                        help="Extend Video's per-segment prompts: one per line, a JSON list, or a caption with timed "
                             "actions (each segment gets the actions in its span); @FILE reads them from a file")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="NODE.INPUT=VALUE",
                        help=f"override an input, e.g. {OVERRIDE_EXAMPLE}; NODE is an id, a unique class type "
                             "or a title (repeatable)")
    parser.add_argument("--shuffle", type=int, metavar="SEED",
                        help="pick among ready nodes in a seeded random order (the graph must not care)")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress or log lines on stderr")
    parser.add_argument("--parallel", nargs="?", const="", metavar="cfg=C,ulysses=U",
                        help="one video on every process of a torchrun world (torchrun --nproc-per-node N -m "
                             "lingbot_nodes ...): cfg 1 or 2, ulysses dividing the DiT's heads, C x U = N; missing "
                             "degrees follow from the world (cfg=1, ulysses=N; the default under torchrun without "
                             "--jobs). Rank 0 encodes, decodes and saves; Offload nodes run as 'none'. With --jobs, C x U "
                             "may divide N: each group of C x U ranks runs its share of the jobs, its rank 0 saving")
    parser.add_argument("--fsdp", action="store_true",
                        help="with --parallel: shard the DiT's blocks over the processes (FSDP2) so each holds a "
                             "part of their weights; float32 norms, modulation and router stay whole")
    from .jobs import JOB_FIELDS

    jobs = parser.add_argument_group(
        "many videos (a jobs file; under torchrun each process takes its share)",
        "Each line of the jobs file is a JSON object of overrides: "
        + ", ".join(f"{k} ({f.help})" for k, f in JOB_FIELDS.items())
        + ', "set": ["NODE.INPUT=VALUE", ...] for any other input, "id" to name the job (default: j + a digest of its content). '
          "Every finished job gets a manifest line; a rerun skips the jobs recorded as done. Exit code 1 when "
          "a job failed (the others still ran).")
    jobs.add_argument("--jobs", metavar="FILE", help="run the workflow once per line of FILE (JSON Lines)")
    jobs.add_argument("--manifest", metavar="FILE",
                      help="where finished jobs are recorded (default: OUTPUT/<jobs file name>.manifest.jsonl)")
    rewrite = parser.add_argument_group("rewriting prose into a caption (a LingBot Rewrite node before each "
                                        "Text Encode; the caption it used is printed)")
    rewrite.add_argument("--rewrite", metavar="TEXT", help="the prompt in plain words")
    rewrite.add_argument("--rewrite-endpoint", default="", metavar="URL",
                         help="an OpenAI-compatible base address (default: the checkpoint's own text encoder); "
                              "the key comes from LINGBOT_REWRITE_API_KEY")
    rewrite.add_argument("--rewrite-model", default="", metavar="NAME", help="the endpoint's model (expand stage)")
    rewrite.add_argument("--rewrite-map-model", default="", metavar="NAME",
                         help="the endpoint's model for the JSON stage (e.g. a LoRA adapter); default: --rewrite-model")
    rewrite.add_argument("--rewrite-duration", type=float, metavar="SECONDS",
                         help="clip length the caption's actions fill (default: Denoise's frames at 24 fps)")
    return parser


REWRITE_FLAGS = {"--rewrite-endpoint": "rewrite_endpoint", "--rewrite-model": "rewrite_model",
                 "--rewrite-map-model": "rewrite_map_model", "--rewrite-duration": "rewrite_duration"}


def video_overrides(prompt, path: Path, *, video: str | None, segments: int | None,
                    segment_prompts: str | None = None) -> list[str]:
    """--video, --segments and --segment-prompts as overrides of the Load Video and Extend Video nodes
    (refused in one line where the workflow has none)."""
    from lingbot_core.workflow import WorkflowError

    def ids(class_type: str, flag: str) -> list[str]:
        found = [nid for nid, node in prompt.nodes.items() if node["class_type"] == class_type]
        if not found:
            raise WorkflowError(f"{flag} given, but {path.name} has no {class_type} node; run v2v or extend "
                                f"(lingbot-run extend {flag} ...)")
        return found

    extending = any(node["class_type"] == "LingBotExtendVideo" for node in prompt.nodes.values())
    overrides = []
    if video is not None:
        for nid in ids("LingBotLoadVideo", "--video"):
            overrides.append(f"{nid}.path={video}")
            if extending:
                overrides.append(f"{nid}.frame_count=0")
    if segments is not None:
        overrides += [f"{nid}.segments={segments}" for nid in ids("LingBotExtendVideo", "--segments")]
    if segment_prompts is not None:
        text = segment_prompts
        if text.startswith("@"):
            try:
                text = Path(text[1:]).read_text(encoding="utf-8-sig")
            except (OSError, UnicodeDecodeError) as err:
                raise WorkflowError(f"--segment-prompts {segment_prompts[:80]}: cannot read it "
                                    f"({getattr(err, 'strerror', None) or err})") from None
        overrides += [f"{nid}.prompts={json.dumps(text)}" for nid in ids("LingBotExtendVideo", "--segment-prompts")]
    return overrides


def rewrite_settings(args: argparse.Namespace) -> list[str]:
    """The --rewrite-* settings given on the command line (their flag names)."""
    return [flag for flag, name in REWRITE_FLAGS.items() if getattr(args, name) not in (None, "")]


def insert_rewrite(prompt, text: str | None, *, endpoint: str = "", model: str = "", map_model: str = "",
                   duration: float | None = None):
    """A LingBot Rewrite node feeding the prompt of every LingBot Text Encode in ``prompt`` (API format),
    with the encoder's pipe, task and (TI2V) the image behind its first frame. Where a Rewrite node
    already feeds it (the shipped rewrite workflows), that node gets ``text`` (and the endpoint
    settings given) instead; ``text`` None keeps such a node's saved prompt and inserts no node."""
    from lingbot_core.rewrite import duration_for
    from lingbot_core.workflow import WorkflowError

    nodes = prompt.nodes
    encoders = [nid for nid, node in nodes.items() if node["class_type"] == "LingBotTextEncode"]
    if not encoders:
        raise WorkflowError(f"--rewrite given, but {prompt.source} has no LingBot Text Encode node")
    next_id = max((int(n) for n in nodes if n.isdigit()), default=0) + 1
    for nid in encoders:
        inputs = nodes[nid]["inputs"]
        source = inputs.get("prompt")
        if isinstance(source, list) and nodes.get(str(source[0]), {}).get("class_type") == "LingBotRewrite":
            given = nodes[str(source[0])]["inputs"]
            if text is not None:
                given["prompt"] = text
            given.update({k: v for k, v in (("endpoint", endpoint), ("expand_model", model),
                                            ("map_model", map_model), ("duration", duration)) if v})
            continue
        if text is None:
            continue
        seconds = duration
        if seconds is None:
            frames = [n["inputs"].get("frames") for n in nodes.values() if n["class_type"] == "LingBotDenoise"
                      and n["inputs"].get("conditioning") == [nid, 0]]
            count = frames[0] if frames and isinstance(frames[0], int) else 121
            seconds = min(60.0, max(0.5, duration_for(count, 24)))
        rewrite = {"prompt": text, "task": inputs.get("task", "t2v"), "duration": float(seconds),
                   "endpoint": endpoint, "expand_model": model, "map_model": map_model}
        if isinstance(inputs.get("pipe"), list):
            rewrite["pipe"] = inputs["pipe"]
        image = inputs.get("image")
        if not isinstance(image, list) and isinstance(inputs.get("image_cond"), list):
            source = nodes.get(str(inputs["image_cond"][0]), {})
            image = source.get("inputs", {}).get("image") if source.get("class_type") == "LingBotImageEncode" else None
        if isinstance(image, list):
            rewrite["image"] = image
        new = str(next_id)
        next_id += 1
        nodes[new] = {"class_type": "LingBotRewrite", "inputs": rewrite, "_meta": {"title": "Rewrite"}}
        inputs["prompt"] = [new, 0]
    return prompt


def main(argv: list[str] | None = None) -> int:
    from lingbot_core.exit_codes import INTERRUPTED, exit_code, interrupted_code, sigterm_interrupts

    args = build_parser().parse_args(argv)
    reporter = Reporter({}, enabled=not args.quiet)
    with sigterm_interrupts() as terms:  # SIGTERM (a container stop, a scheduler) ends the run as Ctrl-C does
        try:
            with _library_log(reporter):
                return _run(args, reporter)
        except KeyboardInterrupt:
            reporter.close_bar()
            where = f" in {reporter.label(reporter.current)}" if reporter.current else ""
            print(f"interrupted{where}", file=sys.stderr)
            return interrupted_code(terms)
        except Exception as err:
            reporter.close_bar()
            code = exit_code(err)
            if code != INTERRUPTED:
                return _failed(err, code, reporter)
            where = f" in {reporter.label(err.node_id)}" if getattr(err, "node_id", None) else ""
            print(f"interrupted{where}", file=sys.stderr)
            return interrupted_code(terms)


def _failed(err: Exception, code: int, reporter: Reporter) -> int:
    """One line for a failed run (an error of the run, or bad input); returns its exit code."""
    from lingbot_core.exit_codes import one_line, root_cause

    cause = root_cause(err)
    node_id = getattr(err, "node_id", None)
    where = f"{reporter.label(node_id)} (node {node_id}, {err.class_type}): " if cause is not err else ""
    kind = "" if code == 2 or isinstance(cause, (RuntimeError, OSError)) else f"{type(cause).__name__}: "
    print(f"error: {where}{kind}{one_line(cause)}", file=sys.stderr)
    return code


def _run(args: argparse.Namespace, reporter: Reporter) -> int:
    from lingbot_core.workflow import Engine, WorkflowError, apply_overrides, load_workflow
    from lingbot_core.workflow.context import watch_nodes

    from . import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS

    path = resolve_workflow(args.workflow)
    prompt = load_workflow(path, NODE_CLASS_MAPPINGS, display_names=NODE_DISPLAY_NAME_MAPPINGS)
    overrides = list(args.overrides)
    if args.model:
        loaders = [nid for nid, node in prompt.nodes.items() if node["class_type"] in LOADERS]
        if not loaders:
            raise WorkflowError(f"--model given, but {path} has no LingBot Loader node")
        overrides += [f"{nid}.{LOADERS[prompt.nodes[nid]['class_type']]}={args.model}" for nid in loaders]
    overrides += video_overrides(prompt, path, video=args.video, segments=args.segments,
                                 segment_prompts=args.segment_prompts)
    given = {flag: getattr(args, flag) for flag in FILE_FLAGS if getattr(args, flag)}
    if given:
        loaders = [nid for nid, node in prompt.nodes.items() if node["class_type"] == "LingBotLoaderFiles"]
        if not loaders:
            flags = ", ".join("--" + f.replace("_", "-") for f in given)
            raise WorkflowError(f"{flags} given, but {path} has no LingBot Loader (files) node; run a files workflow "
                                "(lingbot-run t2v-files, moe-gguf, moe-gguf-refine) or add that node")
        if "refiner" in given and not any(node["class_type"] == "LingBotRefine" for node in prompt.nodes.values()):
            raise WorkflowError(f"--refiner given, but {path.name} has no Refine node, so the refiner would never run; "
                                "run moe-gguf-refine (single files with Refine) or leave --refiner out")
        overrides += [f"{nid}.{FILE_FLAGS[flag]}={value}" for nid in loaders for flag, value in given.items()]
        if not args.model and {"dit", "vae", "text_encoder"} <= set(given):
            overrides += [f"{nid}.checkpoint=none" for nid in loaders]  # nothing from the workflow's own folder
    layout = _start_parallel(args, prompt, overrides, reporter)
    prompt = apply_overrides(prompt, overrides, NODE_CLASS_MAPPINGS)
    settings = rewrite_settings(args)
    if args.rewrite is None and settings:
        has_rewrite = any(node["class_type"] == "LingBotRewrite" for node in prompt.nodes.values())
        if not has_rewrite:  # else they set the workflow's own Rewrite node(s), its saved prompt kept
            flags = ", ".join(settings)
            raise WorkflowError(f"{flags} given without --rewrite, and {path.name} has no Rewrite node: add "
                                "--rewrite \"the prompt in plain words\" (or run t2v-rewrite / ti2v-rewrite)")
    if args.rewrite is not None or settings:
        prompt = insert_rewrite(prompt, args.rewrite, endpoint=args.rewrite_endpoint, model=args.rewrite_model,
                                map_model=args.rewrite_map_model, duration=args.rewrite_duration)
        for nid, node in prompt.nodes.items():
            inputs = node["inputs"] if node["class_type"] == "LingBotRewrite" else {}
            if isinstance(inputs.get("endpoint"), str) and inputs["endpoint"] and not inputs.get("expand_model"):
                raise WorkflowError(f"the Rewrite node {nid} calls the endpoint {inputs['endpoint']} but no model is "
                                    "named: add --rewrite-model NAME (the model the endpoint serves)")
    output = Path(args.output)
    check_output_dir(output)
    engine = Engine(NODE_CLASS_MAPPINGS)
    engine.validate(prompt)  # every graph problem before any model work
    reporter.labels = node_labels(prompt, NODE_DISPLAY_NAME_MAPPINGS)

    os.environ["LINGBOT_OUTPUT_DIR"] = str(output)
    if args.jobs is not None:
        from lingbot_core.distributed.launch import join_world

        joined = layout is None and join_world()  # plain --jobs under torchrun: a group for the jobs' end only
        try:
            return _run_jobs(args, prompt, engine, reporter, output, layout)
        except BaseException as err:
            _publish_failure(layout, err)
            raise
        finally:
            _stop_parallel(layout)
            if joined:
                import torch.distributed as dist

                dist.destroy_process_group()
    reporter.write(f"lingbot-run: {path}" + (f" on {layout.world_size} processes, {layout.describe()}"
                                             if layout is not None else ""))
    with watch_nodes(reporter.node_started):
        try:
            result = engine.run(prompt, seed_order=args.shuffle, progress=reporter.progress)
        except BaseException as err:
            _publish_failure(layout, err)
            raise
        finally:
            reporter.close_bar()
            _stop_parallel(layout)
    reporter.finish()
    # the output nodes' texts are asked for by the graph: shown even with --quiet
    for line in report_texts(result, reporter.labels, reporter, output_nodes(prompt, NODE_CLASS_MAPPINGS)):
        print(line, file=sys.stderr)
    for ui in result.ui.values():
        for entry in (ui or {}).get("images", []):
            print(output / entry.get("subfolder", "") / entry["filename"])
    return 0


def _run_jobs(args: argparse.Namespace, prompt, engine, reporter: Reporter, output: Path, layout=None) -> int:
    """--jobs: every line of the jobs file checked first, then this process's share run on one engine.
    With a `layout` (--parallel) the ranks of each video group run their group's jobs together and
    the group's rank 0 writes the files and the manifest lines."""
    from lingbot_core.errors import is_refused_input
    from lingbot_core.workflow import WorkflowError, apply_overrides
    from lingbot_core.workflow.context import watch_nodes

    from . import NODE_CLASS_MAPPINGS
    from .jobs import (
        DONE,
        Manifest,
        check_file_names,
        failure_text,
        finish_together,
        group_agreement,
        job_overrides,
        read_jobs,
        run_jobs,
        world_place,
    )

    jobs = read_jobs(args.jobs)  # a bad line stops here, before any model work
    rewrites = [job.line for job in jobs if "rewrite" in job.values]
    if rewrites and not any(node["class_type"] == "LingBotRewrite" for node in prompt.nodes.values()):
        lines = ", ".join(map(str, rewrites[:5])) + (", ..." if len(rewrites) > 5 else "")
        raise WorkflowError(f"{args.jobs}: 'rewrite' on line(s) {lines}, but the workflow has no Rewrite node: add "
                            "--rewrite \"a default prompt\" (the jobs without 'rewrite' use it) or run t2v-rewrite / "
                            "ti2v-rewrite")
    place = world_place(layout=layout)
    check_file_names(prompt.nodes, place)  # before any model work: no two groups may pick one file name
    _pick_local_device()
    _tune_allocator()
    # one file per writing group leader (jobs.manifest.group<N>.jsonl) when the world has several groups
    manifest = Manifest(args.manifest or output / f"{Path(args.jobs).stem}.manifest.jsonl", writer=place.writer)
    if layout is not None and layout.nodes > 1 and place.leader:
        reporter.write(f"note: video group {place.group} spans {layout.nodes} nodes (cfg x ulysses = "
                       f"{layout.world_size} does not fit the processes left on one node); its collectives "
                       "cross the network")
    prompts, refused = {}, {}
    reports = output_nodes(prompt, NODE_CLASS_MAPPINGS)
    for job in place.share(jobs):  # each job's overrides and graph checked before the first one runs
        try:
            job_prompt = apply_overrides(prompt, job_overrides(prompt.nodes, job), NODE_CLASS_MAPPINGS)
            engine.validate(job_prompt)
            prompts[job.id] = job_prompt
        except Exception as err:
            if not (isinstance(err, WorkflowError) or is_refused_input(err)):
                raise  # a failure of ours or of a library while checking, not a bad job
            refused[job.id] = err
            if place.leader:  # said once, here: not again when its turn comes, nor by each rank of its group
                print(f"error: job {job.id} (line {job.line}): {failure_text(err)} (recorded as failed when its turn "
                      "comes; the other jobs run)", file=sys.stderr, flush=True)

    def run_one(job) -> list[Path]:
        if job.id in refused:
            raise refused[job.id]
        reporter.write(f"job {job.id} (line {job.line})")
        with watch_nodes(reporter.node_started):
            try:
                result = engine.run(prompts[job.id], seed_order=args.shuffle, progress=reporter.progress)
            except Exception:
                reporter.close_bar()
                reporter.current = None  # the failing node gets no "done" line
                raise
        reporter.close_bar()
        reporter.finish()
        for line in report_texts(result, reporter.labels, reporter, reports):
            print(line, file=sys.stderr)
        return [output / entry.get("subfolder", "") / entry["filename"]
                for ui in result.ui.values() for entry in (ui or {}).get("images", [])]

    def shown(entry: dict) -> None:
        if not place.leader:
            return  # the group's leader speaks for its job: one line per job, not one per rank
        if entry["status"] == DONE:
            if place.leader:
                for path in entry["outputs"]:
                    print(path, flush=True)
        elif entry["id"] not in refused:  # a refused job's line was printed before the first job ran
            print(f"error: job {entry['id']} (line {entry['line']}): {entry['error']}", file=sys.stderr, flush=True)

    where = f" (rank {place.rank} of {place.world_size}, group {place.group} of {place.groups})" \
        if place.world_size > 1 else ""
    reporter.write(f"lingbot-run: {len(jobs)} jobs from {args.jobs}{where}; manifest {manifest.write_path}")
    elsewhere = []  # jobs another run on this jobs file ran meanwhile (Claims)

    def skipped(job, why: str) -> None:
        if why == "waiting":
            reporter.write(f"job {job.id} (line {job.line}) is running in another process; waiting for it")
        elif why == "elsewhere":
            elsewhere.append(job.id)

    try:
        with _sigterm_interrupts(place.world_size > 1):
            results = run_jobs(jobs, run_one, manifest, place=place, on_result=shown, agree=group_agreement(layout),
                               on_skip=skipped)
    except BaseException:  # an interrupt: the processes waiting at the end must not wait for this one
        try:
            finish_together(0, stopped=True)
        except Exception:  # the store may be gone with the rest of the world; the interrupt is what matters
            pass
        raise
    failed = sum(e["status"] != DONE for e in results)
    mine = len(place.share(jobs))
    print(f"jobs: {len(results) - failed} done, {failed} failed, {mine - len(results) - len(elsewhere)} already done"
          + (f", {len(elsewhere)} by another process" if elsewhere else "")
          + f"{where}; manifest {manifest.write_path}", file=sys.stderr)
    # under torchrun every process leaves together, all with the world's exit code (finish_together says why)
    failed = finish_together(failed if place.leader else 0, say=reporter.write)
    if failed and place.world_size > 1 and place.rank == 0:
        print(f"jobs: {failed} failed in the world of {place.world_size} processes; see the manifest files",
              file=sys.stderr)
    return 1 if failed else 0


@contextmanager
def _sigterm_interrupts(under_torchrun: bool) -> Iterator[None]:
    """Under torchrun, SIGTERM interrupts like Ctrl-C. torchrun starts its workers in sessions of their
    own and stops them with SIGTERM (Ctrl-C on the machine, a failed worker there), which ends Python
    at once by default: the other machines' processes, waiting at the jobs' end, would never hear of it."""
    import signal
    import threading

    if not under_torchrun or threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _start_parallel(args: argparse.Namespace, prompt, overrides: list[str], reporter: Reporter):
    """Join the torchrun world when asked (`--parallel`, or a world of several processes without
    `--jobs`), make its layout every handle's (`distributed.stage.use_process_layout`), set the Offload
    nodes to 'none' (no other mode runs on several processes) and quiet the ranks above 0.
    Returns the layout, or None for a one-process run."""
    from lingbot_core.workflow import WorkflowError

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.parallel is None and (world == 1 or args.jobs is not None):
        if args.fsdp:
            raise WorkflowError("--fsdp shards the DiT over the processes of a parallel run: start it with "
                                "torchrun and --parallel")
        return None
    from lingbot_core.distributed.launch import init_from_env
    from lingbot_core.distributed.stage import use_process_layout

    # with --jobs the world splits into groups of cfg x ulysses ranks, each running its share of the jobs
    layout = init_from_env(args.parallel or "", fsdp=args.fsdp, split=args.jobs is not None)
    if layout.world_size == 1:
        if args.fsdp:
            raise WorkflowError("--fsdp shards the DiT over the processes of one video: give --parallel degrees "
                                "whose product is more than 1")
        return None
    use_process_layout(layout)
    offloads = [nid for nid, node in prompt.nodes.items()
                if node["class_type"] == "LingBotOffload" and node["inputs"].get("mode") not in ("none", "auto")]
    if offloads:
        reporter.write(f"--parallel: Offload node(s) {', '.join(offloads)} run as 'none' (each rank holds its DiT; "
                       "'auto' picks it with a per-GPU estimate)")
        overrides += [f"{nid}.mode=none" for nid in offloads]
    if layout.rank != 0:
        reporter.enabled = reporter.tty = False
        reporter.follower = True
    return layout


def _publish_failure(layout, err: BaseException) -> None:
    """A parallel run that failed on this rank: its error goes to the group's store before the rank leaves
    (`distributed.abort`), so the ranks whose collectives then fail name this rank and its error (a failure
    inside a DiT forward already is there; the first one published wins)."""
    if layout is None:
        return
    import torch
    import torch.distributed as dist

    from lingbot_core.distributed.abort import failure_key, publish_failure
    from lingbot_core.exit_codes import root_cause

    node = getattr(err, "node_id", None)
    where = f"in node {node} ({err.class_type})" if node is not None else "in its run"
    nccl = dist.is_initialized() and dist.get_backend() == "nccl"
    device = f"cuda:{torch.cuda.current_device()}" if nccl else "cpu"
    publish_failure(root_cause(err), where=where, device=device, key=failure_key(layout))


def _stop_parallel(layout) -> None:
    """Leave the world `_start_parallel` joined (nothing for a one-process run)."""
    if layout is None:
        return
    import torch.distributed as dist

    from lingbot_core.distributed.stage import use_process_layout

    use_process_layout(None)
    if dist.is_initialized():
        dist.destroy_process_group()


def _tune_allocator() -> None:
    """Without a GPU the run is on the CPU: glibc's allocator set up for its large tensors
    (`lingbot_core.allocator`), before any model loads."""
    import torch

    from lingbot_core.allocator import tune_for_cpu

    said = tune_for_cpu("cuda" if torch.cuda.is_available() else "cpu")
    logging.getLogger("lingbot_nodes").debug("CPU allocator: %s", said)


def _pick_local_device() -> None:
    """Under torchrun on GPUs, each process takes the GPU of its LOCAL_RANK ("cuda" then means that one);
    more processes on the node than GPUs is refused (`distributed.launch.local_gpu`)."""
    if os.environ.get("LOCAL_RANK") is None:
        return
    from lingbot_core.distributed.launch import local_gpu

    gpu = local_gpu()
    if gpu is not None:
        import torch

        torch.cuda.set_device(gpu)


if __name__ == "__main__":
    raise SystemExit(main())
