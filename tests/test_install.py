"""The install routes agree with each other: the README's test command is the one CI runs, uv.lock is
resolved from this pyproject.toml (and names no machine of ours), requirements.txt is the runtime list."""

from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
LOCK = tomllib.loads((ROOT / "uv.lock").read_text())
TORCH = ("torch", "torchvision")  # left to the user's install by requirements.txt


def _bash_lines(text: str) -> list[str]:
    """Command lines of the README's bash blocks, comments dropped."""
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        lines += [" ".join(shlex.split(line, comments=True)) for line in block.replace("\\\n", " ").splitlines()]
    return [line for line in lines if line]


def _test_commands(lines: list[str]) -> list[str]:
    return [line for line in lines if re.match(r"(uv run )?(python -m )?pytest\b", line)]


def test_ci_runs_the_readme_test_command():
    """.ci/run runs the README's test command as written, once."""
    readme = _test_commands(_bash_lines((ROOT / "README.md").read_text()))
    ci_lines = [" ".join(re.sub(r"(^|\s)#.*", "", line).split()) for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    ci = _test_commands(ci_lines)
    assert len(readme) == 1, readme
    assert ci == readme, (ci, readme)


def test_ci_refuses_a_stale_lock():
    """CI installs what uv.lock says or fails: it never re-resolves (a re-resolve would test versions
    nobody committed)."""
    text = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^export UV_LOCKED=1\b", text, flags=re.M)


def _requires(entries: list[dict]) -> set[str]:
    """uv.lock's `requires-dist` as comparable strings."""
    out = set()
    for entry in entries:
        text = entry["name"] + "".join(f"[{e}]" for e in entry.get("extras", [])) + entry.get("specifier", "")
        out.add(str(Requirement(text + (f"; {entry['marker']}" if "marker" in entry else ""))))
    return out


def _root_package() -> dict:
    (root,) = [p for p in LOCK["package"] if p["name"] == PYPROJECT["project"]["name"]]
    return root


def test_lock_is_resolved_from_this_pyproject():
    """The lock's record of what it was resolved from equals pyproject.toml: dependencies, extras,
    the dev group and the torch pins (`uv lock` after changing one of them)."""
    project = PYPROJECT["project"]
    wanted = {str(Requirement(d)) for d in project["dependencies"]}
    for extra, deps in project["optional-dependencies"].items():
        wanted |= {str(Requirement(f"{d}; extra == '{extra}'")) for d in deps}
    metadata = _root_package()["metadata"]
    assert _requires(metadata["requires-dist"]) == wanted
    assert sorted(metadata["provides-extras"]) == sorted(project["optional-dependencies"])
    groups = {name: _requires(deps) for name, deps in metadata["requires-dev"].items()}
    assert groups == {name: {str(Requirement(d)) for d in deps}
                      for name, deps in PYPROJECT["dependency-groups"].items()}
    pins = {c["name"]: c["specifier"] for c in LOCK["manifest"]["constraints"]}
    assert pins == {Requirement(c).name: str(Requirement(c).specifier)
                    for c in PYPROJECT["tool"]["uv"]["constraint-dependencies"]}
    assert LOCK["requires-python"] == project["requires-python"]


def test_lock_pins_the_torch_ci_tests():
    versions = {p["name"]: p["version"] for p in LOCK["package"] if p["name"] in TORCH}
    for pin in PYPROJECT["tool"]["uv"]["constraint-dependencies"]:
        req = Requirement(pin)
        assert req.specifier.contains(versions[req.name]), (pin, versions)


def test_lock_has_no_machine_paths():
    """Every locked package comes from PyPI (or is this project); no path or private index."""
    for package in LOCK["package"]:
        source = package["source"]
        if package["name"] == PYPROJECT["project"]["name"]:
            assert source == {"editable": "."}
        else:
            assert source == {"registry": "https://pypi.org/simple"}, (package["name"], source)
    text = (ROOT / "uv.lock").read_text()
    assert not re.search(r"file://|(?<![\w.])/(work|root|home|Users|tmp)/", text)


def test_requirements_txt_is_the_runtime_dependencies_but_torch():
    """ComfyUI-Manager and `pip install -r requirements.txt` get what pyproject.toml declares, minus
    torch and torchvision (ComfyUI keeps its own build)."""
    lines = [line.split("#")[0].strip() for line in (ROOT / "requirements.txt").read_text().splitlines()]
    listed = {str(Requirement(line)) for line in lines if line}
    wanted = {str(Requirement(d)) for d in PYPROJECT["project"]["dependencies"]
              if Requirement(d).name not in TORCH}
    assert listed == wanted
