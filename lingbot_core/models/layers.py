"""Small DiT building blocks: RMS norm, the SwiGLU feed-forward, the caption projection.

The norms do their statistics in float32 whatever dtype flows through them; see `precision.py`
for which weights are stored in float32.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from diffusers.models.embeddings import PixArtAlphaTextProjection

__all__ = ["CaptionProjection", "RMSNorm", "SwiGLU"]


class RMSNorm(nn.Module):
    """x / rms(x) * gain over the last dimension, computed in float32 and returned in x's dtype."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = x.float()
        inv_rms = torch.rsqrt(wide.square().mean(dim=-1, keepdim=True) + self.eps)
        return (self.weight * (wide * inv_rms)).to(x.dtype)


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)), no biases: the dense FFN and the MoE's shared expert."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class CaptionProjection(PixArtAlphaTextProjection):
    """Text-encoder features -> DiT width: an RMS norm (eps 1e-6) in front of diffusers' two-layer MLP.

    State-dict keys: `norm.weight`, `linear_1.*`, `linear_2.*` (SiLU between the linears).
    """

    def __init__(self, text_dim: int, hidden_size: int):
        super().__init__(text_dim, hidden_size, act_fn="silu")
        self.norm = RMSNorm(text_dim, eps=1e-6)

    def forward(self, caption: torch.Tensor) -> torch.Tensor:
        return super().forward(self.norm(caption))
