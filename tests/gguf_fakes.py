"""GGUF DiT files for tests: a tiny MoE DiT wide enough (rows of 256) for every GGUF block type, its
quantizable weights written as RANDOM packed blocks of one type (the `gguf` package has no quantizer
for Q2_K/Q3_K/IQ4_NL/IQ4_XS), and the float weights they stand for (decoded by the `gguf` package's
numpy reference, never by our decoder)."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch

from lingbot_core.weights import gguf_codec
from lingbot_core.weights.loader import quantizable

T = gguf.GGMLQuantizationType


def write_gguf(path: Path, tensors: dict[str, tuple[np.ndarray, T]], arch: str = "lingbot_video",
               arrays: dict[str, list] | None = None) -> Path:
    """A GGUF file holding `tensors` (name -> (stored array, GGML type)) in order, written by the gguf package;
    `arrays` are extra array-valued metadata keys, written after the architecture."""
    writer = gguf.GGUFWriter(path, arch=arch)
    for key, values in (arrays or {}).items():
        writer.add_array(key, values)
    for name, (data, qtype) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
HIDDEN = 256
# the tiny MoE's structure at hidden 256: every linear and expert row is whole blocks of any type
WIDE_MOE = {
    "axes_dims": [32, 48, 48], "axes_lens": [256, 64, 64], "decoder_sparse_step": 1, "depth": 1, "freq_dim": 256,
    "hidden_size": HIDDEN, "in_channels": 16, "intermediate_size": 256, "mlp_only_layers": [],
    "moe_intermediate_size": 256, "n_group": 2, "n_shared_experts": 1, "norm_eps": 1e-06, "norm_topk_prob": True,
    "num_attention_heads": 2, "num_experts": 4, "num_experts_per_tok": 2, "out_bias": True, "out_channels": 16,
    "patch_embed_bias": True, "patch_size": [1, 2, 2], "qkv_bias": False, "rope_theta": 256.0,
    "routed_scaling_factor": 2.5, "score_func": "sigmoid", "text_dim": 256, "timestep_mlp_bias": True,
    "topk_group": 1,
}


def random_blocks(qtype: T, rows: int, cols: int, rng: np.random.Generator, scale: float = 2e-4) -> np.ndarray:
    """`rows` rows of `cols` values as random blocks of `qtype` (uint8 [rows, bytes per row]), every
    float16 field (`d`, `dmin`) a small positive finite value so the decoded weights stay moderate."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
    for at in gguf_codec.half_fields(int(qtype)):
        d = (scale * rng.uniform(0.5, 1.0, size=raw.shape[0])).astype(np.float16)
        raw[:, at:at + 2] = d.view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, cols // block * size)


def write_wide_moe(folder: Path, qtype: T, seed: int = 0) -> dict[str, torch.Tensor]:
    """`folder/transformer/` with the wide MoE config and a GGUF whose quantizable weights are random
    `qtype` blocks (other tensors F32); returns the float32 state dict those bytes decode to."""
    from lingbot_core.models.transformer import LingBotVideoTransformer3DModel

    target = folder / "transformer"
    target.mkdir(parents=True)
    (target / "config.json").write_text(json.dumps({"_class_name": "LingBotVideoTransformer3DModel", **WIDE_MOE}))
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in LingBotVideoTransformer3DModel.from_config(WIDE_MOE)
                  .state_dict().items()}
    rng = np.random.default_rng(seed)
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    writer = gguf.GGUFWriter(target / "diffusion_pytorch_model.gguf", arch="lingbot_video")
    expected: dict[str, torch.Tensor] = {}
    for key, shape in shapes.items():
        if quantizable(key, shape) and shape[-1] % block == 0:
            rows = int(np.prod(shape[:-1]))
            raw = random_blocks(qtype, rows, shape[-1], rng).reshape(*shape[:-1], -1)
            writer.add_tensor(key, raw, raw_dtype=qtype)
            values = gguf.quants.dequantize(raw, qtype)
        else:
            values = (0.05 * rng.standard_normal(shape)).astype(np.float32)
            writer.add_tensor(key, values, raw_dtype=T.F32)
        expected[key] = torch.from_numpy(np.ascontiguousarray(values).reshape(shape))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


def wide_inputs():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(1, 16, 3, 8, 8, generator=g), torch.tensor([500.0]),
            torch.randn(1, 7, HIDDEN, generator=g))
