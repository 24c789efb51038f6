"""Issue 37 item 6: the smaller things a ComfyUI user meets (one test each; each failed before its fix)."""

from __future__ import annotations

import shutil
import sys
import types

import pytest
import torch

from lingbot_nodes import NODE_CLASS_MAPPINGS


@pytest.fixture
def comfy(tmp_path, monkeypatch):
    """A stand-in ``folder_paths``: ComfyUI under tmp/ComfyUI, started from another working directory."""
    base = tmp_path / "ComfyUI"
    folders = {name: base / name for name in ("models", "input", "output", "temp")}
    for folder in folders.values():
        folder.mkdir(parents=True)
    fp = types.ModuleType("folder_paths")
    fp.base_path = str(base)
    fp.models_dir = str(folders["models"])
    fp.folder_names_and_paths = {"loras": ([str(folders["models"] / "loras")], set())}
    fp.add_model_folder_path = lambda name, path: fp.folder_names_and_paths.setdefault(name, ([], set()))[0].append(path)
    fp.get_folder_paths = lambda name: fp.folder_names_and_paths[name][0]
    fp.get_output_directory = lambda: str(folders["output"])
    fp.get_input_directory = lambda: str(folders["input"])
    fp.get_temp_directory = lambda: str(folders["temp"])
    monkeypatch.setitem(sys.modules, "folder_paths", fp)
    monkeypatch.setitem(sys.modules, "comfy", types.ModuleType("comfy"))
    monkeypatch.delenv("LINGBOT_ALLOW_ANY_MODEL_PATH", raising=False)
    monkeypatch.delenv("LINGBOT_MODELS_DIR", raising=False)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    return types.SimpleNamespace(fp=fp, tmp=tmp_path, base=base, cwd=cwd, **folders)


# -- the model root comes from ComfyUI's folders only --------------------------------------------------

def test_checkpoints_come_only_from_comfyuis_folders_not_the_working_directory(comfy, fixtures_root, monkeypatch):
    from lingbot_nodes.loader import checkpoint_choices, resolve_checkpoint
    from lingbot_nodes.runtime import model_roots

    shutil.copytree(fixtures_root / "models" / "tiny-dense", comfy.models / "lingbot_video" / "inside")
    shutil.copytree(fixtures_root / "models" / "tiny-dense", comfy.cwd / "models" / "lingbot_video" / "beside")
    monkeypatch.setenv("LINGBOT_MODELS_DIR", str(comfy.tmp / "cwd" / "models" / "lingbot_video"))
    assert model_roots() == [comfy.models / "lingbot_video"]
    names = checkpoint_choices()
    assert "inside" in names and "beside" not in names
    assert resolve_checkpoint("inside") == comfy.models / "lingbot_video" / "inside"
    with pytest.raises(ValueError, match="not found") as missing:
        resolve_checkpoint("beside")
    # and the refusal names ComfyUI's folder, not where the server keeps it
    assert str(missing.value).endswith("not found under models/lingbot_video")
    assert str(comfy.tmp) not in str(missing.value)


# -- paths in messages ---------------------------------------------------------------------------------

def test_messages_name_comfyuis_folders_not_the_servers_paths(comfy):
    from lingbot_nodes.runtime import paths_shown_in, server_paths_hidden, shown_path

    ckpt = comfy.models / "lingbot_video" / "mine"
    assert shown_path(ckpt / "model_index.json") == "models/lingbot_video/mine/model_index.json"
    assert shown_path(comfy.input / "cat.png") == "input/cat.png"
    assert shown_path(comfy.tmp / "elsewhere" / "secret.bin") == "secret.bin"
    extra = comfy.tmp / "data" / "loras"  # an extra_model_paths.yaml folder outside ComfyUI
    comfy.fp.folder_names_and_paths["loras"][0].append(str(extra))
    assert shown_path(extra / "style.safetensors") == "loras/style.safetensors"
    text = f"cannot read {ckpt}/transformer/config.json (in {comfy.models}); see {comfy.base}/custom_nodes"
    assert paths_shown_in(text) == ("cannot read models/lingbot_video/mine/transformer/config.json (in models); "
                                    "see ComfyUI/custom_nodes")
    with pytest.raises(OSError) as err, server_paths_hidden():
        raise OSError(f"{ckpt}/vae/diffusion_pytorch_model.safetensors is truncated")
    assert str(err.value) == "models/lingbot_video/mine/vae/diffusion_pytorch_model.safetensors is truncated"


