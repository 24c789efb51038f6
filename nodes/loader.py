"""Loader, offload and release: the nodes that make and manage the shared pipeline handle."""

from __future__ import annotations

import os
from pathlib import Path

from lingbot_core.errors import quoted
from lingbot_core.save_path import is_inside

from . import paths, runtime
from .notices import on_node
from .types import CATEGORY, FRAMES_GRID, MAX_FRAMES, MAX_SIZE, SIZE_GRID, Choice, Pipe, problems_or_true
from .v3 import io

TINY = {"tiny (built-in dense)": "dense", "tiny (built-in moe)": "moe",
        "tiny (built-in moe dmd student)": "moe-dmd"}  # lingbot_core.tiny.TINY_VARIANTS


def attention_options() -> list[str]:
    """The Loaders' attention choices (`handle.attention_choices`: default, diffusers' backends offered
    here, sparse); any but SDPA is tried on its first call and SDPA serves where it fails
    (lingbot_core.kernels), a masked call included."""
    return setting_widget("attention")["options"]


def _attention_choice(value: object) -> str | None:
    """Why `value` is not an attention option (a null, a number, an unknown name), or None. A diffusers
    backend not offered here (its package is missing) passes: `runtime.attention_problem` says why."""
    options = attention_options()
    if isinstance(value, str) and (value in options or runtime.is_diffusers_backend(value)):
        return None
    return f"attention must be one of {', '.join(options)}; got {quoted(value)}"


def validate_attention(attention: object = None) -> object:
    """Both Loaders' `validate_inputs` for `attention`: one of the options (ComfyUI skips its own combo
    check for an input a validator takes) whose kernel package is there; None is what a validator
    receives for a linked input (a constant null is refused in execute, `attention_problem_at_run`)."""
    problem = _attention_choice(attention) if attention is not None else None
    problem = problem or (runtime.attention_problem(attention) if isinstance(attention, str) else None)
    return problems_or_true({"attention": problem} if problem else {})


def attention_problem_at_run(attention: object, device: str) -> str | None:
    """What execute refuses before anything opens: a bad attention value, a bad device, a missing kernel."""
    return (_attention_choice(attention) or runtime.device_problem(device)
            or runtime.attention_problem(attention, device))


def setting_widget(name: str) -> dict:
    from lingbot_core.handle import setting_widget as widget

    return widget(name)


def setting_input(name: str, optional: bool = True) -> Choice:
    """The Loaders' widget `name` of a handle setting, from its field (`handle.HandleSettings`): its
    choices (the first is the default) and tooltip."""
    return Choice(name, optional=optional, **setting_widget(name))


def with_setting_inputs(inputs: list) -> list:
    """A Loader's `inputs` followed by the widgets of the settings not among them, in the fields' order:
    a new field of `HandleSettings` is a new last widget on both Loaders (a saved workflow keeps its
    values in place)."""
    from lingbot_core.handle import setting_widgets

    placed = {i.id for i in inputs}
    return [*inputs, *(setting_input(name) for name in setting_widgets() if name not in placed)]


def open_settings(widgets: dict, *, comfy_dtypes: bool = True) -> dict:
    """A Loader's setting widgets (`execute`'s keywords past its own inputs) as `PipelineHandle.open`'s
    keywords, refused in one line when one is off its choices. dtype auto: ComfyUI's dtype flags,
    if any, else the DiTs as stored."""
    from lingbot_core.handle import settings_from_widgets

    settings = settings_from_widgets(widgets)
    if comfy_dtypes and widgets.get("dtype", "auto") == "auto":
        settings["dtypes"] = {**settings["dtypes"], **runtime.comfy_dtypes()}
    return settings


def checkpoint_choices() -> list[str]:
    names = list(TINY)
    for root in runtime.model_roots():
        if root.is_dir():
            names += sorted(p.name for p in root.iterdir() if _offered(root, p))
    return list(dict.fromkeys(names))


def _offered(root: Path, folder: Path) -> bool:
    """A checkpoint folder the dropdown lists and resolve_checkpoint accepts: one holding model_index.json
    that, inside ComfyUI, resolves into its model folder (the rule of the `path` input: a link out of it is
    refused there, so it is not offered here either; LINGBOT_ALLOW_ANY_MODEL_PATH=1 lifts both)."""
    if not (folder / "model_index.json").is_file():
        return False
    if paths._folder_paths() is None or os.environ.get(paths.ANY_MODEL_PATH_ENV) == "1":
        return True
    return is_inside(root, folder)


