"""Inside ComfyUI (simulated with stand-in `comfy` and `folder_paths` modules speaking the same
protocol): progress bars, interrupts, model folders, the output folder and memory cooperation."""

from __future__ import annotations

import logging
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
    """Minimal ComfyUI surfaces our runtime adapter talks to; free_memory follows ComfyUI's protocol: with
    smart memory (the default) each entry is asked for the bytes still to free (this stand-in has no free
    memory: all of `memory_required`), under --disable-smart-memory for None. tests/test_comfy_real.py runs
    the bridge against the real comfy.model_management where a ComfyUI checkout is at hand."""
    state = types.SimpleNamespace(interrupt=False, progress=[], freed=[])
    mm = types.ModuleType("comfy.model_management")
    mm.current_loaded_models = []
    mm.DISABLE_SMART_MEMORY = False

    def free_memory(memory_required, device, keep_loaded=()):
        unloaded = []
        for i in range(len(mm.current_loaded_models) - 1, -1, -1):
            m = mm.current_loaded_models[i]
            if m.device == device and m not in keep_loaded and not m.is_dead():
                m.currently_used = False
                m.model_offloaded_memory(), m.model_memory(), m.model.model.__class__.__name__
                if m.model_unload(None if mm.DISABLE_SMART_MEMORY else memory_required):
                    unloaded.append(mm.current_loaded_models.pop(i))
        state.freed.append(len(unloaded))
        return unloaded

    def throw():
        if state.interrupt:
            state.interrupt = False
            raise InterruptProcessingException()

    mm.free_memory = free_memory
    mm.get_torch_device = lambda: torch.device("cpu")
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
    folder_paths.get_user_directory = lambda: str(tmp_path / "comfy-user")
    for name, module in {"comfy": package, "comfy.model_management": mm, "comfy.utils": utils,
                         "folder_paths": folder_paths}.items():
        monkeypatch.setitem(sys.modules, name, module)
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
    choices = NODE_CLASS_MAPPINGS["LingBotLoader"].INPUT_TYPES()["required"]["checkpoint"][1]["options"]
    assert "my-dense" in choices and "tiny (built-in dense)" in choices
    handle, = NODE_CLASS_MAPPINGS["LingBotLoader"].execute("my-dense", "dense", "auto", "default").args
    assert handle.folder == target


def test_progress_output_folder_and_unload_models(comfy):
    from lingbot_core.placement import door

    prompt = _prompt()
    engine = Engine(NODE_CLASS_MAPPINGS)
    first = engine.run(prompt)
    steps = prompt.nodes["4"]["inputs"]["steps"]
    denoise = [(i, steps) for i in range(1, steps + 1)]  # one run of updates (text encode and decode tick too)
    assert any(comfy.progress[k:k + steps] == denoise for k in range(len(comfy.progress)))
    saved = first.ui["6"]["images"][0]
    assert (comfy.tmp / "comfy-output" / saved["subfolder"] / saved["filename"]).is_file()

    # ComfyUI now knows about our resident components, and its "Unload models" frees them.
    view = first.output("2")
    ours = [m for m in comfy.mm.current_loaded_models if m.real_model() is view.shared]
    assert len(ours) == 1 and ours[0].model_memory() > 0 and door.resident_components(view)
    comfy.mm.unload_all_models()
    assert not door.resident_components(view) and comfy.mm.current_loaded_models == []
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
    from lingbot_nodes import runtime

    handle, = NODE_CLASS_MAPPINGS["LingBotLoader"].execute("tiny (built-in dense)", "auto", "auto", "default").args
    placement = handle.shared.placement
    assert placement.memory_listeners == [runtime._free_comfy_memory]
    assert placement.settle_listeners == [runtime._track_resident]
    runtime.install_memory_cooperation(handle)  # a second time adds nothing
    assert len(placement.memory_listeners) == len(placement.settle_listeners) == 1
    asked = []
    monkeypatch.setattr(comfy.mm, "free_memory", lambda need, device, keep_loaded=(): asked.append((need, device)))
    for listener in placement.memory_listeners:
        listener("transformer", None, torch.device("cuda", 0), 123)
    assert asked == [(123, torch.device("cuda", 0))]


