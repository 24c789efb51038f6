"""The core's layers: no module of `lingbot_core` imports from a layer above its own.

Read bottom up. Imports inside functions count (a lazy import is still a dependency). A module
may import its own layer and any below; every top-level module and package must be placed, so a
new one has to say where it stands.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "lingbot_core"

LAYERS: list[tuple[str, set[str]]] = [
    # knows nothing of the models: errors, tables, the hook registry, cancellation, paths, the graph engine
    ("base", {"errors", "components", "json_text", "caption_schema", "exit_codes", "hooks", "interrupt", "save_path",
              "workflow", "kernels", "allocator"}),
    # pure computation over tensors: the DiT, the scheduler and samplers, image/video/latent prep
    ("models", {"models", "scheduler", "sampling", "image", "video", "video_input", "latents"}),
    # files -> modules: opening checkpoints (folders and single files), weight formats, the tiny checkpoint,
    # quantizing, LoRA, the text encoder's prompt encoding (it loads through `checkpoints`)
    ("weights", {"weights", "checkpoints", "tiny", "quantize", "lora", "prompt"}),
    # where weights live while stages run, on one device or several
    ("placement", {"placement", "offload", "distributed"}),
    # what a stage accepts (checked against the memory estimate), what a run says before it starts
    ("requests", {"stage_inputs", "notices"}),
    # the lazy handle over one checkpoint
    ("handle", {"handle"}),
    # stages: plain functions over a handle; the prompt rewriter (runs a text model through the door);
    # the runners over the stages on several processes (`parallel_denoise`, LingBot Parallel's worker pool)
    ("stages", {"stages", "video_to_video", "extend", "rewrite", "worker_pool"}),
    # entry points
    ("entry", {"__main__", "__init__", "doctor"}),
]
LEVEL = {unit: level for level, (_name, units) in enumerate(LAYERS) for unit in units}


def _unit(module: str) -> str:
    """`lingbot_core.placement.door` -> `placement`; `lingbot_core` -> `__init__`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _imports(path: Path) -> set[str]:
    module = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts)
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    if path.name == "__init__.py":
        package = package[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            if target.startswith("lingbot_core"):
                found.add(target)
                if target == "lingbot_core":  # `from .. import hooks`: the submodule named
                    found.update(f"{target}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("lingbot_core"))
    return {t for t in found if t != "lingbot_core"}


def _units() -> set[str]:
    return {p.stem if p.is_file() else p.name for p in ROOT.iterdir()
            if (p.suffix == ".py") or (p.is_dir() and (p / "__init__.py").is_file())}


def test_every_module_has_a_layer():
    unplaced = _units() - set(LEVEL)
    assert not unplaced, f"place {sorted(unplaced)} in LAYERS (tests/test_layers.py)"


def test_no_module_imports_from_a_layer_above():
    wrong = []
    for path in sorted(ROOT.rglob("*.py")):
        module = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts)
        here = _unit(module)
        for target in _imports(path):
            there = _unit(target)
            if there in LEVEL and LEVEL[there] > LEVEL.get(here, len(LAYERS)):
                wrong.append(f"{path.relative_to(ROOT.parent)} ({LAYERS[LEVEL[here]][0]}) imports {target} "
                             f"({LAYERS[LEVEL[there]][0]})")
    assert not wrong, "\n".join(wrong)


def test_the_check_sees_an_upward_import(tmp_path):
    """The walk itself works: a lazy import of a stage from a model module is caught."""
    global ROOT
    fake = tmp_path / "lingbot_core"
    (fake / "models").mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "models" / "__init__.py").write_text("")
    (fake / "models" / "block.py").write_text("def f():\n    from ..stages import denoise\n")
    (fake / "stages.py").write_text("from .models import block\n")
    real, ROOT = ROOT, fake
    try:
        assert _imports(fake / "models" / "block.py") == {"lingbot_core.stages"}
        try:
            test_no_module_imports_from_a_layer_above()
        except AssertionError as err:
            assert str(err).splitlines()[0] == "lingbot_core/models/block.py (models) imports lingbot_core.stages (stages)"
        else:
            raise AssertionError("an upward import was not seen")
    finally:
        ROOT = real
