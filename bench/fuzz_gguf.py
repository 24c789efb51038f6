"""Fuzz GGUF headers: thousands of mutated files, opened and decoded as the DiT loader does.

    python -m bench.fuzz_gguf [--cases 5000] [--seed 0] [--engine random|hypothesis] [--baseline]
                              [--keep DIR] [--json OUT]

Seed files are written with the `gguf` package (every metadata value type, nested and string
arrays, `general.alignment` 64, a `comfy.gguf.orig_shape` record, a per-expert stack, F32/F16/BF16,
Q8_0, Q4_K, Q3_K, Q2_K, IQ4_NL and IQ4_XS tensors). Each case applies 1-4 random mutations, mostly
inside the header: a uint32/uint64 field overwritten with a boundary value (0, 1, 2^31, 2^62, 2^64-1,
...), a byte changed, bytes inserted, deleted or copied from elsewhere, the file cut. The case then
goes through `GGUFSource` (the bounded header walk) and, when accepted, every tensor is decoded and
read as stored. Outcomes are counted: read, refused with our error (`GGUFError`, other
`WeightsError`), or ESCAPED (any other exception: the count that must stay 0), plus cases over one
second (a hang guard: SIGALRM after 10 s counts as an escape). `--keep` saves every escaping file.
`--baseline` also opens each case the way `GGUFSource` did before (`gguf.GGUFReader`), counting its
escapes by exception (`_Hang`: no answer within `--baseline-alarm` seconds).
"""

from __future__ import annotations

import os
import random
import resource
import signal
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np

from bench._common import fuzz_parser, fuzz_report, keep_case

INTERESTING = [0, 1, 2, 3, 4, 5, 7, 8, 9, 12, 13, 16, 24, 31, 32, 33, 63, 64, 255, 256, 4096, 2**16, 2**31 - 1,
               2**31, 2**32 - 1, 2**32, 2**40, 2**62, 2**63, 2**64 - 1]


