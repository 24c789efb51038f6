"""GGUF header reading, ours against the `gguf` package's reader, on the files that broke the old path.

    python -m bench.gguf_header [--array-mb 4] [--timeout 300] [--mem-limit-gb 4] [--json OUT]

Cases: a 49-byte file whose metadata array claims 2^62 entries; a valid file with one numeric
metadata array of ARRAY_MB megabytes; a valid file with a tokenizer-sized string array (150,000
entries). Each reader runs in a child process of its own (same interpreter, same files), so time and
peak RSS are the child's alone: wall seconds, peak RSS (ru_maxrss) and how it ended. The baseline
(`gguf.GGUFReader`, what `GGUFSource` used before) runs under an address-space limit and a timeout,
so a runaway allocation ends as MemoryError / timeout instead of taking the machine down.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_CHILD = r"""
import json, resource, sys, time
path, which, limit = sys.argv[1], sys.argv[2], int(sys.argv[3])
if limit:
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
from gguf import GGUFReader  # both children import both readers: the same baseline RSS
from lingbot_core.weights.gguf_file import read_header
start = time.perf_counter()
try:
    if which == "ours":
        header = read_header(path)
        detail = f"{len(header.metadata)} keys, {len(header.tensors)} tensors"
    else:
        reader = GGUFReader(path)
        detail = f"{len(reader.fields)} fields, {len(reader.tensors)} tensors"
    outcome = "read"
except BaseException as err:  # the point is to see what escapes
    outcome, detail = type(err).__name__, str(err)[:160]
print(json.dumps({"seconds": time.perf_counter() - start, "outcome": outcome, "detail": detail,
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def _u32(n: int) -> bytes:
    return struct.pack("<I", n)


def _u64(n: int) -> bytes:
    return struct.pack("<Q", n)


def _str(text: str) -> bytes:
    return _u64(len(text.encode())) + text.encode()


def _file(kvs: list[bytes], tensor: bool = True) -> bytes:
    """A GGUF v3 file with the given metadata and (`tensor`) one F32 [8] tensor."""
    info = _str("w") + _u32(1) + _u64(8) + _u32(0) + _u64(0) if tensor else b""
    head = b"GGUF" + _u32(3) + _u64(int(tensor)) + _u64(len(kvs)) + b"".join(kvs) + info
    return head + bytes(-len(head) % 32) + (bytes(32) if tensor else b"")


def cases(array_mb: float) -> dict[str, bytes]:
    n = int(array_mb * 2**20) // 4
    huge_claim = _str("k") + _u32(9) + _u32(0) + _u64(2**62)  # ARRAY of UINT8, 2^62 entries, none present
    numbers = _str("big") + _u32(9) + _u32(4) + _u64(n) + struct.pack(f"<{n}I", *range(n))
    tokens = _str("tokenizer.ggml.tokens") + _u32(9) + _u32(8) + _u64(150_000)
    tokens += b"".join(_str(f"tok{i}") for i in range(150_000))
    return {"claims 2^62 entries (49 bytes)": b"GGUF" + _u32(3) + _u64(0) + _u64(1) + huge_claim,
            f"valid, {array_mb:g} MB uint32 array": _file([numbers]),
            "valid, 150k-string array": _file([tokens])}


def _peak_rss_mb(pid: int) -> float:
    """A live process's peak RSS (VmHWM), read before it is killed; NaN where /proc has none."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def _run(path: Path, which: str, timeout: float, limit: int) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]), *sys.path])}
    start = time.perf_counter()
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(path), which, str(limit)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env)
    try:
        stdout, stderr = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        peak = _peak_rss_mb(child.pid)
        child.kill()
        child.communicate()
        return {"seconds": time.perf_counter() - start, "outcome": f"timeout ({timeout:g} s)", "detail": "",
                "peak_rss_mb": peak}
    lines = stdout.strip().splitlines()
    if not lines:
        return {"seconds": time.perf_counter() - start, "outcome": f"killed (rc {child.returncode})",
                "detail": stderr[-160:], "peak_rss_mb": float("nan")}
    return json.loads(lines[-1])


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--array-mb", type=float, default=4.0)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per child")
    ap.add_argument("--mem-limit-gb", type=float, default=4.0, help="address-space limit of each child")
    ap.add_argument("--skip-baseline", action="store_true")
    ap.add_argument("--only", default="", help="run the cases whose name contains this")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    limit = int(args.mem_limit_gb * 2**30)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, raw in cases(args.array_mb).items():
            if args.only not in name:
                continue
            path = Path(tmp) / "case.gguf"
            path.write_bytes(raw)
            row = {"case": name, "bytes": len(raw), "ours": _run(path, "ours", args.timeout, limit)}
            if not args.skip_baseline:
                row["gguf.GGUFReader"] = _run(path, "gguf", args.timeout, limit)
                base, ours = row["gguf.GGUFReader"], row["ours"]
                row["time_ratio"] = base["seconds"] / max(ours["seconds"], 1e-9)
                row["rss_ratio"] = base["peak_rss_mb"] / ours["peak_rss_mb"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"\n{'case':36} {'reader':16} {'seconds':>9} {'peak RSS MB':>12}  outcome")
    for row in rows:
        for which in ("ours", "gguf.GGUFReader"):
            if which in row:
                r = row[which]
                print(f"{row['case']:36} {which:16} {r['seconds']:9.3f} {r['peak_rss_mb']:12.1f}  {r['outcome']}")
    result = {"cases": rows, "array_mb": args.array_mb, "mem_limit_gb": args.mem_limit_gb,
              "load_average": os.getloadavg()}
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
