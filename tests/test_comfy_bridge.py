"""Inside ComfyUI (simulated with stand-in `comfy` and `folder_paths` modules speaking the same
protocol): progress bars, interrupts, model folders, the output folder and memory cooperation."""

from __future__ import annotations

import shutil
import sys
import types
from pathlib import Path

import pytest
import torch

from lingbot_core.workflow import Engine, RunInterrupted, load_workflow
from lingbot_nodes import NODE_CLASS_MAPPINGS

API = Path(__file__).resolve().parents[1] / "workflows" / "api"


class InterruptProcessingException(Exception):
    pass


@pytest.fixture
def comfy(tmp_path, monkeypatch):
    """Minimal ComfyUI surfaces our runtime adapter talks to; free_memory follows ComfyUI's protocol."""
    state = types.SimpleNamespace(interrupt=False, progress=[], freed=[])
    mm = types.ModuleType("comfy.model_management")
    mm.current_loaded_models = []

    def free_memory(memory_required, device, keep_loaded=()):
        unloaded = []
        for i in range(len(mm.current_loaded_models) - 1, -1, -1):
            m = mm.current_loaded_models[i]
            if m.device == device and m not in keep_loaded and not m.is_dead():
                m.currently_used = False
                m.model_offloaded_memory(), m.model_memory(), m.model.model.__class__.__name__
                if m.model_unload(None):
                    unloaded.append(mm.current_loaded_models.pop(i))
        state.freed.append(len(unloaded))
        return unloaded

    def throw():
        if state.interrupt:
            state.interrupt = False
            raise InterruptProcessingException()

    mm.free_memory = free_memory
    mm.unload_all_models = lambda: free_memory(1e30, torch.device("cpu"))
    mm.minimum_inference_memory = lambda: 0
    mm.throw_exception_if_processing_interrupted = throw

    utils = types.ModuleType("comfy.utils")

    class ProgressBar:
        def __init__(self, total):
            self.total = total

        def update_absolute(self, value, total=None):
            state.progress.append((value, total or self.total))

    utils.ProgressBar = ProgressBar
    package = types.ModuleType("comfy")
    package.model_management, package.utils = mm, utils
    folder_paths = types.ModuleType("folder_paths")
    folder_paths.models_dir = str(tmp_path / "models")
    folder_paths.folder_names_and_paths = {}
    folder_paths.add_model_folder_path = lambda name, path: folder_paths.folder_names_and_paths.setdefault(
        name, ([], set()))[0].append(path)
    folder_paths.get_folder_paths = lambda name: folder_paths.folder_names_and_paths[name][0]
    folder_paths.get_output_directory = lambda: str(tmp_path / "comfy-output")
    for name, module in {"comfy": package, "comfy.model_management": mm, "comfy.utils": utils,
                         "folder_paths": folder_paths}.items():
        monkeypatch.setitem(sys.modules, name, module)
    from lingbot_core.placement import door

    monkeypatch.setattr(door, "MEMORY_LISTENERS", [])
    monkeypatch.setattr(door, "SETTLE_LISTENERS", [])
    state.mm = mm
    state.tmp = tmp_path
    return state


def _prompt(overrides=()):
    from lingbot_core.workflow import apply_overrides

    prompt = load_workflow(API / "lingbot_t2v_dense.json", NODE_CLASS_MAPPINGS)
    return apply_overrides(prompt, ["Offload.mode=none", *overrides], NODE_CLASS_MAPPINGS)


def test_checkpoints_under_models_lingbot_video_are_offered(comfy, fixtures_root):
    target = comfy.tmp / "models" / "lingbot_video" / "my-dense"
    shutil.copytree(fixtures_root / "models" / "tiny-dense", target)
    choices = NODE_CLASS_MAPPINGS["LingBotLoader"].INPUT_TYPES()["required"]["checkpoint"][0]
    assert "my-dense" in choices and "tiny (built-in dense)" in choices
    handle, = NODE_CLASS_MAPPINGS["LingBotLoader"]().load("my-dense", "dense", "auto", "default")
    assert handle.folder == target


def test_progress_output_folder_and_unload_models(comfy):
    from lingbot_core import offload

    prompt = _prompt()
    engine = Engine(NODE_CLASS_MAPPINGS)
    first = engine.run(prompt)
    steps = prompt.nodes["4"]["inputs"]["steps"]
    assert [(i, steps) for i in range(1, steps + 1)] == [p for p in comfy.progress if p[1] == steps]
    saved = first.ui["6"]["images"][0]
    assert (comfy.tmp / "comfy-output" / saved["subfolder"] / saved["filename"]).is_file()

    # ComfyUI now knows about our resident components, and its "Unload models" frees them.
    view = first.output("2")
    ours = [m for m in comfy.mm.current_loaded_models if m.real_model() is view.shared]
    assert len(ours) == 1 and ours[0].model_memory() > 0 and offload.resident_components(view)
    comfy.mm.unload_all_models()
    assert not offload.resident_components(view) and comfy.mm.current_loaded_models == []
    assert all(p.device.type == "cpu" for n in ("transformer", "vae", "text_encoder")
               for p in view.shared.loaded[n].parameters())
    # The next run brings back what it needs, and gives the same frames.
    again = engine.run(_prompt(["4.seed=43"]))
    back = engine.run(_prompt(["4.seed=42"]))
    assert torch.equal(back.output("5"), first.output("5")) and not torch.equal(again.output("5"), first.output("5"))


def test_comfy_interrupt_cancels_mid_denoise_and_the_next_run_works(comfy):
    prompt = _prompt()
    expected = Engine(NODE_CLASS_MAPPINGS).run(prompt).output("5")
    engine = Engine(NODE_CLASS_MAPPINGS)
    comfy.progress.clear()

    original = comfy.mm.throw_exception_if_processing_interrupted

    def throw_after_two_steps():
        if len(comfy.progress) >= 2:
            comfy.interrupt = True
        original()

    comfy.mm.throw_exception_if_processing_interrupted = throw_after_two_steps
    with pytest.raises(RunInterrupted):
        engine.run(prompt)
    comfy.mm.throw_exception_if_processing_interrupted = original
    result = engine.run(prompt)
    assert torch.equal(result.output("5"), expected)


def test_free_memory_before_our_components_move_to_an_accelerator(comfy, monkeypatch):
    """Moving a whole component onto an accelerator first asks ComfyUI for room."""
    from lingbot_core.placement import door
    from lingbot_nodes import runtime

    NODE_CLASS_MAPPINGS["LingBotLoader"]().load("tiny (built-in dense)", "auto", "auto", "default")
    assert runtime._free_comfy_memory in door.MEMORY_LISTENERS
    assert runtime._track_resident in door.SETTLE_LISTENERS
    asked = []
    monkeypatch.setattr(comfy.mm, "free_memory", lambda need, device, keep_loaded=(): asked.append((need, device)))
    for listener in door.MEMORY_LISTENERS:
        listener("transformer", None, torch.device("cuda", 0), 123)
    assert asked == [(123, torch.device("cuda", 0))]


def test_outside_comfyui_nothing_is_registered(monkeypatch):
    from lingbot_core.placement import door
    from lingbot_nodes import runtime

    monkeypatch.setattr(door, "MEMORY_LISTENERS", [])
    for name in ("comfy", "comfy.model_management", "comfy.utils", "folder_paths"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    assert not runtime.in_comfy()
    runtime.install_memory_cooperation()
    assert door.MEMORY_LISTENERS == []
