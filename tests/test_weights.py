"""Weight formats: the RAM-frugal loader, fp8 and GGUF round trips, offload with packed weights, bad inputs.

Tolerances come from the quantization step: e4m3 keeps 3 mantissa bits (a weight is off by at most
2^-4 of itself, or 2^-10 of its row scale when subnormal); Q8_0 and Q4_0 blocks are off by at most
half (Q8_0) or one (Q4_0, whose extreme value clips) step of the block scale `d`.
"""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from background import Child, selected

from lingbot_core.checkpoints.inspection import inspect_checkpoint
from lingbot_core.checkpoints.loading import load_transformer
from lingbot_core.errors import CheckpointError
from lingbot_core.handle import PipelineHandle
from lingbot_core.models.precision import stays_float32 as keeps_fp32
from lingbot_core.placement import plan
from lingbot_core.placement.door import configure_offload, stage
from lingbot_core.placement.modes import MODE_CLASSES, MODE_ORDER
from lingbot_core.quantize import quantize_checkpoint
from lingbot_core.weights import decode as decode_mod
from lingbot_core.weights import fp8 as fp8_mod
from lingbot_core.weights import gguf_codec
from lingbot_core.weights.modules import QuantizedExperts, QuantizedLinear

T = gguf.GGMLQuantizationType
MODES = list(MODE_ORDER)  # every registered offload mode
OFFLOADING = [m for m in MODES if not MODE_CLASSES[m].keeps_resident]
STREAMING = [m for m in OFFLOADING if MODE_CLASSES[m].disk_unit != "model"]  # units smaller than the DiT
# Byte offsets of the float16 fields in each block layout (kept finite in random blocks).
HALF_FIELDS = {T.Q8_0: [0], T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q4_K: [0, 2],
               T.Q5_K: [0, 2], T.Q6_K: [208], T.Q3_K: [108], T.Q2_K: [80, 82], T.IQ4_NL: [0], T.IQ4_XS: [0]}


def _inputs(hidden_text: int = 32):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(1, 16, 3, 8, 8, generator=g), torch.tensor([500.0]), torch.randn(1, 7, hidden_text, generator=g))


def _run(model) -> torch.Tensor:
    with torch.no_grad():
        return model(*_inputs()).sample


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(scope="module")
def quantized(tmp_path_factory, fixtures_root):
    """tiny dense and MoE checkpoints, quantized once per target with the quantize command's function."""
    root = tmp_path_factory.mktemp("quantized")
    out = {}
    for variant in ("dense", "moe"):
        for target in ("fp8", "gguf-q8_0", "gguf-q4_0"):
            out[variant, target] = quantize_checkpoint(fixtures_root / "models" / f"tiny-{variant}",
                                                       root / f"{variant}-{target}", target)
    return out


@pytest.fixture(scope="module", autouse=True)
def commands(request, tmp_path_factory, fixtures_root):
    """The commands this module runs in processes of their own, started together when the module starts
    (tests/background.py): they import torch on the second core while the tests in this process run. Each
    entry: (the child, the folder it writes or reads)."""
    started = {}
    if selected(request, "test_quantize_command_output_opens_with_the_loader"):
        again = tmp_path_factory.mktemp("again") / "again"
        quantized = request.getfixturevalue("quantized")
        started["already quantized"] = Child([sys.executable, "-m", "lingbot_core.quantize",
                                              str(quantized["moe", "fp8"]), str(again), "--to", "fp8"]), again
    if selected(request, "test_the_quantize_command_writes_per_expert_files"):
        out = tmp_path_factory.mktemp("per_expert_cli") / "cli"
        started["per expert"] = Child([sys.executable, "-m", "lingbot_core.quantize",
                                       str(fixtures_root / "models" / "tiny-moe"), str(out), "--to", "gguf-q4_0",
                                       "--per-expert"]), out
    if selected(request, "test_bf16_checkpoint_loads_as_bf16_without_an_fp32_copy"):
        folder = _bf16_checkpoint(fixtures_root / "models" / "tiny-dense", tmp_path_factory.mktemp("bf16") / "bf16")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        started["bf16 peak"] = Child([sys.executable, "-c", _PEAK_SCRIPT, str(folder)], env=env), folder
    yield started
    for child, _folder in started.values():
        child.stop()


# -- GGUF decoding -----------------------------------------------------------------------------------

@pytest.mark.parametrize("qtype", [t for t in gguf_codec.SUPPORTED if t not in (T.F32, T.F16, T.BF16)],
                         ids=lambda t: t.name)
