"""The Wan 2.1 VAE from one file: original Wan names and diffusers names, any float storage, wrong files refused."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from lingbot_core.checkpoints import vae_file
from lingbot_core.checkpoints.loading import load_component
from lingbot_core.errors import CheckpointError

TINY = Path(__file__).resolve().parent / "fixtures" / "lingbot" / "models" / "tiny-dense"
DIFFUSERS_FILE = TINY / "vae" / "diffusion_pytorch_model.safetensors"

# The original Wan VAE code's names for the parts of one residual block (its nn.Sequential indices).
_RESIDUAL = {"norm1.gamma": "residual.0.gamma", "conv1.weight": "residual.2.weight", "conv1.bias": "residual.2.bias",
             "norm2.gamma": "residual.3.gamma", "conv2.weight": "residual.6.weight", "conv2.bias": "residual.6.bias",
             "conv_shortcut.weight": "shortcut.weight", "conv_shortcut.bias": "shortcut.bias"}
_FLAT = {"encoder.conv_in": "encoder.conv1", "decoder.conv_in": "decoder.conv1", "quant_conv": "conv1",
         "post_quant_conv": "conv2", "encoder.norm_out": "encoder.head.0", "decoder.norm_out": "decoder.head.0",
         "encoder.conv_out": "encoder.head.2", "decoder.conv_out": "decoder.head.2"}


def to_original_name(name: str, num_res_blocks: int) -> str:
    """diffusers AutoencoderKLWan name -> the original Wan code's name (written from the two layouts)."""
    head, _, leaf = name.rpartition(".")
    if head in _FLAT:
        return f"{_FLAT[head]}.{leaf}"
    if m := re.match(r"^(encoder|decoder)\.mid_block\.resnets\.(\d)\.(.+)$", name):
        return f"{m[1]}.middle.{2 * int(m[2])}.{_RESIDUAL[m[3]]}"
    if m := re.match(r"^(encoder|decoder)\.mid_block\.attentions\.0\.(.+)$", name):
        return f"{m[1]}.middle.1.{m[2]}"
    if m := re.match(r"^encoder\.down_blocks\.(\d+)\.(.+)$", name):
        return f"encoder.downsamples.{m[1]}.{_RESIDUAL.get(m[2], m[2])}"
    per_stage = num_res_blocks + 2
    if m := re.match(r"^decoder\.up_blocks\.(\d+)\.resnets\.(\d+)\.(.+)$", name):
        return f"decoder.upsamples.{int(m[1]) * per_stage + int(m[2])}.{_RESIDUAL[m[3]]}"
    if m := re.match(r"^decoder\.up_blocks\.(\d+)\.upsamplers\.0\.(.+)$", name):
        return f"decoder.upsamples.{int(m[1]) * per_stage + num_res_blocks + 1}.{m[2]}"
    raise AssertionError(f"no original name for {name}")


def write_original(state: dict[str, torch.Tensor], path: Path, num_res_blocks: int,
                   dtype: torch.dtype | None = None) -> Path:
    out = {to_original_name(k, num_res_blocks): (v if dtype is None else v.to(dtype)).contiguous()
           for k, v in state.items()}
    assert len(out) == len(state)
    save_file(out, str(path))
    return path


@pytest.fixture(scope="module")
def folder_vae():
    return load_component(TINY, "vae")


def _decode(vae, seed: int = 3) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(1, 16, 2, 4, 4, generator=g)
    with torch.no_grad():
        return vae.decode(z).sample


def test_original_names_decode_bit_identical_to_the_folder(tmp_path, folder_vae):
    path = write_original(load_file(str(DIFFUSERS_FILE)), tmp_path / "wan_2.1_vae.safetensors",
                          folder_vae.config.num_res_blocks)
    info = vae_file.inspect_vae_file(path)
    assert info.naming == "wan"
    for key in ("base_dim", "dim_mult", "num_res_blocks", "temperal_downsample", "z_dim"):
        assert info.config[key] == folder_vae.config[key], key
    vae = vae_file.load_vae_file(info)
    assert torch.equal(_decode(vae), _decode(folder_vae))
    assert vae.config.latents_mean == folder_vae.config.latents_mean


