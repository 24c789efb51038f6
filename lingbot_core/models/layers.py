"""Small building blocks of the LingBot DiT: RMSNorm, 3-axis RoPE, SwiGLU.

Precision follows the reference: norms accumulate in float32 and RoPE is applied in float32 with
autocast off, whatever dtype the surrounding model runs in.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    """RMSNorm computed in float32, returned in the input dtype."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * x32).to(dtype)


class SwiGLU(nn.Module):
    """Gated MLP without biases (the dense FFN and the MoE shared expert)."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Rope3D(nn.Module):
    """Complex RoPE over (t, h, w) positions, one table per axis.

    The tables start at `axes_lens` and grow on demand; values depend only on the position, so the
    initial sizes never change an output.
    """

    def __init__(self, axes_dims: tuple[int, ...], axes_lens: tuple[int, ...], theta: float):
        super().__init__()
        if any(d % 2 for d in axes_dims):
            raise ValueError(f"every RoPE axis dim must be even, got axes_dims={tuple(axes_dims)}")
        self.axes_dims = tuple(int(d) for d in axes_dims)
        self.axes_lens = [int(n) for n in axes_lens]
        self.theta = float(theta)
        self._tables: list[torch.Tensor] | None = None

    def _axis_table(self, dim: int, length: int) -> torch.Tensor:
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        angles = torch.outer(torch.arange(length, dtype=torch.float64), inv_freq).float()
        return torch.polar(torch.ones_like(angles), angles).to(torch.complex64)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        """(S, 3) integer positions -> (S, head_dim/2) complex64 rotations."""
        largest = positions.max(dim=0).values.tolist()
        grow = self._tables is None or any(m >= n for m, n in zip(largest, self.axes_lens))
        if grow:
            self.axes_lens = [int(m * 1.5) + 1 if m >= n else n for m, n in zip(largest, self.axes_lens)]
            self._tables = [self._axis_table(d, n) for d, n in zip(self.axes_dims, self.axes_lens)]
        device = positions.device
        if self._tables[0].device != device:
            self._tables = [t.to(device) for t in self._tables]
        return torch.cat([table[positions[:, i]] for i, table in enumerate(self._tables)], dim=-1)


def apply_rope(x: torch.Tensor, rotations: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive channel pairs of (B, S, H, D) by (B, S, D/2) complex rotations, in fp32."""
    with torch.autocast(x.device.type, enabled=False):
        pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(pairs * rotations.unsqueeze(2)).flatten(3).type_as(x)


def joint_positions(text_len: int, n_text: int, grid: tuple[int, int, int], device: torch.device) -> torch.Tensor:
    """Positions of the joint sequence [video; text].

    Video token (t, h, w) sits at (text_len + 1 + t, h, w) where `text_len` is the real (unpadded)
    text length; text token i sits at (i + 1, 0, 0). `n_text` may exceed `text_len` when the text is
    padded: padded tokens get positions too, and the key mask keeps them out of attention.
    """
    gt, gh, gw = grid
    t = torch.arange(gt, device=device, dtype=torch.int64) + text_len + 1
    h = torch.arange(gh, device=device, dtype=torch.int64)
    w = torch.arange(gw, device=device, dtype=torch.int64)
    video = torch.stack(torch.meshgrid(t, h, w, indexing="ij"), dim=-1).reshape(-1, 3)
    text = torch.zeros(n_text, 3, device=device, dtype=torch.int64)
    text[:, 0] = torch.arange(1, n_text + 1, device=device)
    return torch.cat([video, text], dim=0)
