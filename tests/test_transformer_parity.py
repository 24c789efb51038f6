"""The DiT against the reference: every `transformer-*` case, shared and from LINGBOT_PARITY_DIRS."""

from __future__ import annotations

import pytest
import torch
from parity_cases import discover

from lingbot_core.checkpoints.loading import load_transformer

CASES = discover({"transformer"})


def test_shared_transformer_cases_are_present():
    names = {c.name for c in CASES}
    assert {"transformer-dense", "transformer-dense-padded", "transformer-moe", "transformer-moe-padded"} <= names


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_transformer_forward_matches_reference(case):
    expected = case.expected()
    model = load_transformer(case.model_dir, case.spec.get("transformer_subfolder", "transformer"))
    # The inputs are regenerated from the recorded recipe, then compared with the stored ones.
    g = torch.Generator("cpu").manual_seed(case.spec["seed"])
    b, (t, h, w) = case.spec["batch"], case.spec["latent_frames_height_width"]
    length = case.spec.get("padded_text_length", max(case.spec["text_lengths"]))
    hidden = torch.randn((b, model.config.in_channels, t, h, w), generator=g)
    text = torch.randn((b, length, model.config.text_dim), generator=g)
    mask = torch.zeros(b, length, dtype=torch.int64)
    for i, n in enumerate(case.spec["text_lengths"]):
        mask[i, :n] = 1
    case.check("hidden_states", hidden, expected)
    case.check("encoder_hidden_states", text, expected)
    case.check("encoder_attention_mask", mask, expected)
    timestep = torch.tensor(case.spec["timestep"], dtype=torch.float32).reshape(-1)
    case.check("timestep", timestep, expected)

    with torch.no_grad():
        out = model(hidden, timestep, text, mask).sample
    case.check("output", out, expected)


@pytest.mark.parametrize("case", [c for c in CASES if c.spec["batch"] > 1], ids=lambda c: c.name)
def test_padded_batch_equals_trimmed_single_forwards(case):
    """Padded text must not leak: each sample equals a batch-1 forward on its trimmed text."""
    e = case.expected()
    model = load_transformer(case.model_dir, case.spec.get("transformer_subfolder", "transformer"))
    with torch.no_grad():
        batched = model(e["hidden_states"], e["timestep"], e["encoder_hidden_states"], e["encoder_attention_mask"]).sample
        for i, n in enumerate(case.spec["text_lengths"]):
            single = model(e["hidden_states"][i : i + 1], e["timestep"][i : i + 1],
                           e["encoder_hidden_states"][i : i + 1, :n]).sample
            torch.testing.assert_close(batched[i : i + 1], single, atol=1e-5, rtol=0)
