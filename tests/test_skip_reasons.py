"""Skip reasons are read by users in the test summary: they say what is missing in words, never a
folder of the machine the tests ran on (a path built in the test, formatted into the reason)."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def _path_names(tree: ast.Module) -> set[str]:
    """Module-level names bound to a path: built with `Path(...)`, `/` or from `__file__`."""
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            if _builds_a_path(node.value):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


def _builds_a_path(expr: ast.AST) -> bool:
    for node in ast.walk(expr):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            return True
        if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) == "Path":
            return True
        if isinstance(node, ast.Name) and node.id == "__file__":
            return True
    return False


def _reasons(tree: ast.Module) -> list[ast.AST]:
    """The reason arguments of pytest.skip(...), skipif(..., reason=...) and importorskip(..., reason=...)."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = getattr(node.func, "attr", getattr(node.func, "id", ""))
        if name == "skip" and node.args:
            found.append(node.args[0])
        found += [k.value for k in node.keywords if k.arg in ("reason", "msg") and name in ("skip", "skipif",
                                                                                          "importorskip")]
    return found


def problems(source: str, where: str) -> list[str]:
    tree = ast.parse(source)
    paths = _path_names(tree)
    out = []
    for reason in _reasons(tree):
        for value in ast.walk(reason):
            if not isinstance(value, ast.FormattedValue):
                continue
            used = {n.id for n in ast.walk(value.value) if isinstance(n, ast.Name)}
            if _builds_a_path(value.value) or used & paths:
                out.append(f"{where}:{reason.lineno}: a skip reason formats a path ({ast.unparse(value.value)})")
    return out


def test_no_skip_reason_shows_a_folder_of_this_machine():
    found = [p for path in sorted(TESTS.glob("*.py")) for p in problems(path.read_text(), path.name)]
    assert not found, "\n".join(found)


def test_the_check_finds_a_path_in_a_reason():
    bad = 'from pathlib import Path\nSHARED = Path("x")\nimport pytest\ndef t(name):\n' \
          '    pytest.skip(f"no {SHARED / name} here")\n'
    assert len(problems(bad, "bad.py")) == 1
    good = 'import pytest\ndef t(name):\n    pytest.skip(f"no shared copy of {name!r}")\n'
    assert problems(good, "good.py") == []
