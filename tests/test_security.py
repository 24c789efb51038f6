"""Security: nothing runs that we did not write, nothing escapes ComfyUI's folders.

Issue 12 items 1-3. Each test reproduces a hole found by the adversarial probe.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import sys
import time
import types
from pathlib import Path

import pytest
import torch

from lingbot_core.checkpoints.inspection import inspect_checkpoint
from lingbot_core.checkpoints.loading import load_component
from lingbot_core.errors import CheckpointError
from lingbot_core.save_path import UnsafePrefix, expand_prefix, save_target
from lingbot_core.workflow import Engine, NodeExecutionError
from lingbot_nodes import NODE_CLASS_MAPPINGS

REPO = Path(__file__).resolve().parents[1]


# -- remote code (item 3) ----------------------------------------------------------------------------

@pytest.fixture
def dense(fixtures_root, tmp_path) -> Path:
    dst = tmp_path / "dense"
    shutil.copytree(fixtures_root / "models" / "tiny-dense", dst)
    return dst


def _plant(folder: Path, config: str, auto_map: dict) -> Path:
    """An ``auto_map`` entry pointing at Python that would leave a marker file if it ever ran."""
    marker = folder / "PWNED"
    sub = (folder / config).parent
    (sub / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n"
                                 "from transformers import PreTrainedTokenizerFast as Evil\n")
    path = folder / config
    data = json.loads(path.read_text())
    data["auto_map"] = auto_map
    path.write_text(json.dumps(data))
    return marker


@pytest.mark.parametrize("config,auto_map", [
    ("processor/tokenizer_config.json", {"AutoTokenizer": ["evil.Evil", None]}),
    ("processor/preprocessor_config.json", {"AutoImageProcessor": "evil.Evil"}),
    ("processor/processor_config.json", {"AutoProcessor": "evil.Evil"}),
    ("processor/video_preprocessor_config.json", {"AutoVideoProcessor": "evil.Evil"}),
    ("text_encoder/config.json", {"AutoModel": "evil.Evil", "AutoConfig": "evil.Evil"}),
    ("vae/config.json", {"AutoModel": "evil.Evil"}),
    ("transformer/config.json", {"AutoModel": "evil.Evil"}),
])
def test_auto_map_is_refused_with_a_clear_error_and_never_runs(dense, config, auto_map, monkeypatch):
    marker = _plant(dense, config, auto_map)
    monkeypatch.setattr("builtins.input", lambda *a: pytest.fail("prompted for trust_remote_code"))
    with pytest.raises(CheckpointError, match="auto_map.*never"):
        inspect_checkpoint(dense)
    assert not marker.exists()


def test_auto_map_is_refused_by_the_handle_before_any_component_loads(dense, monkeypatch):
    from lingbot_core.handle import PipelineHandle

    _plant(dense, "processor/tokenizer_config.json", {"AutoTokenizer": ["evil.Evil", None]})
    with pytest.raises(CheckpointError, match="auto_map"):
        PipelineHandle.open(dense)


def test_transformers_loads_get_trust_remote_code_false(dense, monkeypatch):
    import transformers

    seen: list[tuple[str, object]] = []
    for name in ("Qwen3VLProcessor", "Qwen3VLForConditionalGeneration"):
        cls = getattr(transformers, name)
        original = cls.from_pretrained.__func__

        def spy(klass, *args, _name=name, _original=original, **kwargs):
            seen.append((_name, kwargs.get("trust_remote_code", "absent")))
            return _original(klass, *args, **kwargs)

        monkeypatch.setattr(cls, "from_pretrained", classmethod(spy))
    info = inspect_checkpoint(dense)
    load_component(info.folder, "processor")
    load_component(info.folder, "text_encoder")
    assert {n for n, _ in seen} == {"Qwen3VLProcessor", "Qwen3VLForConditionalGeneration"}
    assert all(value is False for _, value in seen), seen


_OURS = {"LingBotVideoTransformer3DModel", "FlowUniPCScheduler"}  # our own classes: no remote-code path
_DIFFUSERS_CONCRETE = {"AutoencoderKLWan"}  # a concrete diffusers model class never imports from the folder


def test_every_library_load_in_the_source_passes_trust_remote_code_false():
    """A static check over lingbot_core/ and nodes/: any ``X.from_pretrained(...)`` on a transformers or
    diffusers class passes ``trust_remote_code=False`` literally (a new call cannot forget it)."""
    offenders = []
    for path in [*REPO.glob("lingbot_core/**/*.py"), *REPO.glob("nodes/**/*.py")]:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "from_pretrained"):
                continue
            receiver = node.func.value
            name = receiver.id if isinstance(receiver, ast.Name) else ast.unparse(receiver)
            if name in _OURS | _DIFFUSERS_CONCRETE:
                continue
            flag = next((k for k in node.keywords if k.arg == "trust_remote_code"), None)
            if not (flag and isinstance(flag.value, ast.Constant) and flag.value.value is False):
                offenders.append(f"{path.relative_to(REPO)}:{node.lineno} {name}.from_pretrained")
    assert not offenders, offenders


def test_no_eval_exec_or_pickle_in_the_pack():
    """Registry rules (S102/S307) and "never unpickle": no eval/exec/pickle/torch.load in our code."""
    offenders = []
    for path in [*REPO.glob("lingbot_core/**/*.py"), *REPO.glob("nodes/**/*.py"), REPO / "__init__.py"]:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                func = node.func
                name = func.id if isinstance(func, ast.Name) else (ast.unparse(func) if isinstance(func, ast.Attribute) else "")
                if name in ("eval", "exec", "torch.load", "pickle.load", "pickle.loads"):
                    offenders.append(f"{path.relative_to(REPO)}:{node.lineno} {name}")
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + ([node.module] if isinstance(node, ast.ImportFrom) else [])
                if any(n and n.split(".")[0] in ("pickle", "dill", "cloudpickle") for n in names):
                    offenders.append(f"{path.relative_to(REPO)}:{node.lineno} imports pickle")
    assert not offenders, offenders


# -- save paths (item 1, issue 13 item 2) --------------------------------------------------------------



@pytest.mark.parametrize("prefix", [
    "", ".", "./", "x/", "x/.", "../x", "../../x/pwn", "a/../../b", "a/..", "/etc/x", "~/x",
    "\\x", "a\\..\\..\\x", "D:x", "C:\\x", "C:/x", "x:stream", "x\x00y", "x\ny", " ", "a/ b", "a./b",
    "x" * 5000,
])
def test_prefixes_that_leave_the_output_folder_or_name_no_file_are_refused(tmp_path, prefix):
    out = tmp_path / "output"
    out.mkdir()
    before = sorted(tmp_path.rglob("*"))
    with pytest.raises(UnsafePrefix):
        save_target(prefix, out)
    assert sorted(tmp_path.rglob("*")) == before, "something was created"


def test_a_link_inside_the_output_folder_that_points_outside_is_refused(tmp_path):
    out = tmp_path / "output"
    outside = tmp_path / "elsewhere"
    out.mkdir()
    outside.mkdir()
    os.symlink(outside, out / "link")
    with pytest.raises(UnsafePrefix, match="outside"):
        save_target("link/pwn", out)
    with pytest.raises(UnsafePrefix, match="outside"):
        save_target("link/deeper/pwn", out)
    assert list(outside.iterdir()) == []


def test_counter_follows_comfyui_numbering(tmp_path):
    out = tmp_path / "output"
    (out / "lingbot").mkdir(parents=True)
    for name in ("video_00001_.mp4", "video_00007_.png", "videox_00009_.mp4", "video_abc_.mp4", "video_00003.mp4"):
        (out / "lingbot" / name).write_bytes(b"")
    target = save_target("lingbot/video", out)
    assert target.counter == 8 and target.subfolder == "lingbot" and target.stem == "video"
    assert target.path("mp4").name == "video_00008_.mp4"
    fresh = save_target("new/deeper/clip", out)
    assert fresh.counter == 1 and fresh.folder == out / "new" / "deeper" and fresh.folder.is_dir()


def test_date_and_server_fields_are_expanded():
    now = time.struct_time((2026, 3, 4, 5, 6, 7, 0, 63, 0))
    assert expand_prefix("v/%date:yyyy-MM-dd%/x", now=now) == "v/2026-03-04/x"
    assert expand_prefix("%date:yy.M.d h_m_s%", now=now) == "26.3.4 5_6_7"
    assert expand_prefix("%date:hhmmss%", now=now) == "050607"
    assert expand_prefix("%year%/%month%/%day%/%hour%%minute%%second%_%width%x%height%", width=832, height=480,
                         now=now) == "2026/03/04/050607_832x480"
    assert expand_prefix("100%", now=now) == "100%"


# -- the nodes inside ComfyUI and headless (items 1-3) -------------------------------------------------



def _within(directory: str, target: str) -> bool:
    directory, target = os.path.realpath(directory), os.path.realpath(target)
    return os.path.commonpath((directory, target)) == directory


@pytest.fixture
def comfy(tmp_path, monkeypatch):
    """A stand-in ``folder_paths`` with ComfyUI's folders and its get_save_image_path contract."""
    folders = {name: tmp_path / name for name in ("models", "input", "output", "temp")}
    for folder in folders.values():
        folder.mkdir()
    fp = types.ModuleType("folder_paths")
    fp.models_dir = str(folders["models"])
    fp.folder_names_and_paths = {"checkpoints": ([str(folders["models"] / "checkpoints")], set())}
    fp.add_model_folder_path = lambda name, path: fp.folder_names_and_paths.setdefault(name, ([], set()))[0].append(path)
    fp.get_folder_paths = lambda name: fp.folder_names_and_paths[name][0]
    fp.get_output_directory = lambda: str(folders["output"])
    fp.get_input_directory = lambda: str(folders["input"])
    fp.get_temp_directory = lambda: str(folders["temp"])
    fp.calls = []

    def get_save_image_path(prefix, output_dir, width=0, height=0):
        fp.calls.append(prefix)
        prefix = prefix.replace("%width%", str(width)).replace("%height%", str(height))
        subfolder = os.path.dirname(os.path.normpath(prefix))
        filename = os.path.basename(os.path.normpath(prefix))
        full = os.path.join(output_dir, subfolder)
        if not _within(output_dir, full):
            raise Exception("Saving image outside the output folder is not allowed.")
        os.makedirs(full, exist_ok=True)
        counters = [int(n[len(filename) + 1:].split("_")[0]) for n in os.listdir(full)
                    if n.startswith(filename + "_") and n[len(filename) + 1:].split("_")[0].isdigit()]
        return full, filename, max(counters, default=0) + 1, subfolder, prefix

    fp.get_save_image_path = get_save_image_path
    monkeypatch.setitem(sys.modules, "folder_paths", fp)
    monkeypatch.setitem(sys.modules, "comfy", types.ModuleType("comfy"))
    monkeypatch.delenv("LINGBOT_ALLOW_ANY_MODEL_PATH", raising=False)
    return types.SimpleNamespace(fp=fp, tmp=tmp_path, **folders)


