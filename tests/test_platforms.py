"""The pack on a platform without POSIX's positional file calls (Windows): no `os.pread`, `os.preadv`,
`os.pwrite`, no flags for `mmap`, no `fcntl`. This machine is Linux, so the fixture takes those away and
the weights readers, disk streaming, the converted-weights cache and the jobs manifest must still give
exactly what they give here with them."""

from __future__ import annotations

import ast
import mmap
import os
import random
import threading
from pathlib import Path

import pytest
import torch

from lingbot_core.handle import PipelineHandle
from lingbot_core.placement.door import configure_offload, stage
from lingbot_core.weights import converted, disk, fileio

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def windows_like(monkeypatch):
    for name in ("pread", "preadv", "pwrite"):
        monkeypatch.delattr(os, name, raising=False)
    for name in ("MAP_ANONYMOUS", "MAP_PRIVATE"):
        monkeypatch.delattr(mmap, name, raising=False)
    monkeypatch.setattr(converted, "fcntl", None)  # converted.py's import found none


def _dit_out(handle: PipelineHandle) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    inputs = (torch.randn(1, 16, 3, 8, 8, generator=g), torch.tensor([500.0]), torch.randn(1, 7, 32, generator=g))
    with stage(handle, "transformer"), torch.no_grad():
        return handle.component("transformer")(*inputs).sample


def _state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def test_checkpoints_load_the_same_without_positional_reads(fixtures_root, windows_like, monkeypatch):
    folder = fixtures_root / "models" / "tiny-dense"
    names = ("transformer", "vae", "text_encoder")
    handle = PipelineHandle.open(folder, device="cpu")
    got = {name: _state(handle.component(name)) for name in names}
    monkeypatch.undo()
    assert hasattr(os, "pread")  # the reference is read the POSIX way
    reference = PipelineHandle.open(folder, device="cpu")
    for name in names:
        want = _state(reference.component(name))
        assert got[name].keys() == want.keys()
        assert all(torch.equal(got[name][k], want[k]) for k in want), name


def test_a_gguf_header_reads_the_same_without_positional_reads(tmp_path, windows_like, monkeypatch):
    import numpy as np
    from gguf import GGMLQuantizationType as T
    from gguf_fakes import write_gguf

    from lingbot_core.weights import gguf_file

    path = tmp_path / "dit.gguf"
    write_gguf(path, {f"blocks.{i}.w": (np.full((4, 32), i, dtype=np.float32), T.F32) for i in range(40)})
    got = gguf_file.read_header(path)
    monkeypatch.undo()
    want = gguf_file.read_header(path)
    assert got.tensors == want.tensors and got.metadata == want.metadata and len(got.tensors) == 40


def test_the_jobs_manifest_and_claims_work_without_positional_calls(tmp_path, windows_like):
    from lingbot_nodes.jobs import Claims, Manifest, read_jobs

    jobs_file = tmp_path / "jobs.jsonl"
    jobs_file.write_text("".join(f'{{"id": "j{i}", "seed": {i}}}\n' for i in range(2)), encoding="utf-8")
    jobs = read_jobs(jobs_file)
    manifest = Manifest(tmp_path / "m.jsonl")
    manifest.write_path.parent.mkdir(parents=True, exist_ok=True)
    manifest.write_path.write_bytes(b'{"id": "torn"')  # a line a killed run left unfinished
    manifest.record({"id": "j0", "status": "done", "digest": jobs[0].digest})
    assert manifest.done() == {"j0"}  # on a line of its own after the torn one
    claims = Claims(manifest.claims_folder)
    assert claims.take(jobs[1]) == (True, False)
    note = next(manifest.claims_folder.glob("j1.*.claim")).read_text(encoding="utf-8")
    assert '"id": "j1"' in note and note.endswith("\n")


