"""The folder as a ComfyUI custom node pack: import, mappings, node contracts, registry rules."""

from __future__ import annotations

import ast
import importlib.util
import re
import sys
import tomllib
from pathlib import Path

import pytest
from background import Child, selected

ROOT = Path(__file__).resolve().parents[1]


PROBE = """
import importlib.util, sys
# As inside ComfyUI: our package is not pip-installed, and ComfyUI's own top-level `nodes` exists.
sys.meta_path = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
sys.path = [p for p in sys.path if p not in ("", ROOT)]
sys.modules.pop("lingbot_core", None)
assert importlib.util.find_spec("lingbot_core") is None, "lingbot_core must not be importable up front"
import nodes
spec = importlib.util.spec_from_file_location("lingbot-nodes", ROOT + "/__init__.py",
                                              submodule_search_locations=[ROOT])
mod = importlib.util.module_from_spec(spec)
sys.modules["lingbot-nodes"] = mod
spec.loader.exec_module(mod)
import nodes as again
assert again.COMFY and "comfy" not in sys.modules
print(len(mod.NODE_CLASS_MAPPINGS), sorted(mod.NODE_DISPLAY_NAME_MAPPINGS) == sorted(mod.NODE_CLASS_MAPPINGS))
"""


def _start_probe(folder: Path, probe: str) -> Child:
    (folder / "probe.py").write_text(f"ROOT = {str(ROOT)!r}\n" + probe)
    return Child([sys.executable, str(folder / "probe.py")], cwd=folder)


@pytest.fixture(scope="module", autouse=True)
def probes(request, tmp_path_factory):
    """The import probes below, each in a fresh Python of its own, started together when the module starts
    (tests/background.py): they run beside each other and beside this module's other tests."""
    started = {}
    if selected(request, "test_pack_imports_as_a_custom_nodes_folder_without_comfyui"):
        folder = tmp_path_factory.mktemp("no_comfyui")
        (folder / "nodes.py").write_text("COMFY = True\n")  # ComfyUI's module of the same name
        started["plain"] = _start_probe(folder, PROBE)
    if selected(request, "test_pack_registers_through_comfy_entrypoint_when_comfyui_has_v3"):
        started["v3"] = _start_probe(tmp_path_factory.mktemp("v3"), V3_PROBE)
    yield started
    for child in started.values():
        child.stop()


def test_pack_imports_as_a_custom_nodes_folder_without_comfyui(probes):
    """ComfyUI imports the folder by path as a package; `lingbot_core` must resolve without pip. (The probe,
    a folder with ComfyUI's own `nodes.py` beside it, started with the module: `probes`.)"""
    done = probes["plain"].result()
    assert done.returncode == 0, done.stderr
    from lingbot_nodes import NODE_CLASS_MAPPINGS

    assert done.stdout.split() == [str(len(NODE_CLASS_MAPPINGS)), "True"]


V3_PROBE = """
import asyncio, importlib.util, sys, types
# A ComfyUI with the V3 API: `comfy_api.latest` importable (here it hands out the pack's own subset).
sys.path.insert(0, ROOT + "/nodes")
import v3_fallback
latest = types.ModuleType("comfy_api.latest")
for name in ("ComfyExtension", "InputImpl", "Types", "io", "ui"):
    setattr(latest, name, getattr(v3_fallback, name))
sys.modules["comfy_api"] = types.ModuleType("comfy_api")
sys.modules["comfy_api.latest"] = latest
sys.path.pop(0)
spec = importlib.util.spec_from_file_location("lingbot-nodes", ROOT + "/__init__.py",
                                              submodule_search_locations=[ROOT])
mod = importlib.util.module_from_spec(spec)
sys.modules["lingbot-nodes"] = mod
spec.loader.exec_module(mod)
assert not hasattr(mod, "NODE_CLASS_MAPPINGS"), "ComfyUI would ignore comfy_entrypoint"
extension = asyncio.run(mod.comfy_entrypoint())
assert isinstance(extension, v3_fallback.ComfyExtension)
names = [c.GET_SCHEMA().node_id for c in asyncio.run(extension.get_node_list())]
print(len(names), all(n.startswith("LingBot") for n in names))
"""


def test_pack_registers_through_comfy_entrypoint_when_comfyui_has_v3(probes):
    done = probes["v3"].result()
    assert done.returncode == 0, done.stderr
    from lingbot_nodes import NODE_CLASS_MAPPINGS

    assert done.stdout.split() == [str(len(NODE_CLASS_MAPPINGS)), "True"]


