"""LoRA cases (tests/fixtures/lingbot-lora and LINGBOT_PARITY_DIRS, mode `transformer-lora`).

Each case: the reference DiT run with a LoRA file merged, and without. We load the file with our
loader, check the merged weights and the output, then take the LoRA off and get the plain model
back bit for bit.
"""

from __future__ import annotations

import hashlib

import pytest
import torch
from parity_cases import discover

from lingbot_core import lora as lora_ops
from lingbot_core.checkpoints.loading import load_transformer
from lingbot_core.weights.state import Models

CASES = discover({"transformer-lora"}, sets=("lingbot-lora",))


def test_shared_lora_cases_are_present():
    assert {"lora-lightx2v-mixed-moe", "lora-kohya-dense"} <= {c.name for c in CASES}


def _forward(model, e):
    with torch.no_grad():
        return model(e["hidden_states"], e["timestep"], e["encoder_hidden_states"], e["encoder_attention_mask"]).sample


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_lora_case(case):
    spec, e = case.spec, case.expected()
    sub = spec.get("transformer_subfolder", "transformer")
    weights = case.model_dir / sub / "diffusion_pytorch_model.safetensors"
    if "model_transformer_sha256" in spec:
        assert hashlib.sha256(weights.read_bytes()).hexdigest() == spec["model_transformer_sha256"]
    model = load_transformer(case.model_dir, sub)
    plain = {n: p.detach().clone() for n, p in model.named_parameters()}

    lora = lora_ops.load_lora_file(case.path / spec["lora"])
    report = lora_ops.match(lora, model, "transformer")
    assert not report.unmatched
    assert len(report.patches) == spec["num_targeted_modules"]
    assert sum(len(p.keys) for p in report.patches) == spec["num_lora_keys"]  # no key left unused
    assert {p.param for p in report.patches} == {t["param"] for t in spec["targets"]}

    stack = lora_ops.LoraStack((lora_ops.LoraItem(lora, spec["strength"]),))
    parts = Models({"transformer": model})  # the modules and the owner of their state
    stack.apply(parts, ["transformer"])
    params = dict(model.named_parameters())
    for target in spec["targets"]:
        case.check(f"merged.{target['param']}", params[target["param"]], e)
    case.check("output", _forward(model, e), e)

    stack.remove(parts, ["transformer"])
    for name, p in model.named_parameters():
        assert torch.equal(p, plain[name]), name
    case.check("output_without_lora", _forward(model, e), e)

    # Strength 0 is the plain model, bit for bit; applying again after that is the same merge.
    lora_ops.LoraStack((lora_ops.LoraItem(lora, 0.0),)).apply(parts, ["transformer"])
    assert all(torch.equal(p, plain[n]) for n, p in model.named_parameters())
    stack.apply(parts, ["transformer"])
    for target in spec["targets"]:
        case.check(f"merged.{target['param']}", params[target["param"]], e)
