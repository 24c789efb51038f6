"""How long `python -m lingbot_core.quantize` takes on the MoE DiT (the DMD student's, 60 GB bf16):
measured on ONE real-width layer on this machine, extrapolated to the whole DiT.

The layer is a bf16 `[rows, 2048]` weight (the MoE's hidden width; `--rows` 6144 by default, the
config's `intermediate_size`) written to a safetensors file and converted by the quantizer's own
writer (`quantize.write_gguf` / `write_fp8`: read, quantize, write). The whole DiT's time is that
rate times the DiT's values, from the real configuration; the file read from disk (60 GB) comes on
top and depends on the disk (the layer here is read from the page cache). An extrapolation, not a
measurement of a full conversion; it says so when it prints.

    python bench/quantize_time.py --threads 1          # Q8_0, Q4_0 and fp8, ~10-30 s on a laptop core
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python bench/x.py` from a plain checkout

import torch

TARGETS = ("gguf-q8_0", "gguf-q4_0", "fp8")  # the default set; --targets takes any of quantize.TARGETS


def dit_values(variant: str = "moe") -> int:
    """Values in the real DiT of `variant` (its configuration built on `meta`)."""
    from bench.memory_table import CONFIGS
    from bench.offload_gpu import build_transformer

    dit = build_transformer(json.loads(CONFIGS[variant].read_text()), torch.device("meta"), torch.bfloat16, 0)
    return sum(t.numel() for t in dit.state_dict().values())


def time_layer(target: str, rows: int, width: int, folder: Path) -> float:
    """Seconds for the quantizer's writer to convert one bf16 [rows, width] linear weight."""
    from safetensors.torch import save_file

    from lingbot_core.quantize import write_fp8, write_gguf
    from lingbot_core.weights.sources import SafetensorsSource

    src = folder / "layer.safetensors"
    weight = torch.randn(rows, width, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16) / width**0.5
    save_file({"blocks.0.attn.to_q.weight": weight}, str(src))
    source = SafetensorsSource([src])
    started = time.perf_counter()
    if target == "fp8":
        write_fp8(source, folder / "out.safetensors")
    else:
        write_gguf(source, folder / "out.gguf", target.split("-", 1)[1].upper())
    elapsed = time.perf_counter() - started
    source.close()
    return elapsed


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=6144, help="rows of the layer (default 6144)")
    parser.add_argument("--width", type=int, default=2048, help="the layer's width (default 2048, the MoE's)")
    from lingbot_core.quantize import TARGETS as ALL

    parser.add_argument("--targets", nargs="+", default=list(TARGETS), choices=ALL)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--json", type=Path, help="write the result here")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from bench._common import print_machine

    print_machine()
    total = dit_values("moe")
    layer = args.rows * args.width
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for target in args.targets:
            seconds = time_layer(target, args.rows, args.width, Path(tmp))
            rate = layer / seconds
            rows.append(dict(target=target, layer=f"{args.rows}x{args.width}", layer_s=round(seconds, 3),
                             values_per_s=rate, dit_values=total, dit_minutes_extrapolated=total / rate / 60))
    print(f"one {args.rows}x{args.width} bf16 layer ({layer / 1e6:.1f} M values), threads {torch.get_num_threads()}; "
          f"whole MoE DiT ({total / 1e9:.2f} B values) EXTRAPOLATED from it, disk read not included:")
    for row in rows:
        print(f"  {row['target']:10s} layer {row['layer_s']:7.3f} s  ->  DiT ~{row['dit_minutes_extrapolated']:.0f} min")
    result = dict(rows=rows, threads=torch.get_num_threads(), extrapolated=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
