"""Fuzz single-file headers: the VAE, text encoder and DiT files of LingBot Loader (files), mutated and opened.

    python -m bench.fuzz_single_files [--cases 650] [--seed 0] [--timeout 20] [--memory-mb 1500]
                                      [--keep DIR] [--json OUT]

Seeds are the tiny checkpoint's components written as the single files users keep (`lingbot_core.tiny`):
the VAE with diffusers and with original Wan names, the text encoder with ComfyUI names (and a
`comfy_quant` fp8 layer), the DiT as one safetensors file and as two GGUF files (Q8_0 as `quantize`
writes it; one with a Q4_K tensor recorded through `comfy.gguf.orig_shape`, decoded at load). Each
case takes a seed and applies 1-3 mutations to its header, most of them structural (the JSON parsed, changed, written back with the
data): a tensor renamed to a huge or 5,000-digit block/layer index, zero-size tensors that claim
100,000 blocks, layers or experts, a dimension set to 0, 1, 2^31 or 2^40, a dtype changed (integers,
fp8, unknown), data offsets moved (gaps, overlaps, past the end), metadata made non-string, a
`comfy_quant` entry filled with nested brackets or garbage, a name 1 MB long, a tensor dropped or
copied; the rest are byte-level (a header byte changed, the file cut, bytes appended). GGUF seeds get
`bench.fuzz_gguf`'s mutations (header fields set to boundary values, bytes changed, inserted,
deleted or copied, cuts) and go through `dit_file_source` (names, `orig_shape`, config matching).

Every case runs in a forked child with an address-space limit (`--memory-mb` above the child's
start) and a `--timeout`: the child inspects the file as the Loader does (`inspect_vae_file`,
`inspect_text_encoder_file`, `dit_file_source`) and, when accepted, loads it. Counted: `refused`
(our `CheckpointError` at inspection), `refused late` (accepted at inspection, refused at load),
`read`; and the three that must stay 0: CRASH (any other exception, or the child killed, e.g. by
SIGBUS or the memory limit), HANG (no answer in time), SILENT (read although the safetensors library
itself refuses the file: a load that would fail later, in a decode, without the file's name; or a
refusal message over 4,000 characters).

Before the mutated cases, the files of the round-4 report run the same way (`reproducers`: a VAE
claiming 100,001 blocks, an empty q_norm, a 4,096-deep `comfy_quant`, a 5,000-digit block index,
10^6 zero-size tensors, a gap in the data, a 20 MB tensor name); `--no-reproducers` leaves them out.
"""

from __future__ import annotations

import json
import os
import random
import struct
import tempfile
import time
from collections import Counter
from pathlib import Path

from bench._common import fuzz_parser, fuzz_report, keep_case, run_limited
from bench.fuzz_gguf import header_end
from bench.fuzz_gguf import mutate as mutate_gguf

INTERESTING_DIMS = [0, 1, 2, 3, 15, 16, 17, 2**31, 2**40]
HUGE_INDEX = ["100000", "999999", "1" + "0" * 9, "9" * 5000]


def _tiny_folder() -> Path:
    from lingbot_core.tiny import ensure_tiny_checkpoint

    return Path(ensure_tiny_checkpoint("dense"))


def seed_files(folder: Path) -> dict[str, tuple[str, bytes]]:
    """name -> (kind, file bytes) of the seed files."""
    import torch
    from safetensors.torch import load_file, save_file

    from tests.test_vae_file import write_original

    tiny = _tiny_folder()
    vae = load_file(str(tiny / "vae" / "diffusion_pytorch_model.safetensors"))
    te = load_file(str(tiny / "text_encoder" / "model.safetensors"))
    out: dict[str, tuple[str, bytes]] = {}
    save_file(vae, str(folder / "vae_diffusers.safetensors"))
    write_original(vae, folder / "vae_wan.safetensors", 1)
    comfy = {k.replace("model.language_model.", "model.", 1): v for k, v in te.items()}
    save_file(comfy, str(folder / "te_comfy.safetensors"))
    quant = dict(comfy)
    layer = "model.layers.0.mlp.gate_proj"
    quant[f"{layer}.weight"] = quant[f"{layer}.weight"].to(torch.float8_e4m3fn)
    quant[f"{layer}.weight_scale"] = torch.ones(1)
    quant[f"{layer}.comfy_quant"] = torch.frombuffer(bytearray(b'{"format": "float8_e4m3fn"}'), dtype=torch.uint8)
    save_file(quant, str(folder / "te_comfy_quant.safetensors"))
    (folder / "dit.safetensors").write_bytes((tiny / "transformer" / "diffusion_pytorch_model.safetensors").read_bytes())
    for name, kind in (("vae_diffusers", "vae"), ("vae_wan", "vae"), ("te_comfy", "text_encoder"),
                       ("te_comfy_quant", "text_encoder"), ("dit", "dit")):
        out[name] = (kind, (folder / f"{name}.safetensors").read_bytes())
    out.update(_gguf_seeds(folder))
    return out


