"""Decoding a packed weight into one output tensor: eagerly piece by piece, or by one compiled kernel.

Eager: a decoder (GGUF blocks, fp8 rows) works in float32 and makes several temporaries the size of
what it decodes. Over a whole [6144, 2048] linear, or a stacked [128, 768, 2048] expert tensor, those
temporaries are tens to hundreds of MB: on a CPU each pass then runs from main memory (and fresh
allocations that large fault their pages in every call), on a GPU they are a transient of 4 bytes per
value on top of the model. Decoding a fixed number of values at a time into the final tensor keeps the
float32 scratch in the CPU's cache and bounds the accelerator transient, with the same values.

Compiled: the same decoder traced by `torch.compile` (inductor) into one kernel that reads the packed
bytes and writes the output dtype, with no temporaries, so the whole tensor goes in one call. Each
format's eager decoder is written as separate torch ops (two to five passes over the values, plus
fresh temporaries); the fused kernel makes one. Why not a library kernel: torch's packed-weight
matmuls (`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`) take per-channel or bf16 group scales
(not GGUF's float16 block scales) and were measured slower than decode + bf16 matmul on CPU.

Which is used (`DECODERS`, set per module by `weights.modules.set_decoder`): `auto` compiles on the
devices in `COMPILE_DEVICES` for formats marked `compiles` and weights of at least
`COMPILE_MIN_VALUES` values (a tiny model is not worth a compile), else eager. Each format's compiled
decoder is a fast kernel of `lingbot_core.kernels` (`compiled_decoder/<format>`): its first decode per
device, dtype and torch is checked bit for bit against the eager one; a compile failure (no C++
compiler, say) or any difference falls back to eager for the rest of the process, with one warning. Measured with `python bench/speed_dit.py --only decode,quantized`
(docs/benchmarks.md).
"""

from __future__ import annotations

import logging
import types
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .. import kernels

log = logging.getLogger("lingbot_core.weights.decode")

#: values decoded per eager piece, by device type: 1M float32 values (4 MB of scratch) fit a CPU's
#: last-level cache; on an accelerator the piece bounds the float32 transient (64 MB) with few launches
PIECE_VALUES: dict[str, int] = {"cpu": 1 << 20}
DEFAULT_PIECE_VALUES = 1 << 24

#: how packed weights decode: `auto` (compiled where measured faster, else eager), `eager`, `compiled`
DECODERS = ("auto", "eager", "compiled")
#: device types where `auto` compiles: measured on CPU (inductor C++); GPUs not run yet
COMPILE_DEVICES = ("cpu",)
#: the smallest weight (values) `auto` compiles a decode for; the real DiT's smallest is 4M
COMPILE_MIN_VALUES = 1 << 20

# values: float32 [n, ...] from (rows [n, ...], per-row extra or None)
RowDecode = Callable[[torch.Tensor, "torch.Tensor | None"], torch.Tensor]


@dataclass(frozen=True)
class PackedFormat:
    """How rows of one packed format decode.

    `eager(rows, extra)` and `traced(rows, extra)` give the float32 values of `rows` (each row
    `per_row` values once reshaped); `extra` is a per-row tensor some formats need (fp8: the scales)
    or None. `traced` is the form the compiler fuses (default: `eager`); `compiles`: `auto` may use a
    compiled kernel (measured faster than eager); `rows_dtype`: the dtype the rows are viewed as before
    either decoder sees them (a view outside the kernel is free; inside, reinterpreting uint8 as int8
    compiled to a per-byte loop, 0.54 vs 0.11 ns per value measured)."""

    name: str
    eager: RowDecode
    traced: RowDecode | None = None
    compiles: bool = True
    rows_dtype: torch.dtype | None = None

    @property
    def fusable(self) -> RowDecode:
        return self.traced or self.eager


def piece_values(device: torch.device) -> int:
    """How many values one eager decoding piece holds on `device`."""
    return PIECE_VALUES.get(torch.device(device).type, DEFAULT_PIECE_VALUES)


def check_decoder(value: object) -> str:
    """`value` if it is one of `DECODERS`, else a ValueError naming them."""
    if value not in DECODERS:
        raise ValueError(f"unknown decoder {value!r}; choose one of {', '.join(DECODERS)}")
    return str(value)


# -- compiled kernels ------------------------------------------------------------------------------

_kernels: dict[str, Callable[..., None]] = {}


def _kernel(fmt: PackedFormat) -> Callable[..., None]:
    """The compiled `out.copy_(decode(rows, extra))` of `fmt`, built once per process.

    Each format gets a function with a code object of its own: the compiler keeps its graphs per code
    object, so formats sharing one wrapper would evict each other and hit the recompile limit."""
    kernel = _kernels.get(fmt.name)
    if kernel is None:
        decode = fmt.fusable

        def write_into(rows: torch.Tensor, extra: torch.Tensor | None, out: torch.Tensor) -> None:
            out.copy_(decode(rows, extra).reshape(out.shape))

        name = f"decode_{fmt.name.lower()}"
        code = write_into.__code__.replace(co_name=name, co_qualname=name)
        own = types.FunctionType(code, write_into.__globals__, name, None, write_into.__closure__)
        kernel = _kernels[fmt.name] = torch.compile(own, dynamic=True, fullgraph=True)
    return kernel


