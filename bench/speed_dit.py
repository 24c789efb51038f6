"""DiT-level speed and memory levers, each against its baseline in one process, reported as ratios.

The DiT-forward sections of `bench/speed.py` (registered there under the names below, run with
its `--quick` flag when it has it); this file also runs alone with its own shapes. Every
measurement is one function `measure_<what>(args) -> dict` listed in `MEASUREMENTS`. Models are
random-weight DiTs built in memory at the width given (default: the real width, hidden 2048, 16
heads, FFN 6144, MoE 128 experts top-8) and `--depth` blocks; quantized copies are packed in memory
with the pack's own packers (fp8: `weights.modules.pack_fp8`; GGUF: the `gguf` package's
quantizer, as the quantize command writes them), so no files are written. Random weights: output
differences measure the mechanism, not quality.

Rows:
- `quantized`: forward time of fp8 / GGUF-Q8_0 / GGUF-Q4_0 DiTs relative to the same model in bf16,
  with the decode paths before this work (fp8 by an fp32 cast, packed experts expert by expert)
  and today's (fp8 by table, packed experts on the grouped matmul), in turn, best of `--repeats`;
- `decode`: one packed weight decoded to bf16, in one pass (before) vs in pieces vs one compiled
  kernel (`weights.decode`), beside a bf16 matmul of the same weight for scale;
- `decoders`: every packed format, eager vs compiled decoder (`weights.decode`), ns per value: the
  evidence for which formats `auto` compiles;
- `spans`: a packed MoE forward with its experts decoded `--spans` at a time (CPU), over bf16;
- `fp8_matmul`: which fp8 matmul path `weights.fp8.choose_fp8_matmul` picks on this machine; the
  scaled fp8 matmul row is "not run" without a CUDA GPU of compute capability 9.0+;
- `chunked`: peak CPU bytes allocated by one block forward, FFN/MoE over token chunks vs whole
  (`bench/_common.cpu_peak_bytes`), and the largest output difference;
- `estimate`: what `placement/estimate.py` says for the MoE base + refine plan, per FFN chunk size;
- `compile`: regional torch.compile of the blocks (inductor on CPU) vs eager: first-call time,
  steady forward ratio, max difference;
- `cfg_batch`: CFG as one batch-2 forward vs two batch-1 forwards, per kind and format (where
  `cfg_batch="auto"` batches).

    python bench/speed_dit.py --only quantized --tokens 1280          # real width, 1 block
    python bench/speed_dit.py --quick                                  # tiny sizes (the smoke test)
    python bench/speed_dit.py --only quantized --kinds moe --formats fp8 --no-before --repeats 1

Each row is printed (flushed) as soon as it is measured, so a run cut short still leaves its rows;
`--kinds` and `--formats` pick one variant at a time.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("KINETO_LOG_LEVEL", "5")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python bench/x.py` from a plain checkout

import torch
import torch.nn as nn

from bench._common import environment, print_machine, table, write_json
from lingbot_core.models.transformer import LingBotVideoTransformer3DModel

REAL = dict(hidden_size=2048, num_attention_heads=16, intermediate_size=6144, text_dim=2560, freq_dim=256,
            axes_dims=[32, 48, 48])
REAL_MOE = dict(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, n_shared_experts=1,
                n_group=4, topk_group=2, routed_scaling_factor=2.5, score_func="sigmoid", norm_topk_prob=True)
QUICK = dict(hidden_size=256, num_attention_heads=2, intermediate_size=512, text_dim=64, freq_dim=32,
             axes_dims=[32, 48, 48])
QUICK_MOE = dict(REAL_MOE, num_experts=8, moe_intermediate_size=64, n_group=2, topk_group=1, num_experts_per_tok=2)
FORMATS = ("bf16", "fp8", "gguf-q8_0", "gguf-q4_0")


# -- models ------------------------------------------------------------------------------------------

def dit_config(kind: str, depth: int, quick: bool) -> dict[str, Any]:
    cfg = dict(QUICK if quick else REAL, depth=depth)
    if kind == "moe":
        cfg.update(QUICK_MOE if quick else REAL_MOE)
    return cfg


def build_model(kind: str, depth: int, quick: bool, dtype: torch.dtype = torch.bfloat16,
                seed: int = 0) -> LingBotVideoTransformer3DModel:
    """A random-weight DiT (norm gains 1, everything else N(0, 0.02)) stored as `dtype` (fp32 set kept)."""
    g = torch.Generator().manual_seed(seed)
    model = LingBotVideoTransformer3DModel(**dit_config(kind, depth, quick))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name.split(".")[-2]:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    return model.to(dtype).eval()


def _gguf_pack(weight: torch.Tensor, qtype_name: str):
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from lingbot_core.weights.modules import Packing

    kind = GGMLQuantizationType[qtype_name]
    rows = weight.reshape(-1, weight.shape[-1]).float().numpy()
    data = np.concatenate([quantize(rows[i:i + 2048], kind) for i in range(0, rows.shape[0], 2048)])
    packed = torch.from_numpy(data).reshape(*weight.shape[:-1], -1)
    return Packing("gguf", tuple(weight.shape), int(kind)), packed, None


def pack_in_memory(model: nn.Module, fmt_name: str) -> nn.Module:
    """Swap every block linear and expert stack for the quantized module the loader would make."""
    from lingbot_core.models.moe import ExpertWeights
    from lingbot_core.models.precision import stays_float32
    from lingbot_core.weights.modules import FP8, Packing, QuantizedExperts, QuantizedLinear, pack_fp8

    if fmt_name == "bf16":
        return model

    def pack(weight: torch.Tensor):
        if fmt_name == "fp8":
            data, scale = pack_fp8(weight)
            return Packing(FP8, tuple(weight.shape)), data, scale
        return _gguf_pack(weight, fmt_name.split("-")[1].upper())

    for name, module in list(model.blocks.named_modules()):
        if not name or stays_float32(name):
            continue
        parent, _, leaf = name.rpartition(".")
        owner = model.blocks.get_submodule(parent) if parent else model.blocks
        if isinstance(module, nn.Linear):
            packing, data, scale = pack(module.weight.data)
            bias = module.bias.data if module.bias is not None else None
            setattr(owner, leaf, QuantizedLinear(packing, data, scale, bias, torch.bfloat16))
        elif isinstance(module, ExpertWeights):
            packed = {w: pack(getattr(module, w).data) for w in QuantizedExperts.NAMES}
            setattr(owner, leaf, QuantizedExperts(packed, torch.bfloat16))
    return model


def dit_inputs(cfg: dict[str, Any], video_tokens: int, text_tokens: int, batch: int = 1, seed: int = 1):
    """Latents whose patch grid holds `video_tokens` tokens (1 frame, rows x cols), text features, timestep."""
    rows = max(1, int(round(video_tokens ** 0.5)))
    while video_tokens % rows:
        rows -= 1
    cols = video_tokens // rows
    g = torch.Generator().manual_seed(seed)
    latents = torch.randn(batch, 16, 1, 2 * rows, 2 * cols, generator=g)
    text = torch.randn(batch, text_tokens, cfg["text_dim"], generator=g)
    return latents, torch.full((batch,), 700.0), text


def emit(section: str, row: dict[str, Any]) -> None:
    """Print one measured row at once (flushed), so a run cut short by a timeout still leaves its rows."""
    cells = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items())
    print(f"[{section}] {cells}", flush=True)


def timed(fn: Callable[..., Any], *args: Any) -> tuple[float, Any]:
    """Seconds `fn(*args)` took, and its result."""
    start = time.perf_counter()
    result = fn(*args)
    return time.perf_counter() - start, result


# -- measurements ------------------------------------------------------------------------------------

def _old_q4_0(blocks: torch.Tensor) -> torch.Tensor:
    """The Q4_0 decoder before the piecewise work (nibbles stacked, then converted): the baseline."""
    q = torch.stack((blocks[:, None, 2:] & 0x0F, blocks[:, None, 2:] >> 4), dim=-2).reshape(blocks.shape[0], 32)
    return blocks[:, :2].contiguous().view(torch.float16).float() * (q.float() - 8.0)


class _OnePassDecode:
    """Weights decoded the way they were before `weights.decode`: the whole tensor in one pass (no
    pieces) and the old Q4_0 decoder; the values are the same (tested)."""

    def __enter__(self):
        from gguf import GGMLQuantizationType

        from lingbot_core.weights import decode, gguf_codec

        self._pieces = dict(decode.PIECE_VALUES)
        decode.PIECE_VALUES["cpu"] = 1 << 62
        q4 = GGMLQuantizationType.Q4_0
        self._q4 = gguf_codec.BLOCK_TYPES[q4]
        gguf_codec.BLOCK_TYPES[q4] = gguf_codec.BlockType(_old_q4_0, self._q4.half_fields)
        return self

    def __exit__(self, *exc):
        from gguf import GGMLQuantizationType

        from lingbot_core.weights import decode, gguf_codec

        decode.PIECE_VALUES.clear()
        decode.PIECE_VALUES.update(self._pieces)
        gguf_codec.BLOCK_TYPES[GGMLQuantizationType.Q4_0] = self._q4


def _fp32_cast_decode(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, decoder: str = "auto",
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """fp8 decoded by an fp32 cast, as before the table decode (`_Legacy`)."""
    values = (q.float() * scale.float()[..., None]).to(dtype)
    return values if out is None else out.view(values.shape).copy_(values)


class _Legacy:
    """The decode paths as they were before the speed work, for the `before` column: fp8 decoded by
    an fp32 cast, packed experts run expert by expert (the grouped path switched off), every weight
    decoded in one pass (`_OnePassDecode`)."""

    def __init__(self, model: nn.Module):
        self.model = model

    def __enter__(self):
        from lingbot_core.models.moe import SparseMoE
        from lingbot_core.weights import modules

        self._saved = modules.dequantize_fp8
        modules.dequantize_fp8 = _fp32_cast_decode
        self._moes = [m for m in self.model.modules() if isinstance(m, SparseMoE)]
        for m in self._moes:
            m.use_grouped_mm = False
        modules.set_decoder(self.model, "eager")
        self._one_pass = _OnePassDecode().__enter__()
        return self

    def __exit__(self, *exc):
        from lingbot_core.weights import modules

        self._one_pass.__exit__(*exc)
        modules.dequantize_fp8 = self._saved
        modules.set_decoder(self.model, "auto")
        for m in self._moes:
            m.use_grouped_mm = True


def measure_decode(args: argparse.Namespace) -> dict[str, Any]:
    """Decode time of one packed weight to bf16: one pass (as before `weights.decode`, `_OnePassDecode`)
    vs in pieces (today), a few calls of each in turn, best of 3 x `--repeats` (at least 3); a [6144, 2048] FFN linear and
    a stacked [16, 768, 2048] expert tensor (16 of the 128 experts), each next to a bf16 matmul of
    that linear at `--tokens` + `--text-tokens` tokens for scale."""
    import torch.nn.functional as F

    from lingbot_core.weights.decode import same_values
    from lingbot_core.weights.modules import unpack

    shapes = {"linear": (6144, 2048), "experts": (16, 768, 2048)}
    if args.quick:
        shapes = {"linear": (512, 256), "experts": (4, 64, 256)}
    repeats = max(3, args.repeats)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for where, shape in shapes.items():
        weight = torch.randn(shape, generator=gen) * 0.02
        x = torch.randn(args.tokens + args.text_tokens, shape[-1], generator=gen).bfloat16()
        flat = weight.reshape(-1, shape[-1]).bfloat16()
        matmul = min(timed(F.linear, x, flat)[0] for _ in range(repeats))
        for fmt_name in args.formats:
            if fmt_name == "bf16":
                continue
            if fmt_name == "fp8":
                from lingbot_core.weights.modules import FP8, Packing, pack_fp8

                data, scale = pack_fp8(weight)
                packing = Packing(FP8, shape)
            else:
                packing, data, scale = _gguf_pack(weight, fmt_name.split("-")[1].upper())
            times: dict[str, list[float]] = {"before": [], "after": [], "compiled": []}
            decoded = {}
            for _ in range(repeats):  # a few calls of each in turn: the allocator settles per way of decoding
                with _OnePassDecode():
                    for _ in range(3):
                        seconds, decoded["before"] = timed(unpack, packing, data, scale, torch.bfloat16, "eager")
                        times["before"].append(seconds)
                for way, decoder in (("after", "eager"), ("compiled", "compiled")):
                    for _ in range(3):  # the first compiled call compiles (and is checked against eager)
                        seconds, decoded[way] = timed(unpack, packing, data, scale, torch.bfloat16, decoder)
                        times[way].append(seconds)
            best = {k: min(v) for k, v in times.items()}
            rows.append({"weight": where, "shape": "x".join(map(str, shape)), "format": fmt_name,
                         "before_ms": best["before"] * 1e3, "after_ms": best["after"] * 1e3,
                         "compiled_ms": best["compiled"] * 1e3,
                         "ratio": best["after"] / best["before"], "compiled_ratio": best["compiled"] / best["before"],
                         "matmul_ms": matmul * 1e3, "after_x_matmul": best["after"] / matmul,
                         "compiled_x_matmul": best["compiled"] / matmul,
                         "equal": all(same_values(decoded["before"], v) for v in decoded.values())})
            emit("decode", rows[-1])
    text = table(["weight", "shape", "format", "one pass ms", "pieces ms", "compiled ms", "pieces x one pass",
                  "compiled x one pass", f"bf16 matmul ms ({args.tokens + args.text_tokens} tokens)", "pieces x matmul",
                  "compiled x matmul", "same values"],
                 [[r["weight"], r["shape"], r["format"], r["before_ms"], r["after_ms"], r["compiled_ms"], r["ratio"],
                   r["compiled_ratio"], r["matmul_ms"], r["after_x_matmul"], r["compiled_x_matmul"], str(r["equal"])]
                  for r in rows])
    return {"rows": rows, "text": text}


def measure_quantized(args: argparse.Namespace) -> dict[str, Any]:
    """Forward time of each stored format over bf16, same weights, in this process: bf16, the format
    with the old decode paths (`before`, see `_Legacy`; skipped with `--no-before`), with today's
    decoders forced eager (`eager`, `weights.modules.set_decoder`) and with today's default (`after`:
    `auto`, compiled decoders on CPU), in turn, best of `--repeats` (the first `after` call compiles,
    so take at least 2); the output's relative L2 error against bf16."""
    from lingbot_core.weights.modules import set_decoder

    rows = []
    for kind in args.kinds:
        base = build_model(kind, args.depth, args.quick)
        cfg = dict(base.config)
        inputs = dit_inputs(cfg, args.tokens, args.text_tokens, batch=args.batch)
        with torch.no_grad():
            reference = base(*inputs).sample.float()
            for fmt_name in args.formats:
                if fmt_name == "bf16":
                    continue
                packed = pack_in_memory(build_model(kind, args.depth, args.quick), fmt_name)
                times: dict[str, list[float]] = {"bf16": [], "before": [], "eager": [], "after": []}
                out = None
                for _ in range(args.repeats):
                    times["bf16"].append(timed(base, *inputs)[0])
                    if args.before:
                        with _Legacy(packed):
                            times["before"].append(timed(packed, *inputs)[0])
                    set_decoder(packed, "eager")
                    times["eager"].append(timed(packed, *inputs)[0])
                    set_decoder(packed, "auto")
                    seconds, out = timed(packed, *inputs)
                    times["after"].append(seconds)
                best = {k: min(v) if v else float("nan") for k, v in times.items()}
                rel = float((out.sample.float() - reference).norm() / reference.norm())
                rows.append({"kind": kind, "format": fmt_name, "tokens": args.tokens, "batch": args.batch, "bf16_s": best["bf16"],
                             "before_s": best["before"], "eager_s": best["eager"], "after_s": best["after"],
                             "before_ratio": best["before"] / best["bf16"], "eager_ratio": best["eager"] / best["bf16"],
                             "after_ratio": best["after"] / best["bf16"], "rel_l2": rel})
                emit("quantized", rows[-1])
                del packed
        del base
    text = table(["kind", "format", "video tokens", "batch", "bf16 s", "before x bf16", "eager x bf16", "after x bf16",
                  "rel L2 vs bf16"],
                 [[r["kind"], r["format"], str(r["tokens"]), str(r["batch"]), r["bf16_s"], r["before_ratio"], r["eager_ratio"],
                   r["after_ratio"], r["rel_l2"]] for r in rows])
    return {"rows": rows, "text": text}