def test_a_stage_node_names_comfyuis_folders_in_a_lazy_loads_error(comfy):
    """Components load when a stage first needs them: Denoise, Decode, Text Encode... run inside
    runtime.node_work, which names ComfyUI's folders in whatever error the load raises."""
    from lingbot_nodes import runtime

    bad = comfy.models / "lingbot_video" / "mine" / "transformer" / "diffusion_pytorch_model.safetensors"
    with pytest.raises(OSError) as err, runtime.node_work(label="denoise"):
        raise OSError(f"{bad} is truncated (4 of 9 bytes)")
    assert str(err.value) == ("models/lingbot_video/mine/transformer/diffusion_pytorch_model.safetensors is "
                              "truncated (4 of 9 bytes)")


def test_headless_messages_keep_the_users_own_paths(tmp_path):
    from lingbot_nodes.runtime import paths_shown_in, server_paths_hidden, shown_path

    assert shown_path(tmp_path / "x") == str(tmp_path / "x")
    assert paths_shown_in(f"at {tmp_path}") == f"at {tmp_path}"
    with pytest.raises(ValueError, match=str(tmp_path)), server_paths_hidden():
        raise ValueError(f"bad file {tmp_path}/a")


def test_the_loader_names_a_broken_checkpoint_by_its_comfyui_folder(comfy, fixtures_root):
    folder = comfy.models / "lingbot_video" / "broken"
    shutil.copytree(fixtures_root / "models" / "tiny-dense", folder)
    (folder / "transformer" / "config.json").write_text("{ not json", encoding="utf-8")
    loader = NODE_CLASS_MAPPINGS["LingBotLoader"]
    with pytest.raises(Exception) as err:  # noqa: B017 - whatever the checkpoint check raises, its text is the point
        loader.execute("broken", "auto")
    assert str(comfy.tmp) not in str(err.value) and "lingbot_video/broken" in str(err.value), str(err.value)


# -- LingBot Parallel's cfg reads as CFG branches ------------------------------------------------------

def test_parallels_cfg_is_labelled_as_cfg_branches_and_keeps_its_widget():
    from lingbot_core.distributed.layout import CFG_DEGREES
    from lingbot_nodes.parallel import CFG_LABEL

    schema = NODE_CLASS_MAPPINGS["LingBotParallel"].define_schema()
    names = [i.id for i in schema.inputs]
    assert names == ["pipe", "devices", "cfg", "ulysses", "fsdp"]  # saved workflows' widget order
    cfg = schema.inputs[names.index("cfg")]
    assert cfg.display_name == CFG_LABEL and "branches" in CFG_LABEL
    assert list(cfg.options) == [str(d) for d in CFG_DEGREES] and cfg.default == "1"
    assert cfg.tooltip.startswith("CFG branches across GPUs, not the guidance scale")


# -- Load Image: ComfyUI's upload combo --------------------------------------------------------------

def test_load_image_is_an_upload_combo_over_the_input_folder(comfy):
    from PIL import Image

    from lingbot_nodes.image_input import TEST_PATTERN, test_pattern

    Image.new("RGB", (8, 8), (10, 200, 30)).save(comfy.input / "cat.png")
    (comfy.input / "notes.txt").write_text("x", encoding="utf-8")
    node = NODE_CLASS_MAPPINGS["LingBotLoadImage"]
    kind, options = node.INPUT_TYPES()["required"]["path"]  # what ComfyUI's editor reads
    assert kind == [TEST_PATTERN, "cat.png"] and options["default"] == TEST_PATTERN
    assert options["image_upload"] is True and options["image_folder"] == "input"
    assert node.validate_inputs(path="cat.png") is True
    assert node.execute("cat.png").args[0].shape == (1, 8, 8, 3)
    for pattern in (TEST_PATTERN, ""):  # "" is what workflows saved before the combo hold
        assert node.validate_inputs(path=pattern) is True
        assert torch.equal(node.execute(pattern).args[0], test_pattern())
    assert "not a file in ComfyUI's input folder" in node.validate_inputs(path="notes.txt.png")


