"""The one home of sigma and schedule rules: the shift formula, what a usable sigma list is, the
refiner's schedule, and the timestep the DiT sees for a sigma.

Every sampler, the flow-UniPC solver (`lingbot_core.scheduler`) and the stages read these; none keeps
its own copy. Numbers here are part of parity: the order of float operations and the dtypes are
the reference's, so a change in this file shows up in the parity tests bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

SigmaList = Sequence[float] | np.ndarray | torch.Tensor

# Sigmas closer than this count as equal (a refiner threshold against a grid value).
SIGMA_TOLERANCE = 1e-6
# The DiT is trained on timesteps t = 1000 * sigma.
TIMESTEP_SCALE = 1000.0


def warp_sigmas(sigmas: Any, shift: float) -> Any:
    """The flow-matching time shift s -> shift*s / (1 + (shift-1)*s), in the input's own type and dtype.

    The expression is kept in exactly this order so that float32 inputs round the way the reference
    rounds them.
    """
    return shift * sigmas / (1 + (shift - 1) * sigmas)


SHIFT_RANGE = (0.01, 100.0)
"""The time shifts accepted (the published schedules use 1 to 12); past 100 the schedule is a step at
sigma 1 and 1e308 overflows to NaN, so a shift outside is refused where it is given (node, call, config)."""


def check_shift(shift: Any) -> None:
    """A time shift is a finite number in `SHIFT_RANGE`."""
    low, high = SHIFT_RANGE
    if (isinstance(shift, bool) or not isinstance(shift, (int, float)) or not math.isfinite(shift)
            or not low <= shift <= high):
        raise ValueError(f"shift must be a positive number in [{low:g}, {high:g}], got {str(shift)[:40]}")


def sigma_array(sigmas: SigmaList) -> np.ndarray:
    """A sigma list as a numpy array, unchecked, keeping a float array's dtype.

    Float32 must stay float32: the reference derives timesteps as float32(sigma) * 1000 when handed
    the float32 refiner list, and the int64 truncation can flip on the last bit.
    """
    if isinstance(sigmas, torch.Tensor):
        arr = sigmas.detach().cpu().numpy()
    elif isinstance(sigmas, np.ndarray):
        arr = sigmas
    else:
        try:
            arr = np.asarray([float(s) for s in sigmas], dtype=np.float64)
        except (TypeError, ValueError):
            raise ValueError(f"sigmas must be a list of numbers, got {sigmas!r}") from None
    if arr.dtype.kind != "f":
        arr = arr.astype(np.float64)
    return arr


def _what_is_wrong(values: np.ndarray, start: float | None) -> str | None:
    """The first reason a flat float64 sigma list cannot drive a sampler, or None when it can."""
    if not np.isfinite(values).all():
        return "sigmas must be finite numbers; it holds NaN or infinite values"
    if values.min() < 0.0 or values.max() > 1.0:
        return "every sigma must lie in [0, 1]"
    if (np.diff(values) >= 0.0).any():
        return "sigmas must be strictly decreasing (each must strictly decrease from the step before)"
    if start is not None and abs(float(values[0]) - start) > SIGMA_TOLERANCE:
        return f"a refiner schedule must begin at t_thresh={start}, this one begins at {float(values[0])}"
    return None


def check_sigmas(sigmas: SigmaList, *, start: float | None = None) -> None:
    """Raise ValueError unless `sigmas` is a usable schedule: a flat, non-empty list of finite values in
    [0, 1], strictly decreasing, and (with `start`) beginning at `start` within 1e-6."""
    values = sigma_array(sigmas).astype(np.float64)
    if values.ndim != 1 or values.size == 0:
        raise ValueError("a sigma schedule is a non-empty flat list of numbers (1-D); "
                         f"got an array shaped {values.shape}")
    reason = _what_is_wrong(values, None if start is None else float(start))
    if reason:
        raise ValueError(f"unusable sigma schedule {values.tolist()}: {reason}")


def as_sigma_array(sigmas: SigmaList, *, allow_terminal_zero: bool = True) -> np.ndarray:
    """A user's sigma list, checked (`check_sigmas`), as a 1-D float array without its terminal 0.

    A trailing 0 (the terminal sigma) is allowed and dropped: samplers append their own. Float32
    input stays float32.
    """
    arr = sigma_array(sigmas)
    check_sigmas(arr)
    if allow_terminal_zero and arr.size > 1 and float(arr[-1]) == 0.0:
        arr = arr[:-1]
    if float(arr[-1]) == 0.0:
        raise ValueError("sigmas need at least one value above 0 (the terminal 0 is appended for you)")
    return arr


def positive_whole(name: str, value: Any) -> int:
    number = int(value)
    if number < 1:
        raise ValueError(f"{name} is {number}; it counts steps, so it must be 1 or more")
    return number


def compute_refiner_sigmas(
    *, t_thresh: float | None, num_inference_steps: int, shift: float,
    sigma_max: float, sigma_min: float, tail_steps: int = 2,
) -> torch.Tensor | None:
    """The refiner's float32 sigma list, or None when `t_thresh` is None (no refinement).

    The refiner re-noises an upscaled video to `t_thresh` and denoises from there. Its list is:
    the base grid of `num_inference_steps` (shifted by `shift`) from `t_thresh` down, `t_thresh`
    itself put in front when the grid does not already hold it, then `tail_steps` sigmas evenly
    between the last of those and `sigma_min`, ends excluded (the reference's "low_noise_tail_v1",
    2 by default). Pipelines pass it as `set_timesteps(sigmas=..., shift=1.0)`.
    """
    if t_thresh is None:
        return None
    start = float(t_thresh)
    if not 0.0 < start <= 1.0:
        raise ValueError(f"t_thresh (the noise level the refiner starts from) is {start}; it must be in (0, 1]")
    steps = positive_whole("num_inference_steps", num_inference_steps)
    tail = int(tail_steps or 0)
    if tail < 0:
        raise ValueError(f"tail_steps is {tail}; use 0 for no low-noise tail, or more")

    base = warp_sigmas(np.linspace(float(sigma_max), float(sigma_min), steps + 1)[:-1], float(shift))
    head = base[base <= start + SIGMA_TOLERANCE]
    if head.size == 0 or abs(float(head[0]) - start) > SIGMA_TOLERANCE:
        head = np.concatenate(([start], head))
    last = float(head[-1])
    # tail + 2 evenly spaced points from `last` to the floor; both ends are dropped (`last` is already
    # in, and the scheduler appends the final sigma itself).
    tail_values = np.linspace(last, min(float(sigma_min), last), tail + 2, dtype=np.float64)[1:-1]
    schedule = np.concatenate((head, tail_values))
    check_sigmas(schedule, start=start)
    return torch.from_numpy(schedule.astype(np.float32))


def transformer_timestep(timestep: torch.Tensor, transformer_dtype: torch.dtype) -> torch.Tensor:
    """The float32 timestep the DiT is called with for a scheduler timestep `t`.

    It is 1000 * (t / 1000), the round trip done in the DiT's dtype when that is bf16 or fp16:
    sigma = t / 1000 is rounded to the half dtype and multiplied by 1000 *in that dtype*, so a bf16 DiT
    sees 999 -> 1000.0, 899 -> 900.0, 499 -> 498.0 (a float32 multiply would give 898.4375 and
    498.046875, which the reference does not). Any other DiT dtype gets float32(t / 1000) * 1000.
    """
    working = transformer_dtype if transformer_dtype in (torch.bfloat16, torch.float16) else torch.float32
    sigma = (torch.as_tensor(timestep).float() / TIMESTEP_SCALE).to(working)
    return (sigma * TIMESTEP_SCALE).float()


__all__ = [
    "SHIFT_RANGE", "SIGMA_TOLERANCE", "TIMESTEP_SCALE", "SigmaList", "as_sigma_array", "check_shift", "check_sigmas",
    "compute_refiner_sigmas", "positive_whole", "sigma_array", "transformer_timestep", "warp_sigmas",
]