def test_node_contracts():
    from lingbot_nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS

    expected = {"LingBotLoader", "LingBotOffload", "LingBotTextEncode", "LingBotImageEncode", "LingBotDenoise",
                "LingBotRefine", "LingBotDecode", "LingBotRelease", "LingBotSaveVideo", "LingBotLoadImage", "LingBotLoadVideo",
                "LingBotMemoryReport", "LingBotCaption", "LingBotLoRA", "LingBotRewrite", "LingBotLoaderFiles",
                "LingBotParallel", "LingBotExtendVideo"}
    assert set(NODE_CLASS_MAPPINGS) == expected == set(NODE_DISPLAY_NAME_MAPPINGS)
    for name, cls in NODE_CLASS_MAPPINGS.items():
        spec = cls.INPUT_TYPES()
        assert set(spec) <= {"required", "optional", "hidden"}, name
        assert callable(getattr(cls, cls.FUNCTION)), name
        assert len(getattr(cls, "RETURN_NAMES", cls.RETURN_TYPES)) == len(cls.RETURN_TYPES), name
        assert cls.CATEGORY == "LingBot-Video"
    prompt = NODE_CLASS_MAPPINGS["LingBotTextEncode"].INPUT_TYPES()["required"]["prompt"][1]
    assert prompt["dynamicPrompts"] is False and prompt["multiline"] is True
    seed = NODE_CLASS_MAPPINGS["LingBotDenoise"].INPUT_TYPES()["required"]["seed"][1]
    assert seed["control_after_generate"] is True


def test_comfy_registry_section():
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    comfy = data["tool"]["comfy"]
    assert {"PublisherId", "DisplayName", "Icon", "includes"} <= set(comfy)
    assert data["project"]["name"] and data["project"]["version"] and data["project"]["license"]
    assert not any(d.startswith("torch") and any(op in d for op in "=<>~") and "torch>=" not in d
                   for d in data["project"]["dependencies"]), "torch must not be pinned to one build"


def test_wheel_lists_every_package_and_carries_the_workflows():
    """`packages` is an explicit list (nodes/ is installed as lingbot_nodes), so a new sub-package
    must be added to it; the shipped workflows must be package data, or `lingbot-run t2v` fails
    from a plain `pip install .` (.ci/wheel-check runs that for real)."""
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {"lingbot_core": ROOT / "lingbot_core", "lingbot_nodes": ROOT / "nodes"}
    found = {"lingbot_nodes.workflows"}
    for name, folder in folders.items():
        for init in folder.rglob("__init__.py"):
            found.add(".".join([name, *init.parent.relative_to(folder).parts]))
    assert set(setup["packages"]) == found
    assert setup["package-dir"]["lingbot_nodes.workflows"] == "workflows"
    shipped = {str(p.relative_to(ROOT / "workflows")) for p in (ROOT / "workflows").rglob("*.json")}
    patterns = setup["package-data"]["lingbot_nodes.workflows"]
    assert shipped and all(any(Path(f).match(pat) for pat in patterns) for f in shipped), shipped


def _python_files():
    for folder in ("lingbot_core", "nodes"):
        yield from (ROOT / folder).rglob("*.py")
    yield ROOT / "__init__.py"


@pytest.mark.parametrize("path", list(_python_files()), ids=lambda p: str(p.relative_to(ROOT)))
def test_registry_rules_no_eval_exec_or_runtime_pip(path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            assert node.func.id not in ("eval", "exec", "compile", "__import__") or node.func.id == "__import__" \
                and path.name == "runtime.py", f"{path}: {node.func.id}()"
    text = path.read_text()
    assert not re.search(r"pip['\"]?\s*,?\s*['\"]?install|pip install", text), f"{path}: runtime pip"
    assert "trust_remote_code=True" not in text and "torch.load(" not in text
    assert "import pickle" not in text and "pickle.load" not in text


def test_nodes_do_not_contain_model_logic():
    """Nodes translate types; only lingbot_core touches models (no torch.nn use in nodes/)."""
    for path in (ROOT / "nodes").glob("*.py"):
        text = path.read_text()
        assert "torch.nn" not in text and ".forward(" not in text, path.name
    assert importlib.util.find_spec("lingbot_nodes") is not None


def test_torch_floor_is_the_release_the_oldest_torch_script_tests():
    """pyproject's torch floor is the torch `bench/oldest_torch.sh` runs the tests on (tested, not guessed)."""
    from packaging.version import Version

    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    floor = next(d for d in dependencies if re.match(r"torch\s*>=", d)).split(">=", 1)[1].strip()
    script = (ROOT / "bench" / "oldest_torch.sh").read_text()
    tested = re.search(r"^TORCH=(\S+)$", script, flags=re.M).group(1)
    assert Version(tested) == Version(floor), (floor, tested)