def _block_args(model: LingBotVideoTransformer3DModel, index: int, inputs) -> tuple:
    """The arguments block `index` receives in a forward of `inputs` (captured by a pre-hook)."""
    captured: dict[str, Any] = {}
    hook = model.blocks[index].register_forward_pre_hook(lambda mod, a: captured.setdefault("args", a))
    with torch.no_grad():
        model(*inputs)
    hook.remove()
    return captured["args"]


def measure_chunked(args: argparse.Namespace) -> dict[str, Any]:
    """Peak CPU bytes torch allocates during one block forward (the block's own inputs excluded),
    FFN/MoE over `--chunk` tokens at a time vs the whole sequence, and the largest output difference."""
    from bench._common import bf16_steps, cpu_peak_bytes, max_abs_diff

    rows = []
    for kind in args.kinds:
        model = build_model(kind, 1, args.quick)
        inputs = dit_inputs(dict(model.config), args.chunk_tokens, args.text_tokens)
        block_args = _block_args(model, 0, inputs)
        block = model.blocks[0]
        results = {}
        with torch.no_grad():
            for chunk in (None, args.chunk):
                block.ffn_chunk = chunk
                start = time.perf_counter()
                peak, out = cpu_peak_bytes(lambda: block(*block_args))  # noqa: B023 (called at once)
                results[chunk] = (peak, out, time.perf_counter() - start)
        block.ffn_chunk = None
        (whole_peak, whole, whole_s), (part_peak, part, part_s) = results[None], results[args.chunk]
        rows.append({"kind": kind, "tokens": whole.shape[1], "chunk": args.chunk, "peak_whole": whole_peak,
                     "peak_chunked": part_peak, "peak_ratio": part_peak / whole_peak, "time_ratio": part_s / whole_s,
                     "max_abs_diff": max_abs_diff(part, whole), "bf16_steps": bf16_steps(part, whole),
                     "bit_identical": torch.equal(part, whole)})
    from bench._common import fmt_bytes

    text = table(["kind", "tokens", "chunk", "peak whole", "peak chunked", "peak ratio", "time ratio",
                  "max |diff|", "bf16 steps", "bit-identical"],
                 [[r["kind"], str(r["tokens"]), str(r["chunk"]), fmt_bytes(r["peak_whole"]),
                   fmt_bytes(r["peak_chunked"]), r["peak_ratio"], r["time_ratio"], r["max_abs_diff"],
                   str(r["bf16_steps"]), r["bit_identical"]] for r in rows])
    return {"rows": rows, "text": text}


