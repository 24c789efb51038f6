"""Stages without steps (text encode, decode) move their progress bar per layer / block run."""

from __future__ import annotations

import pytest
import torch

from lingbot_core.handle import PipelineHandle


class Recorder:
    made: list[Recorder] = []

    def __init__(self, total: int, label: str = "lingbot"):
        self.total, self.label, self.updates = total, label, []
        Recorder.made.append(self)

    def update(self, value, total=None, preview=None):
        self.updates.append((value, total or self.total))

    def close(self):
        pass


@pytest.fixture
def recorded(monkeypatch):
    from lingbot_nodes import runtime

    Recorder.made = []
    monkeypatch.setattr(runtime, "Progress", Recorder)
    return Recorder.made


@pytest.fixture
def tiny(fixtures_root):
    return PipelineHandle.open(fixtures_root / "models" / "tiny-dense", device="cpu")


def test_decode_moves_per_frame_chunk(tiny, recorded):
    from lingbot_nodes.output import LingBotDecode

    latent = {"samples": torch.randn(1, 16, 3, 8, 8, generator=torch.Generator().manual_seed(0))}
    LingBotDecode.execute(tiny, latent)
    (bar,) = [r for r in recorded if r.label == "decode"]
    values = [v for v, _t in bar.updates]
    assert len(values) > 2 and values == sorted(values) and values[0] == 1
    assert bar.updates[-1][0] == bar.updates[-1][1] == bar.total  # the estimate was exact: ends at 100 %
    assert bar.total == 3 * (1 + len(tiny.vae_config()["dim_mult"]))  # three latent frames


def test_text_encode_moves_per_layer(tiny, recorded):
    from lingbot_nodes.conditioning import LingBotTextEncode

    LingBotTextEncode.execute(tiny, '{"comprehensive_description": {"scene_content_description": "a boat"}}')
    (bar,) = [r for r in recorded if r.label == "text encode"]
    values = [v for v, _t in bar.updates]
    assert len(values) > 2 and values == sorted(values)
    assert bar.updates[-1][0] == bar.total and bar.total >= 2 * 2  # prompt + negative, two layers each
