"""Flow-matching UniPC sampler matching the LingBot-Video reference bit for bit.

The reference ships a vendored copy of Wan 2.1's flow UniPC (`FlowUniPCMultistepScheduler`). This
module re-implements the parts inference needs: the sigma grid (linspace from the float32 sigma_max,
float64 shift, timesteps *truncated* to int64), explicit sigma lists for the refiner, and the
UniP/UniC multistep update with the reference's exact order of float32 operations. The sigma rules
it shares with the other samplers (shift formula, list checks, the refiner's list) are in
`lingbot_core.sampling.sigmas`.

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

import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from diffusers.configuration_utils import ConfigMixin
from diffusers.schedulers.scheduling_utils import SchedulerMixin

from .sampling.sigmas import (
    SigmaList,
    check_shift,
    check_sigmas,
    compute_refiner_sigmas,
    positive_whole,
    sigma_array,
    transformer_timestep,
    warp_sigmas,
)

# The sigma rules (shift formula, list checks, the refiner's list, the DiT timestep) live in
# `sampling.sigmas`; the three names below are re-exported for callers that import them from here.
__all__ = [
    "FlowUniPCScheduler",
    "UniPCSettings",
    "check_sigmas",
    "compute_refiner_sigmas",
    "transformer_timestep",
]

def _log_snr(sigma: torch.Tensor) -> torch.Tensor:
    """lambda = log(alpha) - log(sigma) with alpha = 1 - sigma (flow matching), in float32."""
    return torch.log(1 - sigma) - torch.log(sigma)


# -- scheduler_config.json -----------------------------------------------------------------------

# Keys the checkpoint's config carries that this solver supports at one value only, and that value.
_ONLY_VALUE: dict[str, Any] = {
    "prediction_type": "flow_prediction",
    "use_dynamic_shifting": False,
    "thresholding": False,
    "solver_p": None,
    "predict_x0": True,  # the other form divides by zero on the final step to sigma 0 (NaN latents)
    "timestep_spacing": "linspace",
    "steps_offset": 0,
}
# Keys read and kept for save_pretrained but without effect here (they only matter with thresholding).
_INERT: dict[str, Any] = {"dynamic_thresholding_ratio": 0.995, "sample_max_value": 1.0}
# Names of the multistep "B(h)" variants; the reference maps the three old names to bh2.
_SOLVER_VARIANTS = {"bh1": "bh1", "bh2": "bh2", "midpoint": "bh2", "heun": "bh2", "logrho": "bh2"}


@dataclass(frozen=True)
class UniPCSettings:
    """What `scheduler_config.json` asks of the solver, parsed and checked once."""

    num_train_timesteps: int = 1000
    shift: float = 1.0
    solver_order: int = 2
    solver_type: str = "bh2"
    lower_order_final: bool = True
    disable_corrector: tuple[int, ...] = ()
    final_sigmas_type: str = "zero"

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any]) -> UniPCSettings:
        given = {k: v for k, v in raw.items() if not str(k).startswith("_")}
        unknown = sorted(set(given) - set(cls.keys()))
        if unknown:
            raise ValueError(f"scheduler config: unknown keys {unknown}; the known keys are {sorted(cls.keys())}")
        for key, only in _ONLY_VALUE.items():
            if key in given and given[key] != only:
                raise NotImplementedError(f"scheduler config: {key}={given[key]!r} is not supported by "
                                          f"FlowUniPCScheduler; LingBot checkpoints use {key}={only!r}")
        variant = given.get("solver_type", "bh2")
        if variant not in _SOLVER_VARIANTS:
            raise NotImplementedError(f"scheduler config: solver_type={variant!r} is not a UniPC variant "
                                      "(use 'bh1' or 'bh2')")
        final = given.get("final_sigmas_type", "zero")
        if final not in ("zero", "sigma_min"):
            raise ValueError(f"scheduler config: final_sigmas_type={final!r}; the last sigma is either 'zero' "
                             "or the training 'sigma_min'")
        shift = given.get("shift", 1.0)
        if shift is None or not float(shift) > 0.0:
            raise ValueError(f"scheduler config: shift={shift!r}; the time shift must be a number above 0")
        settings = cls(
            num_train_timesteps=positive_whole("num_train_timesteps", given.get("num_train_timesteps", 1000)),
            shift=float(shift),
            solver_order=positive_whole("solver_order", given.get("solver_order", 2)),
            solver_type=_SOLVER_VARIANTS[variant],
            lower_order_final=bool(given.get("lower_order_final", True)),
            disable_corrector=tuple(int(i) for i in given.get("disable_corrector", ())),
            final_sigmas_type=final,
        )
        if not settings.lower_order_final and settings.solver_order > 1:
            raise NotImplementedError(
                f"scheduler config: lower_order_final=False with solver_order={settings.solver_order} would take a "
                "higher-order last step to sigma 0, which divides by zero; use lower_order_final=True or order 1"
            )
        return settings

    @staticmethod
    def keys() -> tuple[str, ...]:
        own = tuple(UniPCSettings.__dataclass_fields__)
        return own + tuple(_ONLY_VALUE) + tuple(_INERT)

    def to_mapping(self, raw: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The full config.json fields: ours, the fixed ones, and the inert ones as given in `raw`."""
        given = dict(raw or {})
        flat: dict[str, Any] = {**_ONLY_VALUE, **{k: given.get(k, v) for k, v in _INERT.items()}}
        for key in UniPCSettings.__dataclass_fields__:
            value = getattr(self, key)
            flat[key] = list(value) if isinstance(value, tuple) else value
        return flat