def test_gguf_blocks_decode_like_the_gguf_package(qtype):
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(int(qtype))
    raw = rng.integers(0, 256, size=(6, 4 * size), dtype=np.uint8)
    blocks = raw.reshape(-1, size)
    for at in HALF_FIELDS[qtype]:
        blocks[:, at + 1] &= 0x3B  # a finite float16 exponent
    expected = gguf.quants.dequantize(raw, qtype)
    ours = gguf_codec.dequantize(torch.from_numpy(raw.copy()), int(qtype), expected.shape)
    np.testing.assert_array_equal(ours.numpy(), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("qtype", [t for t in gguf_codec.SUPPORTED if t not in (T.F32, T.F16, T.BF16)],
                         ids=lambda t: t.name)
def test_gguf_decoding_in_pieces_gives_the_same_values(qtype, dtype, monkeypatch):
    """Big weights decode a few blocks at a time (weights.decode): the pieces, including a short last
    one, must give exactly what one pass gives (and both what the gguf package decodes)."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = np.random.default_rng(int(qtype) + 7).integers(0, 256, size=(7, 3 * size), dtype=np.uint8)
    for at in HALF_FIELDS[qtype]:
        raw.reshape(-1, size)[:, at + 1] &= 0x3B
    whole = gguf_codec.dequantize(torch.from_numpy(raw.copy()), int(qtype), (7, 3 * block), dtype)
    monkeypatch.setitem(decode_mod.PIECE_VALUES, "cpu", 2 * block)  # 21 blocks -> 10 pieces of 2 and 1 of 1
    pieces = gguf_codec.dequantize(torch.from_numpy(raw.copy()), int(qtype), (7, 3 * block), dtype)
    assert pieces.dtype == dtype and torch.equal(pieces, whole)
    np.testing.assert_array_equal(pieces.float().numpy(),
                                  torch.from_numpy(gguf.quants.dequantize(raw, qtype)).to(dtype).float().numpy())


@pytest.mark.parametrize("shape", [(5, 48), (3, 4, 32), (40,)], ids=["linear", "experts", "vector"])
def test_fp8_decoding_in_pieces_gives_the_same_values(shape, monkeypatch):
    w = torch.randn(shape, generator=torch.Generator().manual_seed(5))
    q, scale = fp8_mod.quantize_fp8(w)
    whole = fp8_mod.dequantize_fp8(q, scale, torch.bfloat16)
    monkeypatch.setitem(decode_mod.PIECE_VALUES, "cpu", 2 * shape[-1] + 1)  # two rows a piece, a short last one
    pieces = fp8_mod.dequantize_fp8(q, scale, torch.bfloat16)
    assert pieces.shape == w.shape and torch.equal(pieces, whole)
    assert torch.equal(pieces, (q.float() * scale.float()[..., None]).to(torch.bfloat16))


@pytest.mark.parametrize("qtype", [T.F32, T.F16, T.BF16], ids=lambda t: t.name)
def test_gguf_plain_types_decode_exactly(qtype):
    values = np.random.default_rng(0).standard_normal((3, 64)).astype(np.float32)
    raw = gguf.quants.quantize(values, qtype).view(np.uint8)
    ours = gguf_codec.dequantize(torch.from_numpy(raw.copy()), int(qtype), (3, 64))
    np.testing.assert_array_equal(ours.numpy(), gguf.quants.dequantize(raw, qtype))


# half a step (Q8_0) or one (Q4_0's clipped extreme), plus the float16 rounding of d times the largest |q|
@pytest.mark.parametrize("qtype,steps", [(T.Q8_0, 0.5 + 127 * 2**-11), (T.Q4_0, 1.0 + 8 * 2**-11)],
                         ids=["Q8_0", "Q4_0"])
def test_gguf_quantization_error_is_within_its_step(qtype, steps):
    values = np.random.default_rng(1).standard_normal((8, 256)).astype(np.float32)
    raw = gguf.quants.quantize(values, qtype)
    back = gguf_codec.dequantize(torch.from_numpy(raw), int(qtype), values.shape).numpy()
    d = np.abs(raw.reshape(-1, gguf.GGML_QUANT_SIZES[qtype][1])[:, :2].copy().view(np.float16).astype(np.float32))
    step = np.repeat(d, 32, axis=1).reshape(values.shape)
    assert np.all(np.abs(back - values) <= steps * step * 1.0001 + 1e-7)


# -- fp8 ---------------------------------------------------------------------------------------------

def test_fp8_rows_are_within_half_an_ulp():
    w = torch.randn(64, 96, generator=torch.Generator().manual_seed(2)) * torch.logspace(-3, 1, 64)[:, None]
    q, scale = fp8_mod.quantize_fp8(w)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (64,) and scale.dtype == torch.float32
    back = fp8_mod.dequantize_fp8(q, scale, torch.float32)
    bound = fp8_mod.REL_STEP * w.abs() + fp8_mod.SUBNORMAL_STEP * scale[:, None]
    assert torch.all((back - w).abs() <= bound * 1.0001)


def test_fp8_on_load_quantizes_linears_and_expert_stacks(fixtures_root):
    folder = fixtures_root / "models" / "tiny-moe"
    ref = load_transformer(folder, dtype=torch.float32)
    model = load_transformer(folder, dtype=torch.float32, weights="fp8_e4m3")
    block = model.blocks[0]
    assert isinstance(block.attn.to_q, QuantizedLinear) and isinstance(block.ffn.experts, QuantizedExperts)
    assert isinstance(block.ffn.shared_experts.down_proj, QuantizedLinear)
    assert type(model.patch_embedder) is torch.nn.Linear and type(block.ffn.router) is type(ref.blocks[0].ffn.router)
    # stored bytes: fp8 values as uint8 and their fp32 scales, never a float copy
    assert block.attn.to_q.qdata.dtype == torch.uint8 and block.attn.to_q.qscale.dtype == torch.int32
    for name, lin in model.named_modules():
        if isinstance(lin, QuantizedLinear):
            w = ref.get_submodule(name).weight
            scale = lin.qscale.view(torch.float32)
            bound = fp8_mod.REL_STEP * w.abs() + fp8_mod.SUBNORMAL_STEP * scale[:, None]
            assert torch.all((lin.dequantized_weight(torch.float32) - w).abs() <= bound * 1.0001), name
    # only the routed experts are decoded: expert e of the view equals row e of the full stack
    experts = block.ffn.experts
    assert torch.equal(experts.w2[1], experts.stack("w2")[1])
    assert _rel(_run(model), _run(ref)) < 0.06  # ~2^-4 per weight; measured 0.04 on this model


def test_fp8_dtype_casts_never_touch_stored_bytes(fixtures_root):
    model = load_transformer(fixtures_root / "models" / "tiny-dense", dtype=torch.float32, weights="fp8_e4m3")
    before = model.blocks[0].attn.to_q.qdata.clone()
    model.to(torch.bfloat16)
    layer = model.blocks[0].attn.to_q
    assert layer.qdata.dtype == torch.uint8 and torch.equal(layer.qdata, before)
    assert layer.qscale.dtype == torch.int32


def test_prequantized_fp8_equals_quantizing_on_load(quantized, fixtures_root):
    folder = quantized["dense", "fp8"]
    header = json.loads(_header(folder / "transformer" / "diffusion_pytorch_model.safetensors"))
    assert header["blocks.0.attn.to_q.weight"]["dtype"] == "F8_E4M3"
    assert header["blocks.0.attn.to_q.weight.scale"]["dtype"] == "F32"
    assert header["blocks.0.norm1.weight"]["dtype"] == "F32"
    pre = load_transformer(folder, dtype=torch.float32)
    onload = load_transformer(fixtures_root / "models" / "tiny-dense", dtype=torch.float32, weights="fp8_e4m3")
    assert torch.equal(_run(pre), _run(onload))
    # the rest of the checkpoint is linked, not rewritten
    assert os.path.samefile(folder / "vae" / "diffusion_pytorch_model.safetensors",
                            fixtures_root / "models" / "tiny-dense" / "vae" / "diffusion_pytorch_model.safetensors")


def _header(path: Path) -> str:
    with open(path, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        return fh.read(n).decode()


# -- GGUF files -------------------------------------------------------------------------------------

@pytest.mark.parametrize("target,tol", [("gguf-q8_0", 0.02), ("gguf-q4_0", 0.15)])
@pytest.mark.parametrize("variant", ["dense", "moe"])
def test_gguf_checkpoint_round_trip(quantized, fixtures_root, variant, target, tol):
    folder = quantized[variant, target]
    assert inspect_checkpoint(folder).weight_files["transformer"][0].suffix == ".gguf"
    ref = load_transformer(fixtures_root / "models" / f"tiny-{variant}", dtype=torch.float32)
    model = load_transformer(folder, dtype=torch.float32)
    reader = gguf.GGUFReader(folder / "transformer" / "diffusion_pytorch_model.gguf")
    for t in reader.tensors:
        if t.name == "blocks.0.attn.to_q.weight":
            assert t.tensor_type == T[target.split("-")[1].upper()]
            expected = gguf.quants.dequantize(t.data, t.tensor_type)
            np.testing.assert_array_equal(model.blocks[0].attn.to_q.dequantized_weight(torch.float32).numpy(),
                                          expected)
    # Q8_0 ~0.5% and Q4_0 ~7% output error on these models (a weight is off by <= 1 step of its block)
    assert _rel(_run(model), _run(ref)) < tol
    assert model.blocks[0].attn.to_q.qdata.dtype == torch.uint8


def test_quantize_command_output_opens_with_the_loader(quantized, commands):
    from lingbot_core import stages
    from lingbot_nodes.loader import LingBotLoader

    handle, = LingBotLoader.execute("tiny (built-in moe)", "moe", "auto", "default",
                                    path=str(quantized["moe", "gguf-q8_0"]), device="cpu").args
    cond = stages.encode_prompt(handle, "a boat", None)
    latents = stages.denoise(handle, cond, height=32, width=32, num_frames=1, steps=1, guidance_scale=1.0, seed=0)
    assert torch.isfinite(latents).all()
    assert isinstance(handle.component("transformer").blocks[0].attn.to_q, QuantizedLinear)
    child, _again = commands["already quantized"]  # `python -m lingbot_core.quantize` on the fp8 folder
    rc = child.result()
    assert rc.returncode == 2 and "already quantized" in rc.stderr


# -- offload with packed weights --------------------------------------------------------------------

@pytest.mark.parametrize("weights", ["fp8", "gguf-q4_0"])
def test_every_offload_mode_gives_identical_outputs(quantized, weights):
    outs = {}
    for mode in MODES:
        handle = PipelineHandle.open(quantized["moe", weights], device="cpu", dtypes={"transformer": torch.float32})
        handle = configure_offload(handle, mode, **({"use_stream": False} if mode == "group" else {}))
        with stage(handle, "transformer") as device:
            outs[mode] = _run(handle.component("transformer")).to(device)
        packed = [p for n, p in handle.shared.loaded["transformer"].named_parameters() if n.endswith("qdata")]
        assert packed and all(p.dtype == torch.uint8 for p in packed)
    for mode in MODES[1:]:
        assert torch.equal(outs[mode], outs["none"]), mode


def test_memory_estimate_counts_stored_bytes(quantized):
    from lingbot_core.placement.door import memory_report

    for target in ("fp8", "gguf-q4_0"):
        handle = PipelineHandle.open(quantized["moe", target], device="cpu", dtypes={"transformer": torch.float32})
        estimate = plan.model_sizes(handle.shared).transformer
        dit = handle.component("transformer")
        loaded = sum(t.numel() * t.element_size() for t in [*dit.parameters(), *dit.buffers()])
        assert abs(estimate - loaded) <= 0.05 * loaded, target  # GGUF: file bytes incl. its header
        report = memory_report(handle)
        assert next(c for c in report.components if c.name == "transformer").bytes_by_location["CPU"] == loaded


# -- the RAM-frugal loader --------------------------------------------------------------------------

def _bf16_checkpoint(src: Path, dst: Path, hidden: int = 512, depth: int = 6) -> Path:
    """A plain bf16 DiT folder of a few tens of MB (random), for memory checks."""
    from safetensors.torch import save_file

    from lingbot_core.models.transformer import LingBotVideoTransformer3DModel

    config = json.loads((src / "transformer" / "config.json").read_text())
    config.update(hidden_size=hidden, num_attention_heads=hidden // 16, axes_dims=[4, 6, 6], depth=depth,
                  intermediate_size=4 * hidden, text_dim=32)
    with torch.device("meta"):
        skeleton = LingBotVideoTransformer3DModel.from_config(config)
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for k, v in skeleton.state_dict().items():
        dtype = torch.float32 if keeps_fp32(k) else torch.bfloat16
        tensors[k] = (torch.randn(v.shape, generator=g) * 0.02).to(dtype)
    (dst / "transformer").mkdir(parents=True)
    save_file(tensors, str(dst / "transformer" / "diffusion_pytorch_model.safetensors"))
    (dst / "transformer" / "config.json").write_text(json.dumps(config))
    return dst


_PEAK_SCRIPT = """
import json, resource, sys, torch
from lingbot_core.weights.loader import load_dit
import lingbot_core.models.transformer  # imports done before the baseline
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
model = load_dit(sys.argv[1], dtype=None)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
dtypes = {n: str(p.dtype) for n, p in model.named_parameters()}
print(json.dumps({"base": base * 1024, "peak": peak * 1024, "dtypes": dtypes}))
"""


def test_bf16_checkpoint_loads_as_bf16_without_an_fp32_copy(commands):
    child, folder = commands["bf16 peak"]  # _PEAK_SCRIPT on a _bf16_checkpoint, in a process of its own
    stored = (folder / "transformer" / "diffusion_pytorch_model.safetensors").stat().st_size
    out = child.result()
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    for name, dtype in result["dtypes"].items():
        assert dtype == ("torch.float32" if keeps_fp32(name) else "torch.bfloat16"), name
    grown = result["peak"] - result["base"]
    # the model itself plus one tensor in flight; an fp32 detour would need about twice the stored bytes
    assert grown < 1.3 * stored + 16 * 2**20, (grown, stored)


# -- bad input --------------------------------------------------------------------------------------

def _gguf_file(path: Path, tensors: dict[str, tuple[np.ndarray, T]]) -> Path:
    from gguf_fakes import write_gguf

    return write_gguf(path, tensors)


def _swap_transformer_weights(quantized, tmp_path, variant="dense", target="gguf-q8_0") -> Path:
    import shutil

    folder = tmp_path / "ckpt"
    shutil.copytree(quantized[variant, target], folder)
    return folder


def test_gguf_type_we_cannot_decode_is_named(quantized, tmp_path):
    folder = _swap_transformer_weights(quantized, tmp_path)
    target = folder / "transformer" / "diffusion_pytorch_model.gguf"
    reader = gguf.GGUFReader(target)
    tensors = {t.name: (np.array(t.data), t.tensor_type) for t in reader.tensors}
    del reader
    assert T.IQ2_XXS not in gguf_codec.SUPPORTED
    size = gguf.GGML_QUANT_SIZES[T.IQ2_XXS][1]
    # an IQ2_XXS row holds 256 values; the shape check comes second, the type check first
    tensors["blocks.0.attn.to_q.weight"] = (np.zeros((32, size), dtype=np.uint8), T.IQ2_XXS)
    target.unlink()
    _gguf_file(target, tensors)
    with pytest.raises(CheckpointError, match=r"blocks.0.attn.to_q.weight.*IQ2_XXS.*cannot dequantize"):
        PipelineHandle.open(folder, device="cpu")


def test_gguf_tensor_with_the_wrong_shape_is_named(quantized, tmp_path):
    folder = _swap_transformer_weights(quantized, tmp_path)
    target = folder / "transformer" / "diffusion_pytorch_model.gguf"
    reader = gguf.GGUFReader(target)
    tensors = {t.name: (np.array(t.data), t.tensor_type) for t in reader.tensors}
    del reader
    tensors["blocks.1.attn.to_k.weight"] = (gguf.quants.quantize(np.ones((16, 32), np.float32), T.Q8_0), T.Q8_0)
    target.unlink()
    _gguf_file(target, tensors)
    with pytest.raises(CheckpointError, match=r"wrong shape \(e.g. blocks.1.attn.to_k.weight: stored \[16, 32\]"):
        load_transformer(folder)


def test_fp8_file_with_the_wrong_shape_is_named(quantized, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = _swap_transformer_weights(quantized, tmp_path, target="fp8")
    path = folder / "transformer" / "diffusion_pytorch_model.safetensors"
    tensors = load_file(str(path))
    tensors["blocks.0.attn.to_v.weight"] = tensors["blocks.0.attn.to_v.weight"][:8].clone()
    path.unlink()
    save_file(tensors, str(path))
    with pytest.raises(CheckpointError, match=r"blocks.0.attn.to_v.weight.scale.*expected F32 \[8\]"):
        load_transformer(folder)
    tensors["blocks.0.attn.to_v.weight.scale"] = tensors["blocks.0.attn.to_v.weight.scale"][:8].clone()
    path.unlink()
    save_file(tensors, str(path))
    with pytest.raises(CheckpointError, match=r"blocks.0.attn.to_v.weight: stored \[8, 32\], config implies \[32, 32\]"):
        load_transformer(folder)


def test_fp8_without_float8_in_torch_is_refused_before_loading(fixtures_root, monkeypatch):
    monkeypatch.setattr(fp8_mod, "fp8_available", lambda: False)
    with pytest.raises(ValueError, match=r"fp8 weights need a torch with float8 dtypes"):
        PipelineHandle.open(fixtures_root / "models" / "tiny-dense", device="cpu", weights="fp8_e4m3")


def test_unknown_weights_mode_is_refused(fixtures_root):
    with pytest.raises(ValueError, match=r"unknown weights mode 'int4'"):
        PipelineHandle.open(fixtures_root / "models" / "tiny-dense", device="cpu", weights="int4")


@pytest.mark.parametrize("component", ["vae", "text_encoder"])
def test_quantized_vae_or_text_encoder_is_refused(quantized, tmp_path, component):
    folder = _swap_transformer_weights(quantized, tmp_path)
    (folder / component / "extra.gguf").write_bytes(b"GGUF")
    with pytest.raises(CheckpointError, match=rf"{component}: .* holds quantized weights .*extra.gguf"):
        inspect_checkpoint(folder)


def test_fp8_request_for_a_gguf_checkpoint_is_refused(quantized):
    with pytest.raises(CheckpointError, match=r"already quantized \(GGUF\)"):
        load_transformer(quantized["dense", "gguf-q8_0"], weights="fp8_e4m3")


# -- disk-backed offload ----------------------------------------------------------------------------

@pytest.mark.parametrize("mode", OFFLOADING)
@pytest.mark.parametrize("weights", ["plain", "fp8", "gguf-q4_0"])
def test_disk_offload_streams_from_the_file_and_matches_ram(quantized, fixtures_root, mode, weights):
    folder = fixtures_root / "models" / "tiny-moe" if weights == "plain" else quantized["moe", weights]
    ram = PipelineHandle.open(folder, device="cpu")
    with stage(ram, "transformer"):
        expected = _run(ram.component("transformer"))
    handle = configure_offload(PipelineHandle.open(folder, device="cpu"), mode, offload_to="disk",
                               **({"use_stream": False} if mode == "group" else {}))
    with stage(handle, "transformer"):
        dit = handle.component("transformer")
        got = _run(dit)
    # between forwards no weight is held in memory: the file is the home
    assert all(t.device.type == "meta" for t in [*dit.parameters(), *dit.buffers()])
    assert torch.equal(got, expected)
    configure_offload(handle, "none")  # switching away reads every tensor back
    assert all(t.device.type == "cpu" for t in dit.parameters())
    with stage(handle, "transformer"):
        assert torch.equal(_run(dit), expected)


class _SpanReads:
    """Counts the reads of disk homes (`FileSpan.read`): `loads` into owned memory, `streams` of a unit."""

    def __init__(self, monkeypatch):
        from lingbot_core.weights import disk

        self.loads = self.streams = 0
        real = disk.FileSpan.read

        def counting(span, device, *, transient=False):
            if transient:
                self.streams += 1
            else:
                self.loads += 1
            return real(span, device, transient=transient)

        monkeypatch.setattr(disk.FileSpan, "read", counting)


def _disk_view(handle, mode):
    return configure_offload(handle, mode, offload_to="disk", **({"use_stream": False} if mode == "group" else {}))


def _all_meta(module) -> bool:
    return all(t.device.type == "meta" for t in [*module.parameters(), *module.buffers()])


@pytest.mark.parametrize("weights", ["plain", "gguf-q4_0", "per-expert"])
def test_disk_load_leaves_the_stored_tensors_in_the_file(quantized, per_expert, fixtures_root, monkeypatch, weights):
    folder = {"plain": fixtures_root / "models" / "tiny-moe", "per-expert": per_expert["gguf-q4_0"]}.get(
        weights) or quantized["moe", weights]
    ram = PipelineHandle.open(folder, device="cpu")
    with stage(ram, "transformer"):
        expected = _run(ram.component("transformer"))
    reads = _SpanReads(monkeypatch)
    handle = _disk_view(PipelineHandle.open(folder, device="cpu"), "sequential")
    with stage(handle, "transformer"):
        dit = handle.component("transformer")
        assert _state(handle).reads == 0 and reads.loads == 0  # loaded without reading a single stored tensor
        assert _all_meta(dit) and len(_state(handle).spans) == len(dit.state_dict())
        got = _run(dit)
    assert reads.loads == 0 and reads.streams > 0
    assert torch.equal(got, expected)


def _state(handle, name="transformer"):
    """What the load found about a handle's DiT (disk homes, tensors read): its `ModelState`."""
    return handle.shared.states[name]


def _converted_files(cache_dir: Path) -> list[Path]:
    return sorted((cache_dir / "converted").glob("*.safetensors"))


@pytest.mark.parametrize("weights", ["auto", "fp8_e4m3"], ids=["bf16-from-fp32", "fp8-on-load"])
def test_disk_converted_tensors_are_cached_once_and_streamed(fixtures_root, monkeypatch, tmp_path, weights):
    # a float32 checkpoint loaded as bf16 (and quantized to fp8 on load): converted tensors have no bytes in
    # the checkpoint, so the first streamed load writes them to the cache and every load streams from there
    monkeypatch.setenv("LINGBOT_TINY_DIR", str(tmp_path))
    folder = fixtures_root / "models" / "tiny-moe"

    def open_handle():
        return PipelineHandle.open(folder, device="cpu", dtypes={"transformer": torch.bfloat16}, weights=weights)

    ram = open_handle()
    with stage(ram, "transformer"):
        ram_dit = ram.component("transformer")
        expected = _run(ram_dit)
    converted = _state(ram).reads - len(_state(ram).spans)  # reads that were conversions
    assert converted > 0 and not _converted_files(tmp_path)  # a RAM load converts in memory, caches nothing
    first = _disk_view(open_handle(), "group")
    with stage(first, "transformer"):
        dit = first.component("transformer")
        assert _all_meta(dit) and _state(first).reads == converted  # each converted once, into the cache
        assert torch.equal(_run(dit), expected)
    (cache,) = _converted_files(tmp_path)
    written = cache.stat().st_mtime_ns
    reads = _SpanReads(monkeypatch)
    again = _disk_view(open_handle(), "sequential")
    with stage(again, "transformer"):
        dit = again.component("transformer")
        assert _state(again).reads == 0 and reads.loads == 0  # the cache is reused: nothing read or converted
        assert torch.equal(_run(dit), expected)
    assert _converted_files(tmp_path) == [cache] and cache.stat().st_mtime_ns == written


def test_a_stale_converted_cache_is_rebuilt(fixtures_root, monkeypatch, tmp_path):
    import shutil

    monkeypatch.setenv("LINGBOT_TINY_DIR", str(tmp_path / "cache"))
    folder = tmp_path / "ckpt"
    shutil.copytree(fixtures_root / "models" / "tiny-dense", folder)

    def streamed():
        handle = _disk_view(PipelineHandle.open(folder, device="cpu", dtypes={"transformer": torch.bfloat16}),
                            "model")
        with stage(handle, "transformer"):
            dit = handle.component("transformer")
            return _state(handle).reads, _run(dit)

    converted, expected = streamed()
    (cache,) = _converted_files(tmp_path / "cache")
    with open(cache, "r+b") as fh:  # a torn write: the data ends early
        fh.truncate(cache.stat().st_size - 16)
    assert streamed()[0] == converted and cache.stat().st_size > 16  # refused and rebuilt
    assert torch.equal(streamed()[1], expected)
    weights = folder / "transformer" / "diffusion_pytorch_model.safetensors"
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))  # the checkpoint changed
    gc.collect()  # the earlier handles' spans hold their cache file (a file in use is never evicted)
    reads, out = streamed()
    assert reads == converted and torch.equal(out, expected)
    (rebuilt,) = _converted_files(tmp_path / "cache")  # the old cache of this checkpoint is gone
    assert rebuilt != cache