def resolve_checkpoint(choice: str, path: str = "") -> Path:
    from lingbot_core.tiny import ensure_tiny_checkpoint

    if choice in TINY and not path.strip():
        return ensure_tiny_checkpoint(TINY[choice])
    if path.strip():
        folder = paths.checkpoint_path(path)  # inside ComfyUI: only its model folders (see nodes/paths.py)
    elif not isinstance(choice, str) or Path(choice).name != choice or choice in ("", ".", ".."):
        raise ValueError(f"checkpoint {str(choice)[:80]!r} is not a checkpoint folder name")
    else:
        folder = next((root / choice for root in runtime.model_roots() if _offered(root, root / choice)), None)
    if folder is not None:
        paths.check_folder_files_inside(folder, "checkpoint", ("processor", "tokenizer"))  # the processor reads them
        return folder
    raise ValueError(f"checkpoint {choice!r} not found under "
                     f"{', '.join(runtime.shown_path(root) for root in runtime.model_roots())}")


def resolve_student(path: str = "") -> Path | None:
    """The Loader's `transformer_path`: the same rule as `path` (inside ComfyUI, its model folders only,
    unless LINGBOT_ALLOW_ANY_MODEL_PATH=1; see nodes/paths.py)."""
    if not path or not path.strip():
        return None
    return paths.checkpoint_path(path)


class LingBotLoader(io.ComfyNode):
    """Validates a checkpoint and returns a handle; components load when a stage first needs them."""

    @classmethod
    def define_schema(cls):
        inputs = [
            Choice("checkpoint", options=checkpoint_choices(), default=next(iter(TINY)),
                   tooltip="A folder under models/lingbot_video/ holding model_index.json, or a "
                           "built-in tiny random-weight model (for trying workflows; output is noise)"),
            Choice("variant", options=["auto", "dense", "moe"], default="auto",
                   tooltip="auto: read it from the checkpoint; dense/moe: also check that it matches"),
            setting_input("dtype", optional=False),
            setting_input("attention", optional=False),
            io.String.Input("path", default="", optional=True,
                            tooltip="A checkpoint folder; overrides the combo when not empty. In ComfyUI it "
                                    "must lie under its model folders (LINGBOT_ALLOW_ANY_MODEL_PATH=1 lifts that)"),
            Choice("device", options=["auto", "cuda", "cpu"], default="auto", optional=True,
                   tooltip="Execution device. auto: ComfyUI's device inside ComfyUI (honours --cpu "
                           "and --cuda-device), else CUDA when available"),
            setting_input("weights"),
            io.String.Input("transformer_path", default="", optional=True,
                            tooltip="A student DiT (e.g. DMD-distilled): a folder that differs from the checkpoint "
                                    "only in transformer/, or that transformer folder. A whole root works too "
                                    "(the DMD student's: its transformer/ runs, the checkpoint's other parts "
                                    "and refiner stay; to run the student alone, pick its root as the "
                                    "checkpoint instead). Inside ComfyUI it must lie under "
                                    "models/lingbot_video. Empty: the checkpoint's own"),
            setting_input("compile"),
            setting_input("ffn_chunk"),
            setting_input("fp8_matmul"),
        ]
        return io.Schema(
            node_id="LingBotLoader",
            display_name="LingBot Loader",
            category=CATEGORY,
            description="Opens a LingBot-Video checkpoint (dense 1.3B or MoE 30B-A3B, diffusers folder layout) "
                        "and returns the pipeline handle every other LingBot node takes. Nothing heavy loads "
                        "here: each component loads when a stage first needs it.",
            inputs=with_setting_inputs(inputs),  # a newer setting's widget: last
            outputs=[Pipe.Output(display_name="pipe", tooltip="The pipeline handle")],
        )

    @classmethod
    def validate_inputs(cls, attention=None):
        """Is the attention kernel's package there? (One input per validator: ComfyUI attaches the
        message to every input a validator names.) The device is checked first thing in execute."""
        return validate_attention(attention)

    @classmethod
    def execute(cls, checkpoint, variant, dtype="auto", attention="default", path="", device="auto",
                transformer_path="", **settings):
        """`settings`: the setting widgets past `dtype` and `attention` (`handle.HandleSettings`' widgets)."""
        problem = attention_problem_at_run(attention, device)
        if problem:
            raise ValueError(problem)
        chosen = open_settings({**settings, "dtype": dtype, "attention": attention})  # refused before any read
        folder = resolve_checkpoint(checkpoint, path)
        from lingbot_core.handle import PipelineHandle
        from lingbot_core.interrupt import interrupt_checker
        from lingbot_core.notices import cpu_notice

        # header reads and shape skeletons see /interrupt; a checkpoint's problem names ComfyUI's folders
        with interrupt_checker(runtime.interrupt_check()), runtime.server_paths_hidden():
            handle = PipelineHandle.open(folder, device=runtime.execution_device(device),
                                         transformer_folder=resolve_student(transformer_path), **chosen)
        if variant != "auto" and handle.variant != variant:
            raise ValueError(f"{runtime.shown_path(folder)} is a {handle.variant} checkpoint, but the loader asks for "
                             f"{variant}")
        runtime.install_memory_cooperation(handle)
        return io.NodeOutput(handle, ui=on_node(cpu_notice(handle.shared.info, handle.device)))


