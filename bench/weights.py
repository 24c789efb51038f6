"""Weight formats at real shapes on CPU: load memory, accuracy and forward time of bf16 / fp8 / GGUF.

Builds, outside the repository (`--data`, default ~/.cache/lingbot-nodes/bench-weights), random bf16
checkpoints of real shape: the dense DiT (1,357,171,264 parameters, ~2.7 GB) and the MoE DiT with 4
of its 48 blocks (each block real size), then their fp8 / GGUF-Q8_0 / GGUF-Q4_0 copies with the
quantize command's writers. For each format it reports
- peak RSS while loading (a fresh process per load) minus the process's RSS before loading, divided by
  the bytes the loaded model holds (`load/stored`); the torch baseline RSS is printed once;
- the DiT output's relative L2 error against bf16 on the same input;
- forward time relative to bf16 (all formats timed in one process, one after the other);
- under `sequential` and `group` with `offload_to=disk`, through the real handle and stage door (the
  DiT loads with its stored tensors left in the file, then one forward): peak RSS during the forward
  (the peak is reset after loading, `/proc/self/clear_refs`) divided by the model's stored bytes, both
  as the whole RSS and as the growth over the RSS before the forward; and the whole process's peak
  (load + forward) minus the torch baseline.

`--full-moe` (opt-in, the moonshot): the full-depth MoE DiT (48 real-size blocks, 30.1 B parameters) as
GGUF-Q4_0 (~17 GB), written directly tensor by tensor with random blocks (no bf16 intermediate),
then one DiT forward with disk-backed `group` and `sequential` offload, printing peak RSS and time.

    python bench/weights.py                       # dense + MoE-4, 256 video + 64 text tokens
    python bench/weights.py --which dense --formats bf16,fp8
    python bench/weights.py --full-moe            # 48 MoE blocks as GGUF-Q4_0 (~17 GB of disk)
    python bench/weights.py --quick --formats gguf-q4_0,gguf-q4_0-file   # + that GGUF as one community file
    python bench/weights.py --which moe --depth 1 --load-only --formats bf16,bf16-file,gguf-q4_0,gguf-q4_0-file

A format name ending in `-file` (`bf16-file`, `gguf-q4_0-file`, ...) is that format's weights rewritten
as one ComfyUI-style file (`model.diffusion_model.` names, experts one tensor each as `NAME.E.weight`)
and loaded through single-file loading (`checkpoints.dit_file`), so its rows compare with the folder's.
`--depth N`: real-width blocks, N of them (one MoE block is 1.42 GB bf16 / 512 MB Q4_0: a load row of
realistic size; `--quick` models are a few MB, where the load ratio is the ~2 MB of imports and
header parsing, not the weights). `--load-only`: only the load column.

The machine is small: every child keeps at most one model (plus bf16 for the error) in memory.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python bench/x.py` from a plain checkout

import torch

from bench._common import environment, fmt, fmt_bytes, print_machine, table, write_json

FORMATS = ("bf16", "fp8", "gguf-q8_0", "gguf-q4_0")
DENSE = dict(hidden_size=2048, num_attention_heads=16, depth=24, intermediate_size=6144, text_dim=2560,
             freq_dim=256, axes_dims=[32, 48, 48])
MOE = dict(DENSE, depth=4, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, n_shared_experts=1,
           n_group=4, topk_group=2, routed_scaling_factor=2.5, score_func="sigmoid", norm_topk_prob=True)
EXPECTED_PARAMS = {"dense": 1_357_171_264, "moe": 4 * 625_760_512 + 48_001_600}


# -- building the checkpoints --------------------------------------------------------------------------

QUICK = dict(hidden_size=256, num_attention_heads=2, intermediate_size=512, text_dim=64, freq_dim=32,
             moe_intermediate_size=64, num_experts=8, n_group=2, topk_group=1, num_experts_per_tok=2)


def _config(which: str, full_moe: bool, quick: bool = False, depth: int | None = None) -> dict[str, Any]:
    cfg = dict(DENSE if which == "dense" else MOE)
    if which == "moe" and full_moe:
        cfg["depth"] = 48
    if quick:  # the smoke test's sizes
        cfg.update({k: v for k, v in QUICK.items() if k in cfg or which == "moe"}, depth=2)
    if depth is not None:  # real-width blocks, fewer of them (a load-peak row of a few hundred MB)
        cfg["depth"] = depth
    return {"_class_name": "LingBotVideoTransformer3DModel", **cfg}


def build_bf16(folder: Path, config: dict[str, Any], seed: int = 0) -> Path:
    """A bf16 transformer/ folder with random weights, written tensor by tensor (fp32-kept ones in fp32)."""
    from lingbot_core.models.precision import stays_float32
    from lingbot_core.models.transformer import LingBotVideoTransformer3DModel

    target = folder / "transformer"
    weights = target / "diffusion_pytorch_model.safetensors"
    if weights.is_file():
        return folder
    target.mkdir(parents=True, exist_ok=True)
    with torch.device("meta"):
        skeleton = LingBotVideoTransformer3DModel.from_config(config)
    plan = [(k, torch.float32 if stays_float32(k) else torch.bfloat16, tuple(v.shape))
            for k, v in skeleton.state_dict().items()]
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    names = {torch.float32: "F32", torch.bfloat16: "BF16"}
    for key, dtype, shape in plan:
        n = dtype.itemsize * (int(torch.Size(shape).numel()))
        header[key] = {"dtype": names[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    g = torch.Generator().manual_seed(seed)
    tmp = weights.with_suffix(".tmp")
    with open(tmp, "wb") as fh:
        fh.write(len(raw).to_bytes(8, "little"))
        fh.write(raw)
        for _key, dtype, shape in plan:
            fan_in = shape[-1] if len(shape) >= 2 else 1
            rows = shape[0] if len(shape) >= 2 else 1
            flat = torch.Size(shape).numel()
            per = flat // rows
            for start in range(0, rows, max(1, (1 << 24) // max(per, 1))):
                stop = min(rows, start + max(1, (1 << 24) // max(per, 1)))
                chunk = torch.randn((stop - start) * per, generator=g)
                chunk = chunk / fan_in**0.5 if len(shape) >= 2 else 1.0 + 0.1 * chunk
                fh.write(chunk.to(dtype).view(torch.uint8).numpy().data)
    tmp.rename(weights)
    (target / "config.json").write_text(json.dumps(config))
    return folder


def build_quantized(src: Path, dst: Path, target: str) -> Path:
    from lingbot_core.quantize import write_fp8, write_gguf
    from lingbot_core.weights.sources import SafetensorsSource

    out = dst / "transformer"
    name = "diffusion_pytorch_model." + ("safetensors" if target == "fp8" else "gguf")
    if (out / name).is_file():
        return dst
    out.mkdir(parents=True, exist_ok=True)
    source = SafetensorsSource([src / "transformer" / "diffusion_pytorch_model.safetensors"])
    tmp = out / (name + ".tmp")
    if target == "fp8":
        write_fp8(source, tmp)
    else:
        write_gguf(source, tmp, target.split("-")[1].upper())
    tmp.rename(out / name)
    (out / "config.json").write_text((src / "transformer" / "config.json").read_text())
    return dst


SINGLE_FILE = "-file"  # a format name ending so: that format's weights as one community-named file
_STACKS = (".experts.w1", ".experts.w2", ".experts.w3")


def _single_safetensors(src: Path, target: Path) -> None:
    """A safetensors DiT rewritten with ComfyUI names, the same bytes copied span by span (never the
    whole model in memory): `model.diffusion_model.` on every name, expert stacks one tensor per
    expert as `NAME.E.weight`."""
    from lingbot_core.weights.safetensors_header import read_safetensors_file

    header = read_safetensors_file(src)
    plan: list[tuple[str, str, list[int], int, int]] = []  # name, dtype, shape, source offset, bytes
    for key, t in header.tensors.items():
        start = header.data_start + t.offsets[0]
        name = "model.diffusion_model." + key
        if key.endswith(_STACKS) and len(t.shape) == 3:
            each = t.nbytes // t.shape[0]
            plan += [(f"{name}.{e}.weight", t.dtype, list(t.shape[1:]), start + e * each, each)
                     for e in range(t.shape[0])]
        else:
            plan.append((name, t.dtype, list(t.shape), start, t.nbytes))
    meta: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, dtype, shape, _start, n in plan:
        meta[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(meta, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    tmp = target.with_suffix(".tmp")
    with open(src, "rb") as fin, open(tmp, "wb") as fout:
        fout.write(len(raw).to_bytes(8, "little"))
        fout.write(raw)
        for _name, _dtype, _shape, start, n in plan:
            fin.seek(start)
            while n:
                chunk = fin.read(min(n, 1 << 24))
                fout.write(chunk)
                n -= len(chunk)
    tmp.rename(target)


def build_single_file(src: Path, dst: Path, config: dict[str, Any]) -> Path:
    """`src`'s transformer weights (GGUF or safetensors) rewritten as a single ComfyUI-style file:
    `model.diffusion_model.` on every name and expert stacks stored one tensor per expert as
    `NAME.E.weight` (the same bytes). The bench config goes next to it (`bench-config.json`) so
    single-file loading knows the bench's shape."""
    import gguf
    import numpy as np

    stored = src / "transformer" / "diffusion_pytorch_model.safetensors"
    target = dst / ("lingbot-dit.safetensors" if stored.is_file() else "lingbot-dit.gguf")
    if target.is_file():
        return target
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "bench-config.json").write_text(json.dumps(config))
    if stored.is_file():
        _single_safetensors(stored, target)
        return target
    reader = gguf.GGUFReader(src / "transformer" / "diffusion_pytorch_model.gguf")
    writer = gguf.GGUFWriter(target.with_suffix(".tmp"), arch="lingbot")
    for t in reader.tensors:
        data = np.array(t.data)
        name = "model.diffusion_model." + t.name
        if name.endswith((".experts.w1", ".experts.w2", ".experts.w3")) and data.ndim == 3:
            for e in range(data.shape[0]):
                writer.add_tensor(f"{name}.{e}.weight", np.ascontiguousarray(data[e]), raw_dtype=t.tensor_type)
        else:
            writer.add_tensor(name, data, raw_dtype=t.tensor_type)
    del reader
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    target.with_suffix(".tmp").rename(target)
    return target


