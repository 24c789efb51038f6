"""A light decoder for Wan 2.1 latents: the tiny video autoencoder's decoder (TAEHV).

What it is (from its published description, madebyollin/taehv, MIT; lightx2v's LightTAE is the
same network retrained): per-frame 2-D convolutions, no attention, no 3-D convolution. Time enters
in two ways only: a *memory block* sees its own input frame next to the previous frame's input (zeros
before the first frame), and a *temporal grow* step makes `s` frames out of one by a 1x1 convolution
to `s` times the channels, read as `s` consecutive frames. Three stages (widths 256, 128, 64) each run
three memory blocks, a nearest 2x upsample, a grow (strides 1, 2, 2: 4x frames in all) and a 3x3
convolution to the next width; the input is soft-clamped to +-3 (`3 tanh(x/3)`) and the output is
RGB in [0, 1]. The first `4 - 1` frames out are a warm-up and are dropped, so T latent frames give
4T - 3 frames, the Wan VAE's count.

The stored weights are named by the position of each layer in that one chain (`decoder.<position>.`),
which is why `LAYOUT` below lists every position, including the ones without weights.

Which latents it reads depends on the file: madebyollin's `taew2_1` decodes the normalised latents the
DiT works on; lightx2v's `lighttaew2_1` decodes raw VAE latents (`LATENT_SPACES`).

Memory: frames are decoded a few latent frames at a time (`chunk`), each memory block carrying its
last input frame over to the next chunk, so a long video needs the memory of a short one and the
output is the same as decoding all frames at once (`tests/test_light_vae.py` checks this).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..latents import dit_to_vae

LATENT_CHANNELS = 16
WIDTHS = (256, 128, 64, 64)  # stage widths, then the width before the RGB convolution
GROW_STRIDES = (1, 2, 2)  # frames made per frame by each stage's temporal grow
BLOCKS_PER_STAGE = 3
FRAMES_PER_LATENT = math.prod(GROW_STRIDES)
WARMUP_FRAMES = FRAMES_PER_LATENT - 1  # frames dropped at the start (4T - 3 frames out)
SPATIAL = 2 ** len(GROW_STRIDES)
DEFAULT_CHUNK = 1  # latent frames per pass (memory scales with it; the output does not change)

LATENT_SPACES = {"raw": "raw Wan 2.1 VAE latents", "normalised": "normalised (DiT-space) latents"}


@dataclass(frozen=True)
class Layer:
    """One position of the stored chain: its kind and, for layers with weights, channels in/out."""

    kind: str  # clamp | conv | relu | memory | upsample | grow
    channels_in: int = 0
    channels_out: int = 0
    bias: bool = True
    stride: int = 1  # grow: frames made per frame


def _layout() -> tuple[Layer, ...]:
    chain = [Layer("clamp"), Layer("conv", LATENT_CHANNELS, WIDTHS[0]), Layer("relu")]
    for stage, stride in enumerate(GROW_STRIDES):
        width, after = WIDTHS[stage], WIDTHS[stage + 1]
        chain += [Layer("memory", width, width)] * BLOCKS_PER_STAGE
        chain += [Layer("upsample"), Layer("grow", width, width, stride=stride), Layer("conv", width, after, bias=False)]
    chain += [Layer("relu"), Layer("conv", WIDTHS[-1], 3)]
    return tuple(chain)


LAYOUT = _layout()


def expected_shapes(layout: tuple[Layer, ...] = LAYOUT) -> dict[str, tuple[int, ...]]:
    """Every decoder tensor's name and shape as stored (no module is built). A grow's weight is
    listed at the size this network uses; a file may store more output rows (see `grow_rows`)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for at, layer in enumerate(layout):
        base = f"decoder.{at}."
        if layer.kind == "conv":
            shapes[base + "weight"] = (layer.channels_out, layer.channels_in, 3, 3)
            if layer.bias:
                shapes[base + "bias"] = (layer.channels_out,)
        elif layer.kind == "memory":
            n = layer.channels_out
            for slot, c_in in ((0, 2 * layer.channels_in), (2, n), (4, n)):
                shapes[f"{base}conv.{slot}.weight"] = (n, c_in, 3, 3)
                shapes[f"{base}conv.{slot}.bias"] = (n,)
        elif layer.kind == "grow":
            shapes[base + "conv.weight"] = (layer.channels_out * layer.stride, layer.channels_in, 1, 1)
    return shapes


def grow_weights(layout: tuple[Layer, ...] = LAYOUT) -> dict[str, int]:
    """The grow weights and the rows this network keeps of each. Files trained with a larger stride
    for a stage store `k` times the rows; the frame this network makes is the last of those `k`."""
    return {f"decoder.{at}.conv.weight": layer.channels_out * layer.stride
            for at, layer in enumerate(layout) if layer.kind == "grow"}


class _Memory(nn.Module):
    """Three 3x3 convolutions over (this frame, the previous frame's input), plus the frame itself."""

    def __init__(self, width: int):
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(2 * width, width, 3, padding=1), nn.ReLU(),
                                  nn.Conv2d(width, width, 3, padding=1), nn.ReLU(),
                                  nn.Conv2d(width, width, 3, padding=1))

    def forward(self, frames: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.conv(torch.cat((frames, previous), dim=1)) + frames)