class LingBotOffload(io.ComfyNode):
    """Returns a view of the pipe with its own offload settings, applied when a stage enters."""

    @classmethod
    def define_schema(cls):
        from lingbot_core.placement.modes import MODE_CLASSES, MODE_ORDER

        return io.Schema(
            node_id="LingBotOffload",
            display_name="LingBot Offload",
            category=CATEGORY,
            description="Chooses where the components live while stages run (GPU, CPU, streamed), as a view "
                        "of the pipe: the Loader's cached handle is not changed, so two Offload nodes with "
                        "different settings can share one Loader.",
            inputs=[
                Pipe.Input("pipe", tooltip="From LingBot Loader"),
                Choice("mode", options=["auto", *MODE_ORDER], default="auto",
                       tooltip="auto: the fastest mode expected to fit the free GPU memory for the size "
                               "below. " + " ".join(f"{m}: {MODE_CLASSES[m].summary}." for m in MODE_ORDER)),
                io.Boolean.Input("use_stream", default=True, optional=True,
                                 tooltip="group: prefetch the next blocks on a CUDA stream"),
                io.Boolean.Input("low_cpu_mem_usage", default=False, optional=True,
                                 tooltip="group: pin host memory on the fly instead of up front (less RAM, slower)"),
                io.Int.Input("num_blocks_per_group", default=1, min=1, max=64, optional=True,
                             tooltip="group: DiT blocks moved together"),
                io.Int.Input("plan_width", default=832, max=MAX_SIZE, **SIZE_GRID, optional=True,
                             tooltip="the video width to plan (auto) and check memory for"),
                io.Int.Input("plan_height", default=480, max=MAX_SIZE, **SIZE_GRID, optional=True,
                             tooltip="the video height to plan (auto) and check memory for"),
                io.Int.Input("plan_frames", default=121, max=MAX_FRAMES, **FRAMES_GRID, optional=True,
                             tooltip="the frame count to plan (auto) and check memory for"),
                io.Boolean.Input("plan_refine", default=True, optional=True,
                                 tooltip="MoE: the run refines (1088x1920): plan for it, and refuse a checkpoint without refiner/ now"),
                Choice("offload_to", options=["ram", "disk"], default="ram", optional=True,
                       tooltip="where the DiT's offloaded weights live: ram, or disk (streamed from the "
                               "checkpoint file, no host copy)"),
            ],
            outputs=[Pipe.Output(display_name="pipe", tooltip="A view of the pipe with these offload settings")],
            hidden=[io.Hidden.prompt, io.Hidden.unique_id],  # a LingBot Rewrite on this pipe adds its generation
        )

    @classmethod
    def execute(cls, pipe, mode, use_stream=True, low_cpu_mem_usage=False, num_blocks_per_group=1,
                plan_width=832, plan_height=480, plan_frames=121, plan_refine=True, offload_to="ram"):
        from lingbot_core.placement.door import check_handle, configure_offload, require_refiner
        from lingbot_core.placement.estimate import Geometry
        from lingbot_core.placement.modes import AUTO, OPTIONS

        if mode not in OPTIONS:
            raise ValueError(f"unknown offload mode {mode!r}; choose one of {', '.join(OPTIONS)}")
        from .rewrite import planned_rewrite_tokens

        refine = (1088, 1920) if plan_refine and pipe.variant == "moe" else None
        require_refiner(pipe, refine)  # before the text encoder and the base pass, not after
        rewrite_tokens = planned_rewrite_tokens(cls.hidden.prompt, cls.hidden.unique_id)
        given = dict(use_stream=bool(use_stream) and pipe.device.type == "cuda",
                     low_cpu_mem_usage=bool(low_cpu_mem_usage), num_blocks_per_group=int(num_blocks_per_group),
                     width=int(plan_width), height=int(plan_height), num_frames=int(plan_frames), refine=refine,
                     rewrite_tokens=rewrite_tokens)
        options = {k: v for k, v in given.items() if k in OPTIONS[mode]}  # what this mode takes
        view = configure_offload(pipe, mode, offload_to=offload_to, **options)
        said = None
        if mode != AUTO:  # auto checked the same numbers while choosing; an explicit mode warns here
            verdict = check_handle(view, Geometry(int(plan_height), int(plan_width), int(plan_frames), refine=refine,
                                                  rewrite_tokens=rewrite_tokens))
            said = verdict.line() if verdict is not None else None
        else:
            choice = view.shared.placement.auto
            said = getattr(choice, "reason", None)
            if said and getattr(choice, "offload_to", None) not in (None, offload_to):
                said = f"auto: '{choice.mode}' with offload_to '{choice.offload_to}': {said}"
            elif said:
                said = f"auto offload: {said}"  # as the log line says it (a headless run prints that once)
        return io.NodeOutput(view, ui=on_node(said))


