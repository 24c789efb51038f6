"""Write a quantized copy of a LingBot-Video checkpoint folder.

    python -m lingbot_core.quantize SRC DST --to fp8|gguf-q8_0|gguf-q4_0|gguf-q6_k|...|gguf-q2_k [--per-expert]

Only `transformer/` and `refiner/` change; every other file is hard-linked (copied when linking is
not possible; symlinked component folders are followed), and the command says so: a hard link shares
one copy on disk with SRC. Tensors are read and written one at a time, so memory stays near one
tensor; progress with an ETA goes to stderr (`--quiet`: none). Everything is written into a temporary
folder beside DST, renamed to DST at the end: a failed or interrupted run (Ctrl-C: one line, exit 130)
leaves nothing behind and can be run again. Bad arguments are refused before any work, in one line.
- `fp8`: `diffusion_pytorch_model.safetensors` with each linear weight and expert stack in
  float8_e4m3fn and a float32 `NAME.scale` tensor (one scale per output row) next to it; other
  tensors as stored. The loader reads it directly (docs/weights.md).
- `gguf-*`: `diffusion_pytorch_model.gguf` with the checkpoint's own state-dict names; the same
  weights in Q8_0 or Q4_0 blocks (rows whose length is not a multiple of 32 stay plain), other
  tensors in their stored float type. `--per-expert` stores each MoE expert stack
  `blocks.{i}.ffn.experts.w1` ([E, I, D]) as E tensors `blocks.{i}.ffn.experts.w1.{e}` ([I, D]);
  the blocks are the same bytes, so both layouts load to bit-identical weights.
- `gguf-q6_k`, `gguf-q5_k`, `gguf-q4_k`, `gguf-q3_k`, `gguf-q2_k`: K-quant blocks of 256 values
  (`weights.kquants`, one-pass scales); rows whose length is not a multiple of 256 are written in Q8_0.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":  # Ctrl-C while the imports below run (torch takes seconds) is one line too
    import signal

    def _interrupted_while_importing(signum: int, frame: object) -> None:
        sys.stderr.write("\nquantize: interrupted.\n")
        sys.stderr.flush()
        os._exit(130)

    signal.signal(signal.SIGINT, _interrupted_while_importing)

import argparse
import functools
import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from .checkpoints.inspection import inspect_checkpoint
from .components import DITS
from .errors import CheckpointError
from .weights.fp8 import quantize_fp8, require_fp8
from .weights.loader import quantizable
from .weights.safetensors_header import safetensors_dtype
from .weights.sources import FORMAT_KEY, SCALE_SUFFIX, SafetensorsSource, per_expert_key

if __name__ == "__main__":  # imported: from here on Ctrl-C is a KeyboardInterrupt, which `main` reports
    signal.signal(signal.SIGINT, signal.default_int_handler)

TARGETS = ("fp8", "gguf-q8_0", "gguf-q4_0", "gguf-q6_k", "gguf-q5_k", "gguf-q4_k", "gguf-q3_k", "gguf-q2_k")
DIT_FOLDERS = DITS
WEIGHTS_STEM = "diffusion_pytorch_model"


def _plain_source(folder: Path, files: list[Path]) -> SafetensorsSource:
    source = SafetensorsSource(files)
    packed = [k for k, e in source.entries.items() if e.kind != "plain"]
    if packed:
        raise CheckpointError(f"{folder} is already quantized ({packed[0]} is {source.entries[packed[0]].label}); "
                              "quantize from the original bf16/fp32 checkpoint.")
    return source


# -- fp8 safetensors ------------------------------------------------------------------------------

def write_fp8(source: SafetensorsSource, path: Path, progress: Callable[[str, int], None] | None = None) -> None:
    """A safetensors file, written tensor by tensor, with the quantizable weights in fp8 + scales.
    `progress(name, source_bytes)` is called after each tensor."""
    require_fp8()
    plan: list[tuple[str, str, tuple[int, ...], int]] = []  # (name, dtype, shape, bytes)
    for key, entry in source.entries.items():
        numel = int(np.prod(entry.shape)) if entry.shape else 1
        if quantizable(key, entry.shape):
            plan.append((key, "F8_E4M3", entry.shape, numel))
            plan.append((key + SCALE_SUFFIX, "F32", entry.shape[:-1], 4 * (numel // entry.shape[-1])))
        else:
            plan.append((key, safetensors_dtype(entry.dtype), entry.shape, numel * entry.dtype.itemsize))
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
            if progress is not None:
                progress(key, _plain_bytes(entry))


def _plain_bytes(entry) -> int:
    """Bytes of a plain stored tensor (what progress counts)."""
    return (int(np.prod(entry.shape)) if entry.shape else 1) * entry.dtype.itemsize


def _write_bytes(fh, tensor: torch.Tensor) -> None:
    fh.write(tensor.contiguous().view(torch.uint8).numpy().data)


# -- GGUF -------------------------------------------------------------------------------------------

EXPERT_STACKS = (".experts.w1", ".experts.w2", ".experts.w3")


def _pieces(key: str, shape: tuple[int, ...], per_expert: bool) -> list[tuple[str, tuple[int, ...]]]:
    """The GGUF tensors one checkpoint tensor becomes: itself, or (`per_expert`) one per expert of a stack."""
    if per_expert and key.endswith(EXPERT_STACKS) and len(shape) == 3:
        return [(per_expert_key(key, e), shape[1:]) for e in range(shape[0])]
    return [(key, shape)]


def write_gguf(source: SafetensorsSource, path: Path, qtype_name: str, per_expert: bool = False,
               progress: Callable[[str, int], None] | None = None) -> None:
    """A GGUF file with the checkpoint's own tensor names, written tensor by tensor (expert stacks
    stacked, or with `per_expert` one tensor per expert). `progress(name, source_bytes)` is called
    after each tensor."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize

    from .weights.kquants import K_TYPES
    from .weights.kquants import encode as encode_k

    qtype = GGMLQuantizationType[qtype_name]
    block = GGML_QUANT_SIZES[qtype][0]
    fallback = GGMLQuantizationType.Q8_0  # a K-quant's rows that are not a multiple of 256 values
    plain = {torch.float32: GGMLQuantizationType.F32, torch.float16: GGMLQuantizationType.F16,
             torch.bfloat16: GGMLQuantizationType.BF16}
    writer = GGUFWriter(path, arch="lingbot_video")
    writer.add_string("lingbot.weights", f"gguf-{qtype_name.lower()}")
    chosen: dict[str, GGMLQuantizationType] = {}
    for key, entry in source.entries.items():
        if entry.dtype not in plain:
            raise CheckpointError(f"{key} is stored as {entry.dtype}; only float tensors go into a GGUF DiT")
        kind = plain[entry.dtype]
        if quantizable(key, entry.shape):
            if entry.shape[-1] % block == 0:
                kind = qtype
            elif qtype_name in K_TYPES and entry.shape[-1] % GGML_QUANT_SIZES[fallback][0] == 0:
                kind = fallback
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
                encoder = (lambda a, k: encode_k(a, k.name)) if kind.name in K_TYPES else quantize
                parts = [encoder(rows[i:i + 2048].float().numpy(), kind) for i in range(0, rows.shape[0], 2048)]
                data = np.concatenate(parts, axis=0)
            writer.write_tensor_data(data)
            del data
        del tensor
        if progress is not None:
            progress(key, _plain_bytes(entry))
    writer.close()