class FlowUniPCScheduler(SchedulerMixin, ConfigMixin):
    """Multistep UniPC (predictor UniP + corrector UniC) for flow-matching models.

    Build it from `scheduler_config.json` (`from_pretrained`), from its fields as keywords, or from a
    `UniPCSettings`. Every key of the reference's config is accepted; settings this implementation
    does not support raise at construction instead of being silently ignored.

    `step` tracks its position internally: the first call after `set_timesteps` locates the given
    timestep in `self.timesteps` (the second match if it occurs twice, like diffusers), later calls
    just advance, whatever timestep they are passed. Call `set_timesteps` again to start over.
    """

    config_name = "scheduler_config.json"
    order = 1

    def __init__(self, settings: UniPCSettings | None = None, /, **fields: Any) -> None:
        if settings is None:
            settings = UniPCSettings.from_mapping(fields)
        elif fields:
            raise TypeError("give either UniPCSettings or scheduler_config.json fields, not both")
        self.register_to_config(**settings.to_mapping(fields))
        self.settings = settings
        self.disable_corrector = set(settings.disable_corrector)
        self._sigma_max, self._sigma_min = self._training_sigma_range()
        self.num_inference_steps: int | None = None
        self.sigmas: torch.Tensor | None = None
        self.timesteps: torch.Tensor | None = None
        self._reset_solver_state()

    def _training_sigma_range(self) -> tuple[float, float]:
        """First and last sigma of the training table, float32 values as the reference keeps them.

        The table is 1 - (1/N, 2/N, ..., 1) built in float64 (numpy linspace, exact end points), cast to
        float32 and shifted there by the *config* shift: only its two ends are ever used, so only they
        are computed. The default config gives sigma_max = float32(0.999), sigma_min = 0.
        """
        n = self.settings.num_train_timesteps
        ends = torch.tensor([1.0 - 1.0 / n, 1.0 - 1.0], dtype=torch.float64).to(torch.float32)
        ends = warp_sigmas(ends, self.settings.shift)
        return ends[0].item(), ends[1].item()

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

    def _base_grid(self, steps: int) -> np.ndarray:
        return np.linspace(self.sigma_max, self.sigma_min, steps + 1)[:-1]

    def sigma_grid(self, steps: int, shift: float | None = None) -> np.ndarray:
        """The float64 sigmas `set_timesteps(steps, shift=shift)` builds (no terminal value); passing a
        tail of them as `sigmas` with shift 1.0 gives that run's own timesteps from there on."""
        if int(steps) < 1:
            raise ValueError(f"num_inference_steps must be >= 1, got {steps!r}")
        return warp_sigmas(self._base_grid(int(steps)), float(self.config.shift if shift is None else shift))

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
        check_shift(shift_value)

        if sigmas is None:
            if num_inference_steps is None or int(num_inference_steps) < 1:
                raise ValueError(f"num_inference_steps must be >= 1, got {num_inference_steps!r}")
            grid = self._base_grid(int(num_inference_steps))
        else:
            grid = sigma_array(sigmas)
            check_sigmas(grid)
            if num_inference_steps is not None and int(num_inference_steps) != grid.size:
                raise ValueError(
                    f"num_inference_steps={num_inference_steps} does not match the {grid.size} explicit sigmas"
                )

        grid = warp_sigmas(grid, shift_value)
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
        rows = [torch.pow(rks, power) for power in range(order)]
        # b_k = k! * phi_k(h) / B(h), with phi_{k+1} = (phi_k - 1/k!) / h built up in float32.
        rhs = []
        phi, k_factorial = h_phi_1 / hh - 1, 1
        for k in range(1, order + 1):
            rhs.append(phi * k_factorial / b_h)
            k_factorial *= k + 1
            phi = phi / hh - 1 / k_factorial
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


def _published_signature() -> inspect.Signature:
    """`(self, settings=None, /, *, <every scheduler_config.json key>=<default>)`: diffusers reads the
    config keys from `__init__`'s signature."""
    defaults = UniPCSettings().to_mapping()
    params = [
        inspect.Parameter("self", inspect.Parameter.POSITIONAL_ONLY),
        inspect.Parameter("settings", inspect.Parameter.POSITIONAL_ONLY, default=None),
    ]
    params += [inspect.Parameter(k, inspect.Parameter.KEYWORD_ONLY, default=defaults[k]) for k in UniPCSettings.keys()]
    return inspect.Signature(params)


FlowUniPCScheduler.__init__.__signature__ = _published_signature()  # type: ignore[attr-defined]