def measure_estimate(args: argparse.Namespace) -> dict[str, Any]:
    """What the accelerator-memory estimate says for the MoE base 832x480x121 + refine 1920x1088 plan
    (tiled decode; the estimate is the same for offload_to ram or disk), per FFN chunk size."""
    from bench.memory_table import REFINE, build
    from lingbot_core.placement import estimate
    from lingbot_core.placement.estimate import FFN_CHUNKS, GiB, ffn_chunk_tokens

    sizes = estimate.ModelSizes.from_modules(build("moe"))
    rows = []
    for chunk in (None, *FFN_CHUNKS):
        geometry = estimate.Geometry(height=480, width=832, num_frames=121, refine=REFINE, vae_tiling=True,
                                   ffn_chunk=chunk)
        rows.append({"chunk": chunk, **{m: estimate.estimate_peak(m, sizes, geometry) for m in ("group", "sequential")}})
    plan = estimate.Geometry(height=480, width=832, num_frames=121, refine=REFINE, vae_tiling=True)
    picked = {m: ffn_chunk_tokens(m, sizes, plan, 22 * GiB) for m in ("group", "sequential")}
    text = table(["FFN chunk (tokens)", "group GiB", "sequential GiB"],
                 [[str(r["chunk"] or "whole"), r["group"] / GiB, r["sequential"] / GiB] for r in rows])
    text += f"\nchunk picked for a 22 GiB budget (reserve included): {picked}"
    return {"rows": rows, "picked_for_22GiB": picked, "text": text}


