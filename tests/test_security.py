"""Security: nothing runs that we did not write, nothing escapes ComfyUI's folders.

Issue 12 items 1-3. Each test reproduces a hole found by the adversarial probe.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import time
from pathlib import Path

import pytest

from lingbot_core.checkpoint import CheckpointError, inspect_checkpoint, load_component
from lingbot_core.save_path import UnsafePrefix, expand_prefix, save_target

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