# -- item 7: ComfyUI's dynamic VRAM (comfy-aimdo) ----------------------------------------------------

GiB = 1024 ** 3


@pytest.fixture
def aimdo(monkeypatch):
    """A stand-in for a 2026 ComfyUI with dynamic VRAM on: `comfy.memory_management.aimdo_enabled`,
    `--vram-headroom` in `comfy.cli_args.args`, and a model_management whose `free_memory` has the
    2026 signature and reads of each loaded entry (is_dynamic, partially_unload_ram, model_mmap_residency
    and the rest), so a stand-in missing one of them fails here as it would there."""
    mm = types.ModuleType("comfy.model_management")
    mm.current_loaded_models = []
    mm.DISABLE_SMART_MEMORY = False
    mm.free = {"cuda:0": 10 * GiB}
    mm.calls = []
    mm.get_free_memory = lambda device=None, torch_free_too=False: mm.free[str(device)]
    mm.minimum_inference_memory = lambda: GiB

    def free_memory(memory_required, device, keep_loaded=(), for_dynamic=False, pins_required=0, ram_required=0):
        mm.calls.append({"memory_required": memory_required, "device": device, "for_dynamic": for_dynamic})
        candidates = [i for i, m in enumerate(mm.current_loaded_models)
                      if m.device == device and m not in keep_loaded and not m.is_dead()]
        unloaded = []
        for i in sorted(candidates, key=lambda i: (-mm.current_loaded_models[i].model_offloaded_memory(),
                                                   mm.current_loaded_models[i].model_memory())):
            entry = mm.current_loaded_models[i]
            entry.currently_used = False
            to_free = memory_required - mm.get_free_memory(device)
            if entry.model.is_dynamic() and for_dynamic:
                to_free = 0
            if to_free > 0 and entry.model_unload(to_free):
                _ = entry.model.model.__class__.__name__  # its debug line, built eagerly
                unloaded.append(i)
            pins = pins_required - GiB
            if pins > 0:
                entry.model.partially_unload_ram(pins)
            if i in unloaded:
                resident, _ = entry.model_mmap_residency(free=True)
        for i in sorted(unloaded, reverse=True):
            mm.current_loaded_models.pop(i)
        return unloaded

    mm.free_memory = free_memory
    memory_management = types.ModuleType("comfy.memory_management")
    memory_management.aimdo_enabled = True
    cli = types.ModuleType("comfy.cli_args")
    cli.args = types.SimpleNamespace(vram_headroom=2.0)
    package = types.ModuleType("comfy")
    package.model_management, package.memory_management, package.cli_args = mm, memory_management, cli
    for name, module in (("comfy", package), ("comfy.model_management", mm),
                         ("comfy.memory_management", memory_management), ("comfy.cli_args", cli)):
        monkeypatch.setitem(sys.modules, name, module)
    return types.SimpleNamespace(mm=mm, memory_management=memory_management, cli=cli)


def test_free_memory_is_comfyuis_reading_less_the_dynamic_vram_headroom(aimdo, monkeypatch):
    from lingbot_core.placement import door
    from lingbot_nodes.runtime import comfy_free_bytes

    cuda = torch.device("cuda:0")
    assert comfy_free_bytes(cuda) == 8 * GiB  # 10 GiB free by ComfyUI's count, 2 kept for --vram-headroom
    aimdo.memory_management.aimdo_enabled = False  # legacy model management: no pager, no headroom
    assert comfy_free_bytes(cuda) == 10 * GiB
    aimdo.memory_management.aimdo_enabled = True

    def broken(device=None, torch_free_too=False):
        raise RuntimeError("patched away")

    aimdo.mm.get_free_memory = broken  # no answer from ComfyUI: the driver's figure
    monkeypatch.setattr(door, "free_accelerator_bytes", lambda device: 5 * GiB)
    assert comfy_free_bytes(cuda) == 3 * GiB


