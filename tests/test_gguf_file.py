"""The bounded GGUF header walk: one malformed file per case, each built byte by byte here, must end in
our own error naming the file and the problem, fast and without allocating what the header claims.
A well-formed file reads exactly as the `gguf` package reads it."""

from __future__ import annotations

import os
import struct
import time
from pathlib import Path

import gguf
import numpy as np
import pytest

from lingbot_core.errors import CheckpointError, WeightsError
from lingbot_core.weights.gguf_file import GGUFError, read_header
from lingbot_core.weights.sources import GGUFSource

T = gguf.GGMLQuantizationType
V = gguf.GGUFValueType


def _u32(n: int) -> bytes:
    return struct.pack("<I", n)


def _u64(n: int) -> bytes:
    return struct.pack("<Q", n)


def _str(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return _u64(len(raw)) + raw


def _kv(key: str, vtype: int, payload: bytes) -> bytes:
    return _str(key) + _u32(vtype) + payload


def _info(name: str, dims: tuple[int, ...], qtype: int, offset: int) -> bytes:
    return _str(name) + _u32(len(dims)) + b"".join(_u64(d) for d in dims) + _u32(qtype) + _u64(offset)


def _gguf(kvs=(), infos=(), data=b"", *, version=3, magic=b"GGUF", alignment=32, n_tensors=None, n_kv=None) -> bytes:
    head = (magic + _u32(version) + _u64(len(infos) if n_tensors is None else n_tensors)
            + _u64(len(kvs) if n_kv is None else n_kv) + b"".join(kvs) + b"".join(infos))
    return head + bytes(-len(head) % alignment) + data


def _f32(rows: int, cols: int, seed: int) -> bytes:
    return np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32).tobytes()


def _good(**kw) -> bytes:
    """Two F32 [2, 8] tensors (64 bytes each, contiguous at 32-byte alignment) and some metadata."""
    kvs = [_kv("general.architecture", V.STRING, _str("lingbot_video")),
           _kv("comfy.gguf.orig_shape.b", V.ARRAY, _u32(V.INT32) + _u64(3) + struct.pack("<3i", 2, 2, 4))]
    infos = [_info("a", (8, 2), T.F32, 0), _info("b", (8, 2), T.F32, 64)]
    return _gguf(kvs, infos, _f32(2, 8, 0) + _f32(2, 8, 1), **kw)


def _write(tmp_path: Path, raw: bytes, name: str = "x.gguf") -> Path:
    path = tmp_path / name
    path.write_bytes(raw)
    return path


def _refused(path: Path, match: str) -> GGUFError:
    start = time.perf_counter()
    with pytest.raises(GGUFError, match=match) as err:
        read_header(path)
    assert time.perf_counter() - start < 5.0  # microseconds of work; generous for a loaded machine
    assert str(path) in str(err.value)
    assert isinstance(err.value, WeightsError) and isinstance(err.value, CheckpointError)
    return err.value


def test_a_well_formed_file_reads_as_the_gguf_package_reads_it(tmp_path):
    path = _write(tmp_path, _good())
    header = read_header(path)
    reader = gguf.GGUFReader(path)
    assert list(header.tensors) == [t.name for t in reader.tensors]
    for t in reader.tensors:
        ours = header.tensors[t.name]
        assert (ours.offset, ours.nbytes, ours.qtype) == (t.data_offset, t.n_bytes, int(t.tensor_type))
        assert ours.shape == tuple(reversed(t.shape.tolist()))
    assert header.architecture == "lingbot_video" and header.orig_shape("b") == (2, 2, 4)
    assert header.orig_shape("a") is None