class _Grow(nn.Module):
    """One frame in, `stride` consecutive frames out (a 1x1 convolution to stride x channels)."""

    def __init__(self, width: int, stride: int):
        super().__init__()
        self.stride = stride
        self.conv = nn.Conv2d(width, width * stride, 1, bias=False)

    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        n, c, h, w = frames.shape
        return self.conv(frames).reshape(n * self.stride, c, h, w)


class _SoftClamp(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x / 3.0) * 3.0


def _build(layer: Layer) -> nn.Module:
    if layer.kind == "conv":
        return nn.Conv2d(layer.channels_in, layer.channels_out, 3, padding=1, bias=layer.bias)
    if layer.kind == "memory":
        return _Memory(layer.channels_out)
    if layer.kind == "grow":
        return _Grow(layer.channels_out, layer.stride)
    if layer.kind == "upsample":
        return nn.Upsample(scale_factor=2, mode="nearest")
    return {"clamp": _SoftClamp, "relu": nn.ReLU}[layer.kind]()


class LightVideoDecoder(nn.Module):
    """Latents (N,16,T,h,w) -> frames (N,3,4T-3,8h,8w) in [0, 1]; `latent_space` says which latents."""

    def __init__(self, latent_space: str = "normalised"):
        super().__init__()
        if latent_space not in LATENT_SPACES:
            raise ValueError(f"latent_space must be one of {', '.join(LATENT_SPACES)}, got {latent_space!r}")
        self.latent_space = latent_space
        self.decoder = nn.Sequential(*(_build(layer) for layer in LAYOUT))

    @property
    def entry(self) -> nn.Module:
        """The first layer with weights: it runs once per chunk (a cancellation and progress point)."""
        return self.decoder[1]

    def forward(self, latents: torch.Tensor, chunk: int = DEFAULT_CHUNK, full_size: bool = True) -> torch.Tensor:
        """`full_size` False: the last 2x upsample is skipped (half the width and height, about a
        quarter of the work: what previews use)."""
        if latents.ndim != 5 or latents.shape[1] != LATENT_CHANNELS:
            raise ValueError(f"expected latents (N,{LATENT_CHANNELS},T,h,w), got {tuple(latents.shape)}")
        if chunk < 1:
            raise ValueError(f"chunk must be >= 1 latent frame, got {chunk}")
        n, _c, t, _h, _w = latents.shape
        dtype = next(self.parameters()).dtype
        carried: dict[int, torch.Tensor] = {}  # memory block position -> its last input frame(s)
        pieces = []
        for start in range(0, t, chunk):
            x = latents[:, :, start:start + chunk].to(dtype).transpose(1, 2)  # (N,t,C,h,w)
            pieces.append(self._run(x.reshape(-1, *x.shape[2:]), n, carried, full_size))
        frames = torch.cat(pieces, dim=1)[:, WARMUP_FRAMES:]  # (N,F,3,H,W)
        return frames.clamp(0, 1).transpose(1, 2)

    def _run(self, x: torch.Tensor, n: int, carried: dict[int, torch.Tensor], full_size: bool) -> torch.Tensor:
        """One chunk through the chain; x is (N*t, C, h, w) frame-major within each video."""
        last_upsample = max(at for at, layer in enumerate(LAYOUT) if layer.kind == "upsample")
        for at, layer in enumerate(self.decoder):
            if at == last_upsample and not full_size:
                continue
            if isinstance(layer, _Memory):
                frames = x.reshape(n, -1, *x.shape[1:])  # (N,t,C,h,w)
                before = carried.get(at)
                if before is None:
                    before = torch.zeros_like(frames[:, :1])
                previous = torch.cat((before, frames[:, :-1]), dim=1)
                carried[at] = frames[:, -1:]
                x = layer(x, previous.reshape(x.shape))
            else:
                x = layer(x)
        return x.reshape(n, -1, *x.shape[1:])


def compute_dtype(device: torch.device) -> torch.dtype:
    """float32 on the CPU; float16 on an accelerator (the dtype TAEHV is published in)."""
    return torch.float32 if device.type == "cpu" else torch.float16


def decode_frames(model: LightVideoDecoder, latents: torch.Tensor, vae_config: Any, device: torch.device, *,
                  full_size: bool = True, chunk: int = DEFAULT_CHUNK) -> torch.Tensor:
    """DiT-space latents (1,16,T,h,w) -> frames [F,H,W,3] float32 in [0,1] on the CPU (`vae_config`:
    the latent statistics, needed by a decoder of raw latents). The decoder visits `device` for the
    call as a copy of its own (a few tens of MB; the float32 original stays as it is)."""
    z = dit_to_vae(latents, vae_config) if model.latent_space == "raw" else latents
    dtype = compute_dtype(device)
    work = model
    if next(model.parameters()).device != device or next(model.parameters()).dtype != dtype:
        work = copy.deepcopy(model).to(device=device, dtype=dtype)
    with torch.no_grad():
        video = work(z.to(device=device, dtype=dtype), chunk=chunk, full_size=full_size)
    return video[0].permute(1, 2, 3, 0).float().cpu().contiguous()


def decoder_values(layout: tuple[Layer, ...] = LAYOUT) -> int:
    """Weight values the decoder holds (for memory messages and the bench)."""
    return sum(math.prod(shape) for shape in expected_shapes(layout).values())


def output_shape(latent_shape: tuple[int, ...]) -> tuple[int, int, int]:
    """(frames, height, width) the decoder makes from latents shaped (N,16,T,h,w)."""
    _n, _c, t, h, w = latent_shape
    return FRAMES_PER_LATENT * t - WARMUP_FRAMES, h * SPATIAL, w * SPATIAL