def test_disk_then_ram_then_disk_stays_exact(quantized, monkeypatch):
    folder = quantized["moe", "gguf-q8_0"]
    ram = PipelineHandle.open(folder, device="cpu")
    with stage(ram, "transformer"):
        expected = _run(ram.component("transformer"))
    handle = _disk_view(PipelineHandle.open(folder, device="cpu"), "group")
    with stage(handle, "transformer"):
        dit = handle.component("transformer")
        assert torch.equal(_run(dit), expected)
    reads = _SpanReads(monkeypatch)
    in_ram = configure_offload(handle, "sequential")  # the RAM home: every stored tensor read back, once
    assert reads.loads == len(_state(handle).spans)
    with stage(in_ram, "transformer"):
        assert torch.equal(_run(dit), expected)
    back = _disk_view(handle, "model")
    assert _all_meta(dit)
    with stage(back, "transformer"):
        assert torch.equal(_run(dit), expected)
    assert handle.shared.load_count["transformer"] == 1


def test_disk_release_reload_and_a_failed_forward_stay_exact(quantized, monkeypatch):
    from lingbot_core.placement.door import release

    folder = quantized["moe", "fp8"]
    ram = PipelineHandle.open(folder, device="cpu")
    with stage(ram, "transformer"):
        expected = _run(ram.component("transformer"))
    handle = _disk_view(PipelineHandle.open(folder, device="cpu"), "sequential")
    with stage(handle, "transformer"):
        assert torch.equal(_run(handle.component("transformer")), expected)
    reads = _SpanReads(monkeypatch)
    release(handle, ["transformer"])
    assert reads.loads == 0  # a release forgets the streamed tensors, it does not read them back
    with stage(handle, "transformer"):
        dit = handle.component("transformer")
        assert _state(handle).reads == 0
        hook = dit.blocks[1].register_forward_pre_hook(lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
        with pytest.raises(KeyboardInterrupt):
            _run(dit)
        hook.remove()
    assert _all_meta(dit)  # the units the cancelled forward had read are dropped
    with stage(handle, "transformer"):
        assert torch.equal(_run(dit), expected)
    assert reads.loads == 0 and handle.shared.load_count["transformer"] == 2


def test_disk_offload_serves_a_file_it_could_not_map_and_refuses_a_missing_or_short_one(tmp_path, monkeypatch):
    """Issue 31: streaming reads the file with plain reads, so the check before installing no longer maps it
    (it refused a readable file that cannot be mapped); a gone or shortened file is still refused up front."""
    import numpy as np

    from lingbot_core.weights import disk

    path = tmp_path / "w.bin"
    path.write_bytes(bytes(range(64)))
    span = disk.FileSpan(str(path), 0, 64, torch.uint8, (64,))

    def no_map(*_a, **_k):
        raise OSError("mapping not supported")

    monkeypatch.setattr(np, "memmap", no_map)
    disk.check_readable({"w": span})
    assert span.read(torch.device("cpu")).tolist() == list(range(64))
    with pytest.raises(ValueError, match="shorter than its header says"):
        disk.check_readable({"w": disk.FileSpan(str(path), 32, 64, torch.uint8, (64,))})
    with pytest.raises(ValueError, match="disk offload needs to read the checkpoint file.*does not exist"):
        disk.check_readable({"w": disk.FileSpan(str(tmp_path / "gone.bin"), 0, 8, torch.uint8, (8,))})


def test_failed_disk_install_after_a_streamed_load_leaves_the_handle_exact(quantized, monkeypatch):
    from lingbot_core.weights import disk

    folder = quantized["moe", "gguf-q4_0"]
    ram = PipelineHandle.open(folder, device="cpu")
    with stage(ram, "transformer"):
        expected = _run(ram.component("transformer"))
    handle = PipelineHandle.open(folder, device="cpu")
    on_disk = _disk_view(handle, "group")
    monkeypatch.setattr(disk, "check_readable", lambda spans: (_ for _ in ()).throw(ValueError("not readable")))
    with pytest.raises(ValueError, match="not readable"), stage(on_disk, "transformer"):
        pass
    monkeypatch.undo()
    dit = handle.shared.loaded["transformer"]
    assert _all_meta(dit)  # loaded for streaming; nothing was read
    with stage(on_disk, "transformer"):  # the same view again: streaming installs now
        assert torch.equal(_run(dit), expected)
    with stage(handle.with_offload("model"), "transformer"):  # a RAM-homed mode reads what is in the file
        assert not any(t.device.type == "meta" for t in dit.parameters())
        assert torch.equal(_run(dit), expected)
    assert handle.shared.load_count["transformer"] == 1


def test_disk_offload_on_a_file_that_is_gone_is_refused(quantized, tmp_path):
    import shutil

    folder = tmp_path / "ckpt"
    shutil.copytree(quantized["dense", "gguf-q8_0"], folder)
    handle = PipelineHandle.open(folder, device="cpu")
    handle.component("transformer")
    (folder / "transformer" / "diffusion_pytorch_model.gguf").unlink()
    with pytest.raises(ValueError, match=r"disk offload needs to read the checkpoint file: .*gguf does not exist"):
        configure_offload(handle, "sequential", offload_to="disk")


def test_unknown_offload_home_is_refused(fixtures_root):
    handle = PipelineHandle.open(fixtures_root / "models" / "tiny-dense", device="cpu")
    with pytest.raises(ValueError, match=r"offload_to must be one of ram, disk"):
        configure_offload(handle, "group", offload_to="tape", use_stream=False)


# -- NaN/inf in packed weights ----------------------------------------------------------------------

@pytest.mark.parametrize("qtype", [t for t in gguf_codec.SUPPORTED if t not in (T.F32, T.F16, T.BF16)],
                         ids=lambda t: t.name)
def test_the_gguf_scan_flags_exactly_the_corruptions_that_decode_to_non_finite(qtype):
    """Write an infinite float16 (0x7C00) at every byte position of a block: the scan must flag it
    exactly when the decoder then yields NaN/inf (so it reads the right fields, and all of them)."""
    from lingbot_core.weights.scan import gguf_bad_field_count

    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(7)
    raw = rng.integers(0, 256, size=(1, size), dtype=np.uint8)
    for at in HALF_FIELDS[qtype]:
        raw[0, at + 1] &= 0x3B  # finite to start with
    assert gguf_bad_field_count(torch.from_numpy(raw.copy()), int(qtype)) == 0
    flagged = 0
    for at in range(size - 1):
        bad = raw.copy()
        bad[0, at], bad[0, at + 1] = 0x00, 0x7C
        decoded = gguf_codec.dequantize(torch.from_numpy(bad.copy()), int(qtype), (1, block))
        scanned = gguf_bad_field_count(torch.from_numpy(bad), int(qtype))
        assert (scanned > 0) == (not bool(torch.isfinite(decoded).all())), at
        flagged += scanned > 0
    assert flagged == len(HALF_FIELDS[qtype])


def test_the_fp8_scan_counts_nan_codes_and_bad_scales():
    from lingbot_core.weights.scan import fp8_bad_scale_count, fp8_nan_count

    every = torch.arange(256, dtype=torch.uint8)
    assert fp8_nan_count(every) == int((~torch.isfinite(every.view(torch.float8_e4m3fn).float())).sum()) == 2
    scales = torch.tensor([1.0, float("inf"), float("nan"), 3e38, 1e-3])
    assert fp8_bad_scale_count(scales.view(torch.int32)) == 3  # 3e38 * 448 overflows float32


def _copy(quantized, tmp_path, variant, target) -> Path:
    import shutil

    folder = tmp_path / f"{variant}-{target}"
    shutil.copytree(quantized[variant, target], folder)
    return folder


def _poke(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as fh:
        fh.seek(offset)
        fh.write(data)


def test_nan_in_an_fp8_file_is_refused_naming_the_tensor(quantized, tmp_path):
    from lingbot_core.checkpoints.loading import load_component
    from lingbot_core.weights.sources import SafetensorsSource

    folder = _copy(quantized, tmp_path, "moe", "fp8")
    path = folder / "transformer" / "diffusion_pytorch_model.safetensors"
    source = SafetensorsSource([path])
    nan_at = source.span("blocks.1.attn.to_k.weight", torch.uint8, (32, 32)).offset + 37
    scale_at = source.span("blocks.0.ffn.experts.w3.scale", torch.float32, (4, 16)).offset + 4 * 5
    _poke(path, nan_at, bytes([0xFF]))
    with pytest.raises(CheckpointError, match=r"transformer: quantized weight blocks.1.attn.to_k.weight .* holds "
                                              r"1 NaN fp8 value\(s\)"):
        load_component(folder, "transformer")
    _poke(path, nan_at, bytes([0x00]))
    load_component(folder, "transformer")  # clean again
    _poke(path, scale_at, np.array([np.inf], dtype=np.float32).tobytes())
    with pytest.raises(CheckpointError, match=r"blocks.0.ffn.experts.w3 .* 1 non-finite .*row scale"):
        load_component(folder, "transformer")


@pytest.mark.parametrize("target,tensor", [("gguf-q8_0", "blocks.0.attn.to_v.weight"),
                                           ("gguf-q4_0", "blocks.1.ffn.experts.w1"),
                                           ("per-expert", "blocks.1.ffn.experts.w3.2")])
def test_a_non_finite_gguf_block_scale_is_refused_naming_the_tensor(quantized, per_expert, tmp_path, target, tensor):
    import shutil

    from lingbot_core.checkpoints.loading import load_component

    if target == "per-expert":
        folder = tmp_path / "split"
        shutil.copytree(per_expert["gguf-q8_0"], folder)
    else:
        folder = _copy(quantized, tmp_path, "moe", target)
    path = folder / "transformer" / "diffusion_pytorch_model.gguf"
    reader = gguf.GGUFReader(path)
    info = next(t for t in reader.tensors if t.name == tensor)
    qtype, start = info.tensor_type, int(info.data_offset)
    del reader, info
    size = gguf.GGML_QUANT_SIZES[qtype][1]
    _poke(path, start + 3 * size, bytes([0x00, 0xFC]))  # the 4th block's d = -inf
    with pytest.raises(CheckpointError, match=rf"quantized weight {tensor} .* holds 1 non-finite {qtype.name} block "
                                              r"scale\(s\) \(float16 d/m fields\)"):
        load_component(folder, "transformer")


# -- GGUF expert stacks stored per expert -----------------------------------------------------------

@pytest.fixture(scope="module")
def per_expert(tmp_path_factory, fixtures_root):
    """The tiny MoE checkpoint as GGUF with every expert stack stored one tensor per expert."""
    root = tmp_path_factory.mktemp("per-expert")
    return {target: quantize_checkpoint(fixtures_root / "models" / "tiny-moe", root / target, target, per_expert=True)
            for target in ("gguf-q8_0", "gguf-q4_0")}


def _gguf_tensors(folder: Path, component: str = "transformer") -> dict[str, tuple[np.ndarray, T]]:
    reader = gguf.GGUFReader(folder / component / "diffusion_pytorch_model.gguf")
    out = {t.name: (np.array(t.data), t.tensor_type) for t in reader.tensors}
    del reader
    return out


@pytest.mark.parametrize("target", ["gguf-q8_0", "gguf-q4_0"])
def test_per_expert_gguf_loads_bit_identical_to_the_stacked_file(quantized, per_expert, target):
    stacked_file, split_file = _gguf_tensors(quantized["moe", target]), _gguf_tensors(per_expert[target])
    assert "blocks.0.ffn.experts.w1" in stacked_file and "blocks.0.ffn.experts.w1" not in split_file
    for stack in ("blocks.1.ffn.experts.w1", "blocks.1.ffn.experts.w2"):
        data, qtype = stacked_file[stack]
        for e in range(4):
            part, part_type = split_file[f"{stack}.{e}"]
            assert part_type == qtype and np.array_equal(part, data[e])  # the same blocks, expert by expert
    for component in ("transformer", "refiner"):
        assert "blocks.0.ffn.experts.w3.3" in _gguf_tensors(per_expert[target], component)
    stacked = load_transformer(quantized["moe", target], dtype=torch.float32)
    split = load_transformer(per_expert[target], dtype=torch.float32)
    experts = split.blocks[0].ffn.experts
    assert isinstance(experts, QuantizedExperts) and experts.per_expert("w1")
    assert not stacked.blocks[0].ffn.experts.per_expert("w1")
    assert "blocks.0.ffn.experts.w1_qdata.3" in dict(split.named_parameters())
    assert torch.equal(_run(split), _run(stacked))


@pytest.mark.parametrize("layout", ["stacked", "per-expert", "stacked-Q3_K"])
def test_a_forward_dequantizes_only_the_routed_experts(quantized, per_expert, monkeypatch, tmp_path, layout):
    if layout == "stacked-Q3_K":  # a K type: the wide tiny MoE (rows of 256), random Q3_K blocks
        from gguf_fakes import write_wide_moe

        from lingbot_core.weights.loader import load_dit

        write_wide_moe(tmp_path, T.Q3_K)
        ffn = load_dit(tmp_path, dtype=torch.float32).blocks[0].ffn
        assert ffn.experts.packings["w1"].gguf_type == T.Q3_K
    else:
        folder = quantized["moe", "gguf-q8_0"] if layout == "stacked" else per_expert["gguf-q8_0"]
        ffn = load_transformer(folder, dtype=torch.float32).blocks[1].ffn
    experts = ffn.experts
    hidden = experts.packings["w1"].shape[-1]
    # where each expert's stored bytes start -> (weight, expert)
    owner = {getattr(experts, f"{n}_qdata")[e].data_ptr(): (n, e) for n in experts.NAMES for e in range(4)}
    decoded: list[tuple[str, int]] = []
    real = gguf_codec.dequantize

    def counting(packed, qtype, shape, dtype=torch.float32, decoder="auto", out=None):
        if packed.data_ptr() in owner:
            assert len(shape) == 2, "a whole stack was decoded"
            decoded.append(owner[packed.data_ptr()])
        return real(packed, qtype, shape, dtype, decoder, out)

    monkeypatch.setattr(gguf_codec, "dequantize", counting)
    token = torch.randn(1, 1, hidden, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ffn(token)
    chosen, _ = ffn.router(token.reshape(1, hidden))
    routed = sorted(set(chosen.flatten().tolist()))
    assert len(routed) == 2  # of 4 experts
    assert sorted(decoded) == sorted((n, e) for n in experts.NAMES for e in routed)  # each once, nothing else


@pytest.mark.parametrize("mode", MODES)
def test_per_expert_gguf_under_every_offload_mode_and_disk(per_expert, mode):
    folder = per_expert["gguf-q4_0"]
    ram = PipelineHandle.open(folder, device="cpu")
    with stage(ram, "transformer"):
        expected = _run(ram.component("transformer"))
    for home in ("ram", "disk") if mode != "none" else ("ram",):
        handle = configure_offload(PipelineHandle.open(folder, device="cpu"), mode, offload_to=home,
                                   **({"use_stream": False} if mode == "group" else {}))
        with stage(handle, "transformer"):
            dit = handle.component("transformer")
            assert torch.equal(_run(dit), expected), (mode, home)
        if home == "disk":
            assert "blocks.0.ffn.experts.w1_qdata.2" in _state(handle).spans  # each expert has its home in the file
            assert all(t.device.type == "meta" for t in dit.parameters())


def _rewrite(folder: Path, change) -> Path:
    target = folder / "transformer" / "diffusion_pytorch_model.gguf"
    tensors = _gguf_tensors(folder)
    change(tensors)
    target.unlink()
    _gguf_file(target, tensors)
    return folder


@pytest.mark.parametrize("change,message", [
    (lambda t: t.pop("blocks.0.ffn.experts.w1.1"),
     r"experts of 'blocks.0.ffn.experts.w1' are stored per expert but 'blocks.0.ffn.experts.w1.1' is missing"),
    (lambda t: t.pop("blocks.1.ffn.experts.w3.3"),
     r"blocks.1.ffn.experts.w3: stored \[3, 16, 32\], config implies \[4, 16, 32\]"),
    (lambda t: t.update({"blocks.0.ffn.experts.w2.2": (np.zeros((32, 8), np.float32), T.F32)}),
     r"per-expert tensor 'blocks.0.ffn.experts.w2.2' is \[32, 8\], but 'blocks.0.ffn.experts.w2.0' is \[32, 16\]"),
    (lambda t: t.update({"blocks.0.ffn.experts.w1": (np.zeros((4, 16, 32), np.float32), T.F32)}),
     r"'blocks.0.ffn.experts.w1' is stored both stacked and per expert"),
    (lambda t: t.update({"blocks.0.ffn.experts.w1.2": (np.zeros((16, 32), np.float32), T.F32)}),
     r"stored per expert in types lingbot-nodes cannot stack \(Q8_0 for 'blocks.0.ffn.experts.w1.0', F32 for 'blocks.0.ffn.experts.w1.2'\)"),
], ids=["gap", "too-few", "shape", "both-layouts", "mixed-types"])
def test_bad_per_expert_files_are_refused_naming_the_tensor(per_expert, tmp_path, change, message):
    import shutil

    folder = tmp_path / "ckpt"
    shutil.copytree(per_expert["gguf-q8_0"], folder)
    _rewrite(folder, change)
    with pytest.raises(CheckpointError, match=message):
        load_transformer(folder)


def test_per_expert_is_refused_for_fp8(fixtures_root, tmp_path):
    with pytest.raises(ValueError, match="--per-expert is for the GGUF targets"):
        quantize_checkpoint(fixtures_root / "models" / "tiny-moe", tmp_path / "out", "fp8", per_expert=True)
    assert not (tmp_path / "out").exists()


def test_the_quantize_command_writes_per_expert_files(per_expert, commands):
    child, out = commands["per expert"]  # `python -m lingbot_core.quantize` tiny-moe --to gguf-q4_0 --per-expert
    rc = child.result()
    assert rc.returncode == 0, rc.stderr
    written = (out / "transformer" / "diffusion_pytorch_model.gguf").read_bytes()
    assert written == (per_expert["gguf-q4_0"] / "transformer" / "diffusion_pytorch_model.gguf").read_bytes()


def _to_q_lora_outputs(folder: Path, path: Path, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Write a LoRA on block 0's to_q to `path`; the DiT's output without it and with it merged (RAM)."""
    from safetensors.torch import save_file

    from lingbot_core.lora import with_lora

    g = torch.Generator().manual_seed(seed)
    save_file({"blocks.0.attn.to_q.lora_A.weight": torch.randn(4, 32, generator=g),
               "blocks.0.attn.to_q.lora_B.weight": torch.randn(32, 4, generator=g)}, path)
    plain = PipelineHandle.open(folder, device="cpu")
    with stage(plain, "transformer"):
        without = _run(plain.component("transformer"))
    merged = with_lora(PipelineHandle.open(folder, device="cpu"), path)
    with stage(merged, "transformer"):
        expected = _run(merged.component("transformer"))
    assert not torch.equal(expected, without)
    return without, expected


@pytest.mark.parametrize("mode", OFFLOADING)
def test_a_merged_lora_survives_disk_offload(fixtures_root, tmp_path, mode):
    # a merge changes weights in memory: those no longer match their file, so they stay in memory
    from lingbot_core.lora import with_lora

    folder = fixtures_root / "models" / "tiny-moe"
    path = tmp_path / "lora.safetensors"
    without, expected = _to_q_lora_outputs(folder, path, seed=5)
    handle = PipelineHandle.open(folder, device="cpu")
    view = with_lora(_disk_view(handle, mode), path)
    for _ in range(2):
        with stage(view, "transformer"):
            dit = view.component("transformer")
            assert torch.equal(_run(dit), expected)
    assert dit.blocks[0].attn.to_q.weight.device.type == "cpu"  # merged: held in memory
    assert dit.blocks[1].attn.to_q.weight.device.type == "meta"  # untouched: still in its file
    with stage(_disk_view(handle, mode), "transformer"):  # the LoRA taken off: back to the file's values
        assert torch.equal(_run(dit), without)


@pytest.mark.parametrize("mode", STREAMING)
def test_disk_offload_and_a_merged_lora_under_inference_mode(fixtures_root, tmp_path, mode):
    """ComfyUI runs every node under torch.inference_mode(): loading, streaming, a switch to RAM and back,
    and a merged LoRA's bookkeeping must all work there and stay exact."""
    from lingbot_core.lora import with_lora

    folder = fixtures_root / "models" / "tiny-moe"
    path = tmp_path / "lora.safetensors"
    without, expected = _to_q_lora_outputs(folder, path, seed=7)
    with torch.inference_mode():
        handle = PipelineHandle.open(folder, device="cpu")
        with stage(_disk_view(handle, mode), "transformer"):
            dit = handle.component("transformer")
            assert torch.equal(_run(dit), without)
        assert _all_meta(dit)  # loaded and streamed: nothing held
        with stage(configure_offload(handle, "model"), "transformer"):  # a RAM home, then the file again
            assert torch.equal(_run(dit), without)
        with stage(_disk_view(handle, mode), "transformer"):
            assert torch.equal(_run(dit), without)
        assert _all_meta(dit)
        view = with_lora(_disk_view(handle, mode), path)
        with stage(view, "transformer"):
            assert torch.equal(_run(dit), expected)
        assert dit.blocks[0].attn.to_q.weight.device.type == "cpu"  # merged: kept in memory
        with stage(_disk_view(handle, mode), "transformer"):
            assert torch.equal(_run(dit), without)
