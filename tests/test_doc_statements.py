"""Statements in the README and the developer docs that the code can contradict, checked against it
(issue 31 item 6: each of these had gone stale once)."""

from __future__ import annotations

import mmap
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
WEIGHTS = (ROOT / "docs" / "weights.md").read_text(encoding="utf-8")  # the README's reference pages
PARALLEL = (ROOT / "docs" / "parallel.md").read_text(encoding="utf-8")


def _paragraph(text: str, start: str) -> str:
    """The paragraph of `text` that contains `start`, its lines joined."""
    at = text.index(start)
    begin = text.rfind("\n\n", 0, at) + 2
    end = text.find("\n\n", at)
    return " ".join(text[begin:end].split())


def test_contributing_names_every_module_and_only_real_files():
    """docs/contributing.md's one-line-per-module list names every top-level module and package of
    lingbot_core, and every file it names exists (`checkpoints/` lists its per-component readers,
    `weights/` its checks)."""
    text = (ROOT / "docs" / "contributing.md").read_text(encoding="utf-8")
    section = text.split("## Packages and modules, one line each", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"`([A-Za-z_][A-Za-z_0-9/.]*)`", section))
    core = ROOT / "lingbot_core"
    top = [p.name + "/" if p.is_dir() else p.name for p in core.iterdir()
           if (p.suffix == ".py" and p.name != "__init__.py") or (p.is_dir() and (p / "__init__.py").is_file())]
    assert [t for t in top if t not in named] == []
    files = [n for n in named if n.endswith(".py")]
    assert [f for f in files if not any(core.rglob(Path(f).name))] == []
    checkpoints = _paragraph(section, "- `checkpoints/`")
    for reader in ("inspection.py", "configs.py", "loading.py", "dit_file.py", "vae_file.py", "text_encoder_file.py",
                   "single_files.py", "processor_files.py"):
        assert (core / "checkpoints" / reader).is_file() and f"`{reader}`" in checkpoints
    assert (core / "weights" / "checks.py").is_file() and "`checks.py`" in _paragraph(section, "- `weights/`")


def test_the_door_names_every_offload_mode_and_what_disk_offload_streams():
    """placement/door.py's mode table has a row per registered mode, and its `offload_to="disk"`
    paragraph names each mode's streaming unit (`Mode.disk_unit`)."""
    from lingbot_core.placement import door
    from lingbot_core.placement.modes import MODE_CLASSES, MODE_ORDER

    doc = door.__doc__
    rows = re.findall(r"^\| `(\w+)` ", doc, flags=re.M)
    assert sorted(rows) == sorted(MODE_ORDER)
    disk = _paragraph(doc, '`offload_to="disk"`')
    for name in MODE_ORDER:
        unit = MODE_CLASSES[name].disk_unit
        if unit is not None:
            assert re.search(rf"`{name}`[^`]*`{unit}`", disk), (name, unit)


def test_gguf_weights_load_with_plain_reads_as_the_readme_says(tmp_path, monkeypatch):
    """docs/weights.md: DiT tensors, GGUF included, are plain reads, not a mapping of the file:
    a GGUF source reads every tensor with file mappings refused."""
    import gguf
    from gguf_fakes import write_gguf

    from lingbot_core.weights.sources import GGUFSource

    formats = _paragraph(WEIGHTS, "The DiTs (`transformer/`, `refiner/`) load tensor by tensor")
    assert "plain reads, GGUF included" in formats and "mapping" not in formats
    values = np.arange(64, dtype=np.float32).reshape(4, 16)
    path = write_gguf(tmp_path / "w.gguf", {"w": (values, gguf.GGMLQuantizationType.F32)})

    def refused(*_a, **_k):
        raise AssertionError("a DiT load mapped its file")

    monkeypatch.setattr(np, "memmap", refused)
    monkeypatch.setattr(mmap, "mmap", refused)
    source = GGUFSource(path)
    assert torch.equal(source.plain("w"), torch.from_numpy(values))
    assert source.packed("w").numel() == values.nbytes


def test_a_step_cache_runs_on_several_processes_as_the_readme_says():
    """docs/parallel.md (--parallel): a step cache runs on a parallel view; MagCache calibration and `cfg_batch on`
    with `cfg=2` are refused."""
    from lingbot_core.distributed import ParallelLayout
    from lingbot_core.distributed import stage as parallel_stage

    said = _paragraph(PARALLEL, "Rank 0 encodes the prompt, decodes and saves")
    assert "A step cache runs" in said and "MagCache calibration, and `cfg_batch on` with `cfg=2`, are refused" in said
    layout = ParallelLayout(cfg=2, ulysses=1, rank=0, mesh=object())
    view = SimpleNamespace(parallel=layout, info=None, shared=SimpleNamespace(loaded={}))
    for method in ("first_block", "magcache"):
        parallel_stage.check_request(view, cfg_batch="off", step_cache=method)
    with pytest.raises(ValueError, match="MagCache calibration runs on one process"):
        parallel_stage.check_request(view, cfg_batch="off", step_cache="magcache_calibrate")
    with pytest.raises(ValueError, match="cfg_batch 'on' and CFG parallel"):
        parallel_stage.check_request(view, cfg_batch="on")


def test_the_chunked_ffn_sentence_says_it_is_not_always_bit_identical():
    """docs/speed.md (issue 36 item 5): token-chunked FFN/MoE is not bit-identical on every CPU (a MoE block
    1 bf16 ulp apart on an AMD EPYC with AVX512-bf16); the bench counts that ulp with `bf16_steps`."""
    from bench._common import bf16_steps

    said = _paragraph((ROOT / "docs" / "speed.md").read_text(encoding="utf-8"), "Each token's math is unchanged")
    assert "not always bit-identical" in said and "1 bf16 ulp" in said and "bit-identical in the CPU" not in said
    x = torch.tensor([0.1, -3.0, 0.0, 1e-3]).bfloat16()
    nudged = (x.view(torch.int16) + 1).view(torch.bfloat16)  # each value one representable step away
    assert bf16_steps(x, x) == 0 and bf16_steps(x, nudged) == 1
    assert bf16_steps(torch.tensor([-0.0]), torch.tensor([0.0])) == 0


def test_speed_figures_name_their_cpu():
    """Issue 36 item 5: docs/speed.md's quantized-decoder and light-decoder figures, and docs/benchmarks.md's
    CPU table, name the CPU (and AMX or not) each figure was measured on."""
    speed = (ROOT / "docs" / "speed.md").read_text(encoding="utf-8")
    quantized = _paragraph(speed, "How close a quantized DiT")
    assert "Intel Xeon" in quantized and "AMD EPYC" in quantized and "AMX" in quantized and "not met" in quantized
    assert "AMD EPYC" in _paragraph(speed, "Gives: 14.6x less CPU time")
    bench = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    assert "| AMD EPYC, 2 cores (December 6 2026) | AVX512-bf16, **no AMX**" in bench
