"""The README's numbers, commands and pictures are checked against what they claim to come from."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _code_commands(program: str) -> list[list[str]]:
    """Every `program ...` command in the README's bash blocks, continuation lines joined."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", README, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            if line.strip().startswith(program + " ") or line.strip() == program:
                commands.append(shlex.split(line, comments=True))
    return commands


def _table_rows(header_start: str) -> list[list[str]]:
    lines = README.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def test_offload_table_is_what_the_bench_script_prints():
    from bench.memory_table import MODES, collect

    data = collect()
    printed = {key: [f"{est[m] / 1024**3:.1f}" for m in MODES] for key, est in data["estimate"].items()}
    readme = {row[0]: row[1:] for row in _table_rows("| model and size")}
    assert readme == printed
    assert "not yet confirmed by a GPU run" in README  # labelled as an estimate

    disk = _table_rows("| checkpoint | transformer")
    for row, variant in zip(disk, ("dense", "moe")):
        total = sum(data["disk"][variant]["bytes"].values()) / 1e9
        assert row[-1] == f"**{total:.1f} GB**", row


@pytest.mark.parametrize("argv", _code_commands("lingbot-run"), ids=lambda a: " ".join(a[:2]))
def test_readme_commands_are_complete_and_valid(argv, tmp_path):
    """No placeholder `...`; every --set applies to the named workflow (nothing is run)."""
    from lingbot_core.workflow import apply_overrides, load_workflow
    from lingbot_nodes import NODE_CLASS_MAPPINGS
    from lingbot_nodes.cli import build_parser, resolve_workflow

    assert "..." not in argv
    args = build_parser().parse_args(argv[1:])
    prompt = load_workflow(resolve_workflow(args.workflow), NODE_CLASS_MAPPINGS)
    changed = apply_overrides(prompt, args.overrides, NODE_CLASS_MAPPINGS)
    for text in args.overrides:
        assert text.split("=", 1)[1] in {str(v) for node in changed.nodes.values() for v in node["inputs"].values()}


def test_a_complete_moe_command_is_shown():
    moe = [a for a in _code_commands("lingbot-run") if a[1:2] == ["moe"]]
    assert moe and any("--model" in a for a in moe)
    assert "--set Refine.width=1920 --set Refine.height=1088 ..." not in README


def test_pictures_exist_and_are_pngs():
    pictures = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", README)
    assert pictures
    for rel in pictures:
        data = (ROOT / rel).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n", rel