def test_reads_at_an_offset_from_several_threads_keep_their_own_offsets(tmp_path, windows_like):
    """The fallback seeks and reads under a lock per descriptor: threads sharing one descriptor (disk
    streaming's prefetch beside the forward) never read at another's offset."""
    data = bytes(random.Random(0).randrange(256) for _ in range(1 << 16))
    path = tmp_path / "blob.bin"
    path.write_bytes(data)
    fd, _info = fileio.open_regular(path)
    failures = []

    def reader(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(300):
            offset, n = rng.randrange(len(data) - 64), rng.randrange(1, 64)
            if rng.random() < 0.5:
                got = fileio.read_at(fd, n, offset)
            else:
                buffer = bytearray(n)
                got = bytes(buffer[:fileio.readinto_at(fd, memoryview(buffer), offset)])
            if got != data[offset:offset + n]:
                failures.append((offset, n))

    try:
        threads = [threading.Thread(target=reader, args=(seed,)) for seed in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        os.close(fd)
    assert not failures
    assert fileio.read_at(os.open(path, os.O_RDONLY | fileio.BINARY), 4, len(data) - 2) == data[-2:]  # the end


def test_every_descriptor_of_ours_is_opened_binary():
    """Windows opens a descriptor in text mode unless told otherwise (line ends rewritten, a Ctrl-Z byte
    read as the end): every `os.open` in the product passes `fileio.BINARY` (or is `open_regular`'s)."""
    calls = []
    for path in [*ROOT.joinpath("lingbot_core").rglob("*.py"), *ROOT.joinpath("nodes").rglob("*.py")]:
        source = path.read_text(encoding="utf-8")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "os.open":
                calls.append((path.relative_to(ROOT).as_posix(), ast.unparse(node.args[1]) if len(node.args) > 1 else ""))
    assert len(calls) >= 5  # the calls were found
    missing = [(path, args) for path, args in calls if "BINARY" not in args and "_FLAGS" not in args]
    assert not missing, f"open these with fileio.BINARY: {missing}"
    assert fileio.BINARY & getattr(os, "O_BINARY", 0) == getattr(os, "O_BINARY", 0)


def test_disk_streaming_reads_into_memory_of_its_own_without_mmap_flags(fixtures_root, windows_like, monkeypatch):
    monkeypatch.setattr(disk, "_TRANSIENT_MIN", 0)  # every streamed tensor into an anonymous mapping
    mapped = []
    real = mmap.mmap

    def counting(*args, **kwargs):
        assert "flags" not in kwargs  # Windows' mmap takes none
        mapped.append(args[1])
        return real(*args, **kwargs)

    monkeypatch.setattr(mmap, "mmap", counting)
    folder = fixtures_root / "models" / "tiny-dense"
    streamed = configure_offload(PipelineHandle.open(folder, device="cpu"), "sequential", offload_to="disk")
    out = _dit_out(streamed)
    assert mapped  # the streamed weights came through the fallback
    monkeypatch.undo()
    assert torch.equal(out, _dit_out(PipelineHandle.open(folder, device="cpu")))


def test_a_converted_cache_is_used_where_an_open_file_cannot_be_removed(fixtures_root, windows_like, monkeypatch,
                                                                         tmp_path):
    """Windows refuses to remove a file that is open: the written cache's temporary name (the lease holds the
    file open) stays, and the run goes on streaming from the cache."""
    monkeypatch.setenv("LINGBOT_TINY_DIR", str(tmp_path))
    real_unlink = Path.unlink

    def open_files_stay(self, missing_ok=False):
        if ".tmp-" in self.name:
            raise PermissionError(32, "The process cannot access the file because it is being used by another process")
        return real_unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", open_files_stay)
    folder = fixtures_root / "models" / "tiny-dense"

    def streamed():
        handle = PipelineHandle.open(folder, device="cpu", dtypes={"transformer": torch.bfloat16}, weights="fp8_e4m3")
        return configure_offload(handle, "sequential", offload_to="disk")

    out = _dit_out(streamed())
    assert sorted(p.name for p in (tmp_path / "converted").glob("*.safetensors"))  # written, and used below
    assert torch.equal(_dit_out(streamed()), out)