def test_diffusers_named_file_loads_as_is(folder_vae):
    vae = vae_file.load_vae_file(DIFFUSERS_FILE)
    assert torch.equal(_decode(vae), _decode(folder_vae))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_storage_is_widened(tmp_path, folder_vae, dtype):
    state = load_file(str(DIFFUSERS_FILE))
    path = write_original(state, tmp_path / "vae.safetensors", folder_vae.config.num_res_blocks, dtype)
    vae = vae_file.load_vae_file(path)
    assert next(vae.parameters()).dtype == torch.float32
    for name, value in vae.state_dict().items():
        assert torch.equal(value, state[name].to(dtype).float()), name


def test_published_layout_renames_as_diffusers_converter_does():
    """On the published structure (2 residual blocks, 4 stages) our regrouping of the decoder equals
    diffusers' own converter, which is right for exactly that layout."""
    from diffusers import AutoencoderKLWan
    from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers

    with torch.device("meta"):
        names = list(AutoencoderKLWan(base_dim=8, dim_mult=[1, 2, 4, 4], num_res_blocks=2).state_dict())
    original = [to_original_name(n, 2) for n in names]
    ours = vae_file._rename_original(original)
    theirs = {new: old for new, old in convert_wan_vae_to_diffusers({n: n for n in original}).items()}
    assert ours == theirs
    assert sorted(ours) == sorted(names)


def _fake(path: Path, tensors: dict[str, tuple[int, ...]]) -> Path:
    save_file({k: torch.zeros(s) for k, s in tensors.items()}, str(path))
    return path


@pytest.mark.parametrize(("tensors", "says"), [
    ({"decoder.upsamples.0.upsamples.0.residual.2.weight": (2, 2, 1, 1, 1),
      "decoder.middle.0.residual.0.gamma": (2, 1, 1, 1)}, "is a Wan 2.2 VAE (48 latent channels)"),
    ({"encoder.down.0.block.0.conv1.weight": (2, 2, 3, 3), "decoder.conv_in.weight": (8, 4, 3, 3)},
     "is an SD 1.x / SD 2.x / SDXL image VAE (4 latent channels)"),
    ({"encoder.down.0.block.0.conv1.weight": (2, 2, 3, 3), "decoder.conv_in.weight": (8, 16, 3, 3)},
     "is an SD3 / Flux image VAE (16 latent channels)"),
    ({"model.language_model.embed_tokens.weight": (4, 2)}, "is a text encoder"),
    ({"blocks.0.attn.to_q.weight": (2, 2)}, "is a diffusion model (DiT)"),
    ({"something.else": (2,)}, "is not a Wan 2.1 VAE (none of its tensors is named like one)"),
])
def test_other_files_are_refused_by_name(tmp_path, tensors, says):
    path = _fake(tmp_path / "x.safetensors", tensors)
    with pytest.raises(CheckpointError) as err:
        vae_file.inspect_vae_file(path)
    assert f"x.safetensors {says}, not the Wan 2.1 VAE LingBot-Video uses." in str(err.value)
    assert "\n" not in str(err.value)


def test_wan22_latent_width_is_refused(tmp_path):
    from diffusers import AutoencoderKLWan

    vae = AutoencoderKLWan(base_dim=8, z_dim=48, dim_mult=[1, 2, 2, 2], num_res_blocks=1)
    path = tmp_path / "wan2.2_vae.safetensors"
    save_file(vae.state_dict(), str(path))
    with pytest.raises(CheckpointError, match="is a Wan 2.2 VAE \\(48 latent channels\\)"):
        vae_file.inspect_vae_file(path)


def test_incomplete_file_names_what_is_missing(tmp_path):
    state = load_file(str(DIFFUSERS_FILE))
    state.pop("decoder.up_blocks.0.resnets.0.conv2.bias")
    save_file(state, str(tmp_path / "v.safetensors"))
    with pytest.raises(CheckpointError, match="1 missing tensors \\(e.g. decoder.up_blocks.0.resnets.0.conv2.bias\\)"):
        vae_file.inspect_vae_file(tmp_path / "v.safetensors")


def test_truncated_and_wrong_extension(tmp_path):
    data = DIFFUSERS_FILE.read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated"):
        vae_file.inspect_vae_file(tmp_path / "cut.safetensors")
    (tmp_path / "v.ckpt").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="must be .safetensors"):
        vae_file.inspect_vae_file(tmp_path / "v.ckpt")