class _Text:
    """A core PrimitiveString stand-in: a STRING arriving through a link."""

    CATEGORY = "tests"
    RETURN_TYPES = ("STRING",)
    FUNCTION = "run"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"value": ("STRING", {"default": ""})}}

    def run(self, value):
        return (value,)


REGISTRY = {**NODE_CLASS_MAPPINGS, "Text": _Text}


def _save_prompt(prefix_source: dict) -> dict:
    return {"1": {"class_type": "LingBotLoadImage", "inputs": {"path": ""}},
            "2": prefix_source,
            "3": {"class_type": "LingBotSaveVideo",
                  "inputs": {"images": ["1", 0], "fps": 24.0, "filename_prefix": ["2", 0]}}}


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


@pytest.mark.parametrize("prefix", ["../../x/pwn", "", ".", "./", "\\x", "D:x", "../sibling"])
def test_save_video_refuses_a_linked_prefix_that_escapes_inside_comfyui(comfy, prefix):
    prompt = _save_prompt({"class_type": "Text", "inputs": {"value": prefix}})
    before = _files(comfy.tmp)
    with pytest.raises(NodeExecutionError, match="filename_prefix"):
        Engine(REGISTRY).run(prompt)
    assert _files(comfy.tmp) == before


@pytest.mark.parametrize("prefix", ["../../x/pwn", "", ".", "./", "\\x", "D:x"])
def test_save_video_refuses_a_linked_prefix_that_escapes_headless(tmp_path, monkeypatch, prefix):
    out = tmp_path / "out" / "output"
    out.mkdir(parents=True)
    monkeypatch.setenv("LINGBOT_OUTPUT_DIR", str(out))
    prompt = _save_prompt({"class_type": "Text", "inputs": {"value": prefix}})
    with pytest.raises(NodeExecutionError, match="filename_prefix"):
        Engine(REGISTRY).run(prompt)
    assert _files(tmp_path) == []


