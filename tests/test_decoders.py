"""Compiled weight decoders (`weights.decode`): same values as the eager decoders, chosen only where
`auto` should, and a compile that fails or differs falls back to eager for good, with the output right."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from bench.speed_dit import random_blocks
from lingbot_core import kernels
from lingbot_core.weights import decode, gguf_codec
from lingbot_core.weights.fp8 import FP8_ROWS, dequantize_fp8, quantize_fp8
from lingbot_core.weights.modules import (
    FP8,
    Packing,
    QuantizedExperts,
    QuantizedLinear,
    pack_fp8,
    set_decoder,
)


def _judged() -> list[tuple[str, str, str, str]]:
    """(kernel, device, dtype, verdict) of every fast kernel judged so far (`lingbot_core.kernels`; each
    test starts with none, tests/conftest.py; the compiled kernels themselves stay cached)."""
    return [(r["kernel"], r["device"], r["dtype"], r["verdict"]) for r in kernels.verdicts()]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _gguf_bytes(kind: GGMLQuantizationType, rows: int, width: int, seed: int = 0) -> torch.Tensor:
    weight = torch.randn(rows, width, generator=torch.Generator().manual_seed(seed)) * 0.02
    weight[0, :32] = 0  # an all-zero block
    return torch.from_numpy(np.ascontiguousarray(quantize(weight.numpy(), kind)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_compiled_decoders_give_the_eager_values_bit_for_bit(dtype):
    q8 = _gguf_bytes(GGMLQuantizationType.Q8_0, 8, 256)
    got = gguf_codec.dequantize(q8, int(GGMLQuantizationType.Q8_0), (8, 256), dtype, decoder="compiled")
    want = gguf_codec.dequantize(q8, int(GGMLQuantizationType.Q8_0), (8, 256), dtype, decoder="eager")
    assert torch.equal(_bits(got), _bits(want))

    k4 = random_blocks(GGMLQuantizationType.Q4_K, 6, torch.Generator().manual_seed(0))
    got = gguf_codec.dequantize(k4, int(GGMLQuantizationType.Q4_K), (6, 256), dtype, decoder="compiled")
    want = gguf_codec.dequantize(k4, int(GGMLQuantizationType.Q4_K), (6, 256), dtype, decoder="eager")
    assert torch.equal(_bits(got), _bits(want))

    # fp8: every byte (NaN bytes and subnormals included) under a tiny, a plain and a large row scale
    every_byte = torch.arange(256, dtype=torch.uint8).repeat(3, 1).view(torch.float8_e4m3fn)
    scale = torch.tensor([3e-38, 3.7e-3, 2.5e4])
    got = dequantize_fp8(every_byte, scale, dtype, decoder="compiled")
    want = dequantize_fp8(every_byte, scale, dtype, decoder="eager")
    assert decode.same_values(got, want)  # NaN bytes may decode to another NaN payload compiled
    assert got.isnan().sum() == 6
    assert [v for *_rest, v in _judged()] == [kernels.FAST] * 3


def test_same_values_tells_signed_zeros_apart_and_any_nan_from_a_number():
    a = torch.tensor([0.0, 1.0, float("nan")])
    assert decode.same_values(a, torch.tensor([0.0, 1.0, -float("nan")]))
    assert not decode.same_values(a, torch.tensor([-0.0, 1.0, float("nan")]))
    assert not decode.same_values(a, torch.tensor([0.0, 1.0, 2.0]))
    assert not decode.same_values(a, torch.tensor([0.0, 1.0000001, float("nan")]))


def test_auto_compiles_only_big_weights_of_compiling_formats_on_measured_devices():
    big, small = decode.COMPILE_MIN_VALUES, decode.COMPILE_MIN_VALUES - 1
    cpu = torch.device("cpu")
    q6k = gguf_codec.BLOCK_TYPES[GGMLQuantizationType.Q6_K]
    assert not q6k.compiles  # measured slower compiled (bench/speed_dit.py --only decoders)
    q8 = gguf_codec.BLOCK_TYPES[GGMLQuantizationType.Q8_0].rows_format("Q8_0")
    assert decode.wants_compiled(q8, "auto", big, cpu)
    assert decode.wants_compiled(FP8_ROWS, "auto", big, cpu)
    assert not decode.wants_compiled(q8, "auto", small, cpu)
    assert not decode.wants_compiled(q6k.rows_format("Q6_K"), "auto", big, cpu)
    assert not decode.wants_compiled(q8, "auto", big, torch.device("meta"))  # a device type not measured
    assert not decode.wants_compiled(q8, "eager", big, cpu)
    assert decode.wants_compiled(q6k.rows_format("Q6_K"), "compiled", 1, cpu)  # asked for: used anyway


def test_a_failing_compile_falls_back_to_eager_once_and_for_all(monkeypatch, caplog):
    calls = []

    def broken(fmt):
        def kernel(rows, extra, out):
            calls.append(fmt.name)
            raise RuntimeError("no C++ compiler found\nmore detail")
        return kernel

    monkeypatch.setattr(decode, "_kernel", broken)
    q8 = _gguf_bytes(GGMLQuantizationType.Q8_0, 4, 64)
    want = gguf_codec.dequantize(q8, int(GGMLQuantizationType.Q8_0), (4, 64), torch.bfloat16, decoder="eager")
    with caplog.at_level(logging.WARNING, logger="lingbot_core.weights.decode"):
        for _ in range(3):
            got = gguf_codec.dequantize(q8, int(GGMLQuantizationType.Q8_0), (4, 64), torch.bfloat16,
                                        decoder="compiled")
            assert torch.equal(_bits(got), _bits(want))
    assert calls == ["Q8_0"]  # tried once
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "no C++ compiler found" in warnings[0] and "decoding eagerly" in warnings[0]
    assert _judged() == [("compiled_decoder/Q8_0", "cpu", "bfloat16", kernels.REFUSED)]


def test_a_compiled_decoder_that_differs_is_not_trusted(monkeypatch, caplog):
    def off_by_one(fmt):
        def kernel(rows, extra, out):
            out.copy_(fmt.eager(rows, extra).reshape(out.shape) + 1)
        return kernel

    monkeypatch.setattr(decode, "_kernel", off_by_one)
    weight = torch.randn(4, 64) * 0.02
    q, s = quantize_fp8(weight)
    want = dequantize_fp8(q, s, torch.float32, decoder="eager")
    with caplog.at_level(logging.WARNING, logger="lingbot_core.weights.decode"):
        first = dequantize_fp8(q, s, torch.float32, decoder="compiled")
        second = dequantize_fp8(q, s, torch.float32, decoder="compiled")
    assert torch.equal(first, want) and torch.equal(second, want)
    assert any("differs from the eager decoder" in r.getMessage() for r in caplog.records)
    assert _judged() == [("compiled_decoder/fp8_e4m3", "cpu", "float32", kernels.MISMATCH)]


def test_set_decoder_reaches_every_packed_module_and_refuses_unknown_names():
    weight = torch.randn(16, 32) * 0.02
    data, scale = pack_fp8(weight)
    linear = QuantizedLinear(Packing(FP8, (16, 32)), data, scale, None, torch.float32)
    stacked = torch.randn(2, 8, 32) * 0.02
    packed = {name: (Packing(FP8, tuple(stacked.shape)), *pack_fp8(stacked)) for name in QuantizedExperts.NAMES}
    model = torch.nn.ModuleDict({"linear": linear, "experts": QuantizedExperts(packed, torch.float32)})
    assert linear.decoder == "auto" and model["experts"].decoder == "auto"
    assert set_decoder(model, "eager") == 2
    assert linear.decoder == "eager" and model["experts"].decoder == "eager"
    with pytest.raises(ValueError, match="auto, eager, compiled"):
        set_decoder(model, "fast")
    x = torch.randn(3, 32)
    eager = linear(x)
    set_decoder(model, "compiled")
    assert torch.equal(linear(x), eager)
    assert torch.equal(model["experts"].stack("w1"), model["experts"].stack("w1").clone())


def test_compiled_decode_runs_under_inference_mode_in_a_worker_thread():
    """As ComfyUI runs a node: in its prompt thread, under `torch.inference_mode()`, the packed bytes
    made outside it."""
    import threading

    weight = torch.randn(8, 128) * 0.02
    q, s = quantize_fp8(weight)
    q8 = _gguf_bytes(GGMLQuantizationType.Q4_0, 8, 128, seed=3)
    results = {}

    def node():
        with torch.inference_mode():
            results["fp8"] = (dequantize_fp8(q, s, torch.bfloat16, decoder="compiled"),
                              dequantize_fp8(q, s, torch.bfloat16, decoder="eager"))
            results["q4_0"] = tuple(gguf_codec.dequantize(q8, int(GGMLQuantizationType.Q4_0), (8, 128), torch.bfloat16,
                                                          decoder=way) for way in ("compiled", "eager"))

    worker = threading.Thread(target=node)
    worker.start()
    worker.join(timeout=300)
    assert set(results) == {"fp8", "q4_0"}
    for got, want in results.values():
        assert decode.same_values(got, want)
    assert _judged() and all(v == kernels.FAST for *_rest, v in _judged())  # compiled, not fallen back


@pytest.mark.parametrize("kind", [GGMLQuantizationType.F16, GGMLQuantizationType.Q4_0])
def test_decoding_into_a_given_tensor_writes_the_same_values_there(kind):
    weight = torch.randn(2, 4, 64) * 0.02
    if kind == GGMLQuantizationType.F16:
        stored = weight.half().view(torch.uint8).reshape(2, 4, 128)
    else:
        stored = _gguf_bytes(kind, 8, 64).reshape(2, 4, -1)
    want = gguf_codec.dequantize(stored, int(kind), (2, 4, 64), torch.bfloat16)
    scratch = torch.full((3, 4, 64), float("nan"), dtype=torch.bfloat16)
    got = gguf_codec.dequantize(stored, int(kind), (2, 4, 64), torch.bfloat16, out=scratch[:2])
    assert got.data_ptr() == scratch.data_ptr() and torch.equal(scratch[:2], want)
    assert scratch[2].isnan().all()  # nothing written past the given part
