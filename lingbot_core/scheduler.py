"""Flow-matching UniPC sampler matching the LingBot-Video reference bit for bit.

The reference ships a vendored copy of Wan 2.1's flow UniPC (`FlowUniPCMultistepScheduler`). This
module re-implements the parts inference needs: the sigma grid (linspace from the float32 sigma_max,
float64 shift, timesteps *truncated* to int64), explicit sigma lists for the refiner, and the
UniP/UniC multistep update with the reference's exact order of float32 operations.

Why not diffusers' `UniPCMultistepScheduler`: with `use_flow_sigmas=True` its own grid starts at 1.0
(not 0.999), keeps float timesteps and has no call-time shift, so the grid must be built here anyway.
Fed this grid as explicit `sigmas` with `flow_shift=1.0`, diffusers 0.42.1 did reproduce every fixture
bit for bit, but we keep the small solver here so parity does not hang on diffusers internals that
users' installs vary in (and on its sigma~1 nudge and different `sigma_min` final sigma).

Deliberate differences from the reference, all in configurations LingBot never uses: predict_x0=False
and lower_order_final=False with order > 1 are refused (the reference returns NaN on the final step
to sigma 0), `final_sigmas_type="sigma_min"` appends the training sigma_min (the reference crashes),
and bh1 returns the x0 estimate on the final step where the reference computes -inf * 0 = NaN.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.schedulers.scheduling_utils import SchedulerMixin

__all__ = [
    "FlowUniPCScheduler",
    "compute_refiner_sigmas",
    "transformer_timestep",
    "validate_sigmas",
]

SigmaList = Sequence[float] | np.ndarray | torch.Tensor

# Solver-type aliases the reference silently maps to bh2.
_BH2_ALIASES = ("midpoint", "heun", "logrho")


def _flow_shift(sigmas, shift: float):
    """Time-shift sigmas in whatever array type and dtype they come in.

    The expression (shift * s) / (1 + (shift - 1) * s) is kept in this exact order so that float32
    inputs round the way the reference rounds them.
    """
    return shift * sigmas / (1 + (shift - 1) * sigmas)


def _as_float_array(sigmas: SigmaList) -> np.ndarray:
    """Turn a user sigma list into a 1-D numpy array without changing a float tensor's dtype.

    Float32 arrays must stay float32: the reference derives the timesteps as float32(sigma) * 1000
    when it is handed the float32 refiner list, and truncation can flip on the last bit.
    """
    if isinstance(sigmas, torch.Tensor):
        arr = sigmas.detach().cpu().numpy()
    elif isinstance(sigmas, np.ndarray):
        arr = sigmas
    else:
        arr = np.asarray(list(sigmas), dtype=np.float64)
    if arr.dtype.kind != "f":
        arr = arr.astype(np.float64)
    return arr


def validate_sigmas(sigmas: SigmaList, *, t_thresh: float | None = None) -> None:
    """Reject sigma lists the solver cannot use: it needs a strictly falling sequence inside [0, 1].

    With `t_thresh` the list must also start there (within 1e-6), as a refiner schedule does.
    """
    arr = _as_float_array(sigmas).astype(np.float64)
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"sigma schedule must be a non-empty 1-D list, got shape {tuple(arr.shape)}")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"sigma schedule contains non-finite values: {arr.tolist()}")
    if np.any(arr < 0.0) or np.any(arr > 1.0):
        raise ValueError(f"sigma schedule values must lie in [0, 1], got {arr.tolist()}")
    if arr.size > 1 and not np.all(np.diff(arr) < 0.0):
        raise ValueError(f"sigma schedule must be strictly descending, got {arr.tolist()}")
    if t_thresh is not None and abs(float(arr[0]) - float(t_thresh)) > 1e-6:
        raise ValueError(f"sigma schedule must start at t_thresh={float(t_thresh)}, got {float(arr[0])}")


def compute_refiner_sigmas(
    *,
    sigma_max: float,
    sigma_min: float,
    num_inference_steps: int,
    shift: float,
    t_thresh: float | None,
    tail_steps: int = 2,
) -> torch.Tensor | None:
    """Sigma list for the refiner: the shifted base grid cut at `t_thresh`, plus a low-noise tail.

    The refiner re-noises an upscaled video to `t_thresh` and only denoises from there, so the
    grid starts at `t_thresh`; `tail_steps` extra sigmas split the gap between the last grid
    value and `sigma_min` (the reference's "low_noise_tail_v1", default 2). Returns None when
    `t_thresh` is None (no refinement: use the plain grid). The result is float32, as the
    reference hands it to `set_timesteps(len(s), sigmas=s, shift=1.0)`.
    """
    if t_thresh is None:
        return None
    t_value = float(t_thresh)
    if not 0.0 < t_value <= 1.0:
        raise ValueError(f"refiner t_thresh must lie in (0, 1], got {t_value}")
    steps = int(num_inference_steps)
    if steps < 1:
        raise ValueError(f"num_inference_steps must be >= 1, got {steps}")
    tail = int(tail_steps or 0)
    if tail < 0:
        raise ValueError(f"tail_steps must be >= 0, got {tail}")

    eps = 1e-6
    grid = _flow_shift(np.linspace(float(sigma_max), float(sigma_min), steps + 1)[:-1], float(shift))
    kept = grid[grid <= t_value + eps]
    if kept.size == 0 or abs(float(kept[0]) - t_value) > eps:
        kept = np.concatenate([[t_value], kept])
    if tail > 0:
        last = float(kept[-1])
        # Interior points only: the first equals `last`, the final sigma is appended by the scheduler.
        tail_values = np.linspace(last, min(float(sigma_min), last), tail + 2, dtype=np.float64)[1:-1]
        kept = np.concatenate([kept, tail_values])
    validate_sigmas(kept, t_thresh=t_value)
    return torch.from_numpy(kept.astype(np.float32))


def transformer_timestep(timestep: torch.Tensor, transformer_dtype: torch.dtype) -> torch.Tensor:
    """The timestep value the DiT is given for a scheduler timestep, as the reference computes it.

    sigma = t / 1000 is cast to a half-precision DiT dtype and multiplied back by 1000 *in that
    dtype* before the float32 cast, so a bf16 DiT sees 999 -> 1000.0, 899 -> 900.0, 499 -> 498.0.
    (Multiplying in float32 instead would give 898.4375 / 498.046875, which the reference does not.)
    A float32 DiT gets float32(t / 1000) * 1000.
    """
    sigma = torch.as_tensor(timestep).float() / 1000.0
    if transformer_dtype in (torch.bfloat16, torch.float16):
        sigma = sigma.to(transformer_dtype)
    return (sigma * 1000.0).float()


def _log_snr(sigma: torch.Tensor) -> torch.Tensor:
    """lambda = log(alpha) - log(sigma) with alpha = 1 - sigma (flow matching), in float32."""
    return torch.log(1 - sigma) - torch.log(sigma)


class FlowUniPCScheduler(SchedulerMixin, ConfigMixin):
    """Multistep UniPC (predictor UniP + corrector UniC) for flow-matching models.

    Reads the reference's `scheduler_config.json` unchanged (every field is accepted); settings this
    implementation does not support raise at construction instead of being silently ignored.

    `step` tracks its position internally: the first call after `set_timesteps` locates the given
    timestep in `self.timesteps` (the second match if it occurs twice, like diffusers), later calls
    just advance, whatever timestep they are passed. Call `set_timesteps` again to start over.
    """

    config_name = "scheduler_config.json"
    order = 1

    @register_to_config
    def __init__(
        self,
        num_train_timesteps: int = 1000,
        solver_order: int = 2,
        prediction_type: str = "flow_prediction",
        shift: float = 1.0,
        use_dynamic_shifting: bool = False,
        thresholding: bool = False,
        dynamic_thresholding_ratio: float = 0.995,
        sample_max_value: float = 1.0,
        predict_x0: bool = True,
        solver_type: str = "bh2",
        lower_order_final: bool = True,
        disable_corrector: Sequence[int] = (),
        solver_p: object | None = None,
        timestep_spacing: str = "linspace",
        steps_offset: int = 0,
        final_sigmas_type: str = "zero",
    ) -> None:
        if prediction_type != "flow_prediction":
            raise ValueError(f"prediction_type must be 'flow_prediction', got {prediction_type!r}")
        if solver_type in _BH2_ALIASES:
            self.register_to_config(solver_type="bh2")
        elif solver_type not in ("bh1", "bh2"):
            raise NotImplementedError(f"solver_type {solver_type!r} is not supported (use 'bh1' or 'bh2')")
        if int(solver_order) < 1:
            raise ValueError(f"solver_order must be >= 1, got {solver_order}")
        if int(num_train_timesteps) < 1:
            raise ValueError(f"num_train_timesteps must be >= 1, got {num_train_timesteps}")
        if final_sigmas_type not in ("zero", "sigma_min"):
            raise ValueError(f"final_sigmas_type must be 'zero' or 'sigma_min', got {final_sigmas_type!r}")
        if shift is None or not float(shift) > 0.0:
            raise ValueError(f"shift must be a positive number, got {shift!r}")
        unsupported = {
            "use_dynamic_shifting": use_dynamic_shifting,
            "thresholding": thresholding,
            "solver_p": solver_p is not None,
        }
        for name, enabled in unsupported.items():
            if enabled:
                raise NotImplementedError(f"{name} is not supported by FlowUniPCScheduler")
        # Both of these divide by zero on the last step (to sigma 0) in the reference, which then
        # returns NaN latents; refuse them instead of reproducing that.
        if not predict_x0:
            raise NotImplementedError(
                "predict_x0=False is not supported: its update is NaN on the final step to sigma 0"
            )
        if not lower_order_final and int(solver_order) > 1:
            raise NotImplementedError(
                "lower_order_final=False needs solver_order=1: a higher-order final step to sigma 0 "
                "divides by zero"
            )
        if timestep_spacing != "linspace" or int(steps_offset) != 0:
            raise NotImplementedError(
                "only timestep_spacing='linspace' with steps_offset=0 is supported, got "
                f"{timestep_spacing!r} / {steps_offset!r}"
            )

        self.disable_corrector = {int(i) for i in disable_corrector}
        self._sigma_max, self._sigma_min = self._training_sigma_range()
        self.num_inference_steps: int | None = None
        self.sigmas: torch.Tensor | None = None
        self.timesteps: torch.Tensor | None = None
        self._reset_solver_state()

    def _training_sigma_range(self) -> tuple[float, float]:
        """Ends of the training sigma table, as float32 values like the reference keeps them.

        The table is 1 - reversed(linspace(1, 1/N, N)) in float64, cast to float32 and shifted by
        the *config* shift there; the default gives sigma_max = float32(0.999), sigma_min = 0.
        """
        n = int(self.config.num_train_timesteps)
        alphas = np.linspace(1.0, 1.0 / n, n)[::-1].copy()
        table = torch.from_numpy(1.0 - alphas).to(torch.float32)
        table = _flow_shift(table, float(self.config.shift))
        return table[0].item(), table[-1].item()

    @property
    def sigma_max(self) -> float:
        """Largest training sigma (float32 value as a Python float): the grid's starting point."""
        return self._sigma_max

    @property
    def sigma_min(self) -> float:
        """Smallest training sigma: the grid's end point (0.0 for the LingBot config)."""
        return self._sigma_min

    @property
    def step_index(self) -> int | None:
        return self._step_index

    @property
    def begin_index(self) -> int | None:
        return self._begin_index

    def set_begin_index(self, begin_index: int = 0) -> None:
        """Start this run at `begin_index` instead of looking the first timestep up (call after set_timesteps)."""
        self._begin_index = int(begin_index)

    def _reset_solver_state(self) -> None:
        order = int(self.config.solver_order)
        self.model_outputs: list[torch.Tensor | None] = [None] * order
        self.lower_order_nums = 0
        self.last_sample: torch.Tensor | None = None
        self.this_order = 0
        self._step_index: int | None = None
        self._begin_index: int | None = None

    def set_timesteps(
        self,
        num_inference_steps: int | None = None,
        device: str | torch.device | None = None,
        *,
        shift: float | None = None,
        sigmas: SigmaList | None = None,
    ) -> None:
        """Build the sigma/timestep schedule for one sampling run and clear all solver state.

        Without `sigmas`: linspace(sigma_max, sigma_min, S+1)[:-1] in float64, shifted by `shift`
        (config shift when None). With `sigmas`: that list, shifted the same way (pipelines pass
        shift=1.0 for refiner lists), keeping a float32 list in float32 like the reference.
        Timesteps are sigma * num_train_timesteps truncated to int64; `self.sigmas` is float32
        with the final sigma (0, or sigma_min) appended and stays on the CPU.
        """
        shift_value = float(self.config.shift if shift is None else shift)
        if not shift_value > 0.0:
            raise ValueError(f"shift must be a positive number, got {shift!r}")

        if sigmas is None:
            if num_inference_steps is None or int(num_inference_steps) < 1:
                raise ValueError(f"num_inference_steps must be >= 1, got {num_inference_steps!r}")
            grid = np.linspace(self.sigma_max, self.sigma_min, int(num_inference_steps) + 1)[:-1]
        else:
            grid = _as_float_array(sigmas)
            validate_sigmas(grid)
            if num_inference_steps is not None and int(num_inference_steps) != grid.size:
                raise ValueError(
                    f"num_inference_steps={num_inference_steps} does not match the {grid.size} explicit sigmas"
                )

        grid = _flow_shift(grid, shift_value)
        final_sigma = 0.0 if self.config.final_sigmas_type == "zero" else self.sigma_min
        if not float(grid[-1]) > final_sigma:
            raise ValueError(
                f"the last sigma ({float(grid[-1])}) must be above the final sigma {final_sigma} "
                "that the scheduler appends"
            )

        timesteps = torch.from_numpy(grid * self.config.num_train_timesteps).to(dtype=torch.int64)
        table = np.concatenate([grid.astype(np.float64), [final_sigma]]).astype(np.float32)

        self.sigmas = torch.from_numpy(table)
        self.timesteps = timesteps.to(device=device)
        self.num_inference_steps = int(timesteps.numel())
        self._reset_solver_state()

    def scale_model_input(self, sample: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        """Flow matching feeds the latent to the model unscaled."""
        return sample

    def _locate(self, timestep) -> int:
        """Schedule index of `timestep`; a value that occurs twice resolves to its second position."""
        value = torch.as_tensor(timestep).reshape(-1)
        if value.numel() != 1:
            raise ValueError(f"step expects a single timestep, got {value.numel()} values")
        matches = (self.timesteps == value.to(self.timesteps.device)).nonzero().flatten()
        if matches.numel() == 0:
            raise ValueError(
                f"timestep {value.item()} is not in the schedule {self.timesteps.tolist()}; "
                "call set_timesteps first or pass one of its timesteps"
            )
        return int(matches[1 if matches.numel() > 1 else 0].item())

    def _coefficients(self, target: int, source: int, history: Sequence[int], order: int, device):
        """UniPC B(h) terms for a move from sigma index `source` to `target`.

        `history` holds the sigma indices of the older model outputs (newest first). Returns the
        per-history ratios rk, the right-hand side b of the order conditions, the Vandermonde rows
        R, and the scalars the update needs; everything is float32 and built in the reference's
        order so the rounding matches.
        """
        sigma_t, sigma_s0 = self.sigmas[target], self.sigmas[source]
        lambda_s0 = _log_snr(sigma_s0)
        h = _log_snr(sigma_t) - lambda_s0
        ratios = [(_log_snr(self.sigmas[idx]) - lambda_s0) / h for idx in history]

        hh = -h  # x0-prediction form
        h_phi_1 = torch.expm1(hh)
        b_h = hh if self.config.solver_type == "bh1" else torch.expm1(hh)

        rks = torch.stack([*ratios, torch.ones((), dtype=torch.float32)]).to(device)
        rows, rhs = [], []
        h_phi_k = h_phi_1 / hh - 1
        factorial = 1
        for k in range(1, order + 1):
            rows.append(torch.pow(rks, k - 1))
            rhs.append(h_phi_k * factorial / b_h)
            factorial *= k + 1
            h_phi_k = h_phi_k / hh - 1 / factorial
        return {
            "sigma_t": sigma_t,
            "sigma_s0": sigma_s0,
            "ratios": ratios,
            "h_phi_1": h_phi_1,
            "b_h": b_h,
            "R": torch.stack(rows),
            "b": torch.stack(rhs).to(device),
        }

    @staticmethod
    def _base_update(x: torch.Tensor, m0: torch.Tensor, c: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """First-order (DDIM-like) part of the update, and the scalar that multiplies the residual."""
        sigma_t = c["sigma_t"]
        alpha_t = 1 - sigma_t
        base = sigma_t / c["sigma_s0"] * x - alpha_t * c["h_phi_1"] * m0
        return base, alpha_t * c["b_h"]

    @staticmethod
    def _combine(weights: torch.Tensor, diffs: list[torch.Tensor]) -> torch.Tensor:
        """sum_k weights[k] * diffs[k], contracted the way the reference does (einsum over dim 1)."""
        return torch.einsum("k,bk...->b...", weights, torch.stack(diffs, dim=1))

    def _predict(self, x: torch.Tensor, order: int) -> torch.Tensor:
        """UniP: extrapolate from sigma[i] to sigma[i+1] using the last `order` model outputs."""
        i = self._step_index
        m0 = self.model_outputs[-1]
        history = [i - k for k in range(1, order)]
        c = self._coefficients(i + 1, i, history, order, x.device)
        diffs = [(self.model_outputs[-(k + 1)] - m0) / rk for k, rk in enumerate(c["ratios"], start=1)]
        base, scale = self._base_update(x, m0, c)
        if not diffs:
            return base
        if order == 2:
            rhos = torch.tensor([0.5], dtype=x.dtype, device=x.device)
        else:
            rhos = torch.linalg.solve(c["R"][:-1, :-1], c["b"][:-1]).to(x.dtype)
        return base - scale * self._combine(rhos, diffs)

    def _correct(self, x_prev: torch.Tensor, model_t: torch.Tensor, order: int) -> torch.Tensor:
        """UniC: redo the previous step from `x_prev` now that the model output at its target is known."""
        i = self._step_index
        m0 = self.model_outputs[-1]
        history = [i - (k + 1) for k in range(1, order)]
        c = self._coefficients(i, i - 1, history, order, x_prev.device)
        diffs = [(self.model_outputs[-(k + 1)] - m0) / rk for k, rk in enumerate(c["ratios"], start=1)]
        if order == 1:
            rhos = torch.tensor([0.5], dtype=x_prev.dtype, device=x_prev.device)
        else:
            rhos = torch.linalg.solve(c["R"], c["b"]).to(x_prev.dtype)
        base, scale = self._base_update(x_prev, m0, c)
        correction = rhos[-1] * (model_t - m0)
        if diffs:
            correction = self._combine(rhos[:-1], diffs) + correction
        return base - scale * correction

    def step(self, model_output: torch.Tensor, timestep, sample: torch.Tensor) -> torch.Tensor:
        """Advance `sample` from the current sigma to the next one and return it (float32).

        `model_output` is the (guided) flow prediction at `sample`. Inputs are upcast to float32;
        for float32 inputs this is the reference's arithmetic exactly.
        """
        if self.num_inference_steps is None:
            raise ValueError("call set_timesteps before step")
        if self._step_index is None:
            self._step_index = self._begin_index if self._begin_index is not None else self._locate(timestep)
        i = self._step_index
        if i >= self.num_inference_steps:
            raise ValueError(
                f"all {self.num_inference_steps} steps are done; call set_timesteps to sample again"
            )

        given = sample
        model_output = model_output.float()
        sample = sample.float()
        # Flow prediction v = noise - x0, so x0 = x - sigma * v; the solver works on x0 estimates.
        converted = sample - self.sigmas[i] * model_output

        if i > 0 and (i - 1) not in self.disable_corrector and self.last_sample is not None:
            sample = self._correct(self.last_sample, converted, self.this_order)

        self.model_outputs = [*self.model_outputs[1:], converted]

        order = int(self.config.solver_order)
        if self.config.lower_order_final:
            order = min(order, self.num_inference_steps - i)
        self.this_order = min(order, self.lower_order_nums + 1)

        # The corrector reads this at the next step; never alias a tensor the caller may edit in place.
        self.last_sample = sample.clone() if sample is given else sample
        prev_sample = self._predict(sample, self.this_order)
        self.lower_order_nums = min(self.lower_order_nums + 1, int(self.config.solver_order))
        self._step_index = i + 1
        return prev_sample

    def __len__(self) -> int:
        return int(self.config.num_train_timesteps)