def test_outside_comfyui_nothing_is_registered(monkeypatch, fixtures_root):
    from lingbot_core.handle import PipelineHandle
    from lingbot_nodes import runtime

    for name in ("comfy", "comfy.model_management", "comfy.utils", "folder_paths"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    assert not runtime.in_comfy()
    handle = PipelineHandle.open(fixtures_root / "models" / "tiny-dense", device="cpu")
    assert runtime.install_memory_cooperation(handle) is handle
    assert handle.shared.placement.memory_listeners == handle.shared.placement.settle_listeners == []


class _Loaded:
    """One entry of ComfyUI's current_loaded_models, on a given device."""

    def __init__(self, device):
        self.device = device
        self.unloaded = False
        self.currently_used = False
        self.model = types.SimpleNamespace(model=self)

    def is_dead(self):
        return False

    def model_offloaded_memory(self):
        return 0

    def model_memory(self):
        return 1

    def model_unload(self, _memory_to_free=None):
        self.unloaded = True
        return True


@pytest.mark.parametrize("theirs, ours", [("cuda:0", "cuda"), ("cuda", "cuda:0"), ("cuda:0", "cuda:0")])
def test_free_memory_reaches_comfy_models_however_the_gpu_is_spelled(comfy, monkeypatch, theirs, ours):
    """ComfyUI compares devices with ==, and torch.device("cuda") != torch.device("cuda", 0): our
    request must free ComfyUI's models on the same GPU whichever spelling either side uses."""
    from lingbot_nodes import runtime

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    other_gpu = _Loaded(torch.device("cuda", 1))
    same_gpu = _Loaded(torch.device(theirs))
    comfy.mm.current_loaded_models[:] = [other_gpu, same_gpu]
    runtime._free_comfy_memory("transformer", None, torch.device(ours), 10)
    assert same_gpu.unloaded and not other_gpu.unloaded
    assert comfy.mm.current_loaded_models == [other_gpu]


def test_device_auto_is_comfyuis_device(comfy, monkeypatch):
    from lingbot_nodes import runtime

    monkeypatch.setattr(comfy.mm, "get_torch_device", lambda: torch.device("cpu"))  # as under --cpu
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # even on a GPU machine
    assert runtime.execution_device("auto") == torch.device("cpu")
    handle, = NODE_CLASS_MAPPINGS["LingBotLoader"].execute("tiny (built-in dense)", "auto", "auto", "default").args
    assert handle.device == torch.device("cpu")
    monkeypatch.setattr(comfy.mm, "get_torch_device", lambda: torch.device("cuda", 0))
    assert runtime.execution_device("auto") == torch.device("cuda", 0)
    assert runtime.execution_device("cpu") == torch.device("cpu")


def test_loader_refuses_missing_attention_packages_and_devices(monkeypatch):
    import importlib.util

    from lingbot_core.workflow import NodeExecutionError, WorkflowValidationError

    loader = NODE_CLASS_MAPPINGS["LingBotLoader"]
    prompt = load_workflow(API / "lingbot_t2v_dense.json", NODE_CLASS_MAPPINGS).to_dict()
    engine = Engine(NODE_CLASS_MAPPINGS)
    if importlib.util.find_spec("sageattention") is None:
        prompt["1"]["inputs"]["attention"] = "sage"
        with pytest.raises(WorkflowValidationError) as err:
            engine.validate(prompt)
        assert [i.input_name for i in err.value.issues] == ["attention"]
        assert "sageattention" in err.value.issues[0].message
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="no CUDA device.*choose auto or cpu"):
        loader.execute("tiny (built-in dense)", "auto", "auto", "default", device="cuda")
    with pytest.raises(ValueError, match="CUDA only"):
        loader.execute("tiny (built-in dense)", "auto", "auto", "_native_flash", device="cpu")
    prompt["1"]["inputs"].update(attention="default", device="cuda")
    with pytest.raises(NodeExecutionError) as err:
        engine.run(prompt)
    assert err.value.node_id == "1"  # the first node fails, before any model loads


