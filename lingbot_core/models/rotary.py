"""Three-axis rotary position embedding for the joint [video; text] sequence.

Every token has a (frame, row, column) position. The head channels are split into three runs, one
per axis (`axes_dims`), and each run is rotated in channel pairs: pair j of an axis with d channels
turns by the angle `position * theta ** (-2j / d)`.

Numerics (they decide bit-parity with the reference): the frequencies and the angles are formed in
float64, the angles rounded to float32, and the unit complex numbers made with `torch.polar` on the
CPU; a device only ever receives that finished table. The rotation itself runs in float32 with
autocast off, whatever the model dtype.
"""

from __future__ import annotations

import torch
import torch.nn as nn

__all__ = ["AxialRotary", "joint_positions", "rotate_pairs"]


class _AxisTable:
    """Unit complex rotations for positions 0 .. capacity-1 along one axis, kept on the CPU.

    Entries depend only on their own position, so how far ahead the table is built never shows in
    an output; it is rebuilt, twice as long as needed, only when a position falls off its end.
    """

    def __init__(self, channels: int, capacity: int, theta: float):
        self.channels = channels
        self.capacity = capacity
        self.theta = theta
        self._host: torch.Tensor | None = None
        self._device_copy: torch.Tensor | None = None

    def _build(self, capacity: int) -> None:
        exponent = torch.arange(0, self.channels, 2, dtype=torch.float64) / self.channels
        per_position = 1.0 / (self.theta ** exponent)
        steps = torch.arange(capacity, dtype=torch.float64)
        angle = (steps[:, None] * per_position[None, :]).to(torch.float32)
        self._host = torch.polar(torch.ones_like(angle), angle)
        self._device_copy = None
        self.capacity = capacity

    def reserve(self, positions: int) -> None:
        """Build the table for positions 0 .. positions-1 now (before compiling: a compiled lookup
        does not grow the table, whose growth check reads a value back from the device)."""
        if self._host is None or positions > self.capacity:
            self._build(max(self.capacity, positions))

    def lookup(self, index: torch.Tensor) -> torch.Tensor:
        """(S,) integer positions -> (S, channels/2) complex64 rotations on `index`'s device."""
        if torch.compiler.is_compiling():
            if self._host is None:
                self._build(self.capacity)
        else:
            needed = int(index.max()) + 1 if index.numel() else 0
            if self._host is None or needed > self.capacity:
                self._build(self.capacity if needed <= self.capacity else 2 * needed)
        table = self._host
        if index.device != table.device:
            if self._device_copy is None or self._device_copy.device != index.device:
                self._device_copy = table.to(index.device)
            table = self._device_copy
        return table[index]


class AxialRotary(nn.Module):
    """Maps (S, 3) positions to the (S, head_dim/2) complex rotations of `rotate_pairs`.

    `initial_lengths` (the config's `axes_lens`) only size the first tables; larger positions are
    served as well. The module has no parameters and no state-dict entries.
    """

    def __init__(self, axes_dims: tuple[int, ...], initial_lengths: tuple[int, ...], theta: float):
        super().__init__()
        self.axes = [_AxisTable(int(d), int(n), float(theta)) for d, n in zip(axes_dims, initial_lengths)]

    def reserve(self, grid: tuple[int, int, int], n_text: int) -> None:
        """Size the tables for a planned [video; text] sequence of this latent grid (see `joint_positions`)."""
        frames, rows, cols = grid
        for axis, length in zip(self.axes, (n_text + 1 + frames, rows, cols)):
            axis.reserve(length)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        per_axis = [axis.lookup(positions[:, i]) for i, axis in enumerate(self.axes)]
        return torch.cat(per_axis, dim=-1)


def joint_positions(text_len: int, n_text: int, grid: tuple[int, int, int], device: torch.device) -> torch.Tensor:
    """(frames*rows*cols + n_text, 3) int64 positions of one sample's [video; text] sequence.

    Text comes first on the frame axis: text token i is at (1 + i, 0, 0), and the video starts
    right after the *real* text, video token (f, r, c) at (text_len + 1 + f, r, c), in f-major
    order. `n_text` may exceed `text_len` for a right-padded prompt: the pad tokens get positions
    (continuing the text run) so shapes line up; attention masks them out.
    """
    frames, rows, cols = grid
    flat = torch.arange(frames * rows * cols, device=device, dtype=torch.int64)
    video = torch.stack((flat // (rows * cols) + (text_len + 1), (flat // cols) % rows, flat % cols), dim=1)
    text = torch.zeros(n_text, 3, device=device, dtype=torch.int64)
    text[:, 0] = torch.arange(1, n_text + 1, device=device, dtype=torch.int64)
    return torch.cat((video, text))


def rotate_pairs(x: torch.Tensor, rotations: torch.Tensor) -> torch.Tensor:
    """Rotate (B, S, H, D) queries/keys by (B, S, D/2) complex rotations, shared by all heads."""
    with torch.autocast(x.device.type, enabled=False):
        pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))
        turned = pairs * rotations[:, :, None, :]
        return torch.view_as_real(turned).flatten(-2).to(x.dtype)
