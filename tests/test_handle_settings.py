"""One settings object for a handle (`handle.HandleSettings`): a knob is one field, and the CLI, both
Loaders and LingBot Parallel's workers follow from it."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from lingbot_core.handle import HandleSettings, PipelineHandle, settings_flags
from lingbot_core.models.sparse_attention import SparseSettings

FIELDS = [f for f in dataclasses.fields(HandleSettings)]


def _loader_inputs(cls) -> list[str]:
    spec = cls.INPUT_TYPES()
    return [*spec.get("required", {}), *spec.get("optional", {})]


def test_every_field_is_a_cli_flag_or_says_where_it_is_set():
    from lingbot_core.__main__ import build_parser

    flags = {opt for action in build_parser()._actions for opt in action.option_strings}
    generated = {flag for flag, _options in settings_flags()}
    for f in FIELDS:
        cli, surface = f.metadata.get("cli"), f.metadata.get("surface")
        assert cli or surface, f"HandleSettings.{f.name}: give it a flag (cli=) or say where it is set (surface=)"
        if cli:
            assert cli in flags and cli in generated, f"{cli} ({f.name}) is not a flag of python -m lingbot_core"
    # the flags' defaults are the fields' defaults: no flag given opens the handle as PipelineHandle.open does
    from lingbot_core.handle import settings_from_flags

    args = build_parser().parse_args([])
    defaults = HandleSettings()
    for name, value in settings_from_flags(args).items():
        assert value == getattr(defaults, name), name


def test_every_field_crosses_to_the_pools_workers(fixtures_root):
    from lingbot_core.worker_pool.spec import describe_handle, open_described

    # a value other than the default for every field a worker can open with on the CPU
    changed = dict(weights="fp8_e4m3", attention_backend="sparse", text_attn="eager", ffn_chunk=64,
                   fp8_matmul="auto", decoder="eager", sparse=SparseSettings(tau=2.0, dense_blocks=(0, 1)),
                   dtypes={"transformer": torch.float16})
    missing = {f.name for f in FIELDS} - set(changed) - {"compile"}  # compile=blocks needs a compiler here
    assert not missing, f"give the round trip a non-default value for {sorted(missing)}"
    handle = PipelineHandle.open(fixtures_root / "models" / "tiny-dense", device="cpu", **changed)
    description = describe_handle(handle)
    assert description == json.loads(json.dumps(description))  # JSON-able
    worker = open_described(description, "cpu")
    assert worker.shared.settings == handle.shared.settings and not worker.shared.loaded
    assert worker.shared.sparse == changed["sparse"] and worker.shared.dtypes["transformer"] == torch.float16


def test_every_widget_field_is_on_both_loaders_in_place():
    from lingbot_nodes.files import LingBotLoaderFiles
    from lingbot_nodes.loader import LingBotLoader

    for cls in (LingBotLoader, LingBotLoaderFiles):
        names = _loader_inputs(cls)
        for f in FIELDS:
            widget = f.metadata.get("widget")
            if widget:
                assert widget in names, f"{cls.__name__} lacks the widget {widget!r} of HandleSettings.{f.name}"
        spec = {**cls.INPUT_TYPES().get("required", {}), **cls.INPUT_TYPES().get("optional", {})}
        for f in FIELDS:  # a generated widget offers the field's choices, the first as default
            meta = f.metadata
            if meta.get("widget") and (meta.get("widget_choices") or meta.get("choices")):
                kind, options = spec[meta["widget"]]
                choices = (meta.get("widget_choices") or meta["choices"])()
                assert list(kind if isinstance(kind, list) else options.get("options", kind)) == choices
                assert options["default"] == choices[0] and options["tooltip"] == meta["tooltip"]


def test_settings_are_checked_once_and_readable_as_before(fixtures_root):
    handle = PipelineHandle.open(fixtures_root / "models" / "tiny-dense", device="cpu", ffn_chunk=0)
    shared = handle.shared
    assert shared.ffn_chunk is None and shared.settings.ffn_chunk is None  # 0: never chunk, normalised
    with pytest.raises(dataclasses.FrozenInstanceError):
        shared.settings.weights = "fp8_e4m3"
    shared.ffn_chunk = 32  # tests set an attribute as before: the settings object follows
    assert shared.settings.ffn_chunk == 32
    for bad, match in ((dict(fp8_matmul="fast"), "fp8_matmul"), (dict(decoder="x"), "decoder"),
                       (dict(ffn_chunk=-1), "ffn_chunk"), (dict(compile="all"), "compile"),
                       (dict(attention_backend="nope"), "attention backend"), (dict(sparse=1), "SparseSettings")):
        with pytest.raises(ValueError, match=match):
            PipelineHandle.open(fixtures_root / "models" / "tiny-dense", device="cpu", **bad)
    with pytest.raises(ValueError, match="not both"):
        PipelineHandle.open(fixtures_root / "models" / "tiny-dense", device="cpu", decoder="eager",
                            settings=HandleSettings())
    with pytest.raises(ValueError, match="unknown handle settings"):
        HandleSettings.from_json({"warp_drive": True})


def test_a_new_knob_is_one_field(monkeypatch, fixtures_root):
    """A field added to the settings (here in a subclass standing in for an edit of HandleSettings) is a
    flag of the CLI, the last widget of both Loaders, reaches the handle from either Loader, is refused
    off its choices, defaults where a saved workflow lacks it, and crosses to LingBot Parallel's workers;
    nothing else is written for it."""
    from lingbot_core import handle as handle_module
    from lingbot_core.__main__ import build_parser
    from lingbot_core.handle import knob, settings_from_flags, settings_from_widgets
    from lingbot_core.worker_pool.spec import describe_handle, open_described
    from lingbot_nodes.files import FROM_CHECKPOINT, LingBotLoaderFiles
    from lingbot_nodes.loader import LingBotLoader

    @dataclasses.dataclass(frozen=True)
    class WithKnob(HandleSettings):
        demo_knob: str = knob("calm", cli="--demo-knob", widget="demo_knob", choices=lambda: ["calm", "loud"],
                              help="a knob for this test", tooltip="a knob for this test")

    monkeypatch.setattr(handle_module, "HandleSettings", WithKnob)
    args = build_parser().parse_args(["--demo-knob", "loud"])
    assert settings_from_flags(args)["demo_knob"] == "loud"
    assert settings_from_flags(build_parser().parse_args([]))["demo_knob"] == "calm"
    assert settings_from_widgets({})["demo_knob"] == "calm"  # a workflow saved before the knob

    tiny = "tiny (built-in dense)"
    opened = {LingBotLoader: lambda **w: LingBotLoader.execute(tiny, "auto", device="cpu", **w),
              LingBotLoaderFiles: lambda **w: LingBotLoaderFiles.execute(FROM_CHECKPOINT, FROM_CHECKPOINT,
                                                                         FROM_CHECKPOINT, tiny, device="cpu", **w)}
    for cls, run in opened.items():
        assert _loader_inputs(cls)[-1] == "demo_knob", cls.__name__  # appended last: saved values stay put
        handle, = run(demo_knob="loud").args
        assert handle.shared.settings.demo_knob == "loud", cls.__name__
        with pytest.raises(ValueError, match="demo_knob must be one of calm, loud; got 'shout'"):
            run(demo_knob="shout")
    worker = open_described(describe_handle(handle), "cpu")
    assert worker.shared.settings.demo_knob == "loud"
    with pytest.raises(ValueError, match="no handle setting has the widget"):
        LingBotLoader.execute(tiny, "auto", device="cpu", demo_knbo="loud")  # a misspelt widget


def test_the_dtype_widget_is_the_dtypes_setting_and_comfyuis_flags_fill_auto(monkeypatch):
    from lingbot_core.handle import DTYPE_CHOICES, settings_from_widgets
    from lingbot_nodes.loader import LingBotLoader

    for choice, dtype in DTYPE_CHOICES.items():
        dtypes = settings_from_widgets({"dtype": choice})["dtypes"]
        want = {"transformer": dtype, "refiner": dtype} | ({} if dtype is None else {"text_encoder": dtype})
        assert dtypes == want, choice
    with pytest.raises(ValueError, match="dtype must be one of auto, bf16, fp16, fp32; got 'fp8'"):
        LingBotLoader.execute("tiny (built-in dense)", "auto", "fp8", device="cpu")
    # inside ComfyUI, `--bf16-unet` fills the DiTs' dtype where the widget says auto, and only there
    from lingbot_nodes import runtime

    bf16 = torch.bfloat16
    monkeypatch.setattr(runtime, "comfy_dtypes", lambda: {"transformer": bf16, "refiner": bf16})
    auto, = LingBotLoader.execute("tiny (built-in dense)", "auto", "auto", device="cpu").args
    fp32, = LingBotLoader.execute("tiny (built-in dense)", "auto", "fp32", device="cpu").args
    assert auto.shared.dtypes["transformer"] == torch.bfloat16
    assert fp32.shared.dtypes["transformer"] == fp32.shared.dtypes["text_encoder"] == torch.float32
