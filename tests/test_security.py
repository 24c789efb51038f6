"""Security: nothing runs that we did not write, nothing escapes ComfyUI's folders.

Issue 12 items 1-3. Each test reproduces a hole found by the adversarial probe.
"""

from __future__ import annotations

import ast
import json
import shutil
from pathlib import Path

import pytest

from lingbot_core.checkpoint import CheckpointError, inspect_checkpoint, load_component

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