def _dit_target(path: str) -> Any:
    """What the loader takes for a bench checkpoint: a folder (`folder/transformer`), or a single file
    resolved by `checkpoints.dit_file` (its shape registered from the bench config beside it)."""
    target = Path(path)
    if not target.is_file():
        return path
    from lingbot_core.checkpoints.dit_file import dit_file_source, register_config

    register_config("bench", json.loads((target.parent / "bench-config.json").read_text()))
    return dit_file_source(target)


# -- the measurements (children) -------------------------------------------------------------------------

def _rss() -> tuple[int, int]:
    """(current RSS, peak RSS) of this process in bytes, from /proc/self/status."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(("VmRSS:", "VmHWM:")):
            key, value = line.split(":", 1)
            fields[key] = int(value.split()[0]) * 1024
    return fields["VmRSS"], fields["VmHWM"]


def _reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _inputs(config: dict[str, Any], video_tokens: int, text_tokens: int):
    side = int(round((video_tokens) ** 0.5))
    g = torch.Generator().manual_seed(1)
    latents = torch.randn(1, 16, 1, 2 * side, 2 * side, generator=g)
    text = torch.randn(1, text_tokens, config["text_dim"], generator=g)
    return latents, torch.tensor([700.0]), text


def _held_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()] if t.device.type != "meta")


def child_load(folder: str) -> dict[str, Any]:
    import lingbot_core.models.transformer  # noqa: F401  (imports before the baseline)
    from lingbot_core.weights.loader import load_dit
    from lingbot_core.weights.state import ModelState

    base, _ = _rss()
    start = time.perf_counter()
    state = ModelState()
    model = load_dit(_dit_target(folder), dtype=torch.bfloat16, state=state)  # a single file: its header walk is counted
    seconds = time.perf_counter() - start
    _, peak = _rss()
    return {"baseline_rss": base, "peak_rss": peak, "held": _held_bytes(model), "seconds": seconds,
            "format": state.format}


def child_forward(folders: dict[str, str], video_tokens: int, text_tokens: int, out: str, repeats: int) -> dict:
    """Every format in this one process, one after the other: output error vs bf16 and forward time."""
    from lingbot_core.weights.loader import load_dit

    results: dict[str, Any] = {}
    reference = None
    torch.manual_seed(0)
    for name, folder in folders.items():
        model = load_dit(_dit_target(folder), dtype=torch.bfloat16)
        config = dict(model.config)
        inputs = _inputs(config, video_tokens, text_tokens)
        with torch.no_grad():
            model(*inputs)  # warm up
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                sample = model(*inputs).sample.float()
                times.append(time.perf_counter() - t0)
        if reference is None:
            reference = sample
        err = float((sample - reference).norm() / reference.norm())
        results[name] = {"seconds": min(times), "rel_l2": err}
        del model
    return results


def _bench_handle(folder: str):
    """A pipeline handle whose transformer loads from `folder/transformer` (bf16 compute), as a Loader's
    would: the bench folders hold only the DiT, so the shared components are made without a full
    checkpoint, and every load and forward below goes through the real stage door."""
    from lingbot_core.handle import PipelineHandle, SharedComponents

    target = _dit_target(folder)
    if not isinstance(target, str):  # a single file: a handle without a folder, its transformer that file
        from lingbot_core.checkpoints.inspection import CheckpointInfo

        info = CheckpointInfo(None, "moe" if target.config.get("num_experts") else "dense", False, target.config,
                              {"transformer": target})
        shared = SharedComponents(None, info=info, dtypes={"transformer": torch.bfloat16}, text_attn="sdpa",
                                  attention_backend=None)
        return PipelineHandle(shared, torch.device("cpu"))
    shared = SharedComponents(folder, info=None, dtypes={"transformer": torch.bfloat16}, text_attn="sdpa",
                              attention_backend=None)
    shared.transformer_source = (Path(folder), "transformer")
    return PipelineHandle(shared, torch.device("cpu"))


def child_disk(folder: str, mode: str, video_tokens: int, text_tokens: int) -> dict[str, Any]:
    import gc

    import lingbot_core.models.transformer  # noqa: F401  (imports before the baseline)
    from lingbot_core.placement.door import configure_offload, stage
    from lingbot_core.placement.tensors import stored_bytes

    base, _ = _rss()
    view = configure_offload(_bench_handle(folder), mode, offload_to="disk",
                             **({"use_stream": False} if mode == "group" else {}))
    t0 = time.perf_counter()
    with stage(view, "transformer"):  # loads the DiT for streaming: stored tensors stay in the file
        model = view.component("transformer")
    load_seconds = time.perf_counter() - t0
    loaded, load_peak = _rss()
    stored = stored_bytes(model, include_meta=True)
    config = dict(model.config)
    inputs = _inputs(config, video_tokens, text_tokens)
    gc.collect()
    before, _ = _rss()
    reset = _reset_peak()
    t0 = time.perf_counter()
    with stage(view, "transformer"), torch.no_grad():
        sample = model(*inputs).sample
    seconds = time.perf_counter() - t0
    _, peak = _rss()
    return {"stored": stored, "baseline_rss": base, "rss_loaded": loaded, "load_peak_rss": load_peak,
            "rss_before": before, "peak_rss": peak, "peak_reset": reset, "seconds": seconds,
            "load_seconds": load_seconds, "weight_reads": view.shared.states["transformer"].reads,
            "finite": bool(sample.isfinite().all()), "format": view.shared.states["transformer"].format}


# -- the full-depth MoE, written directly as GGUF-Q4_0 ---------------------------------------------------

def build_random_q4_0(folder: Path, config: dict[str, Any], seed: int = 0) -> Path:
    """A transformer/ folder holding a GGUF-Q4_0 DiT of random blocks, written tensor by tensor.

    No float intermediate: each quantizable tensor is written as Q4_0 blocks made directly (a float16
    scale `d` chosen so the weights have std ~ 1/sqrt(fan_in), and random 4-bit values), the others
    as random bf16 / float32 (the fp32-kept modules), in the layout `quantize --to gguf-q4_0` writes.
    """
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter

    from lingbot_core.models.precision import stays_float32
    from lingbot_core.models.transformer import LingBotVideoTransformer3DModel
    from lingbot_core.weights.loader import quantizable

    target = folder / "transformer"
    weights = target / "diffusion_pytorch_model.gguf"
    if weights.is_file():
        return folder
    target.mkdir(parents=True, exist_ok=True)
    with torch.device("meta"):
        skeleton = LingBotVideoTransformer3DModel.from_config(config)
    q4 = GGMLQuantizationType.Q4_0
    block, size = GGML_QUANT_SIZES[q4]
    plan = []
    for key, value in skeleton.state_dict().items():
        shape = tuple(value.shape)
        if quantizable(key, shape) and shape[-1] % block == 0:
            kind = q4
        else:
            kind = GGMLQuantizationType.F32 if stays_float32(key) else GGMLQuantizationType.BF16
        plan.append((key, shape, kind))
    tmp = weights.with_suffix(".tmp")
    writer = GGUFWriter(tmp, arch="lingbot_video")
    writer.add_string("lingbot.weights", "gguf-q4_0")
    for key, shape, kind in plan:
        rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
        n_block, n_bytes = GGML_QUANT_SIZES[kind]
        writer.add_tensor_info(key, shape, np.dtype(np.float32), rows * (shape[-1] // n_block) * n_bytes, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    g = torch.Generator().manual_seed(seed)
    for _key, shape, kind in plan:
        if kind == q4:
            # value = (nibble - 8) * d; uniform nibbles have std ~4.6, so d = 1 / (4.6 sqrt(fan_in))
            d = np.array([1.0 / (4.6 * shape[-1] ** 0.5)], dtype=np.float16).view(np.uint8)
            raw = rng.integers(0, 256, size=(int(np.prod(shape)) // block, size), dtype=np.uint8)
            raw[:, :2] = d  # (the largest tensor, one expert stack, is ~113 MB of blocks)
            writer.write_tensor_data(raw)
            del raw
        else:
            t = torch.randn(shape, generator=g)
            t = t / shape[-1] ** 0.5 if len(shape) >= 2 else 1.0 + 0.1 * t
            dtype = torch.float32 if kind == GGMLQuantizationType.F32 else torch.bfloat16
            writer.write_tensor_data(t.to(dtype).view(torch.uint8).numpy())
    writer.close()
    tmp.rename(weights)
    (target / "config.json").write_text(json.dumps(config))
    return folder


def run_full_moe(data: Path, video_tokens: int, text_tokens: int, modes: list[str],
                 quick: bool = False) -> dict[str, Any]:
    config = _config("moe", True, quick)
    root = data / ("quick-moe-full" if quick else "moe-full")
    t0 = time.perf_counter()
    folder = build_random_q4_0(root / "gguf-q4_0", config)
    file = folder / "transformer" / "diffusion_pytorch_model.gguf"
    print(f"[moe-full] {file} ready ({file.stat().st_size / 1e9:.2f} GB) in {time.perf_counter() - t0:.0f} s",
          flush=True)
    rows = {}
    for mode in modes:
        rows[mode] = _child(["disk", str(folder), mode, str(video_tokens), str(text_tokens)])
        print(f"[moe-full] gguf-q4_0 disk {mode}: {rows[mode]}", flush=True)
    return {"config": config, "file_bytes": file.stat().st_size, "rows": rows}


def render_full_moe(entry: dict[str, Any], video_tokens: int, text_tokens: int) -> str:
    rows = []
    for mode, r in entry["rows"].items():
        rows.append([mode, fmt_bytes(r["stored"]), fmt_bytes(r["peak_rss"]), fmt(r["peak_rss"] / r["stored"]),
                     fmt((r["peak_rss"] - r["rss_before"]) / r["stored"]),
                     fmt_bytes(max(r["peak_rss"], r["load_peak_rss"]) - r["baseline_rss"]),
                     f"{r['load_seconds']:.1f}", f"{r['seconds']:.1f}", fmt(r["finite"])])
    head = (f"full MoE (48 blocks, GGUF-Q4_0, random), {video_tokens} video + {text_tokens} text tokens, CPU bf16 "
            f"compute, offload_to=disk; torch baseline RSS {fmt_bytes(next(iter(entry['rows'].values()))['baseline_rss'])}")
    return head + "\n" + table(["mode", "stored", "forward peak RSS", "peak/stored", "forward growth/stored",
                                 "process peak - baseline", "load s", "forward s", "finite"], rows)


def _child(args: list[str]) -> dict[str, Any]:
    env = {**os.environ, "LINGBOT_SKIP_WEIGHT_SCAN": "1"}
    proc = subprocess.run([sys.executable, __file__, "--child", *args], capture_output=True, text=True, env=env)
    if proc.returncode:
        raise RuntimeError(f"child {args} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# -- the report -------------------------------------------------------------------------------------------

def run(which: list[str], formats: list[str], data: Path, video_tokens: int, text_tokens: int, repeats: int,
        quick: bool = False, disk_only: bool = False, depth: int | None = None,
        load_only: bool = False) -> dict[str, Any]:
    report: dict[str, Any] = {"environment": environment(), "video_tokens": video_tokens,
                              "text_tokens": text_tokens, "models": {}}
    for kind in which:
        config = _config(kind, False, quick, depth)
        root = data / (("quick-" if quick else "") + kind + (f"-depth{depth}" if depth is not None else ""))
        t0 = time.perf_counter()
        folders = {"bf16": build_bf16(root / "bf16", config)}
        for fmt_name in formats:
            if fmt_name.endswith(SINGLE_FILE):
                base = fmt_name[: -len(SINGLE_FILE)]
                if base == "fp8":
                    raise SystemExit("fp8-file: fp8 expert stacks are not read per expert; use bf16-file")
                folders[base] = folders.get(base) or build_quantized(folders["bf16"], root / base, base)
                folders[fmt_name] = build_single_file(folders[base], root / fmt_name, config)
            elif fmt_name != "bf16":
                folders[fmt_name] = build_quantized(folders["bf16"], root / fmt_name, fmt_name)
        print(f"[{kind}] checkpoints ready in {time.perf_counter() - t0:.0f} s under {root}", flush=True)
        if not quick and depth is None:
            from lingbot_core.models.transformer import LingBotVideoTransformer3DModel
            from lingbot_core.weights.sources import SafetensorsSource

            entries = SafetensorsSource([folders["bf16"] / "transformer" / "diffusion_pytorch_model.safetensors"]).entries
            with torch.device("meta"):
                buffers = {n for n, _ in LingBotVideoTransformer3DModel.from_config(config).named_buffers()}
            params = sum(torch.Size(e.shape).numel() for k, e in entries.items() if k not in buffers)
            assert params == EXPECTED_PARAMS[kind], (kind, params)  # the real shape, to the parameter
        rows: dict[str, Any] = {name: {} for name in formats}
        if not disk_only:
            for fmt_name in formats:
                rows[fmt_name]["load"] = _child(["load", str(folders[fmt_name])])
                print(f"[{kind}] {fmt_name} load: {rows[fmt_name]['load']}", flush=True)
        if load_only:
            report["models"][kind] = {"config": config, "rows": rows}
            continue
        if not disk_only:
            timed = _child(["forward", json.dumps({k: str(folders[k]) for k in formats}), str(video_tokens),
                            str(text_tokens), str(repeats)])
            for fmt_name in formats:
                rows[fmt_name]["forward"] = timed[fmt_name]
        for fmt_name in formats:
            for mode in ("sequential", "group"):
                rows[fmt_name][f"disk_{mode}"] = _child(["disk", str(folders[fmt_name]), mode, str(video_tokens),
                                                         str(text_tokens)])
                print(f"[{kind}] {fmt_name} disk {mode}: {rows[fmt_name][f'disk_{mode}']}", flush=True)
        report["models"][kind] = {"config": config, "rows": rows}
    return report


def _disk_cells(r: dict[str, Any]) -> list[str]:
    """peak/stored (forward growth/stored) per disk mode, then the process peak over the torch baseline."""
    cells = []
    for m in ("sequential", "group"):
        d = r[f"disk_{m}"]
        cells.append(f"{fmt(d['peak_rss'] / d['stored'])} ({fmt((d['peak_rss'] - d['rss_before']) / d['stored'])})")
    cells.append(" / ".join(fmt_bytes(max(r[f"disk_{m}"]["peak_rss"], r[f"disk_{m}"]["load_peak_rss"])
                                      - r[f"disk_{m}"]["baseline_rss"]) for m in ("sequential", "group")))
    return cells


def render(report: dict[str, Any]) -> str:
    out = []
    for kind, entry in report["models"].items():
        rows = entry["rows"]
        base_t = rows["bf16"]["forward"]["seconds"] if "forward" in rows.get("bf16", {}) else None
        table_rows = []
        for name, r in rows.items():
            load = r.get("load")
            stored = load["held"] if load else r["disk_group"]["stored"]
            table_rows.append([
                name, fmt_bytes(stored),
                fmt((load["peak_rss"] - load["baseline_rss"]) / load["held"]) if load else "-",
                fmt(r["forward"]["rel_l2"]) if "forward" in r else "-",
                fmt(r["forward"]["seconds"] / base_t) if base_t else "-",
                *(_disk_cells(r) if "disk_group" in r else ["-", "-", "-"]),
            ])
        first = next(iter(rows.values()))
        baseline = (first["disk_group"] if "disk_group" in first else first["load"])["baseline_rss"]
        out.append(f"{kind}: {report['video_tokens']} video + {report['text_tokens']} text tokens, CPU bf16 compute; "
                   f"torch baseline RSS {fmt_bytes(baseline)}")
        out.append(table(["format", "stored", "load peak/stored", "rel-L2 vs bf16", "forward vs bf16",
                          "seq+disk peak/stored (forward growth)", "group+disk peak/stored (forward growth)",
                          "seq / group process peak - baseline"], table_rows))
    return "\n\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    p.add_argument("--which", default="dense,moe")
    p.add_argument("--formats", default=",".join(FORMATS))
    p.add_argument("--data", type=Path, default=Path.home() / ".cache" / "lingbot-nodes" / "bench-weights")
    p.add_argument("--video-tokens", type=int, default=256)
    p.add_argument("--text-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--full-moe", action="store_true",
                   help="only the full-depth MoE (48 blocks) as GGUF-Q4_0, ~17 GB on disk, disk-backed forward; opt-in")
    p.add_argument("--modes", default="group,sequential", help="disk-backed modes for --full-moe")
    p.add_argument("--disk-only", action="store_true", help="only the disk-offload columns")
    p.add_argument("--load-only", action="store_true", help="only the load column (one child process per load)")
    p.add_argument("--depth", type=int, help="real-width models with this many blocks (a smaller load row)")
    p.add_argument("--json", type=Path)
    p.add_argument("--quick", action="store_true", help="small shapes (the smoke test)")
    args = p.parse_args(argv)
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    if args.child:
        kind, *rest = args.child
        if kind == "load":
            result = child_load(rest[0])
        elif kind == "forward":
            result = child_forward(json.loads(rest[0]), int(rest[1]), int(rest[2]), "", int(rest[3]))
        else:
            result = child_disk(rest[0], rest[1], int(rest[2]), int(rest[3]))
        print(json.dumps(result))
        return 0
    print_machine()
    if args.full_moe:
        entry = run_full_moe(args.data, args.video_tokens, args.text_tokens, args.modes.split(","), args.quick)
        print(render_full_moe(entry, args.video_tokens, args.text_tokens))
        write_json(args.json, {"environment": environment(), "video_tokens": args.video_tokens,
                               "text_tokens": args.text_tokens, "full_moe": entry})
        return 0
    formats = [f for f in args.formats.split(",") if f]
    if "bf16" not in formats:
        formats.insert(0, "bf16")
    report = run(args.which.split(","), formats, args.data, args.video_tokens, args.text_tokens, args.repeats,
                 args.quick, args.disk_only, args.depth, args.load_only)
    print(render(report))
    write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