def test_denoise_sends_comfyuis_latent_previews(comfy, monkeypatch):
    """Each step's progress update carries the preview ComfyUI's previewer made for Wan 2.1 latents."""
    made = []

    class FakePreviewer:
        def decode_latent_to_preview_image(self, fmt, x0):
            made.append(tuple(x0.shape))
            return (fmt, "image", 512)

    latent_preview = types.ModuleType("latent_preview")
    latent_formats = types.ModuleType("comfy.latent_formats")
    latent_formats.Wan21 = type("Wan21", (), {"latent_channels": 16})
    asked = []
    latent_preview.get_previewer = lambda device, fmt: asked.append(type(fmt).__name__) or FakePreviewer()
    monkeypatch.setitem(sys.modules, "latent_preview", latent_preview)
    monkeypatch.setitem(sys.modules, "comfy.latent_formats", latent_formats)
    sys.modules["comfy"].latent_formats = latent_formats
    previews = []
    original = sys.modules["comfy.utils"].ProgressBar.update_absolute

    def update_absolute(self, value, total=None, preview=None):
        previews.append(preview)
        original(self, value, total)

    monkeypatch.setattr(sys.modules["comfy.utils"].ProgressBar, "update_absolute", update_absolute)
    prompt = _prompt()
    Engine(NODE_CLASS_MAPPINGS).run(prompt)
    steps = prompt.nodes["4"]["inputs"]["steps"]
    assert asked == ["Wan21"] and len(made) == steps and made[0][:2] == (1, 16)
    assert previews.count(("JPEG", "image", 512)) == steps


def test_headless_preview_frames_per_step_and_one_info_line_per_run(tmp_path, monkeypatch, caplog):
    import logging

    from PIL import Image

    from lingbot_core.workflow import apply_overrides

    monkeypatch.setenv("LINGBOT_PREVIEW_DIR", str(tmp_path / "previews"))
    prompt = load_workflow(API / "lingbot_t2v_dense.json", NODE_CLASS_MAPPINGS)
    prompt = apply_overrides(prompt, ["Offload.mode=none"], NODE_CLASS_MAPPINGS)
    with caplog.at_level(logging.DEBUG):
        Engine(NODE_CLASS_MAPPINGS).run(prompt)
    stage_lines = [r for r in caplog.records if r.getMessage().startswith("after ")]
    summary = [r for r in caplog.records if r.name == "lingbot_nodes" and r.levelno == logging.INFO]
    assert stage_lines and all(r.levelno == logging.DEBUG for r in stage_lines)
    assert len(summary) == 1 and "decoded 9x64x64" in summary[0].getMessage()
    files = sorted((tmp_path / "previews").glob("*.png"))
    steps, width = prompt.nodes["4"]["inputs"]["steps"], prompt.nodes["4"]["inputs"]["width"]
    assert [f.name for f in files] == [f"denoise_4_{i:04d}.png" for i in range(1, steps + 1)]
    with Image.open(files[-1]) as image:
        assert image.size[0] == width // 8 and image.mode == "RGB"