def wants_compiled(fmt: PackedFormat, decoder: str, values: int, device: torch.device) -> bool:
    """Whether a decode of `values` values of `fmt` on `device` goes through the compiled kernel."""
    if decoder == "eager" or torch.compiler.is_compiling():
        return False
    if decoder == "auto" and (not fmt.compiles or values < COMPILE_MIN_VALUES
                              or torch.device(device).type not in COMPILE_DEVICES):
        return False
    return True


def _piece_rows(device: torch.device, per_row: int) -> int:
    """Rows of `per_row` values in one eager piece on `device`."""
    return max(1, piece_values(device) // max(1, per_row))


def _eager_into(rows: torch.Tensor, extra: torch.Tensor | None, fmt: PackedFormat, out: torch.Tensor) -> None:
    n, per_row = out.shape
    step = _piece_rows(rows.device, per_row)
    for start in range(0, n, step):
        part = slice(start, min(n, start + step))
        out[part].copy_(fmt.eager(rows[part], None if extra is None else extra[part]).reshape(-1, per_row))


def kernel_name(fmt: PackedFormat) -> str:
    """The name `lingbot_core.kernels` judges `fmt`'s compiled decoder by: `compiled_decoder/<format>`."""
    return f"compiled_decoder/{fmt.name}"


def _compiled_into(rows: torch.Tensor, extra: torch.Tensor | None, fmt: PackedFormat, out: torch.Tensor) -> bool:
    """Decode into `out` through the compiled kernel and return True; False (`out` untouched) where
    this format, device and dtype decode eagerly after a failed or differing first try.

    The first call per format, device, dtype (and torch) is the kernel's trial (`lingbot_core.kernels`):
    compiled, then checked against the eager decoder bit for bit; a compile failure (no C++ compiler,
    an op it cannot lower) or any difference leaves `out` decoded eagerly and the format eager for the
    rest of the process, with one warning."""
    name = kernel_name(fmt)
    if not kernels.usable(name, out.device, out.dtype):
        return False
    first = kernels.verdict(name, out.device, out.dtype) is None

    def compiled() -> bool:
        if not first:
            _kernel(fmt)(rows, extra, out)
            return True
        log.info("lingbot: compiling the %s -> %s weight decoder on %s (once per process)", fmt.name,
                 str(out.dtype).replace("torch.", ""), out.device.type)
        # one small C++ kernel: compiled in this process (no pool of compile workers, one per CPU core,
        # started on a big server for it); inductor's note on mixing fp16 scales with bf16 output is noise
        import torch._inductor.config as inductor_config

        with inductor_config.patch(compile_threads=1), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="bf16 and fp16 are mixed")
            _kernel(fmt)(rows, extra, out)
        return True

    def eager() -> bool:
        _eager_into(rows, extra, fmt, out)
        return True

    def against_eager(_done: bool) -> str | None:
        expected = torch.empty_like(out)
        _eager_into(rows, extra, fmt, expected)
        return None if same_values(out, expected) else "its values differ from the eager decoder's"

    kernels.run(name, compiled, eager, device=out.device, dtype=out.dtype, check=against_eager,
                label=f"the compiled {fmt.name} weight decoder")
    return True


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same floats bit for bit (signed zeros told apart), except that any NaN equals any NaN: a
    compiled cast may write another NaN payload than the eager one."""
    nan = a.isnan()
    if not torch.equal(nan, b.isnan()):
        return False
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.view(width)[~nan], b.view(width)[~nan])


def decode_rows(rows: torch.Tensor, per_row: int, fmt: PackedFormat, dtype: torch.dtype, device: torch.device,
                extra: torch.Tensor | None = None, decoder: str = "auto", out: torch.Tensor | None = None) -> torch.Tensor:
    """`rows` of `fmt` (each decoding to `per_row` values, with per-row `extra` where the format has
    one) decoded into one [len(rows), per_row] tensor of `dtype` (`out`, a contiguous tensor of that
    many values and `dtype`, where given): by the compiled kernel where `wants_compiled` says so and
    it is trusted, else eagerly piece by piece.

    While tracing for `torch.compile` the traced form in one call (the compiler fuses the passes
    itself and a Python loop would unroll into the graph)."""
    n = rows.shape[0]
    if fmt.rows_dtype is not None:
        rows = rows.view(fmt.rows_dtype)
    if torch.compiler.is_compiling() and out is None:
        return fmt.fusable(rows, extra).reshape(n, per_row).to(dtype)
    compiled = n > 0 and wants_compiled(fmt, decoder, n * per_row, device)
    if out is None:
        if not compiled and n <= _piece_rows(device, per_row):
            return fmt.eager(rows, extra).reshape(n, per_row).to(dtype)
        out = torch.empty(n, per_row, dtype=dtype, device=device)
    else:
        out = out.view(n, per_row)
    if compiled and _compiled_into(rows, extra, fmt, out):
        return out
    _eager_into(rows, extra, fmt, out)
    return out