# -- progress ----------------------------------------------------------------------------------------

class Progress:
    """Per-tensor progress with an ETA on stderr: one line rewritten in place on a terminal, else a
    line every `every_s` seconds (logs stay short). `quiet`: nothing."""

    def __init__(self, total_bytes: int, *, quiet: bool = False, stream=None, every_s: float = 10.0) -> None:
        self.total, self.done, self.quiet, self.every_s = max(total_bytes, 1), 0, quiet, every_s
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.start = self.last = time.monotonic()
        self.tensors = 0

    def __call__(self, folder: str, name: str, nbytes: int) -> None:
        """One source tensor of `nbytes` was written (its quantized form)."""
        self.done += nbytes
        self.tensors += 1
        now = time.monotonic()
        if self.quiet or (not self.tty and now - self.last < self.every_s and self.done < self.total):
            return
        self.last = now
        elapsed = now - self.start
        eta = elapsed * (self.total - self.done) / self.done if self.done else 0.0
        line = (f"quantize: {folder}: {self.tensors} tensors, {_size(self.done)} of {_size(self.total)} "
                f"({100 * self.done / self.total:.0f}%), {_clock(elapsed)} elapsed, ETA {_clock(eta)}")
        if self.tty:
            self.stream.write("\r" + line[:160].ljust(100))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def finish(self) -> None:
        if self.tty and not self.quiet and self.tensors:
            self.stream.write("\n")
            self.stream.flush()


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _clock(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


# -- the folder -------------------------------------------------------------------------------------

def _files(root: Path) -> list[Path]:
    """Every file under `root`, following symlinked folders (a shared VAE or text encoder is often a
    link), each real folder once (a link loop ends there)."""
    out, seen = [], set()
    for here, dirs, names in os.walk(root, followlinks=True):
        st = os.stat(here)
        if (st.st_dev, st.st_ino) in seen:
            dirs[:] = []
            continue
        seen.add((st.st_dev, st.st_ino))
        dirs.sort()
        out += [Path(here) / n for n in sorted(names)]
    return out


def _link_or_copy(src: Path, dst: Path) -> bool:
    """Hard-link `src` (a link's target) at `dst`, else copy it. True when linked."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(os.path.realpath(src), dst)
        return True
    except OSError:
        shutil.copy2(src, dst)
        return False


def _inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def check_arguments(src: str | os.PathLike, dst: str | os.PathLike, to: str, per_expert: bool = False
                    ) -> tuple[Path, Path]:
    """Every refusal that needs no weights read: the resolved SRC folder and DST path, or a ValueError
    (a CheckpointError for SRC itself) in one line."""
    if to not in TARGETS:
        raise ValueError(f"unknown target {to!r}; choose one of {', '.join(TARGETS)}")
    if per_expert and not to.startswith("gguf-"):
        raise ValueError("--per-expert is for the GGUF targets (gguf-*); fp8 files keep expert stacks")
    source = Path(src).expanduser()
    if source.is_file():
        kind = "a GGUF file" if source.suffix.lower() == ".gguf" else "a file"
        raise ValueError(f"SRC {source} is {kind}; quantize takes a whole checkpoint folder (the one holding "
                         "model_index.json) with bf16/fp32 DiT weights, and writes a new folder.")
    out = Path(dst).expanduser().absolute()
    real_src, real_out = source.resolve(), out.resolve()
    if _inside(real_out, real_src):
        raise ValueError(f"DST {out} is inside SRC {source.resolve()}; choose a folder outside the checkpoint")
    if _inside(real_src, real_out):
        raise ValueError(f"SRC {source} is inside DST {out}; choose another DST")
    if out.is_file() or out.is_symlink() and not out.exists():
        raise ValueError(f"DST {out} is a file (or a broken link); choose a new folder")
    if out.is_dir() and any(out.iterdir()):
        raise ValueError(f"DST {out} exists and is not empty; choose a new folder")
    parent = next((p for p in out.parents if p.exists()), None)
    if parent is None or not parent.is_dir():
        raise ValueError(f"DST {out} cannot be made: {parent} is not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"DST {out} cannot be made: no write permission in {parent}")
    if to == "fp8":
        require_fp8()
    return source, out


def _stale_partials(out: Path) -> None:
    """Remove temporary folders of earlier runs into `out` whose process is gone (killed, not interrupted)."""
    for old in out.parent.glob(f".{out.name}.partial-*"):
        try:
            pid = int(old.name.rsplit("-", 1)[1])
            os.kill(pid, 0)
            continue  # that run is still going
        except (ValueError, ProcessLookupError):
            pass
        except PermissionError:
            continue
        shutil.rmtree(old, ignore_errors=True)


def quantize_checkpoint(src: str | os.PathLike, dst: str | os.PathLike, to: str, *,
                        per_expert: bool = False, quiet: bool = True, note_links: bool = False) -> Path:
    """Write DST: SRC with its DiT folders quantized to `to` (one of TARGETS); `per_expert` (GGUF only)
    stores MoE expert stacks one tensor per expert. Returns DST.

    Everything is written into a temporary folder next to DST (`.NAME.partial-PID`) that is renamed
    to DST at the end: a failed or interrupted run leaves no DST (and no temporary folder), so the
    same command can simply be run again. Progress goes to stderr unless `quiet`; `note_links`: say
    on stderr that the unchanged files are hard links (when they are)."""
    source, out = check_arguments(src, dst, to, per_expert)
    info = inspect_checkpoint(source)
    dits = [f for f in DIT_FOLDERS if f in info.sources]
    for folder in dits:
        found = info.sources[folder]
        if found.format.name != "safetensors":
            raise CheckpointError(f"{found.where} is already quantized ({found.format.name}); quantize from the "
                                  "original bf16/fp32 checkpoint.")
    out.parent.mkdir(parents=True, exist_ok=True)
    _stale_partials(out)
    work = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    linked = linked_bytes = 0
    progress = None
    try:
        work.mkdir()
        for item in _files(info.folder):
            rel = item.relative_to(info.folder)
            if rel.parts[0] in dits and item.name.startswith(WEIGHTS_STEM):
                continue
            if _link_or_copy(item, work / rel):
                linked += 1
                linked_bytes += item.stat().st_size
        sources = {folder: _plain_source(info.folder / folder, list(info.sources[folder].files)) for folder in dits}
        total = sum(_plain_bytes(e) for s in sources.values() for e in s.entries.values())
        progress = Progress(total, quiet=quiet)
        for folder, plain in sources.items():
            (work / folder).mkdir(parents=True, exist_ok=True)
            report = functools.partial(progress, folder)
            if to == "fp8":
                write_fp8(plain, work / folder / f"{WEIGHTS_STEM}.safetensors", progress=report)
            else:
                write_gguf(plain, work / folder / f"{WEIGHTS_STEM}.gguf", to.split("-", 1)[1].upper(), per_expert,
                           progress=report)
            plain.close()
        progress.finish()
        if out.is_dir():
            out.rmdir()  # an empty DST made beforehand (checked empty above)
        os.rename(work, out)
    except BaseException:
        if progress is not None:
            progress.finish()
        shutil.rmtree(work, ignore_errors=True)
        raise
    if linked and note_links:
        print(f"quantize: note: {linked} unchanged files ({_size(linked_bytes)}) in {out} are hard links to "
              f"the files in {info.folder}: they share one copy on disk, so editing one in place edits both "
              "(replace a file rather than editing it).", file=sys.stderr)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lingbot_core.quantize", description=__doc__.split("\n\n")[0])
    parser.add_argument("src", help="a LingBot-Video checkpoint folder (bf16 or fp32)")
    parser.add_argument("dst", help="the new folder to write (made at the end; nothing is left if the run stops)")
    parser.add_argument("--to", required=True, choices=TARGETS)
    parser.add_argument("--per-expert", action="store_true",
                        help="GGUF: store each MoE expert as its own tensor (NAME.{e}) instead of one stack")
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")
    args = parser.parse_args(argv)
    try:
        out = quantize_checkpoint(args.src, args.dst, args.to, per_expert=args.per_expert, quiet=args.quiet,
                                  note_links=True)
    except KeyboardInterrupt:
        print(f"\nquantize: interrupted; {args.dst} was not written (run the same command again).", file=sys.stderr)
        return 130
    except ValueError as err:  # bad arguments and checkpoints (CheckpointError is one)
        print(f"error: {_one_line(err)}", file=sys.stderr)
        return 2
    except OSError as err:  # the disk: full, unwritable, vanished
        print(f"error: could not write {args.dst}: {_one_line(err)}; nothing was left behind.", file=sys.stderr)
        return 1
    print(out)
    return 0


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split())[:2000]


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # between two checks above: still one line
        print("\nquantize: interrupted.", file=sys.stderr)
        sys.exit(130)
