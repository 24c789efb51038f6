"""GGUF block types ComfyUI users meet beyond Q8_0/Q4_0 (Q3_K, Q2_K in *_K_M/*_K_S files; IQ4_NL,
IQ4_XS): a DiT stored in each loads with its bytes kept packed and computes exactly what the same
weights, decoded by the `gguf` package's numpy reference and loaded as plain floats, compute."""

from __future__ import annotations

import gguf
import pytest
import torch
from gguf_fakes import WIDE_MOE, wide_inputs, write_wide_moe

from lingbot_core.models.transformer import LingBotVideoTransformer3DModel
from lingbot_core.weights import gguf_codec
from lingbot_core.weights.loader import load_dit
from lingbot_core.weights.modules import QuantizedExperts, QuantizedLinear

T = gguf.GGMLQuantizationType
NEW_TYPES = [T.Q3_K, T.Q2_K, T.IQ4_NL, T.IQ4_XS]


def _run(model) -> torch.Tensor:
    with torch.no_grad():
        return model(*wide_inputs()).sample


@pytest.mark.parametrize("qtype", NEW_TYPES, ids=lambda t: t.name)
def test_a_dit_stored_in_the_type_runs_as_its_decoded_weights(tmp_path, qtype):
    assert qtype in gguf_codec.SUPPORTED
    expected = write_wide_moe(tmp_path, qtype)
    model = load_dit(tmp_path, dtype=torch.float32)
    layer, experts = model.blocks[0].attn.to_q, model.blocks[0].ffn.experts
    assert isinstance(layer, QuantizedLinear) and isinstance(experts, QuantizedExperts)
    assert layer.packing.gguf_type == qtype and layer.qdata.dtype == torch.uint8  # packed bytes stay packed
    assert experts.packings["w2"].gguf_type == qtype
    assert layer.qdata.numel() == 256 * gguf_codec.bytes_per_row(int(qtype), 256)
    reference = LingBotVideoTransformer3DModel.from_config(WIDE_MOE).float()
    reference.load_state_dict(expected)
    assert torch.equal(_run(model), _run(reference))


def test_the_guide_lists_exactly_the_types_that_load():
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "docs" / "weights.md").read_text()
    line = re.search(r"GGUF types that load \(.*?\): (.*?), so the", readme, flags=re.S)
    assert line, "docs/weights.md's list of GGUF types is gone"
    listed = {name.strip() for name in line.group(1).replace("\n", " ").split(",")}
    assert listed == {t.name for t in gguf_codec.SUPPORTED}