def test_magcache_calibration_stays_in_the_user_folder(comfy, monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home-cache"))
    monkeypatch.delenv("LINGBOT_CACHE_DIR", raising=False)
    prompt = _prompt(["4.step_cache=magcache_calibrate", "4.steps=9"])
    Engine(NODE_CLASS_MAPPINGS).run(prompt, outputs=["4"])
    written = list((comfy.tmp / "comfy-user" / "lingbot" / "magcache").glob("*.json"))
    assert len(written) == 1 and not (tmp_path / "home-cache").exists()


def _rewrite_server():
    import json

    from rewrite_fakes import FakeChatServer, reply, valid_caption

    return FakeChatServer([reply("A red paper boat drifts."), reply(json.dumps(valid_caption(5.0)))] * 2)


def _run_rewrite(url):
    return NODE_CLASS_MAPPINGS["LingBotRewrite"].execute("a red paper boat on a canal at dawn " + url, "t2v", 5.0,
                                                         endpoint=url, expand_model="base", map_model="json")


def test_rewrite_endpoints_inside_comfyui_only_from_the_operators_list(comfy, monkeypatch, caplog):
    from lingbot_core.rewrite import ENDPOINTS_ENV

    monkeypatch.delenv(ENDPOINTS_ENV, raising=False)
    with _rewrite_server() as server:
        with pytest.raises(ValueError, match=f"not allowed on this server.*{ENDPOINTS_ENV}"):
            _run_rewrite(server.url)
        monkeypatch.setenv(ENDPOINTS_ENV, "http://127.0.0.1:1/v1,https://internal.example:8443/v1")
        with caplog.at_level(logging.WARNING, logger="lingbot_nodes"), \
                pytest.raises(ValueError, match="not allowed on this server") as refused:
            _run_rewrite(server.url)
        # whoever queues a workflow learns where the operator sets the list, not what is on it; the log has it
        assert "127.0.0.1:1" not in str(refused.value) and "internal.example" not in str(refused.value)
        assert "internal.example:8443" in caplog.text and server.url.split("//")[1] in caplog.text
        assert server.requests == []  # refused before any call
        monkeypatch.setenv(ENDPOINTS_ENV, f"http://127.0.0.1:1/v1,{server.url}")
        out = _run_rewrite(server.url)
    caption, expanded, negative = out.args
    assert negative == "" and expanded == "A red paper boat drifts." and '"prominent_elements"' in caption
    shown = out.ui.as_dict()["text"][0]
    assert caption in shown and expanded in shown  # shown on the node
    assert comfy.progress and [r["body"]["model"] for r in server.requests] == ["base", "json"]


def test_rewrite_headless_takes_any_endpoint(monkeypatch):
    from lingbot_core.rewrite import ENDPOINTS_ENV

    monkeypatch.delenv(ENDPOINTS_ENV, raising=False)
    with _rewrite_server() as server:
        caption, _, _ = _run_rewrite(server.url).args
    assert len(server.requests) == 2 and caption.startswith('{"caption"')


def test_rewrite_node_auto_negative(monkeypatch):
    import json

    from rewrite_fakes import FakeChatServer, reply, valid_caption

    from lingbot_core.prompt import DEFAULT_NEGATIVE_PROMPT_IMAGE

    script = [reply("A cartoon boat."), reply(json.dumps(valid_caption(0, video=False))),
              reply('{"remove": ["cartoon"]}')]
    with FakeChatServer(script) as server:
        out = NODE_CLASS_MAPPINGS["LingBotRewrite"].execute("a cartoon paper boat", "t2i", 5.0, endpoint=server.url,
                                                            expand_model="base", auto_negative=True)
    negative = out.args[2]
    assert "cartoon" not in negative and negative == DEFAULT_NEGATIVE_PROMPT_IMAGE.replace('"cartoon", ', "")
    assert "removed cartoon" in out.ui.as_dict()["text"][0]


def test_cancel_stops_a_rewrite_waiting_on_a_silent_endpoint(comfy, monkeypatch):
    """ComfyUI's Cancel (its interrupt flag) while the Rewrite waits on an endpoint that never answers,
    the operator's deadline 60 s: the node raises ComfyUI's interrupt within a poll (it waited for the
    socket's timeout before: up to 120 s per attempt, three attempts)."""
    import threading

    from rewrite_fakes import HostileServer

    from lingbot_core.rewrite import ENDPOINTS_ENV
    from lingbot_core.rewrite.openai_backend import TIMEOUT_ENV

    monkeypatch.setenv(TIMEOUT_ENV, "60")
    outcome = []

    def run():
        try:
            _run_rewrite(server.url)
        except BaseException as exc:  # noqa: BLE001 - judged below
            outcome.append(exc)

    with HostileServer("silent") as server:
        monkeypatch.setenv(ENDPOINTS_ENV, server.url)
        worker = threading.Thread(target=run, daemon=True)
        worker.start()
        threading.Timer(0.3, lambda: setattr(comfy, "interrupt", True)).start()
        worker.join(5)
        assert not worker.is_alive(), "the Rewrite still waits after Cancel"
    assert len(outcome) == 1 and isinstance(outcome[0], InterruptProcessingException), outcome
    assert server.requests == 1