RESHAPED_TENSOR = "blocks.0.ffn.down_proj.weight"  # [32, 64] in the tiny DiT: 2,048 values = 8 whole Q4_K blocks


def write_reshaped_q4k_gguf(state: dict, path: Path, name: str = RESHAPED_TENSOR) -> bytes:
    """A DiT GGUF as ComfyUI-GGUF's converter writes a Q4_K tensor whose rows are not whole blocks: `name`
    ([32, 64]) stored as 8 Q4_K blocks (144 bytes: d, dmin as fp16, 12 scale bytes, 128 quants; seeded
    random) with its shape in `comfy.gguf.orig_shape.<name>`, every other tensor as float32. Returns the
    blocks' bytes (a test dequantizes them for the expected values)."""
    import gguf
    import numpy as np

    rng = np.random.default_rng(0)
    blocks = b"".join(np.float16(0.01).tobytes() + np.float16(0.0).tobytes()
                      + rng.integers(0, 64, 12, dtype=np.uint8).tobytes()
                      + rng.integers(0, 256, 128, dtype=np.uint8).tobytes() for _ in range(8))
    writer = gguf.GGUFWriter(str(path), "lingbot_video")
    writer.add_array(f"comfy.gguf.orig_shape.{name}", [32, 64])
    for key, tensor in state.items():
        if key == name:
            writer.add_tensor(key, np.frombuffer(blocks, np.uint8).reshape(8, 144),
                              raw_dtype=gguf.GGMLQuantizationType.Q4_K)
        else:
            writer.add_tensor(key, tensor.float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return blocks


def _gguf_seeds(folder: Path) -> dict[str, tuple[str, bytes]]:
    """The DiT as GGUF files: Q8_0 as `lingbot_core.quantize` writes it, and one holding a Q4_K tensor
    that ComfyUI-GGUF's converter would record through `comfy.gguf.orig_shape` (rows not whole blocks)."""
    from safetensors.torch import load_file

    from lingbot_core.quantize import write_gguf
    from lingbot_core.weights.sources import SafetensorsSource

    dit = folder / "dit.safetensors"
    write_gguf(SafetensorsSource([dit]), folder / "dit_q8_0.gguf", "Q8_0")
    reshaped = folder / "dit_q4_k_reshaped.gguf"
    write_reshaped_q4k_gguf(load_file(str(dit)), reshaped)
    return {"dit_q8_0.gguf": ("dit", (folder / "dit_q8_0.gguf").read_bytes()),
            "dit_q4_k_reshaped.gguf": ("dit", reshaped.read_bytes())}


def _suffix(name: str) -> str:
    return ".gguf" if name.endswith(".gguf") else ".safetensors"


def split(raw: bytes) -> tuple[dict, bytes]:
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def join(header: dict, data: bytes) -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


def _structural_name(kind: str, rnd: random.Random) -> str:
    index = rnd.choice(HUGE_INDEX)
    return rnd.choice({
        "vae": [f"decoder.up_blocks.0.resnets.{index}.norm1.gamma", f"decoder.up_blocks.{index}.resnets.0.norm1.gamma",
                f"encoder.down_blocks.{index}.resample.1.weight", f"decoder.upsamples.{index}.residual.0.gamma"],
        "text_encoder": [f"model.layers.{index}.mlp.up_proj.weight", f"model.visual.blocks.{index}.norm1.weight",
                         f"model.visual.deepstack_merger_list.{index}.norm.weight"],
        "dit": [f"blocks.{index}.norm1.weight", f"blocks.0.ffn.experts.w1.{index}", f"blocks.{index}.x"],
    }[kind])


def mutate(kind: str, raw: bytes, rnd: random.Random) -> bytes:
    """1-3 mutations: mostly structural (header JSON), some byte-level."""
    if rnd.random() < 0.15:
        out = bytearray(raw)
        (n,) = struct.unpack("<Q", raw[:8])
        choice = rnd.choice(["byte", "cut", "append", "length"])
        if choice == "byte":
            at = rnd.randrange(8, 8 + n)
            out[at] = rnd.randrange(256)
        elif choice == "cut":
            del out[rnd.randrange(0, len(out)):]
        elif choice == "append":
            out += bytes(rnd.randint(1, 64))
        else:
            out[:8] = struct.pack("<Q", rnd.choice([0, 1, n - 1, n + 1, 2**31, 2**63]))
        return bytes(out)
    header, data = split(raw)
    names = [k for k in header if k != "__metadata__"]
    for _ in range(rnd.randint(1, 3)):
        what = rnd.choice(["rename", "zero_blocks", "dim", "dtype", "offsets", "metadata", "long_name", "drop",
                           "copy", "comfy_quant", "rank"])
        name = rnd.choice(names)
        entry = header.get(name)
        if entry is None:
            continue
        if what == "rename":
            new = _structural_name(kind, rnd)
            header[new] = header.pop(name)
            names = [k for k in header if k != "__metadata__"]
        elif what == "zero_blocks":  # zero-size tensors claiming many blocks (no data needed)
            for _ in range(rnd.choice([1, 2, 50])):
                header[_structural_name(kind, rnd)] = {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}
        elif what == "dim" and entry["shape"]:
            shape = list(entry["shape"])
            shape[rnd.randrange(len(shape))] = rnd.choice(INTERESTING_DIMS)
            entry["shape"] = shape
            if rnd.random() < 0.5:  # keep the byte count consistent with the new shape when it is empty
                if 0 in shape:
                    entry["data_offsets"] = [entry["data_offsets"][0]] * 2
        elif what == "dtype":
            entry["dtype"] = rnd.choice(["I32", "I64", "U8", "BOOL", "F8_E4M3", "F64", "F16", "Q4", "F8_E8M0"])
        elif what == "offsets":
            a, b = entry["data_offsets"]
            delta = rnd.choice([1, 4, 64, -4, len(data), 2**40])
            entry["data_offsets"] = rnd.choice([[a + delta, b + delta], [a, b + delta], [a + delta, b]])
        elif what == "metadata":
            header["__metadata__"] = rnd.choice([{"format": 1}, [], "x", {"format": "pt", "k": None}, None])
        elif what == "long_name":
            header[name + "." + "x" * (1 << 20)] = header.pop(name)
            names = [k for k in header if k != "__metadata__"]
        elif what == "drop":
            header.pop(name)
            names = [k for k in header if k != "__metadata__"] or names
        elif what == "copy":
            header[_structural_name(kind, rnd) if rnd.random() < 0.5 else name + ".copy"] = dict(entry)
        elif what == "comfy_quant":
            quant = [k for k in names if k.endswith(".comfy_quant")]
            if quant:
                body = rnd.choice([b"[" * 4096, b"{" * 2000, b"\xff\xfe", b'{"format": 1e999}', b"[]", b'"x"'])
                start = len(data)
                data = data + body
                header[quant[0]] = {"dtype": "U8", "shape": [len(body)], "data_offsets": [start, start + len(body)]}
        elif what == "rank" and entry["shape"]:
            entry["shape"] = rnd.choice([entry["shape"][:-1], entry["shape"] + [1], [int(x) for x in entry["shape"][::-1]]])
    return join(header, data)


def reproducers(seeds: dict[str, tuple[str, bytes]]) -> list[tuple[str, str, bytes]]:
    """The round-4 report's files, run before the mutated cases: (label, kind, bytes)."""
    out = []

    def edited(seed: str, change) -> bytes:
        header, data = split(seeds[seed][1])
        data = change(header, data) or data
        return join(header, data)

    def zero(header: dict, name: str) -> None:
        header[name] = {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}

    def one_stage(header: dict, data: bytes) -> bytes:  # the report's file: one decoder stage, 100,001 blocks
        kept, packed = {}, b""
        for name, entry in sorted(((k, v) for k, v in header.items() if k != "__metadata__"),
                                  key=lambda kv: kv[1]["data_offsets"][0]):
            if name.startswith("decoder.up_blocks.") and not name.startswith("decoder.up_blocks.0."):
                continue
            a, b = entry["data_offsets"]
            kept[name] = {**entry, "data_offsets": [len(packed), len(packed) + b - a]}
            packed += data[a:b]
        header.clear()
        header.update(kept)
        zero(header, "decoder.up_blocks.0.resnets.100000.norm1.gamma")
        return packed

    out.append(("VAE of one stage claiming 100,001 residual blocks (one zero-size tensor)", "vae",
                edited("vae_diffusers", one_stage)))

    def empty_q_norm(header: dict, data: bytes) -> None:
        header["model.layers.0.self_attn.q_norm.weight"].update(shape=[0], data_offsets=[0, 0])

    out.append(("text encoder with q_norm of shape [0]", "text_encoder", edited("te_comfy", empty_q_norm)))

    def nested_quant(header: dict, data: bytes) -> bytes:
        body = b"[" * 4096
        header["model.layers.0.mlp.gate_proj.comfy_quant"] = {"dtype": "U8", "shape": [len(body)],
                                                              "data_offsets": [len(data), len(data) + len(body)]}
        return data + body

    out.append(("comfy_quant entry of 4,096 '['", "text_encoder", edited("te_comfy_quant", nested_quant)))

    def long_index(header: dict, data: bytes) -> None:
        header["blocks." + "9" * 5000 + ".x"] = header.pop("blocks.0.norm1.weight")

    out.append(("DiT tensor named blocks.<5,000 digits>.x", "dit", edited("dit", long_index)))

    def many(header: dict, data: bytes) -> None:
        for i in range(10**6):
            zero(header, f"z{i}")

    out.append(("DiT with 10^6 zero-size tensors", "dit", edited("dit", many)))

    def gap(header: dict, data: bytes) -> bytes:
        entries = sorted((e for e in header.values() if isinstance(e, dict) and "data_offsets" in e),
                         key=lambda e: e["data_offsets"][0])
        cut = entries[0]["data_offsets"][1]
        for entry in entries[1:]:
            entry["data_offsets"] = [x + 64 for x in entry["data_offsets"]]
        return data[:cut] + bytes(64) + data[cut:]

    out.append(("VAE with 64 unused bytes between two tensors", "vae", edited("vae_diffusers", gap)))

    def long_name(header: dict, data: bytes) -> None:
        header["decoder." + "y" * (20 << 20)] = header.pop("decoder.conv_out.bias")

    out.append(("VAE with a 20 MB tensor name", "vae", edited("vae_diffusers", long_name)))
    return out


def open_case(kind: str, path: Path) -> str:
    """What the Loader does with the file: inspect, then (accepted) load. The outcome."""
    from lingbot_core.errors import CheckpointError

    try:
        if kind == "vae":
            from lingbot_core.checkpoints.vae_file import inspect_vae_file as inspect
            from lingbot_core.checkpoints.vae_file import load_vae_file as load
        elif kind == "text_encoder":
            from lingbot_core.checkpoints.text_encoder_file import inspect_text_encoder_file as inspect
            from lingbot_core.checkpoints.text_encoder_file import load_text_encoder_file as load
        else:
            from lingbot_core.checkpoints.dit_file import dit_file_source as inspect
            from lingbot_core.weights.loader import load_dit as load
        info = inspect(path)
    except CheckpointError as err:
        return _refusal("refused", err)
    try:
        load(info)
    except CheckpointError as err:
        return _refusal("refused late", err)
    return "read"


MAX_MESSAGE = 4000


def _refusal(outcome: str, err: Exception) -> str:
    """A refusal counts when its message is one readable line (a 20 MB name once made a 20 MB message)."""
    text = str(err)
    return outcome if len(text) <= MAX_MESSAGE else f"SILENT: a refusal of {len(text)} characters"


def _library_refuses(path: Path) -> bool:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as fh:
            for key in fh.keys():
                fh.get_slice(key)
    except Exception:  # the library's own SafetensorError (or an OSError)
        return True
    return False


def run_case(kind: str, path: Path, timeout: float, memory: int) -> tuple[str, str]:
    status, value = run_limited(open_case, kind, path, seconds=timeout, memory=memory)
    if status == "ok":
        return ("SILENT", value[len("SILENT: "):]) if value.startswith("SILENT") else (value, "")
    if status == "raised":
        name, message = value
        return "CRASH", f"{name}: {message[:300]}"
    if status == "hang":
        return "HANG", f"no answer in {timeout} s"
    return "CRASH", f"child died (exit {value})"


def main(argv: list[str] | None = None) -> dict:
    ap = fuzz_parser(__doc__, cases=650, keep=True)
    ap.add_argument("--timeout", type=float, default=20.0)
    ap.add_argument("--memory-mb", type=int, default=1500)
    ap.add_argument("--no-reproducers", action="store_true", help="only the mutated cases (not the report's files)")
    args = ap.parse_args(argv)
    rnd = random.Random(args.seed)
    outcomes: Counter[str] = Counter()
    per_kind: dict[str, Counter[str]] = {}
    examples: dict[str, str] = {}
    found: dict[str, str] = {}  # reproducer -> its outcome
    kinds: Counter[str] = Counter()  # what crashed (the exception's type, or how the child died)
    slowest = 0.0
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        seeds = seed_files(folder)
        unread: list[str] = []
        for name, (kind, raw) in seeds.items():  # warm the skeleton memo in the parent: children inherit it
            warm = folder / f"warm{_suffix(name)}"
            warm.write_bytes(raw)
            if open_case(kind, warm) != "read":  # (the code before this round refused the reshaped GGUF)
                unread.append(name)
        order = sorted(seeds)
        ends = {name: header_end(raw) for name, (_kind, raw) in seeds.items() if name.endswith(".gguf")}
        fixed = reproducers(seeds) if not args.no_reproducers else []
        for i in range(len(fixed) + args.cases):
            if i < len(fixed):
                name, kind, case = fixed[i]
            else:
                name = order[i % len(order)]
                kind, raw = seeds[name]
                case = mutate_gguf(raw, ends[name], rnd) if name in ends else mutate(kind, raw, rnd)
            path = folder / f"case{_suffix(name)}"
            path.write_bytes(case)
            start = time.perf_counter()
            outcome, detail = run_case(kind, path, args.timeout, args.memory_mb << 20)
            slowest = max(slowest, time.perf_counter() - start)
            if outcome == "read" and path.suffix == ".safetensors" and _library_refuses(path):
                outcome, detail = "SILENT", "read, but safetensors refuses the file"
            if i < len(fixed):
                found[name] = f"{outcome} {detail[:160]}".strip()
            outcomes[outcome] += 1
            per_kind.setdefault(kind, Counter())[outcome] += 1
            if outcome in ("CRASH", "HANG", "SILENT"):
                kinds[f"{outcome} {detail.split(':')[0]}"] += 1
                examples.setdefault(f"{outcome} {kind}", f"case {i} ({name}): {detail}")
                keep_case(args.keep, f"{outcome.lower()}-{i}-{kind}.safetensors", case)
    result = {"cases": args.cases, "seeds_not_read": unread, "reproducers": found, "seed": args.seed, "outcomes": dict(outcomes),
              "per_kind": {k: dict(v) for k, v in per_kind.items()},
              "crashes": outcomes["CRASH"], "hangs": outcomes["HANG"], "silent": outcomes["SILENT"],
              "what_escaped": dict(kinds),
              "examples": examples, "slowest_s": round(slowest, 2), "total_s": round(time.perf_counter() - started, 1),
              "load_average": os.getloadavg()}
    return fuzz_report(result, args.json)


if __name__ == "__main__":
    main()