def test_save_video_refuses_a_constant_escape_at_validation(comfy):
    prompt = _save_prompt({"class_type": "Text", "inputs": {"value": "x"}})
    prompt["3"]["inputs"]["filename_prefix"] = "../../x/pwn"
    from lingbot_core.workflow import WorkflowValidationError

    with pytest.raises(WorkflowValidationError, match="filename_prefix"):
        Engine(REGISTRY).validate(prompt)


def test_save_video_uses_comfyui_naming_and_its_save_path(comfy):
    prompt = _save_prompt({"class_type": "Text", "inputs": {"value": "lingbot/%year%/clip"}})
    first = Engine(REGISTRY).run(prompt).ui["3"]["images"][0]
    second = Engine(REGISTRY).run(prompt).ui["3"]["images"][0]
    year = str(time.localtime().tm_year)
    assert first == {"filename": "clip_00001_.png", "subfolder": f"lingbot/{year}", "type": "output"}
    assert second["filename"] == "clip_00002_.png"
    assert (comfy.output / "lingbot" / year / "clip_00002_.png").is_file()
    assert comfy.fp.calls and "%" not in comfy.fp.calls[-1]  # ComfyUI's function placed it


def test_save_video_headless_follows_the_same_rules(tmp_path, monkeypatch):
    monkeypatch.setenv("LINGBOT_OUTPUT_DIR", str(tmp_path / "out"))
    node = NODE_CLASS_MAPPINGS["LingBotSaveVideo"]
    frames = torch.rand(5, 16, 16, 3)
    ui = node.execute(frames, 8.0, "v/%date:yyyy%/x").ui
    year = str(time.localtime().tm_year)
    assert ui["images"][0] == {"filename": "x_00001_.mp4", "subfolder": f"v/{year}", "type": "output"}
    assert node.execute(frames, 8.0, "v/%date:yyyy%/x").ui["images"][0]["filename"] == "x_00002_.mp4"