def random_blocks(kind: Any, blocks: int, gen: torch.Generator) -> torch.Tensor:
    """`blocks` GGUF blocks of `kind` made of random bytes, their float16 scale fields set to small
    finite values (so nothing decodes to NaN/inf): any block type, the K-quants included, which the
    `gguf` package cannot quantize."""
    from lingbot_core.weights import gguf_codec

    stored = torch.randint(0, 256, (blocks, gguf_codec.block_bytes(int(kind))), dtype=torch.uint8, generator=gen)
    for at in gguf_codec.half_fields(int(kind)):
        stored[:, at:at + 2] = (torch.rand(blocks, 1, generator=gen) * 1e-3).half().view(torch.uint8)
    return stored


def measure_decoders(args: argparse.Namespace) -> dict[str, Any]:
    """Every packed format the pack reads (each GGUF block type of `weights.gguf_codec.BLOCK_TYPES`,
    and fp8): one [1536, 2048] weight of random stored bytes (valid float16 scale fields, so no NaN)
    decoded to bf16 by the eager decoder (in pieces) and by its compiled kernel, best of 3 x
    `--repeats`, ns per value, whether the values are the same, and whether the registry lets `auto`
    compile it (`compiles`). The evidence behind those flags."""
    from lingbot_core.weights import decode, gguf_codec
    from lingbot_core.weights.fp8 import FP8_ROWS

    values = 256 * 1024 if args.quick else 1536 * 2048
    repeats = max(3, args.repeats)
    gen = torch.Generator().manual_seed(0)
    cases = []
    for kind, block in gguf_codec.BLOCK_TYPES.items():
        per_block = gguf_codec.block_values(int(kind))
        stored = random_blocks(kind, values // per_block, gen)
        cases.append((block.rows_format(kind.name), stored, None, per_block))
    fp8_bytes = torch.randint(0, 256, (values // 2048, 2048), dtype=torch.uint8, generator=gen)
    fp8_bytes[(fp8_bytes & 0x7F) == 0x7F] = 0  # no NaN bytes
    cases.append((FP8_ROWS, fp8_bytes.view(torch.float8_e4m3fn), torch.rand(values // 2048, generator=gen) * 1e-3, 2048))
    rows = []
    for fmt, stored, extra, per_row in cases:
        got = {}
        times: dict[str, list[float]] = {"eager": [], "compiled": []}
        for _ in range(repeats):
            for way in times:
                seconds, got[way] = timed(decode.decode_rows, stored, per_row, fmt, torch.bfloat16, stored.device,
                                          extra, way)
                times[way].append(seconds)
        best = {k: min(v) for k, v in times.items()}
        rows.append({"format": fmt.name, "values": stored.shape[0] * per_row,
                     "eager_ns": best["eager"] / (stored.shape[0] * per_row) * 1e9,
                     "compiled_ns": best["compiled"] / (stored.shape[0] * per_row) * 1e9,
                     "ratio": best["compiled"] / best["eager"], "compiles": fmt.compiles,
                     "equal": decode.same_values(got["eager"], got["compiled"])})
        emit("decoders", rows[-1])
    text = table(["format", "values", "eager ns/value", "compiled ns/value", "compiled x eager", "auto compiles",
                  "same values"],
                 [[r["format"], str(r["values"]), r["eager_ns"], r["compiled_ns"], r["ratio"], str(r["compiles"]),
                   str(r["equal"])] for r in rows])
    return {"rows": rows, "text": text}


def measure_spans(args: argparse.Namespace) -> dict[str, Any]:
    """MoE forward time with packed experts decoded `--spans` experts at a time on the grouped path
    (`weights.modules.GROUPED_SPAN_VALUES` set for each in turn, the same packed model), over the bf16
    model, alternating, best of `--repeats`: the evidence for the CPU's span size."""
    import math

    from lingbot_core.weights import modules

    rows = []
    base = build_model("moe", args.depth, args.quick)
    inputs = dit_inputs(dict(base.config), args.tokens, args.text_tokens, batch=args.batch)
    saved = dict(modules.GROUPED_SPAN_VALUES)
    try:
        with torch.no_grad():
            for fmt_name in [f for f in args.formats if f != "bf16"]:
                packed = pack_in_memory(build_model("moe", args.depth, args.quick), fmt_name)
                experts = next(m for m in packed.modules() if isinstance(m, modules.QuantizedExperts))
                per_expert = sum(math.prod(experts.packings[n].shape[1:]) for n in experts.NAMES)
                packed(*inputs)  # compiles the decoders once, outside the timing
                times: dict[Any, list[float]] = {"bf16": [], **{n: [] for n in args.spans}}
                for _ in range(args.repeats):
                    times["bf16"].append(timed(base, *inputs)[0])
                    for n in args.spans:
                        modules.GROUPED_SPAN_VALUES["cpu"] = n * per_expert
                        times[n].append(timed(packed, *inputs)[0])
                bf16 = min(times["bf16"])
                for n in args.spans:
                    rows.append({"format": fmt_name, "tokens": args.tokens, "span": n, "bf16_s": bf16,
                                 "ratio": min(times[n]) / bf16})
                    emit("spans", rows[-1])
                del packed
    finally:
        modules.GROUPED_SPAN_VALUES.clear()
        modules.GROUPED_SPAN_VALUES.update(saved)
    text = table(["format", "video tokens", "experts a span", "bf16 s", "x bf16"],
                 [[r["format"], str(r["tokens"]), str(r["span"]), r["bf16_s"], r["ratio"]] for r in rows])
    return {"rows": rows, "text": text}


def measure_fp8_matmul(args: argparse.Namespace) -> dict[str, Any]:
    """The fp8 matmul path `auto` picks here; the scaled fp8 matmul itself needs a CUDA GPU whose torch runs
    it (tried on its first call, `lingbot_core.kernels`: where it refuses, the timed layer decodes)."""
    from lingbot_core.weights.fp8 import choose_fp8_matmul, scaled_mm_problem

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    width = dit_config("dense", 1, args.quick)["hidden_size"]
    problem = scaled_mm_problem(device, torch.bfloat16, width, width)
    rows = [{"device": str(device), "auto_picks": choose_fp8_matmul("auto", device, torch.bfloat16, width, width),
             "scaled_mm": "not run" if problem else "available", "why": problem or ""}]
    if problem is None:
        from lingbot_core.weights.modules import FP8, Packing, QuantizedLinear, pack_fp8

        weight = torch.randn(4 * width, width) * 0.02
        layer = QuantizedLinear(Packing(FP8, tuple(weight.shape)), *pack_fp8(weight), None, torch.bfloat16).to(device)
        x = torch.randn(args.tokens, width, device=device, dtype=torch.bfloat16)
        times = {}
        for path in ("decode", "scaled_mm"):
            layer.fp8_matmul = path
            layer(x)
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(20):
                layer(x)
            torch.cuda.synchronize()
            times[path] = time.perf_counter() - start
        rows[0]["scaled_mm"] = f"{times['scaled_mm'] / times['decode']:.3f}x decode"
    text = table(["device", "auto picks", "scaled_mm", "why not"],
                 [[r["device"], r["auto_picks"], r["scaled_mm"], r["why"]] for r in rows])
    return {"rows": rows, "text": text}


def measure_compile(args: argparse.Namespace) -> dict[str, Any]:
    """Regional compile (inductor, dynamic) vs eager, same model in this process: first compiled
    call (compile time included), steady forward ratio (best of `--repeats`), max difference."""
    from bench._common import max_abs_diff
    from lingbot_core.models.compile import compile_blocks, compile_problem, uncompile_blocks

    problem = compile_problem("cpu")
    if problem:
        return {"rows": [], "text": f"not run: {problem}"}
    rows = []
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.compile_dtype]
    for kind in args.kinds:
        model = build_model(kind, args.depth, args.quick, dtype=dtype)
        inputs = dit_inputs(dict(model.config), args.tokens, args.text_tokens)
        torch._dynamo.reset()
        with torch.no_grad():
            eager_s, eager = timed(model, *inputs)
            compile_blocks(model)
            first_s, compiled = timed(model, *inputs)
            best_eager, best_compiled = eager_s, None
            for _ in range(args.repeats):
                uncompile_blocks(model)
                best_eager = min(best_eager, timed(model, *inputs)[0])
                compile_blocks(model)
                seconds = timed(model, *inputs)[0]
                best_compiled = seconds if best_compiled is None else min(best_compiled, seconds)
        uncompile_blocks(model)
        rows.append({"kind": kind, "dtype": args.compile_dtype, "tokens": args.tokens, "eager_s": best_eager, "first_call_s": first_s,
                     "compiled_s": best_compiled, "ratio": best_compiled / best_eager,
                     "max_abs_diff": max_abs_diff(compiled.sample, eager.sample)})
        emit("compile", rows[-1])
    text = table(["kind", "dtype", "video tokens", "eager s", "first compiled call s", "compiled x eager", "max |diff|"],
                 [[r["kind"], r["dtype"], str(r["tokens"]), r["eager_s"], r["first_call_s"], r["ratio"], r["max_abs_diff"]]
                  for r in rows])
    return {"rows": rows, "text": text}


def _two_forwards(model: nn.Module, pos: tuple, neg: tuple) -> None:
    model(*pos)
    model(*neg)


def measure_cfg_batch(args: argparse.Namespace) -> dict[str, Any]:
    """CFG's two branches as one batch-2 forward against two batch-1 forwards (`cfg_batch`), per kind and
    stored format, in turn, best of `--repeats`: the evidence for where `cfg_batch="auto"` batches
    (`placement.estimate.cfg_batch_gain`)."""
    rows = []
    for kind in args.kinds:
        for fmt_name in args.formats:
            model = build_model(kind, args.depth, args.quick)
            if fmt_name != "bf16":
                model = pack_in_memory(model, fmt_name)
            cfg = dict(model.config)
            pos = dit_inputs(cfg, args.tokens, args.text_tokens, seed=1)
            neg = dit_inputs(cfg, args.tokens, args.text_tokens, seed=2)
            both = tuple(torch.cat([p, n]) for p, n in zip(pos, neg))
            two, one = [], []
            with torch.no_grad():
                model(*both)  # warm-up (a compiled decoder compiles here)
                for _ in range(args.repeats):
                    two.append(timed(_two_forwards, model, pos, neg)[0])
                    one.append(timed(model, *both)[0])
            rows.append({"kind": kind, "format": fmt_name, "tokens": args.tokens, "two_s": min(two),
                         "batched_s": min(one), "batched_x_two": min(one) / min(two)})
            emit("cfg_batch", rows[-1])
            del model
    text = table(["kind", "format", "video tokens", "two forwards s", "batch-2 forward s", "batched x two"],
                 [[r["kind"], r["format"], str(r["tokens"]), r["two_s"], r["batched_s"], r["batched_x_two"]]
                  for r in rows])
    return {"rows": rows, "text": text}


MEASUREMENTS: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "quantized": measure_quantized,
    "decode": measure_decode,
    "decoders": measure_decoders,
    "spans": measure_spans,
    "chunked": measure_chunked,
    "estimate": measure_estimate,
    "fp8_matmul": measure_fp8_matmul,
    "compile": measure_compile,
    "cfg_batch": measure_cfg_batch,
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default=",".join(MEASUREMENTS), help="comma-separated measurements")
    p.add_argument("--kinds", default="dense,moe")
    p.add_argument("--formats", default=",".join(FORMATS))
    p.add_argument("--depth", type=int, default=1)
    p.add_argument("--tokens", type=int, default=1280, help="video tokens")
    p.add_argument("--text-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2, help="timed pairs per row (at least 1); on a slow or "
                   "loaded CPU lower this, not the shape")
    p.add_argument("--batch", type=int, default=1, help="quantized: batch size of the forward (2 = CFG as one "
                   "call, `cfg_batch`: one decode serves both branches)")
    p.add_argument("--compile-dtype", choices=("bf16", "fp32"), default="bf16",
                   help="compile: the model's dtype (fp32 separates compiler error from bf16 rounding)")
    p.add_argument("--no-before", dest="before", action="store_false",
                   help="quantized: skip the `before` (old decode paths) column, one forward less per pair")
    p.add_argument("--spans", default="3,8", help="spans: experts decoded at a time on the CPU's grouped path, in turn")
    p.add_argument("--chunk-tokens", type=int, default=2048, help="video tokens of the chunked-block row")
    p.add_argument("--chunk", type=int, default=512, help="tokens per FFN/MoE pass in the chunked row")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="tiny sizes (the smoke test)")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    args.kinds = args.kinds.split(",")
    args.formats = args.formats.split(",")
    args.spans = [int(n) for n in args.spans.split(",")]
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    if args.quick:
        args.tokens, args.text_tokens, args.repeats = min(args.tokens, 64), min(args.text_tokens, 8), 1
        args.chunk_tokens, args.chunk = min(args.chunk_tokens, 128), min(args.chunk, 48)
    return args


def register_sections(section: Callable, table_cls: type) -> None:
    """Register each measurement as a `bench/speed.py` section (its rows, this file's shapes)."""
    for name, measure in MEASUREMENTS.items():
        def run(bench: Any, name: str = name, measure: Callable = measure) -> Any:
            args = parse_args(["--quick"] if getattr(bench.args, "quick", False) else [])
            result = measure(args)
            return table_cls(f"{name} (bench/speed_dit.py)", result["rows"], [result["text"].splitlines()[-1]]
                             if name == "estimate" else [])
        section(name)(run)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print_machine()
    report: dict[str, Any] = {"environment": environment(), "args": {k: v for k, v in vars(args).items()
                                                                     if k != "json"}}
    for name in args.only.split(","):
        result = MEASUREMENTS[name](args)
        report[name] = result
        print(f"\n## {name}\n{result['text']}", flush=True)
    write_json(args.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
