"""The converted-weights cache of disk offload: no live file deleted, no stale file served."""

from __future__ import annotations

import gc
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

import lingbot_core
from lingbot_core.handle import PipelineHandle
from lingbot_core.placement.door import configure_offload, stage
from lingbot_core.weights.loader import load_dit
from lingbot_core.weights.state import ModelState


def _inputs():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(1, 16, 3, 8, 8, generator=g), torch.tensor([500.0]), torch.randn(1, 7, 32, generator=g))


def _run(model) -> torch.Tensor:
    with torch.no_grad():
        return model(*_inputs()).sample


def _files(cache: Path) -> list[Path]:
    return sorted((cache / "converted").glob("*.safetensors"))


def _disk(folder: Path, weights: str, dtype: torch.dtype = torch.bfloat16) -> PipelineHandle:
    handle = PipelineHandle.open(folder, device="cpu", dtypes={"transformer": dtype}, weights=weights)
    return configure_offload(handle, "sequential", offload_to="disk")


def _dit_out(handle: PipelineHandle) -> torch.Tensor:
    with stage(handle, "transformer"):
        return _run(handle.component("transformer"))


def test_two_conversions_of_one_checkpoint_on_two_handles_both_keep_streaming(fixtures_root, monkeypatch, tmp_path):
    # an A/B graph: one Loader streams the checkpoint as bf16, another quantizes it to fp8 on load
    monkeypatch.setenv("LINGBOT_TINY_DIR", str(tmp_path))
    folder = fixtures_root / "models" / "tiny-dense"
    a, b = _disk(folder, "auto"), _disk(folder, "fp8_e4m3")
    first_a = _dit_out(a)
    first_b = _dit_out(b)  # writes the second conversion of the same checkpoint
    assert len(_files(tmp_path)) == 2
    assert torch.equal(_dit_out(a), first_a)  # A still streams from its cache file
    assert torch.equal(_dit_out(b), first_b)
    a_files = set(_files(tmp_path))
    del a
    gc.collect()
    c = _disk(folder, "auto", torch.float16)  # a third conversion: A's file is free now, B's is not
    _dit_out(c)
    left = set(_files(tmp_path))
    assert len(left) == 2 and len(left & a_files) == 1  # A's file went, B's stayed
    assert torch.equal(_dit_out(b), first_b)


_CHILD = """
import sys, torch
from lingbot_core.weights.loader import load_dit
from lingbot_core.weights.state import ModelState
state = ModelState()  # holds the disk homes (and their cache-file leases) as long as it lives
dit = load_dit(sys.argv[1], dtype=torch.bfloat16, weights=sys.argv[2], streamed=True, state=state)
print("ready", flush=True)
sys.stdin.readline()
total = sum(float(s.read(torch.device("cpu")).float().sum()) for s in state.spans.values())
print("read", total, flush=True)
"""


def test_processes_sharing_one_cache_keep_their_files(fixtures_root, tmp_path):
    # two processes hold two conversions of one checkpoint; a third conversion in this process evicts neither
    root = str(Path(lingbot_core.__file__).parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]),
           "LINGBOT_TINY_DIR": str(tmp_path)}
    folder = fixtures_root / "models" / "tiny-dense"
    children = [subprocess.Popen([sys.executable, "-c", _CHILD, str(folder), w], cwd=tmp_path, stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
                for w in ("auto", "fp8_e4m3")]
    try:
        for child in children:
            assert child.stdout.readline().strip() == "ready", child.stderr.read()
        os.environ["LINGBOT_TINY_DIR"] = str(tmp_path)
        try:
            mine = ModelState()
            load_dit(folder, dtype=torch.float16, streamed=True, state=mine)
        finally:
            del os.environ["LINGBOT_TINY_DIR"]
        assert len(_files(tmp_path)) == 3
        for child in children:
            out, err = child.communicate("go\n", timeout=120)
            assert child.returncode == 0 and "read" in out, err[-2000:]
        assert mine.spans
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()


def _scale_one_weight(path: Path, factor: float) -> None:
    with open(path, "r+b") as fh:
        n = int.from_bytes(fh.read(8), "little")
        header = json.loads(fh.read(n))
        name = next(k for k, v in header.items() if k != "__metadata__" and len(v["shape"]) == 2 and "blocks" in k)
        assert header[name]["dtype"] == "F32"
        start, end = header[name]["data_offsets"]
        fh.seek(8 + n + start)
        values = np.frombuffer(fh.read(end - start), dtype=np.float32) * factor
        fh.seek(8 + n + start)
        fh.write(values.astype(np.float32).tobytes())


def test_a_checkpoint_replaced_with_cp_p_is_converted_again(fixtures_root, monkeypatch, tmp_path):
    # same path, same size, same mtime (cp -p / rsync -a), other weights: the old conversion must not be served
    monkeypatch.setenv("LINGBOT_TINY_DIR", str(tmp_path / "cache"))
    folder = tmp_path / "ckpt"
    shutil.copytree(fixtures_root / "models" / "tiny-dense", folder)
    weights = folder / "transformer" / "diffusion_pytorch_model.safetensors"
    old = _dit_out(_disk(folder, "auto"))
    other = tmp_path / "other.safetensors"
    shutil.copyfile(weights, other)
    _scale_one_weight(other, 1.5)  # a fine-tune of the same model: same names, shapes, dtypes, size
    st = weights.stat()
    os.utime(other, ns=(st.st_atime_ns, st.st_mtime_ns))
    shutil.copy2(other, weights)  # what cp -p does
    assert weights.stat().st_mtime_ns == st.st_mtime_ns and weights.stat().st_size == st.st_size
    fresh = PipelineHandle.open(folder, device="cpu", dtypes={"transformer": torch.bfloat16})
    expected = _dit_out(fresh)
    assert not torch.equal(expected, old)
    assert torch.equal(_dit_out(_disk(folder, "auto")), expected)
