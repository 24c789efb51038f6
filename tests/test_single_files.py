"""The handle's slot for single-file VAE / text encoder / processor: checked at open, loaded later,
and held to each other and to the DiT's config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lingbot_core import single_files as sf
from lingbot_core.checkpoint import CheckpointError

TINY = Path(__file__).resolve().parent / "fixtures" / "lingbot" / "models" / "tiny-dense"


def _config(name: str) -> dict:
    return json.loads((TINY / name / "config.json").read_text())


def test_inspect_then_load_each_kind():
    vae = sf.inspect_file("vae", TINY / "vae" / "diffusion_pytorch_model.safetensors")
    te = sf.inspect_file("text_encoder", TINY / "text_encoder" / "model.safetensors", folder=TINY)
    proc = sf.inspect_file("processor", TINY)
    assert vae.config["z_dim"] == 16 and te.config["text_config"]["hidden_size"] == 32
    assert proc.path == TINY / "processor" and proc.info == "processor"
    loaded = {c.name: sf.load_file(c) for c in (vae, te, proc)}
    assert type(loaded["vae"]).__name__ == "AutoencoderKLWan"
    sf.check_processor(loaded["processor"], te.config, proc.path)
    sf.check_fit(_config("transformer"), vae.config, te.config, {})


def test_parts_that_do_not_belong_together_are_refused():
    dit = _config("transformer")
    with pytest.raises(CheckpointError, match="the VAE has 48 latent channels, the DiT .* takes 16"):
        sf.check_fit(dit, {"z_dim": 48}, None, {"vae": Path("wan2.2_vae.safetensors")})
    with pytest.raises(CheckpointError, match="its hidden size is 2560, the DiT .* reads text 32 wide"):
        sf.check_fit(dit, None, {"text_config": {"hidden_size": 2560}}, {"text_encoder": Path("te.safetensors")})


def test_unknown_component():
    with pytest.raises(ValueError, match="cannot be given as a single file"):
        sf.inspect_file("scheduler", TINY)


def test_a_text_encoder_file_of_another_width_is_refused_when_the_checkpoint_opens():
    """The open-time check holds a single-file text encoder to the DiT's text width, as it does a folder's."""
    from lingbot_core.checkpoint_inspect import check_values_and_shapes

    configs = {name: _config(name) for name in ("transformer", "vae", "text_encoder")}
    check_values_and_shapes(TINY, configs, {}, skip={"text_encoder"}, scheduler=False)  # the tiny parts fit
    configs["text_encoder"]["text_config"] = dict(configs["text_encoder"]["text_config"], hidden_size=2560)
    with pytest.raises(CheckpointError, match="its hidden size is 2560, the DiT .* reads text 32 wide"):
        check_values_and_shapes(TINY, configs, {}, skip={"text_encoder"}, scheduler=False)