def seed_files(folder: Path) -> list[bytes]:
    """Two seeds: the broad file described in the module docstring, and a minimal one (two tensors)."""
    import gguf

    from lingbot_core.weights import gguf_codec

    T = gguf.GGMLQuantizationType
    rng = np.random.default_rng(0)
    broad = folder / "broad.gguf"
    writer = gguf.GGUFWriter(broad, arch="lingbot_video")
    writer.add_custom_alignment(64)
    writer.add_uint8("k.u8", 3)
    writer.add_int64("k.i64", -5)
    writer.add_float64("k.f64", 0.25)
    writer.add_bool("k.bool", False)
    writer.add_string("k.str", "ab\u00e9")
    writer.add_array("k.strs", ["x", "", "yz"])
    writer.add_array("k.floats", [0.5, 1.5])
    writer.add_array("k.nested", [[1, 2], [3, 4]])
    writer.add_array("comfy.gguf.orig_shape.plain", [2, 2, 16])
    writer.add_tensor("plain", rng.standard_normal((2, 32)).astype(np.float32), raw_dtype=T.F32)
    writer.add_tensor("half", rng.standard_normal((2, 32)).astype(np.float16), raw_dtype=T.F16)
    for e in range(2):
        writer.add_tensor(f"blocks.0.ffn.experts.w1.{e}", rng.standard_normal((2, 32)).astype(np.float32),
                          raw_dtype=T.F32)
    for qtype in (T.BF16, T.Q8_0, T.Q4_K, T.Q3_K, T.Q2_K, T.IQ4_NL, T.IQ4_XS):
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, size=(2, 32 // block * size if block == 1 else size), dtype=np.uint8)
        for at in gguf_codec.half_fields(int(qtype)) if block > 1 else ():
            raw[:, at + 1] &= 0x3B
        writer.add_tensor(f"t.{qtype.name}", raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    small = folder / "small.gguf"
    writer = gguf.GGUFWriter(small, arch="x")
    writer.add_tensor("a", np.ones((1, 8), np.float32), raw_dtype=T.F32)
    writer.add_tensor("b", np.ones((2, 8), np.float32), raw_dtype=T.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return [broad.read_bytes(), small.read_bytes()]


def header_end(raw: bytes) -> int:
    from lingbot_core.weights.gguf_file import read_header

    with tempfile.NamedTemporaryFile(suffix=".gguf") as fh:
        fh.write(raw)
        fh.flush()
        return read_header(fh.name).data_start


def mutate(raw: bytes, end: int, rnd: random.Random) -> bytes:
    out = bytearray(raw)
    for _ in range(rnd.randint(1, 4)):
        at = rnd.randrange(0, end + 64) if rnd.random() < 0.9 else rnd.randrange(0, len(out) + 1)
        at = min(at, len(out))
        kind = rnd.choice(["u64", "u64", "u32", "u32", "byte", "insert", "delete", "copy", "cut"])
        value = rnd.choice(INTERESTING) if rnd.random() < 0.8 else rnd.getrandbits(64)
        if kind == "u64":
            out[at:at + 8] = (value % 2**64).to_bytes(8, "little")
        elif kind == "u32":
            out[at:at + 4] = (value % 2**32).to_bytes(4, "little")
        elif kind == "byte":
            out[at:at + 1] = bytes([rnd.randrange(256)])
        elif kind == "insert":
            out[at:at] = bytes(rnd.randrange(256) for _ in range(rnd.randint(1, 24)))
        elif kind == "delete":
            del out[at:at + rnd.randint(1, 24)]
        elif kind == "copy":
            src = rnd.randrange(0, max(1, len(out)))
            out[at:at] = out[src:src + rnd.randint(1, 48)]
        else:
            del out[at:]
    return bytes(out)


class _Hang(Exception):
    pass


def _alarm(signum, frame):
    raise _Hang("no answer within the alarm")


def load_everything(path: Path) -> str:
    """What the loader does with a file: open the source, decode and read every tensor. The outcome."""
    from lingbot_core.errors import WeightsError
    from lingbot_core.weights.gguf_file import GGUFError
    from lingbot_core.weights.sources import GGUFSource

    try:
        source = GGUFSource(path)
    except GGUFError:
        return "refused: GGUFError"
    except WeightsError:
        return "refused: WeightsError"
    try:
        for key, entry in source.entries.items():
            source.plain(key)
            if not entry.parts:
                source.packed(key)
    except WeightsError:
        return "refused while decoding: WeightsError"
    return "read"


def old_open(path: Path) -> str:
    """The baseline: what GGUFSource did before the bounded walk (gguf.GGUFReader, ValueError/OSError
    turned into our error, then the tensor list and orig_shape records read)."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path, mode="c")
    except (ValueError, OSError):
        return "refused"
    for t in reader.tensors:
        int(t.tensor_type)
        tuple(int(n) for n in reversed(t.shape.tolist()))
        field = reader.fields.get(f"comfy.gguf.orig_shape.{t.name}")
        if field is not None:
            tuple(int(field.parts[i][0]) for i in field.data)
    return "read"


def _outcome(fn, path: Path, limit: int) -> tuple[str, str | None, str]:
    """(outcome, escaping exception name or None, its message) of `fn(path)` under a `limit` s alarm."""
    signal.alarm(limit)
    try:
        return fn(path), None, ""
    except KeyboardInterrupt:
        raise
    except BaseException as err:  # anything but our own error is what this bench counts
        return "ESCAPED", type(err).__name__, str(err)[:200]
    finally:
        signal.alarm(0)


def _cases(engine: str, n: int, seed: int, seeds: list[bytes], ends: list[int]):
    """`n` mutated files: drawn by a seeded `random.Random`, or by hypothesis (which biases its draws
    toward boundaries and repeats; the cases are collected first, then all are run the same way)."""
    if engine == "random":
        rnd = random.Random(seed)
        for _ in range(n):
            pick = rnd.randrange(len(seeds))
            yield mutate(seeds[pick], ends[pick], rnd)
        return
    from hypothesis import HealthCheck, given, settings
    from hypothesis import seed as fixed_seed
    from hypothesis import strategies as st

    drawn: list[bytes] = []

    @fixed_seed(seed)
    @settings(max_examples=n, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(pick=st.integers(0, len(seeds) - 1), rnd=st.randoms(use_true_random=False))
    def collect(pick: int, rnd: random.Random) -> None:
        drawn.append(mutate(seeds[pick], ends[pick], rnd))

    collect()
    yield from drawn


def main(argv: list[str] | None = None) -> dict:
    ap = fuzz_parser(__doc__, cases=5000, keep=True)
    ap.add_argument("--baseline", action="store_true", help="also open every case as GGUFSource did before "
                    "(gguf.GGUFReader), counting what escapes (a hang: _Hang after --baseline-alarm s)")
    ap.add_argument("--baseline-alarm", type=int, default=2)
    ap.add_argument("--engine", choices=["random", "hypothesis"], default="random",
                    help="who draws the mutations: a seeded random.Random, or hypothesis (seeded, no database)")
    args = ap.parse_args(argv)
    baseline: Counter[str] = Counter()
    outcomes: Counter[str] = Counter()
    escapes: Counter[str] = Counter()
    examples: dict[str, str] = {}
    slow, slowest = 0, 0.0
    signal.signal(signal.SIGALRM, _alarm)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        seeds = seed_files(Path(tmp))
        ends = [header_end(s) for s in seeds]
        path = Path(tmp) / "case.gguf"
        for i, raw in enumerate(_cases(args.engine, args.cases, args.seed, seeds, ends)):
            path.write_bytes(raw)
            start = time.perf_counter()
            outcome, escaped, message = _outcome(load_everything, path, 10)
            if escaped:
                escapes[escaped] += 1
                examples.setdefault(escaped, f"case {i}: {message}")
                keep_case(args.keep, f"escape-{i}-{escaped}.gguf", raw)
            took = time.perf_counter() - start
            slow += took > 1.0
            slowest = max(slowest, took)
            outcomes[outcome] += 1
            if args.baseline:
                outcome, escaped, _ = _outcome(old_open, path, args.baseline_alarm)
                baseline[escaped or outcome] += 1
    result = {"cases": args.cases, "engine": args.engine, "seed": args.seed, "outcomes": dict(outcomes), "escapes": dict(escapes),
              "escape_examples": examples, "over_1s": slow, "slowest_s": round(slowest, 4),
              "total_s": round(time.perf_counter() - started, 1),
              "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
              "load_average": os.getloadavg(), **({"baseline_gguf_reader": dict(baseline)} if args.baseline else {})}
    return fuzz_report(result, args.json)


if __name__ == "__main__":
    main()