def test_auto_offload_plans_with_the_hosts_reading_after_its_unload_request(aimdo, fixtures_root):
    from lingbot_core.handle import PipelineHandle
    from lingbot_core.placement import door
    from lingbot_nodes.runtime import install_memory_cooperation

    handle = install_memory_cooperation(PipelineHandle.open(fixtures_root / "models" / "tiny-dense", device="cpu"))
    cuda = torch.device("cuda:0")

    def freed(memory_required, device, **_):  # the unload request frees 3 GiB, then the plan reads
        aimdo.mm.calls.append(memory_required)
        aimdo.mm.free["cuda:0"] += 3 * GiB

    aimdo.mm.free_memory = freed
    assert door._free_budget(handle.shared, cuda, 4 * GiB) == 11 * GiB  # (10 + 3) - 2 of headroom
    assert aimdo.mm.calls == [4 * GiB + GiB]  # asked for what the plan wants plus ComfyUI's reserve


def test_resident_components_answer_every_read_of_comfyuis_dynamic_free_memory(aimdo, monkeypatch):
    """ComfyUI's unload requests still reach our GPU-resident components under dynamic VRAM, and we never
    ask as a dynamic model (its models then give way to ours in full)."""
    from lingbot_core.placement import door
    from lingbot_nodes import runtime

    class Shared:  # the components a handle shares (weakly referenced by the stand-in)
        pass

    evicted = []
    shared = Shared()
    monkeypatch.setattr(door, "resident_bytes", lambda s: 6 * GiB)
    monkeypatch.setattr(door, "evict", lambda s: evicted.append(s))
    cuda = torch.device("cuda:0")
    aimdo.mm.current_loaded_models.append(runtime.ResidentStandIn(shared, cuda))
    unloaded = aimdo.mm.free_memory(20 * GiB, cuda, pins_required=4 * GiB)
    assert unloaded == [0] and evicted == [shared] and aimdo.mm.current_loaded_models == []
    runtime._free_comfy_memory("transformer", None, cuda, 3 * GiB)  # our own request, before a stage
    assert aimdo.mm.calls[-1] == {"memory_required": 4 * GiB, "device": cuda, "for_dynamic": False}


# -- template thumbnails ---------------------------------------------------------------------------------

def test_each_template_thumbnail_carries_its_own_title_in_its_tasks_colour():
    """The browser shows a pack's template by its file name over its thumbnail and the graphs look alike
    when small: each thumbnail has its title on a band in its task's colour, and no two bands are alike."""
    import importlib.util
    from pathlib import Path

    from PIL import Image

    from workflows import build

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("render_graph", root / "docs" / "render_graph.py")
    render_graph = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(render_graph)
    bands = set()
    for name, entry in build.WORKFLOWS.items():
        with Image.open(build.thumbnail_path(name)) as image:
            rgb = image.convert("RGB")
            corner = rgb.getpixel((rgb.width - 4, 4))  # the band's plain colour, right of the text
            band = rgb.convert("L").crop((0, 0, rgb.width, 160)).resize((128, 40))
        colour = render_graph.TASK_COLOURS[entry["title"].partition(" · ")[0]]
        assert max(abs(a - b) for a, b in zip(corner, colour)) <= 8, (name, corner, colour)
        bands.add(band.tobytes())
    assert len(bands) == len(build.WORKFLOWS) >= 10


def test_a_workflow_saved_with_the_upload_button_still_loads_headless(tmp_path):
    """The editor saves the upload button's value after the combo's (["cat.png", "image"]); workflows
    saved before the combo hold only the path. Both load, to the same `path` input."""
    for values, expected in (([""], ""), (["cat.png", "image"], "cat.png")):
        prompt = _saved_with(tmp_path, "lingbot_ti2v_dense", "LingBotLoadImage", values)
        assert [n["inputs"] for n in prompt.nodes.values() if n["class_type"] == "LingBotLoadImage"] == \
            [{"path": expected}]