def _image(path: Path) -> Path:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (8, 8), (10, 200, 30)).save(path)
    return path


def test_load_image_inside_comfyui_reads_only_its_folders(comfy):
    node = NODE_CLASS_MAPPINGS["LingBotLoadImage"]
    _image(comfy.input / "cat.png")
    _image(comfy.output / "render.png")
    secret = _image(comfy.tmp / "secret" / "private.png")
    assert node.validate_inputs(path="cat.png") is True
    assert node.validate_inputs(path="render.png [output]") is True
    image, = node.execute("cat.png").args
    assert image.shape == (1, 8, 8, 3) and abs(float(image[0, 0, 0, 1]) - 200 / 255) < 1e-6
    os.symlink(secret, comfy.input / "link.png")
    for probe in (str(secret), "../secret/private.png", "link.png", "..\\secret\\private.png",
                  "../secret/private.png [output]"):
        message = node.validate_inputs(path=probe)
        assert message is not True and "not a file in ComfyUI's" in message, probe
        with pytest.raises(ValueError, match="not a file in ComfyUI's"):
            node.execute(probe)


def test_load_video_inside_comfyui_reads_only_its_folders(comfy):
    from lingbot_core.video import save_mp4

    node = NODE_CLASS_MAPPINGS["LingBotLoadVideo"]
    save_mp4(torch.rand(5, 16, 16, 3), comfy.input / "clip.mp4")
    secret = save_mp4(torch.rand(5, 16, 16, 3), comfy.tmp / "secret" / "private.mp4")
    assert node.validate_inputs(path="clip.mp4") is True
    assert node.execute("clip.mp4", 0, 5, 1, 0, 0).args[0].shape == (5, 16, 16, 3)
    for probe in (str(secret), "../secret/private.mp4", "../secret/private.mp4 [output]"):
        message = node.validate_inputs(path=probe)
        assert message is not True and message.startswith("video ") and "not a file in ComfyUI's" in message
        with pytest.raises(ValueError, match="not a file in ComfyUI's"):
            node.execute(probe)


def test_load_image_answers_alike_for_missing_and_existing_outside_files(comfy):
    node = NODE_CLASS_MAPPINGS["LingBotLoadImage"]
    _image(comfy.tmp / "exists.png")
    there = node.validate_inputs(path=str(comfy.tmp / "exists.png"))
    missing = node.validate_inputs(path=str(comfy.tmp / "absent.png"))
    assert there.replace("exists", "X") == missing.replace("absent", "X")


def test_load_image_headless_takes_any_path(tmp_path):
    node = NODE_CLASS_MAPPINGS["LingBotLoadImage"]
    path = _image(tmp_path / "anywhere" / "frame.png")
    assert node.validate_inputs(path=str(path)) is True
    assert node.execute(str(path)).args[0].shape == (1, 8, 8, 3)
    assert "not found" in node.validate_inputs(path=str(tmp_path / "nope.png"))


