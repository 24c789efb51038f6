"""Write a quantized copy of a LingBot-Video checkpoint folder.

    python -m lingbot_core.quantize SRC DST --to fp8|gguf-q8_0|gguf-q4_0 [--per-expert]

Only `transformer/` and `refiner/` change; every other file is hard-linked (copied when linking is
not possible). Tensors are read and written one at a time, so memory stays near one tensor.
- `fp8`: `diffusion_pytorch_model.safetensors` with each linear weight and expert stack in
  float8_e4m3fn and a float32 `NAME.scale` tensor (one scale per output row) next to it; other
  tensors as stored. The loader reads it directly (README, "Weight formats").
- `gguf-*`: `diffusion_pytorch_model.gguf` with the checkpoint's own state-dict names; the same
  weights in Q8_0 or Q4_0 blocks (rows whose length is not a multiple of 32 stay plain), other
  tensors in their stored float type. `--per-expert` stores each MoE expert stack
  `blocks.{i}.ffn.experts.w1` ([E, I, D]) as E tensors `blocks.{i}.ffn.experts.w1.{e}` ([I, D]);
  the blocks are the same bytes, so both layouts load to bit-identical weights.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import torch

from .checkpoint import CheckpointError, inspect_checkpoint
from .weights.fp8 import quantize_fp8, require_fp8
from .weights.loader import quantizable
from .weights.sources import FORMAT_KEY, SCALE_SUFFIX, SafetensorsSource, per_expert_key

TARGETS = ("fp8", "gguf-q8_0", "gguf-q4_0")
DIT_FOLDERS = ("transformer", "refiner")
WEIGHTS_STEM = "diffusion_pytorch_model"
_ST_NAMES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64",
             torch.int32: "I32", torch.uint8: "U8", torch.int8: "I8", torch.bool: "BOOL"}
if hasattr(torch, "float8_e4m3fn"):
    _ST_NAMES[torch.float8_e4m3fn] = "F8_E4M3"


def _plain_source(folder: Path, files: list[Path]) -> SafetensorsSource:
    source = SafetensorsSource(files)
    packed = [k for k, e in source.entries.items() if e.kind != "plain"]
    if packed:
        raise CheckpointError(f"{folder} is already quantized ({packed[0]} is {source.entries[packed[0]].label}); "
                              "quantize from the original bf16/fp32 checkpoint.")
    return source


# -- fp8 safetensors ------------------------------------------------------------------------------

def write_fp8(source: SafetensorsSource, path: Path) -> None:
    """A safetensors file, written tensor by tensor, with the quantizable weights in fp8 + scales."""
    require_fp8()
    plan: list[tuple[str, str, tuple[int, ...], int]] = []  # (name, dtype, shape, bytes)
    for key, entry in source.entries.items():
        numel = int(np.prod(entry.shape)) if entry.shape else 1
        if quantizable(key, entry.shape):
            plan.append((key, "F8_E4M3", entry.shape, numel))
            plan.append((key + SCALE_SUFFIX, "F32", entry.shape[:-1], 4 * (numel // entry.shape[-1])))
        else:
            plan.append((key, _ST_NAMES[entry.dtype], entry.shape, numel * entry.dtype.itemsize))
    header: dict = {"__metadata__": {"format": "pt", FORMAT_KEY: "fp8_e4m3"}}
    offset = 0
    for name, dtype, shape, nbytes in plan:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as fh:
        fh.write(len(raw).to_bytes(8, "little"))
        fh.write(raw)
        for key, entry in source.entries.items():
            tensor = source.plain(key)
            if quantizable(key, entry.shape):
                q, scale = quantize_fp8(tensor)
                _write_bytes(fh, q)
                _write_bytes(fh, scale)
            else:
                _write_bytes(fh, tensor)
            del tensor


def _write_bytes(fh, tensor: torch.Tensor) -> None:
    fh.write(tensor.contiguous().view(torch.uint8).numpy().data)


# -- GGUF -------------------------------------------------------------------------------------------

EXPERT_STACKS = (".experts.w1", ".experts.w2", ".experts.w3")


def _pieces(key: str, shape: tuple[int, ...], per_expert: bool) -> list[tuple[str, tuple[int, ...]]]:
    """The GGUF tensors one checkpoint tensor becomes: itself, or (`per_expert`) one per expert of a stack."""
    if per_expert and key.endswith(EXPERT_STACKS) and len(shape) == 3:
        return [(per_expert_key(key, e), shape[1:]) for e in range(shape[0])]
    return [(key, shape)]


def write_gguf(source: SafetensorsSource, path: Path, qtype_name: str, per_expert: bool = False) -> None:
    """A GGUF file with the checkpoint's own tensor names, written tensor by tensor (expert stacks
    stacked, or with `per_expert` one tensor per expert)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize

    qtype = GGMLQuantizationType[qtype_name]
    block = GGML_QUANT_SIZES[qtype][0]
    plain = {torch.float32: GGMLQuantizationType.F32, torch.float16: GGMLQuantizationType.F16,
             torch.bfloat16: GGMLQuantizationType.BF16}
    writer = GGUFWriter(path, arch="lingbot_video")
    writer.add_string("lingbot.weights", f"gguf-{qtype_name.lower()}")
    chosen: dict[str, GGMLQuantizationType] = {}
    for key, entry in source.entries.items():
        if entry.dtype not in plain:
            raise CheckpointError(f"{key} is stored as {entry.dtype}; only float tensors go into a GGUF DiT")
        kind = qtype if quantizable(key, entry.shape) and entry.shape[-1] % block == 0 else plain[entry.dtype]
        chosen[key] = kind
        block_n, size = GGML_QUANT_SIZES[kind]
        for name, shape in _pieces(key, entry.shape, per_expert):
            rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
            nbytes = rows * (shape[-1] // block_n) * size
            # shapes go in in torch order; the writer stores them in ggml order (reversed)
            writer.add_tensor_info(name, shape, np.dtype(np.float32), nbytes, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for key, entry in source.entries.items():
        tensor = source.plain(key)
        kind = chosen[key]
        pieces = _pieces(key, entry.shape, per_expert)
        for piece in (tensor.unbind(0) if len(pieces) > 1 else (tensor,)):
            if kind in (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16):
                data = piece.contiguous().view(torch.uint8).numpy()
            else:  # blocks run along rows, so a stack and its experts quantize to the same bytes
                rows = piece.reshape(-1, entry.shape[-1])
                parts = [quantize(rows[i:i + 2048].float().numpy(), kind) for i in range(0, rows.shape[0], 2048)]
                data = np.concatenate(parts, axis=0)
            writer.write_tensor_data(data)
            del data
        del tensor
    writer.close()


# -- the folder -------------------------------------------------------------------------------------

def _link_or_copy(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def quantize_checkpoint(src: str | os.PathLike, dst: str | os.PathLike, to: str, *,
                        per_expert: bool = False) -> Path:
    """Write DST: SRC with its DiT folders quantized to `to` (one of TARGETS); `per_expert` (GGUF only)
    stores MoE expert stacks one tensor per expert. Returns DST."""
    if to not in TARGETS:
        raise ValueError(f"unknown target {to!r}; choose one of {', '.join(TARGETS)}")
    if per_expert and not to.startswith("gguf-"):
        raise ValueError("--per-expert is for GGUF targets (gguf-q8_0, gguf-q4_0); fp8 files keep expert stacks")
    if to == "fp8":
        require_fp8()
    info = inspect_checkpoint(src)
    out = Path(dst).expanduser().absolute()
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty; choose a new folder")
    if out.resolve() == info.folder.resolve():
        raise ValueError("DST must differ from SRC")
    out.mkdir(parents=True, exist_ok=True)
    for item in sorted(info.folder.rglob("*")):
        rel = item.relative_to(info.folder)
        if item.is_dir() or rel.parts[0] in DIT_FOLDERS and item.name.startswith(WEIGHTS_STEM):
            continue
        _link_or_copy(item, out / rel)
    for folder in DIT_FOLDERS:
        if folder not in info.weight_files:
            continue
        source = _plain_source(info.folder / folder, info.weight_files[folder])
        (out / folder).mkdir(parents=True, exist_ok=True)
        if to == "fp8":
            write_fp8(source, out / folder / f"{WEIGHTS_STEM}.safetensors")
        else:
            write_gguf(source, out / folder / f"{WEIGHTS_STEM}.gguf", to.split("-", 1)[1].upper(), per_expert)
        source.close()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lingbot_core.quantize", description=__doc__.split("\n\n")[0])
    parser.add_argument("src", help="a LingBot-Video checkpoint folder (bf16 or fp32)")
    parser.add_argument("dst", help="the new folder to write")
    parser.add_argument("--to", required=True, choices=TARGETS)
    parser.add_argument("--per-expert", action="store_true",
                        help="GGUF: store each MoE expert as its own tensor (NAME.{e}) instead of one stack")
    args = parser.parse_args(argv)
    try:
        out = quantize_checkpoint(args.src, args.dst, args.to, per_expert=args.per_expert)
    except (ValueError, FileExistsError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
