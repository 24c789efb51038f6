"""Block-sparse self-attention for the DiT (the Loader's `attention: sparse`): training-free routing.

The method is Sol-Attn's (NVlabs, arXiv 2607.24027), written here from its description: the joint
sequence is cut into blocks of `BLOCK` tokens; for each query block, a cheap block-level score (the
query block's mean query against each key block's mean key, keys centred over the blocks) routes
the key blocks that matter to exact attention, and every other key block still enters the same
softmax as one pooled term (its mean score for that query block, weighted by its token count,
carrying the sum of its values), so no key is ever dropped from the denominator. A key block is
exact when its score clears `tau` standard deviations of the query block's score spread (or, with
`density` set, when it is among that fraction of the highest-scoring blocks); the diagonal block
and its neighbours are always exact.

Safeguards (the field's, as `SparseSettings` with its defaults): dense below `min_tokens` tokens,
dense while the timestep is in the first `dense_first` of the noise schedule, dense in the blocks
listed in `dense_blocks`; a call with a key mask (padded prompts, Ulysses padding) runs dense; the
text tokens at the end of the joint sequence are exact keys for every query, and text queries
attend every key exactly.

Two paths, one rule (`lingbot_core.kernels`, kernel `sparse_attention/<path>`): comfy-kitchen's
`sol_attn` CUDA kernel where the optional `comfy-kitchen` package is installed and reports the
device usable (the package's `sparse` extra), else our eager path (plain torch, block by
block: it computes only the routed blocks, so its count of computed blocks is the real work, but it
is a Python loop over query blocks and heads, not a fast kernel). Either one is tried on its first
call, its first query block's rows checked (finite, inside the range of the values, since attention
averages them, and within `SPARSE_TOLERANCE` of dense SDPA's: a sanity bound, sparse is an
approximation by design), and dense SDPA serves for the rest of the process
where it raises or is further off, with one warning.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from .. import kernels

log = logging.getLogger("lingbot_core.kernels")

__all__ = ["BLOCK", "DEFAULTS", "SPARSE", "SparseSettings", "attend_sparse", "eager_sparse_attention", "route", "scope"]

SPARSE = "sparse"
"""The attention choice (Loader, `--attention`, `PipelineHandle.open(attention_backend=...)`)."""
BLOCK = 64
"""Tokens per block, for the routing and for the exact tiles (comfy-kitchen's kernel uses the same)."""
SPARSE_TOLERANCE = 0.99
"""How far (relative L2) a sparse path's first query rows may be from dense SDPA's on its trial: it
catches zeros, garbage and a wrong layout, not the approximation (0.1-0.3 per layer on real
activations; about 0.6 on random queries and keys, where attention is near uniform)."""


@dataclass(frozen=True)
class SparseSettings:
    """Where sparse attention runs and how sparse it is.

    `tau`: a key block is exact when its routing score is above `tau` standard deviations of the
    query block's score spread (higher: sparser). `density`: when set (0 < density <= 1), the
    fraction of key blocks each query block computes exactly instead (top scores), `tau` unused.
    `min_tokens`: shorter sequences run dense. `dense_first`: the first fraction of the noise
    schedule (timesteps above (1 - dense_first) * 1000) runs dense: it lays out the scene.
    `dense_blocks`: DiT block indices that always run dense."""

    tau: float = 1.0
    density: float | None = None
    min_tokens: int = 12_288
    dense_first: float = 0.2
    dense_blocks: tuple[int, ...] = field(default=(0,))

    def __post_init__(self) -> None:
        if not (math.isfinite(self.tau) and self.tau >= 0):
            raise ValueError(f"sparse attention's tau is a number >= 0, not {self.tau}")
        if self.density is not None and not 0 < self.density <= 1:
            raise ValueError(f"sparse attention's density is a fraction in (0, 1], not {self.density}")
        if self.min_tokens < 0:
            raise ValueError(f"sparse attention's min_tokens is a count >= 0, not {self.min_tokens}")
        if not 0 <= self.dense_first <= 1:
            raise ValueError(f"sparse attention's dense_first is a fraction in [0, 1], not {self.dense_first}")


DEFAULTS = SparseSettings()
"""The settings `attention: sparse` gets where none are given (the Loaders, `set_attention_backend`)."""


@dataclass(frozen=True)
class _Call:
    """What one DiT forward tells its attention calls: the settings, the video token count, the timestep."""

    settings: SparseSettings
    n_video: int
    timestep: float


_current: contextvars.ContextVar[_Call | None] = contextvars.ContextVar("lingbot_sparse_call", default=None)


@contextlib.contextmanager
def scope(settings: SparseSettings, n_video: int, timestep: float) -> Iterator[None]:
    """Within: sparse attention calls know the settings, where the text tokens start and the timestep
    (0..1000). The DiT's forward opens it; an attention call outside one treats every token as video."""
    token = _current.set(_Call(settings, int(n_video), float(timestep)))
    try:
        yield
    finally:
        _current.reset(token)


def should_run_sparse(settings: SparseSettings, tokens: int, layer: int | None, timestep: float | None,
                      masked: bool) -> bool:
    """The safeguards: False where this call runs dense."""
    if masked or tokens < max(settings.min_tokens, 2 * BLOCK):
        return False
    if layer is not None and layer in settings.dense_blocks:
        return False
    return not (timestep is not None and timestep > (1.0 - settings.dense_first) * 1000.0)


# -- routing --------------------------------------------------------------------------------------

def _blocks(x: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, H, S, D) -> block sums (B, H, N, D) and live tokens per block (N,), the last one ragged."""
    b, h, s, d = x.shape
    padded = torch.nn.functional.pad(x, (0, 0, 0, n * BLOCK - s))
    sizes = torch.full((n,), float(BLOCK), device=x.device)
    sizes[-1] = s - (n - 1) * BLOCK
    return padded.view(b, h, n, BLOCK, d).sum(dim=3), sizes


def route(q: torch.Tensor, k: torch.Tensor, settings: SparseSettings, n_video: int | None = None,
          scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Which (query block, key block) pairs are exact, and the pooled scores.

    q, k: (B, H, S, D) float32 with the keys already centred. Returns `exact` (B, H, N, N) bool and
    `scores` (B, H, N, N): the query block's mean query against each key block's mean key, times
    the softmax scale (the pooled term's logit)."""
    b, h, s, d = q.shape
    scale = d ** -0.5 if scale is None else scale
    n = -(-s // BLOCK)
    q_sum, sizes = _blocks(q, n)
    k_sum, _ = _blocks(k, n)
    q_mean, k_mean = q_sum / sizes[:, None], k_sum / sizes[:, None]
    scores = (q_mean @ k_mean.transpose(-1, -2)) * scale
    if settings.density is not None:
        keep = max(1, min(n, round(settings.density * n)))
        cut = scores.topk(keep, dim=-1).values[..., -1:]
        exact = scores >= cut
    else:
        # spread of a query block's scores over the key blocks, from the keys' variance per feature
        spread = ((q_mean ** 2) @ k_mean.var(dim=2, unbiased=False).unsqueeze(-1)).squeeze(-1).clamp_min(0).sqrt()
        exact = scores > settings.tau * spread.unsqueeze(-1) * scale
    idx = torch.arange(n, device=q.device)
    exact |= (idx[:, None] - idx[None, :]).abs() <= 1
    if n_video is not None and n_video < s:
        first_text = n_video // BLOCK  # the block holding the first text token, and every later one
        exact[..., first_text:] = True
        exact[..., first_text:, :] = True
    return exact, scores


def eager_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, settings: SparseSettings,
                           n_video: int | None = None, stats: dict[str, int] | None = None) -> torch.Tensor:
    """Block-sparse attention in plain torch over (B, S, H, D) q, k, v; returns (B, S, H, D) in v's dtype.

    Computes only the routed blocks: per (sample, head, query block) the exact keys' scores plus one
    pooled logit per other key block. `stats` (optional) receives `computed` (exact block pairs)
    and `dense` (all block pairs)."""
    b, s, h, d = q.shape
    scale = d ** -0.5
    n = -(-s // BLOCK)
    qh, kh, vh = (t.float().transpose(1, 2) for t in (q, k, v))  # (B, H, S, D)
    k_sum, sizes = _blocks(kh, n)
    kh = kh - (k_sum / sizes[:, None]).mean(dim=2, keepdim=True)  # centred keys: softmax-invariant
    exact, scores = route(qh, kh, settings, n_video, scale)
    v_sum, _ = _blocks(vh, n)
    pad = n * BLOCK - s
    kp = torch.nn.functional.pad(kh, (0, 0, 0, pad)).view(b, h, n, BLOCK, d)
    vp = torch.nn.functional.pad(vh, (0, 0, 0, pad)).view(b, h, n, BLOCK, d)
    live = torch.zeros(n, BLOCK, dtype=torch.bool, device=q.device)
    live.view(-1)[:s] = True
    out = torch.empty(b, h, n * BLOCK, d, dtype=torch.float32, device=q.device)
    qp = torch.nn.functional.pad(qh, (0, 0, 0, pad)).view(b, h, n, BLOCK, d)
    for bi in range(b):
        for hi in range(h):
            for i in range(n):
                chosen = exact[bi, hi, i].nonzero().squeeze(1)
                keys = kp[bi, hi, chosen].reshape(-1, d)
                logits = (qp[bi, hi, i] @ keys.T) * scale  # (BLOCK, m*BLOCK)
                logits.masked_fill_(~live[chosen].reshape(1, -1), float("-inf"))
                rest = ~exact[bi, hi, i]
                pooled = scores[bi, hi, i, rest]  # one logit per pooled block, shared by the block's rows
                top = logits.amax(dim=-1, keepdim=True)
                if pooled.numel():
                    top = torch.maximum(top, pooled.max())
                weights = (logits - top).exp()
                num = weights @ vp[bi, hi, chosen].reshape(-1, d)
                den = weights.sum(dim=-1, keepdim=True)
                if pooled.numel():
                    pw = (pooled.unsqueeze(0) - top).exp()  # (BLOCK, p)
                    num = num + pw @ v_sum[bi, hi, rest]
                    den = den + pw @ sizes[rest].unsqueeze(-1)
                out[bi, hi, i * BLOCK:(i + 1) * BLOCK] = num / den
    if stats is not None:
        stats["computed"] = stats.get("computed", 0) + int(exact.sum())
        stats["dense"] = stats.get("dense", 0) + b * h * n * n
    return out[:, :, :s].transpose(1, 2).to(v.dtype)


# -- the two paths, by trial ------------------------------------------------------------------------

_said: set[str] = set()


def _kitchen(device: torch.device) -> Callable | None:
    """comfy-kitchen's `sol_attn` where the package is installed and says it runs on `device`, else None
    (on a GPU, said once: the eager path is slow there)."""
    if device.type != "cuda":
        return None
    try:
        import comfy_kitchen
    except ImportError:
        why = "comfy-kitchen is not installed (install it for the CUDA kernel)"
    else:
        usable = getattr(comfy_kitchen, "sol_attn_is_available", None)
        if usable is not None and usable(device):
            return comfy_kitchen.sol_attn
        why = f"comfy-kitchen {getattr(comfy_kitchen, '__version__', '')} has no sol_attn kernel for this GPU"
    if why not in _said:
        _said.add(why)
        log.warning("lingbot: sparse attention: %s; running its eager path (slow, same routing)", why)
    return None


def _kitchen_call(fn: Callable, q, k, v, settings: SparseSettings, n_video: int | None) -> torch.Tensor:
    s = q.shape[1]
    n = -(-s // BLOCK)
    sinks = [n_video // BLOCK, n] if n_video is not None and n_video < s else [0, 0]
    return fn(q, k, v, tau=settings.tau, sink_blocks=sinks, sink_q=sinks, topk_ratio=settings.density or 0.0)


@torch.compiler.disable
def attend_sparse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None,
                  layer: int | None, dense: Callable[[], torch.Tensor],
                  settings: SparseSettings | None = None) -> torch.Tensor:
    """One self-attention call under `attention: sparse`: `dense()` where a safeguard says so, else
    the sparse path by trial (module docstring). Outside a DiT forward's `scope`, `settings` (default:
    `SparseSettings()`) apply and every token counts as video. Runs eagerly under torch.compile."""
    call = _current.get()
    if call is not None:
        settings, n_video, timestep = call.settings, call.n_video, call.timestep
    else:
        settings, n_video, timestep = settings or DEFAULTS, None, None
    if not should_run_sparse(settings, q.shape[1], layer, timestep, key_mask is not None):
        return dense()
    kitchen = _kitchen(q.device)
    path = "comfy_kitchen" if kitchen is not None else "eager"

    def fast() -> torch.Tensor:
        if kitchen is not None:
            return _kitchen_call(kitchen, q, k, v, settings, n_video)
        return eager_sparse_attention(q, k, v, settings, n_video)

    def against_dense(out: torch.Tensor) -> str | None:
        return _check(out[:, :BLOCK], q, k, v)

    return kernels.run(f"sparse_attention/{path}", fast, dense, device=q.device, dtype=q.dtype, check=against_dense)


def _check(rows: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    """Why the first query rows of a sparse result are wrong, or None (the trial's check)."""
    if not torch.isfinite(rows).all():
        return "its output is not finite"
    low, high = v.amin(dim=1, keepdim=True).float(), v.amax(dim=1, keepdim=True).float()
    slack = 1e-2 * (high - low) + 1e-6
    if ((rows.float() < low - slack) | (rows.float() > high + slack)).any():
        return "its output lies outside the range of the values it averages"
    want = torch.nn.functional.scaled_dot_product_attention(
        q[:, :BLOCK].transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
    return kernels.differs(rows, want, SPARSE_TOLERANCE)


@kernels.trial_for("sparse_attention")
def _sparse_trial(device: torch.device, dtype: torch.dtype, variant: str = "") -> str | None:
    """`kernels.probe`'s small trial: 2 heads of 64 over 256 tokens (4 blocks) on `device` in `dtype`."""
    if variant == "comfy_kitchen" and _kitchen(device) is None:
        return "comfy-kitchen is not installed or has no sol_attn kernel for this device"
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4 * BLOCK, 2, 64, generator=g).to(device=device, dtype=dtype) for _ in range(3))

    def dense() -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)

    attend_sparse(q, k, v, None, None, dense, SparseSettings(min_tokens=0, dense_first=0.0, dense_blocks=()))
    return None
