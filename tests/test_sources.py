"""One resolver, opened once: each weights file's header is read once per open, and every weight
format problem is refused when the checkpoint opens (before any component loads)."""

from __future__ import annotations

import shutil
import sys
from collections import Counter
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from lingbot_core.components import DITS, INDEXED, TABLE
from lingbot_core.errors import CheckpointError, WeightsError
from lingbot_core.handle import PipelineHandle
from lingbot_core.placement import plan
from lingbot_core.quantize import quantize_checkpoint
from lingbot_core.weights import formats, safetensors_header, sources

T = gguf.GGMLQuantizationType


@pytest.fixture(scope="module")
def moe_gguf(tmp_path_factory, fixtures_root) -> Path:
    """The tiny MoE checkpoint (with its refiner) with both DiTs as GGUF Q8_0."""
    return quantize_checkpoint(fixtures_root / "models" / "tiny-moe", tmp_path_factory.mktemp("q") / "moe-q8", "gguf-q8_0")


@pytest.fixture(scope="module")
def moe_fp8(tmp_path_factory, fixtures_root) -> Path:
    return quantize_checkpoint(fixtures_root / "models" / "tiny-moe", tmp_path_factory.mktemp("f") / "moe-fp8", "fp8")


def _count_header_reads(monkeypatch) -> Counter:
    """Count every read of a weights file's header by our code, per file: safetensors through the one
    validated reader (wherever a module imported it), GGUF by opening its source."""
    reads: Counter = Counter()
    original = safetensors_header.read_safetensors_file

    def counted(path):
        reads[str(path)] += 1
        return original(path)

    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "").startswith("lingbot_core") and \
                getattr(module, "read_safetensors_file", None) is original:
            monkeypatch.setattr(module, "read_safetensors_file", counted)
    gguf_init = sources.GGUFSource.__init__

    def counted_gguf(self, path, *args, **kwargs):
        reads[str(path)] += 1
        gguf_init(self, path, *args, **kwargs)

    monkeypatch.setattr(sources.GGUFSource, "__init__", counted_gguf)
    return reads


def _dit_files(folder: Path) -> list[str]:
    return sorted(str(p) for name in DITS for p in (folder / name).glob("diffusion_pytorch_model*")
                  if p.suffix in (".gguf", ".safetensors"))


@pytest.mark.parametrize("fmt", ["gguf", "fp8"])
def test_each_header_is_read_once_per_open(moe_gguf, moe_fp8, monkeypatch, fmt):
    folder = moe_gguf if fmt == "gguf" else moe_fp8
    reads = _count_header_reads(monkeypatch)
    handle = PipelineHandle.open(folder, device="cpu")

    plan.model_sizes(handle.shared)  # the memory estimate reads the same headers
    for _ in range(2):  # load, release, load again: the handle's resolved sources serve both
        for name in DITS:
            handle.shared.get(name)
        handle.shared.loaded.clear()
    dit_files = _dit_files(folder)
    assert len(dit_files) == 2
    assert {f: reads[f] for f in dit_files} == {f: 1 for f in dit_files}
    assert all(n == 1 for n in reads.values()), reads  # the VAE's and text encoder's headers too


def test_the_component_table_is_what_the_checkpoint_reads():
    from lingbot_core import handle
    from lingbot_core.checkpoints import inspection

    assert inspection.COMPONENTS == INDEXED
    assert set(handle.ALL_COMPONENTS) == set(TABLE)
    assert all(TABLE[n].quantizable and TABLE[n].may_stream for n in DITS)
    assert set(inspection.default_dtypes("cuda")) == {n for n, c in TABLE.items() if c.weight_stem}


def test_a_format_is_found_by_its_row(tmp_path):
    assert formats.format_of(tmp_path / "x.gguf") is formats.FORMATS["gguf"]
    assert formats.format_of(tmp_path / "x.safetensors") is formats.FORMATS["safetensors"]
    with pytest.raises(WeightsError, match="pickled"):
        formats.format_of(tmp_path / "x.ckpt")


# -- problems found when the checkpoint opens ------------------------------------------------------

def _rewrite_gguf(path: Path, change) -> None:
    reader = gguf.GGUFReader(path)
    tensors = {t.name: (np.array(t.data), t.tensor_type) for t in reader.tensors}
    del reader
    change(tensors)
    path.unlink()
    from gguf_fakes import write_gguf

    write_gguf(path, tensors)


def _no_loads(monkeypatch) -> None:
    """Make any component load fail loudly: the open must refuse before one is attempted."""
    from lingbot_core import handle as handle_mod

    def refuse(*args, **kwargs):
        raise AssertionError("a component loaded before the problem was reported")

    for name in ("load_component", "load_refiner", "load_transformer"):
        monkeypatch.setattr(handle_mod, name, refuse)


@pytest.mark.parametrize("component", DITS)
def test_a_gguf_shape_mismatch_is_refused_at_open(moe_gguf, tmp_path, monkeypatch, component):
    folder = tmp_path / "ckpt"
    shutil.copytree(moe_gguf, folder)
    q8 = gguf.quants.quantize(np.ones((16, 32), np.float32), T.Q8_0)
    _rewrite_gguf(folder / component / "diffusion_pytorch_model.gguf",
                  lambda t: t.__setitem__("blocks.1.attn.to_k.weight", (q8, T.Q8_0)))
    _no_loads(monkeypatch)
    with pytest.raises(CheckpointError, match=rf"{component}: .*blocks.1.attn.to_k.weight: stored \[16, 32\]"):
        PipelineHandle.open(folder, device="cpu")


def test_an_fp8_scale_problem_is_refused_at_open(moe_fp8, tmp_path, monkeypatch):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "ckpt"
    shutil.copytree(moe_fp8, folder)
    path = folder / "refiner" / "diffusion_pytorch_model.safetensors"
    tensors = load_file(str(path))
    tensors["blocks.0.attn.to_v.weight.scale"] = tensors["blocks.0.attn.to_v.weight.scale"].to(torch.float16)
    path.unlink()
    save_file(tensors, str(path))
    _no_loads(monkeypatch)
    with pytest.raises(CheckpointError, match=r"blocks.0.attn.to_v.weight.scale.*is F16 .*expected F32"):
        PipelineHandle.open(folder, device="cpu")
    del tensors["blocks.0.attn.to_v.weight.scale"]
    path.unlink()
    save_file(tensors, str(path))
    with pytest.raises(CheckpointError, match=r"fp8 tensor 'blocks.0.attn.to_v.weight' has no"):
        PipelineHandle.open(folder, device="cpu")


def test_fp8_on_load_of_a_gguf_checkpoint_is_refused_at_open(moe_gguf, monkeypatch):
    _no_loads(monkeypatch)
    with pytest.raises(CheckpointError, match=r"already quantized \(GGUF\)"):
        PipelineHandle.open(moe_gguf, device="cpu", weights="fp8_e4m3")