def test_loader_path_inside_comfyui_is_limited_to_model_folders(comfy, fixtures_root, monkeypatch):
    from lingbot_nodes.loader import resolve_checkpoint

    outside = comfy.tmp / "elsewhere" / "ckpt"
    shutil.copytree(fixtures_root / "models" / "tiny-dense", outside)
    answers = []
    for probe in (str(outside), str(comfy.tmp / "no" / "such" / "dir"), "../elsewhere/ckpt", "/etc"):
        with pytest.raises(ValueError, match="LINGBOT_ALLOW_ANY_MODEL_PATH") as info:
            resolve_checkpoint("tiny (built-in dense)", probe)
        answers.append(str(info.value))
    assert len(set(answers)) == 1, "the answer must not depend on whether the folder exists"
    inside = comfy.models / "lingbot_video" / "mine"
    shutil.copytree(fixtures_root / "models" / "tiny-dense", inside)
    assert resolve_checkpoint("x", str(inside)) == inside
    assert resolve_checkpoint("x", "lingbot_video/mine") == inside
    with pytest.raises(ValueError, match="not a checkpoint folder name"):
        resolve_checkpoint("../elsewhere", "")
    monkeypatch.setenv("LINGBOT_ALLOW_ANY_MODEL_PATH", "1")
    assert resolve_checkpoint("x", str(outside)) == outside


def test_loader_path_headless_takes_any_folder(tmp_path, fixtures_root):
    from lingbot_nodes.loader import resolve_checkpoint

    target = tmp_path / "ckpt"
    shutil.copytree(fixtures_root / "models" / "tiny-dense", target)
    assert resolve_checkpoint("x", str(target)) == target


def test_no_prefix_writes_outside_the_output_folder(tmp_path_factory):
    """Property: for any text, save_target refuses it or lands inside the output folder."""
    hypothesis = pytest.importorskip("hypothesis")
    from hypothesis import given, settings
    from hypothesis import strategies as st

    root = tmp_path_factory.mktemp("prop")
    out = root / "output"
    out.mkdir()
    (root / "outside").mkdir()
    os.symlink(root / "outside", out / "escape")
    pieces = st.sampled_from(["..", ".", "", "a", "escape", "b.c", " ", "\\", "D:", "%date:yyyy%", "%year%", "~",
                              "/", "x\x00", "%", "..\\..", "é"])

    @settings(max_examples=120, deadline=None, derandomize=True)
    @given(st.lists(pieces, min_size=0, max_size=6).map("/".join) | st.text(max_size=20))
    def check(prefix):
        try:
            target = save_target(prefix, out)
        except UnsafePrefix:
            return
        assert os.path.commonpath([os.path.realpath(target.folder), os.path.realpath(out)]) == os.path.realpath(out)
        assert target.stem and target.stem not in (".", "..")

    assert hypothesis
    check()
    assert list((root / "outside").iterdir()) == []


def test_loader_transformer_path_follows_the_same_rule(comfy, monkeypatch):
    from lingbot_nodes.loader import resolve_student

    with pytest.raises(ValueError, match="LINGBOT_ALLOW_ANY_MODEL_PATH"):
        resolve_student(str(comfy.tmp / "elsewhere" / "student"))
    inside = comfy.models / "lingbot_video" / "student"
    assert resolve_student(str(inside)) == inside
    monkeypatch.setenv("LINGBOT_ALLOW_ANY_MODEL_PATH", "1")
    assert resolve_student(str(comfy.tmp / "elsewhere")) == comfy.tmp / "elsewhere"


def test_lora_names_come_only_from_comfyuis_loras_folders(comfy, monkeypatch):
    """Inside ComfyUI a LoRA name never resolves under the server's working directory."""
    from lingbot_nodes.lora import lora_choices, resolve_lora

    loras = comfy.models / "loras"
    loras.mkdir()
    (loras / "inside.safetensors").write_bytes(b"")
    comfy.fp.folder_names_and_paths["loras"] = ([str(loras)], set())
    cwd = comfy.tmp / "cwd"
    (cwd / "models" / "loras").mkdir(parents=True)
    (cwd / "models" / "loras" / "beside.safetensors").write_bytes(b"")
    monkeypatch.chdir(cwd)
    assert lora_choices() == ["none", "inside.safetensors"]
    assert resolve_lora("inside.safetensors") == loras / "inside.safetensors"
    with pytest.raises(ValueError, match="not found"):
        resolve_lora("beside.safetensors")