class LingBotMemoryReport(io.ComfyNode):
    """Where each component lives now (GPU, pinned CPU, CPU, meta, not loaded) and its size."""

    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="LingBotMemoryReport",
            display_name="LingBot Memory Report",
            category=CATEGORY,
            description="After `value` is computed, reports where each component lives (GPU, pinned CPU, CPU, "
                        "not loaded) and its size. The report is a STRING output: wire it to Preview Any or "
                        "a text display node; headless runs print it.",
            inputs=[
                Pipe.Input("pipe", tooltip="The pipe to report on"),
                io.AnyType.Input("value", tooltip="Report after this has been computed (passed through)"),
            ],
            outputs=[io.AnyType.Output(display_name="value", tooltip="`value`, unchanged"),
                     io.String.Output(display_name="report", tooltip="The memory report as text")],
            is_output_node=True,
        )

    @classmethod
    def execute(cls, pipe, value):
        from lingbot_core.placement.door import memory_report

        text = str(memory_report(pipe))
        return io.NodeOutput(value, text, ui=on_node(text))


class LingBotRelease(io.ComfyNode):
    """Frees the pipe's components (hooks first) after `value` is computed; passes `value` through."""

    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="LingBotRelease",
            display_name="LingBot Release",
            category=CATEGORY,
            description="Frees the pipe's components (GPU and host memory) once `value` is computed and passes "
                        "`value` on. The handle stays usable: the next run loads what it needs again.",
            inputs=[
                Pipe.Input("pipe", tooltip="The pipe whose components to free"),
                io.AnyType.Input("value", tooltip="Wire the last output here: the release runs after it"),
                Choice("what", options=["all", "base transformer", "refiner", "text encoder"],
                       default="all", tooltip="Which components to free"),
            ],
            outputs=[io.AnyType.Output(display_name="value", tooltip="`value`, unchanged")],
        )

    @classmethod
    def execute(cls, pipe, value, what="all"):
        from lingbot_core.placement.door import release

        names = {"all": None, "base transformer": ["transformer"], "refiner": ["refiner"],
                 "text encoder": ["text_encoder"]}[what]
        release(pipe, names)
        if what != "text encoder":
            from lingbot_core.worker_pool.pool import release_pool_of

            release_pool_of(pipe)  # a LingBot Parallel pipe: its workers stop too (and restart when next used)
        return io.NodeOutput(value)