def _saved_with(tmp_path, workflow: str, node_type: str, values: list):
    """Shipped editor file `workflow` with every `node_type` node's saved widget values set to `values`,
    written and loaded back headless as ComfyUI's editor would send it."""
    import json

    from lingbot_core.workflow import load_workflow
    from lingbot_nodes import NODE_DISPLAY_NAME_MAPPINGS
    from workflows import build

    data = json.loads(build.ui_path(workflow).read_text(encoding="utf-8"))
    for node in data["nodes"]:
        if node["type"] == node_type:
            node["widgets_values"] = values
    saved = tmp_path / "saved.json"
    saved.write_text(json.dumps(data), encoding="utf-8")
    return load_workflow(saved, NODE_CLASS_MAPPINGS, display_names=NODE_DISPLAY_NAME_MAPPINGS)


# -- Load Video: ComfyUI's video upload combo -----------------------------------------------------------

def test_load_video_is_an_upload_combo_over_the_input_folders_videos(comfy):
    from lingbot_core.video import save_mp4
    from lingbot_nodes.image_input import TEST_PATTERN
    from lingbot_nodes.video_input import test_pattern_video

    save_mp4(torch.rand(5, 16, 16, 3), comfy.input / "clip.mp4")
    (comfy.input / "b.webm").write_bytes(b"")  # listed by its type; validation reads the file
    for other in ("notes.txt", "still.png", "sound.m4a", "readme"):
        (comfy.input / other).write_bytes(b"x")
    (comfy.input / "folder.mp4").mkdir()
    secret = save_mp4(torch.rand(5, 16, 16, 3), comfy.tmp / "secret.mp4")
    node = NODE_CLASS_MAPPINGS["LingBotLoadVideo"]
    kind, options = node.INPUT_TYPES()["required"]["path"]  # what ComfyUI's editor reads
    assert kind == [TEST_PATTERN, "b.webm", "clip.mp4"] and options["default"] == TEST_PATTERN
    assert options["video_upload"] is True and options["image_folder"] == "input"
    assert node.validate_inputs(path="clip.mp4") is True
    assert node.execute("clip.mp4", 0, 5, 1, 0, 0).args[0].shape == (5, 16, 16, 3)
    for pattern in (TEST_PATTERN, ""):  # "" is what workflows saved before the combo hold
        assert node.validate_inputs(path=pattern) is True
        assert torch.equal(node.execute(pattern, 0, 3, 1, 32, 48).args[0], test_pattern_video(3, 48, 32))
    for outside in (str(secret), "../secret.mp4"):  # a typed path outside the input folder: one line
        message = node.validate_inputs(path=outside)
        assert message.startswith("video ") and "not a file in ComfyUI's input folder" in message
        assert "\n" not in message
        with pytest.raises(ValueError, match="not a file in ComfyUI's input folder"):
            node.execute(outside, 0, 5, 1, 0, 0)
    # a ComfyUI that has its own content-type filter: the list is its answer, as for core Load Video
    asked = []
    comfy.fp.filter_files_content_types = lambda files, kinds: asked.append(kinds) or [f for f in files if f < "c"]
    assert node.INPUT_TYPES()["required"]["path"][0] == [TEST_PATTERN, "b.webm"] and asked == [["video"]]


def test_a_v2v_workflow_saved_before_the_video_combo_still_loads_and_validates(tmp_path):
    """Workflows saved with Load Video's typed path (['', 0, 9, ...]) and ones saved with the upload
    button's value (the editor adds the button as the last required input, so its value comes after the
    last widget's: [clip, 0, 9, ..., 'image']) both load headless to the same `path`, and pass validation."""
    from lingbot_core.video import save_mp4
    from lingbot_core.workflow import Engine

    clip = str(save_mp4(torch.rand(5, 16, 16, 3), tmp_path / "clip.mp4"))
    rest = [0, 9, 1, 64, 64]
    for values, expected in (([""] + rest, ""), ([clip] + rest, clip), ([clip] + rest + ["image"], clip)):
        prompt = _saved_with(tmp_path, "lingbot_v2v_dense", "LingBotLoadVideo", values)
        [inputs] = [n["inputs"] for n in prompt.nodes.values() if n["class_type"] == "LingBotLoadVideo"]
        assert inputs == dict(path=expected, start_frame=0, frame_count=9, stride=1, width=64, height=64)
        assert Engine(NODE_CLASS_MAPPINGS).validate(prompt)