def test_metadata_of_every_value_type_matches_the_gguf_reader(tmp_path):
    path = tmp_path / "w.gguf"
    writer = gguf.GGUFWriter(path, arch="lingbot_video")
    writer.add_uint8("k.u8", 7)
    writer.add_int16("k.i16", -3)
    writer.add_uint64("k.u64", 2**40)
    writer.add_float32("k.f32", 0.5)
    writer.add_float64("k.f64", -1.25)
    writer.add_bool("k.bool", True)
    writer.add_string("k.str", "héllo 你好")
    writer.add_array("k.ints", [1, 2, 3])
    writer.add_array("k.strs", ["a", "", "ccc"])
    writer.add_array("k.nested", [[1, 2], [3]])
    writer.add_custom_alignment(64)
    writer.add_tensor("w", np.arange(64, dtype=np.float32).reshape(2, 32), raw_dtype=T.F32)
    writer.add_tensor("v", np.arange(96, dtype=np.float32).reshape(3, 32), raw_dtype=T.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    header = read_header(path)
    reader = gguf.GGUFReader(path)
    assert header.alignment == 64 and header.data_start == reader.data_offset
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        ours = header.metadata[key]
        if key == "k.nested":  # the reader flattens nested arrays; we keep their structure
            assert [x.tolist() for x in ours] == [[1, 2], [3]]
            continue
        theirs = field.contents()
        assert (ours.tolist() if isinstance(ours, np.ndarray) else ours) == theirs, key
    assert [(t.offset, t.nbytes) for t in header.tensors.values()] == [(t.data_offset, t.n_bytes)
                                                                        for t in reader.tensors]


def test_a_tiny_file_claiming_2_to_the_62_array_entries_fails_at_once(tmp_path):
    raw = _gguf([_kv("k", V.ARRAY, _u32(V.UINT8) + _u64(2**62))], alignment=1)
    assert len(raw) == 49  # nothing after the count
    _refused(_write(tmp_path, raw), r"metadata 'k' \(array\) claims 4611686018427387904 entries \(0 bytes left\)")


def test_a_4_mb_metadata_array_reads_in_seconds_not_minutes(tmp_path):
    # gguf.GGUFReader: about 115 s and 1.45 GB for such an array (bench/gguf_header.py measures both)
    n = 1 << 20
    raw = _gguf([_kv("big", V.ARRAY, _u32(V.UINT32) + _u64(n) + np.arange(n, dtype="<u4").tobytes()),
                 _kv("names", V.ARRAY, _u32(V.STRING) + _u64(50_000) + _str("tok") * 50_000)])
    path = _write(tmp_path, raw)
    start = time.perf_counter()
    header = read_header(path)
    assert time.perf_counter() - start < 5.0  # ~0.1 s on an idle core
    assert header.metadata["big"].shape == (n,) and int(header.metadata["big"][-1]) == n - 1
    assert len(header.metadata["names"]) == 50_000


@pytest.mark.parametrize("cut", [0, 3, 10, 23, 40, 100])
def test_a_truncated_header_is_refused(tmp_path, cut):
    _refused(_write(tmp_path, _good()[:cut]), "truncated")


@pytest.mark.parametrize("magic,version,match", [
    (b"GGUG", 3, r"bad magic b'GGUG'"),
    (b"GGUF", 1, r"unsupported version 1"),
    (b"GGUF", 7, r"unsupported version 7"),
    (b"GGUF", 3 << 24, r"big-endian"),
], ids=["magic", "v1", "v7", "big-endian"])
def test_bad_magic_and_version_are_refused(tmp_path, magic, version, match):
    _refused(_write(tmp_path, _good(magic=magic, version=version)), match)


def test_an_unknown_value_type_is_refused(tmp_path):
    _refused(_write(tmp_path, _gguf([_kv("k", 13, _u32(0))])), r"metadata 'k' has unknown value type 13")
    _refused(_write(tmp_path, _gguf([_kv("k", V.ARRAY, _u32(99) + _u64(1))])), r"array of unknown value type 99")


def test_nesting_abuse_is_refused(tmp_path):
    deep = _u32(V.ARRAY) + _u64(1)  # an array holding one array, 10,000 levels deep
    raw = _gguf([_kv("k", V.ARRAY, deep * 10_000 + _u32(V.UINT8) + _u64(0))])
    _refused(_write(tmp_path, raw), r"nests arrays deeper than 3 levels")


@pytest.mark.parametrize("n_kv,n_tensors,match", [
    (2**63, 0, r"metadata claims 9223372036854775808 entries"),
    (0, 2**40, r"tensor count claims 1099511627776 tensors"),
], ids=["kv-count", "tensor-count"])
def test_counts_beyond_the_file_are_refused(tmp_path, n_kv, n_tensors, match):
    _refused(_write(tmp_path, _gguf(n_kv=n_kv, n_tensors=n_tensors)), match)


def test_a_huge_string_length_is_refused(tmp_path):
    raw = _gguf([_kv("k", V.STRING, _u64(2**60) + b"abc")])
    _refused(_write(tmp_path, raw), r"truncated .*metadata 'k' needs 1152921504606846976 bytes")
    in_array = _gguf([_kv("k", V.ARRAY, _u32(V.STRING) + _u64(2) + _str("a") + _u64(2**40) + b"abc")])
    _refused(_write(tmp_path, in_array), r"truncated .*metadata 'k' entry 1 needs 1099511627776 bytes")
    not_utf8 = _gguf([_kv("k", V.ARRAY, _u32(V.STRING) + _u64(1) + _str(b"\xc3"))])
    _refused(_write(tmp_path, not_utf8), r"metadata 'k' entry 0 at byte \d+ is not UTF-8")


def test_duplicate_keys_and_tensors_are_refused(tmp_path):
    kv = _kv("k", V.UINT8, b"\x01")
    _refused(_write(tmp_path, _gguf([kv, kv])), r"metadata key 'k' appears twice")
    infos = [_info("a", (8,), T.F32, 0), _info("a", (8,), T.F32, 32)]
    _refused(_write(tmp_path, _gguf(infos=infos, data=bytes(64))), r"tensor 'a' appears twice")


def test_an_unknown_tensor_type_is_refused(tmp_path):
    raw = _gguf(infos=[_info("w", (32,), 4, 0)], data=bytes(32))  # 4: Q4_2, long gone from ggml
    _refused(_write(tmp_path, raw), r"tensor 'w' has unknown tensor type 4")


@pytest.mark.parametrize("dims,match", [
    ((2**32, 2**32, 2**32), r"sizes \[4294967296, 4294967296, 4294967296\]"),
    ((8, 0), r"sizes \[8, 0\]"),
    ((1, 1, 1, 1, 1), r"has 5 dimensions \(at most 4\)"),
], ids=["huge", "zero", "five-dims"])
def test_bad_dimensions_are_refused(tmp_path, dims, match):
    _refused(_write(tmp_path, _gguf(infos=[_info("w", dims, T.F32, 0)], data=bytes(32))), match)


def test_n_dims_beyond_the_file_is_refused_without_reading_it(tmp_path):
    raw = _gguf(infos=[_str("w") + _u32(2**31)])
    _refused(_write(tmp_path, raw), r"tensor 'w' has 2147483648 dimensions")


def test_a_row_that_is_not_whole_blocks_is_refused(tmp_path):
    raw = _gguf(infos=[_info("w", (48, 2), T.Q8_0, 0)], data=bytes(128))
    _refused(_write(tmp_path, raw), r"tensor 'w': a Q8_0 row holds a multiple of 32 values, not 48")


def test_overlapping_tensors_are_refused(tmp_path):
    infos = [_info("a", (8, 2), T.F32, 0), _info("b", (8, 2), T.F32, 32)]
    _refused(_write(tmp_path, _gguf(infos=infos, data=bytes(128))), r"'b' .* inside 'a' .*tensors overlap")


def test_a_misaligned_offset_is_refused(tmp_path):
    infos = [_info("a", (4,), T.F32, 0), _info("b", (4,), T.F32, 16)]
    _refused(_write(tmp_path, _gguf(infos=infos, data=bytes(64))), r"data offset 16, not a multiple of .* 32")


def test_general_alignment_is_respected_and_checked(tmp_path):
    align = [_kv("general.alignment", V.UINT32, _u32(64))]
    good = _gguf(align, [_info("a", (4,), T.F32, 0), _info("b", (4,), T.F32, 64)], bytes(128), alignment=64)
    header = read_header(_write(tmp_path, good))
    assert header.alignment == 64 and header.data_start % 64 == 0
    assert header.tensors["b"].offset == header.data_start + 64
    packed = _gguf(align, [_info("a", (4,), T.F32, 0), _info("b", (4,), T.F32, 32)], bytes(96), alignment=64)
    _refused(_write(tmp_path, packed), r"data offset 32, not a multiple of the alignment 64")
    for bad in (_u32(0), _u32(48)):
        raw = _gguf([_kv("general.alignment", V.UINT32, bad)], alignment=1)
        _refused(_write(tmp_path, raw), r"general.alignment is (0|48)")


def test_a_declared_type_that_does_not_match_the_bytes_is_refused(tmp_path):
    # 'a' is declared Q4_0 [64, 2] (72 bytes, 96 with padding) but holds Q8_0 bytes (136): 'b' starts at 160
    infos = [_info("a", (64, 2), T.Q4_0, 0), _info("b", (8,), T.F32, 160)]
    raw = _gguf(infos=infos, data=bytes(192))
    _refused(_write(tmp_path, raw), r"'b' .* starts at data offset 160, but 96 is where it belongs after 'a'.*"
                                    r"does not match")
    last = _gguf(infos=[_info("a", (64, 2), T.Q4_0, 0)], data=bytes(160))
    _refused(_write(tmp_path, last), r"64 bytes follow the last tensor 'a'")


def test_a_tensor_running_past_the_end_is_refused(tmp_path):
    raw = _good()[:-20]
    _refused(_write(tmp_path, raw), r"tensor 'b' .*runs past the end of the file")


def test_non_utf8_names_are_refused(tmp_path):
    _refused(_write(tmp_path, _gguf([_str(b"\xff\xfe") + _u32(V.UINT8) + b"\x00"])), r"not UTF-8")


def test_a_bad_orig_shape_record_is_refused(tmp_path):
    kvs = [_kv("comfy.gguf.orig_shape.a", V.ARRAY, _u32(V.INT32) + _u64(2) + struct.pack("<2i", 3, 5))]
    header = read_header(_write(tmp_path, _gguf(kvs, [_info("a", (8, 2), T.F32, 0)], bytes(64))))
    with pytest.raises(GGUFError, match=r"orig_shape.a = \[3, 5\] is not a shape of that tensor .*16 values"):
        header.orig_shape("a")


def test_a_directory_fifo_and_device_are_refused_without_blocking(tmp_path):
    folder = tmp_path / "dir.gguf"
    folder.mkdir()
    _refused(folder, r"is a directory")
    fifo = tmp_path / "fifo.gguf"
    os.mkfifo(fifo)
    _refused(fifo, r"is a FIFO")  # never opened: opening a FIFO with no writer blocks
    link = tmp_path / "zero.gguf"
    link.symlink_to("/dev/zero")
    _refused(link, r"is a device")
    _refused(tmp_path / "missing.gguf", r"does not exist")


def test_the_gguf_source_reports_a_malformed_file_as_a_weights_error(tmp_path):
    path = _write(tmp_path, _good()[:-20])
    with pytest.raises(WeightsError, match=r"runs past the end"):
        GGUFSource(path)
    source = GGUFSource(_write(tmp_path, _good(), "ok.gguf"))
    assert source.entries["b"].shape == (2, 2, 4)  # from comfy.gguf.orig_shape
    expected = np.frombuffer(_f32(2, 8, 1), dtype=np.float32).reshape(2, 2, 4)
    np.testing.assert_array_equal(source.plain("b").numpy(), expected)
    assert source.packed("a").tolist() == np.frombuffer(_f32(2, 8, 0), np.uint8).reshape(2, 32).tolist()


def test_a_recorded_shape_that_splits_blocks_is_decoded_whole(tmp_path):
    """Issue 34 item 12: ComfyUI-GGUF packs a tensor whose rows are not whole blocks (Q8_0 [4, 16]) as
    whole-block rows ([2, 32]) and records the shape; it is decoded at load, as ComfyUI-GGUF does."""
    kvs = [_kv("comfy.gguf.orig_shape.w", V.ARRAY, _u32(V.INT32) + _u64(2) + struct.pack("<2i", 4, 16))]
    values = np.arange(-32, 32, dtype=np.int8)
    blocks = b"".join(np.float16(0.5).tobytes() + values[i * 32:(i + 1) * 32].tobytes() for i in range(2))
    raw = _gguf(kvs, [_info("w", (32, 2), T.Q8_0, 0)], blocks + bytes(28))
    source = GGUFSource(_write(tmp_path, raw))
    entry = source.entries["w"]
    assert entry.shape == (4, 16) and entry.kind == "plain" and not entry.quantized
    expected = (values.astype(np.float32) * 0.5).reshape(4, 16)
    np.testing.assert_array_equal(source.plain("w").numpy(), expected)


# -- fuzz: mutated headers end in our error or load and decode --------------------------------------

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

INTERESTING = [0, 1, 2, 3, 4, 7, 8, 9, 12, 13, 31, 32, 33, 64, 255, 256, 2**16, 2**31 - 1, 2**31, 2**32 - 1,
               2**32, 2**40, 2**62, 2**63, 2**64 - 1]


def _seed_file() -> bytes:
    """A small file with every value type, a quantized and a K-block tensor, a per-expert stack and an
    orig_shape record: most fields a mutation can hit are ones the walk must bound."""
    kvs = [_kv("general.architecture", V.STRING, _str("lingbot_video")),
           _kv("k.f", V.FLOAT32, struct.pack("<f", 0.5)), _kv("k.b", V.BOOL, b"\x01"),
           _kv("k.strs", V.ARRAY, _u32(V.STRING) + _u64(2) + _str("ab") + _str("")),
           _kv("k.nested", V.ARRAY, _u32(V.ARRAY) + _u64(1) + _u32(V.UINT16) + _u64(2) + bytes(4)),
           _kv("comfy.gguf.orig_shape.p", V.ARRAY, _u32(V.INT32) + _u64(3) + struct.pack("<3i", 2, 2, 8))]
    q8 = gguf.GGML_QUANT_SIZES[T.Q8_0][1]
    infos = [_info("p", (16, 2), T.F32, 0), _info("q", (32, 2), T.Q8_0, 128),
             _info("blocks.0.ffn.experts.w1.0", (32, 1), T.F16, 224), _info("blocks.0.ffn.experts.w1.1", (32, 1),
                                                                            T.F16, 288),
             _info("k", (256, 1), T.Q4_K, 352)]
    data = (_f32(2, 16, 2) + bytes(2 * q8) + bytes(-2 * q8 % 32) + bytes(64) + bytes(64)
            + bytes(gguf.GGML_QUANT_SIZES[T.Q4_K][1]))
    return _gguf(kvs, infos, data + bytes(-len(data) % 32))


SEED = _seed_file()
HEADER_END = len(SEED) - 512  # the tensor data is the last 512 bytes

mutation = st.tuples(st.sampled_from(["u64", "u32", "byte", "cut", "insert", "delete"]),
                     st.integers(0, HEADER_END + 40), st.sampled_from(INTERESTING), st.integers(0, 255))


def _mutate(raw: bytes, steps) -> bytes:
    out = bytearray(raw)
    for kind, at, value, byte in steps:
        at = min(at, len(out))
        if kind == "u64":
            out[at:at + 8] = struct.pack("<Q", value % 2**64)
        elif kind == "u32":
            out[at:at + 4] = struct.pack("<I", value % 2**32)
        elif kind == "byte":
            out[at:at + 1] = bytes([byte])
        elif kind == "cut":
            del out[at:]
        elif kind == "insert":
            out[at:at] = bytes([byte]) * (value % 24)
        else:
            del out[at:at + 1 + value % 24]
    return bytes(out)


def _load_everything(path: Path) -> None:
    """Open the file as the loader does and decode every tensor: only WeightsError may stop it."""
    try:
        source = GGUFSource(path)
    except WeightsError:
        return
    for key, entry in source.entries.items():
        source.plain(key)
        if not entry.parts:
            source.packed(key)


def test_the_fuzz_seed_loads(tmp_path):
    source = GGUFSource(_write(tmp_path, SEED))
    assert source.entries["blocks.0.ffn.experts.w1"].shape == (2, 1, 32)
    assert source.entries["p"].shape == (2, 2, 8)
    _load_everything(tmp_path / "x.gguf")


@pytest.fixture(scope="module")
def fuzz_file(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gguf-fuzz") / "f.gguf"


@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(steps=st.lists(mutation, min_size=1, max_size=4))
def test_mutated_headers_end_in_our_error_or_load(fuzz_file, steps):
    fuzz_file.write_bytes(_mutate(SEED, steps))
    start = time.perf_counter()
    _load_everything(fuzz_file)
    assert time.perf_counter() - start < 5.0  # milliseconds on an idle core; generous for a loaded one


@pytest.mark.parametrize("engine", ["random", "hypothesis"])
def test_the_fuzz_bench_runs_and_counts_no_escapes(tmp_path, engine):
    from bench import fuzz_gguf

    result = fuzz_gguf.main(["--cases", "40", "--seed", "3", "--engine", engine, "--json", str(tmp_path / "r.json")])
    assert sum(result["outcomes"].values()) == 40
    assert result["escapes"] == {}, result["escape_examples"]
