"""The expert FFN of the MoE DiT: a router, a stack of SwiGLU experts, an optional shared expert.

Routing facts (from the reference behaviour the fixtures pin): scores are sigmoid (or softmax) of
float32 logits; a learned per-expert bias (`e_score_correction_bias`) is added only to *choose*
experts, the gates use the scores without it; with `n_group` > 1 a token first keeps its best
`topk_group` groups, a group rated by the sum of its two best biased scores; the chosen gates are
renormalised to sum to 1 (when more than one is chosen) and multiplied by `routed_scaling_factor`.

Expert compute: a float32 model runs the experts one by one in float32 (the path the parity
fixtures pin). A bf16/fp16 model runs all experts in three `torch._grouped_mm` calls, packed
(fp8/GGUF) experts too, decoded for the call, unless a runtime LoRA delta is on them. The grouped
path routes with fixed shapes (every (token, choice) slot, sorted by expert, per-expert counts as a
tensor), so it has no data-dependent size and compiles without graph breaks (the float32 loop
does not: it splits by per-expert counts read back to Python). A slot whose gate is exactly zero
is computed and weighted by zero, which adds nothing.

`torch._grouped_mm` runs on some devices, dtypes and torch versions only (torch <= 2.8: compute
capability 9.0 and bf16): it is the `grouped_mm` kernel of `lingbot_core.kernels`, tried on its
first call per device, dtype and torch, its first `CHECK_TOKENS` tokens compared with the loop's;
where it refuses or differs the loop serves the rest of the process, with one warning.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import kernels
from .config import MoEConfig
from .layers import SwiGLU

__all__ = ["ExpertWeights", "Router", "SparseMoE"]

#: tokens of a grouped call's first result compared with the loop's (`kernels.run`'s check)
CHECK_TOKENS = 64
#: how far (relative error, `kernels.relative_error`) the grouped result may be from the loop's: both
#: round to the half-precision dtype between the matmuls (equal on the CPU; on a GPU, not run yet)
GROUPED_TOLERANCE = 2e-2


class Router(nn.Module):
    """Token -> (expert ids, gates). All its settings live in one `MoEConfig`."""

    def __init__(self, hidden_size: int, routing: MoEConfig):
        super().__init__()
        self.routing = routing
        self.weight = nn.Parameter(torch.empty(routing.num_experts, hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(routing.num_experts), persistent=True)

    def _pick(self, preference: torch.Tensor) -> torch.Tensor:
        """Expert ids per token from the bias-corrected scores (N, E), group limit applied."""
        k = self.routing.num_experts_per_tok
        if not self.routing.grouped:
            return preference.topk(k, dim=-1, sorted=False).indices
        tokens, groups = preference.shape[0], int(self.routing.n_group or 1)
        by_group = preference.unflatten(-1, (groups, -1))
        best_two = by_group.topk(2, dim=-1).values
        group_rating = best_two[..., 0] + best_two[..., 1]
        kept_groups = group_rating.topk(int(self.routing.topk_group or 1), dim=-1, sorted=False).indices
        allowed = torch.zeros(tokens, groups, dtype=torch.bool, device=preference.device)
        allowed[torch.arange(tokens, device=preference.device)[:, None], kept_groups] = True
        candidates = torch.where(allowed[..., None], by_group, float("-inf")).flatten(1)
        return candidates.topk(k, dim=-1, sorted=False).indices

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(N, D) tokens -> chosen expert ids (N, k) and their gates (N, k) in the tokens' dtype."""
        with torch.autocast(tokens.device.type, enabled=False):
            logits = F.linear(tokens.float(), self.weight.float())
        scores = torch.sigmoid(logits) if self.routing.score_func == "sigmoid" else torch.softmax(logits, dim=-1)
        chosen = self._pick(scores + self.e_score_correction_bias.float())
        gates = torch.gather(scores, 1, chosen)
        if self.routing.norm_topk_prob and chosen.shape[1] > 1:
            gates = gates / (gates.sum(dim=-1, keepdim=True) + 1e-20)
        gates = gates * self.routing.routed_scaling_factor
        return chosen, gates.to(tokens.dtype)


class ExpertWeights(nn.Module):
    """The experts' stacked SwiGLU weights: w1 (gate) and w3 (up) are [E, I, D], w2 (down) is [E, D, I].

    Only a container (the checkpoint's key layout); `SparseMoE` does the compute.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.w3 = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))


def _grouped_mm_fits(tokens: torch.Tensor, experts: nn.Module) -> bool:
    """torch._grouped_mm exists, the dtype is half precision (it has no float32 kernel on every
    device, nor a float32 shape rule for the compiler), no runtime expert delta is attached, and both
    matmul strides are 16-byte aligned."""
    if not hasattr(torch, "_grouped_mm") or getattr(experts, "deltas", None):
        return False
    if tokens.dtype not in (torch.bfloat16, torch.float16):
        return False
    width = tokens.element_size()
    return all(size * width % 16 == 0 for size in experts.w1.shape[1:])


def _loop_mix(tokens: torch.Tensor, chosen: torch.Tensor, gates: torch.Tensor, project, num_experts: int) -> torch.Tensor:
    """(N, D) -> (N, D) float32 weighted sum of each token's experts, expert by expert over the slots
    with a non-zero gate; `project(name, e, rows)` applies weight `name` of expert e."""
    n_tokens, per_token = chosen.shape
    # One row per (token, choice) with a non-zero gate, stably sorted by expert id.
    expert_of = chosen.flatten()
    gate_of = gates.flatten()
    live = torch.nonzero(gate_of != 0).squeeze(1)
    slots = live[torch.argsort(expert_of[live], stable=True)]
    counts = torch.bincount(expert_of[slots], minlength=num_experts).tolist()
    rows_by_expert = tokens[slots // per_token].split(counts)
    outputs = [project("w2", e, F.silu(project("w1", e, rows)) * project("w3", e, rows))
               for e, rows in enumerate(rows_by_expert) if rows.shape[0]]
    answers = torch.cat(outputs) if outputs else tokens.new_zeros((0, tokens.shape[1]))

    # Weighted sum over each token's choices in float32, in choice order (dropped slots stay 0).
    width = answers.shape[1] if outputs else tokens.shape[1]
    by_slot = answers.new_zeros(n_tokens * per_token, width, dtype=torch.float32)
    by_slot[slots] = answers.float()
    weight = torch.zeros(n_tokens * per_token, dtype=torch.float32, device=tokens.device)
    weight[slots] = gate_of[slots].float()
    return (by_slot.view(n_tokens, per_token, -1) * weight.view(n_tokens, per_token, 1)).sum(dim=1)


def _swiglu_grouped(tokens: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor,
                    ends: torch.Tensor) -> torch.Tensor:
    """SwiGLU experts over expert-sorted `tokens` in three `torch._grouped_mm` calls; w1/w3 [E, I, D],
    w2 [E, D, I]; `ends` int32 cumulative row counts per expert."""
    gate, down, up = (w.transpose(-2, -1) for w in (w1, w2, w3))
    inner = F.silu(torch._grouped_mm(tokens, gate, offs=ends)) * torch._grouped_mm(tokens, up, offs=ends)
    return torch._grouped_mm(inner, down, offs=ends)


@torch.library.custom_op("lingbot::expert_loop", mutates_args=())
def expert_loop(tokens: torch.Tensor, chosen: torch.Tensor, gates: torch.Tensor, w1: torch.Tensor,
                w2: torch.Tensor, w3: torch.Tensor) -> torch.Tensor:
    """`_loop_mix` over plain stacked weights as one op. Why an op: inside a compiled block the
    loop's sizes depend on the routing (a graph break, and a recompile per expert-count pattern
    until the limit); as an op whose output shape is fixed (N, D), the compiler treats it as one
    call. Used where `torch._grouped_mm` cannot trace (float32, which has no shape rule for it)."""
    return _loop_mix(tokens, chosen, gates, lambda name, e, rows: F.linear(rows, {"w1": w1, "w2": w2, "w3": w3}[name][e]),
                     w1.shape[0])


@expert_loop.register_fake
def _(tokens, chosen, gates, w1, w2, w3):
    return tokens.new_empty((tokens.shape[0], w2.shape[1]), dtype=torch.float32)


class SparseMoE(nn.Module):
    """Routed experts plus the shared expert (when the config has one), on (B, S, D) hidden states."""

    def __init__(self, hidden_size: int, routing: MoEConfig):
        super().__init__()
        self.hidden_size = hidden_size
        self.router = Router(hidden_size, routing)
        self.experts = ExpertWeights(routing.num_experts, hidden_size, routing.moe_intermediate_size)
        self.shared_experts = SwiGLU(hidden_size, routing.shared_width) if routing.shared_width else None
        self.use_grouped_mm = True

    def _experts_grouped(self, tokens: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        """All experts in three grouped matmuls over expert-sorted tokens; `ends`: int32 cumulative counts.

        Packed experts are decoded here: every expert of one weight at once while compiling (fixed
        shapes), else a span of experts at a time (`grouped_span`), their rows only."""
        span = getattr(self.experts, "grouped_span", None)
        if span is not None and not torch.compiler.is_compiling():
            step = span(tokens.device)
            if step < self.router.routing.num_experts:
                return self._experts_grouped_in_spans(tokens, ends, step)
        weights = (self.experts.w1, self.experts.w2, self.experts.w3)
        return _swiglu_grouped(tokens, *(w.to(tokens.dtype) for w in weights), ends)

    def _experts_grouped_in_spans(self, tokens: torch.Tensor, ends: torch.Tensor, step: int) -> torch.Tensor:
        """`_experts_grouped` for packed experts, `step` experts decoded at a time into one scratch per
        weight (allocated once per call, not per span: fresh tensors of tens of MB fault their pages
        in on a CPU); spans no token routes to are not decoded. The rows of a span are contiguous
        (tokens are sorted by expert)."""
        experts, num = self.experts, self.router.routing.num_experts
        bounds = [0, *ends.tolist()]  # one host read per layer: where each span's rows start and end
        out = tokens.new_empty(tokens.shape[0], self.hidden_size)
        names = ("w1", "w2", "w3")
        scratch = {name: tokens.new_empty(min(step, num), *experts.packings[name].shape[1:]) for name in names}
        for first in range(0, num, step):
            last = min(num, first + step)
            lo, hi = bounds[first], bounds[last]
            if hi == lo:
                continue
            part = slice(first, last)
            weights = (experts.stack(name, tokens.dtype, part, out=scratch[name][:last - first]) for name in names)
            out[lo:hi] = _swiglu_grouped(tokens[lo:hi], *weights, ends[part] - lo)
        return out

    def _mix_grouped(self, tokens: torch.Tensor, chosen: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        """(N, D) -> (N, D) float32 weighted expert sum, with shapes fixed by N, top-k and E only."""
        n_tokens, per_token = chosen.shape
        expert_of = chosen.flatten()
        slots = torch.argsort(expert_of, stable=True)
        counts = torch.zeros(self.router.routing.num_experts, dtype=torch.int32, device=tokens.device)
        counts.index_add_(0, expert_of, torch.ones_like(expert_of, dtype=torch.int32))
        answers = self._experts_grouped(tokens[slots // per_token], counts.cumsum(0, dtype=torch.int32))
        by_slot = answers.new_zeros(n_tokens * per_token, self.hidden_size, dtype=torch.float32)
        by_slot[slots] = answers.float()
        weight = gates.float().view(n_tokens, per_token, 1)
        return (by_slot.view(n_tokens, per_token, -1) * weight).sum(dim=1)

    def _mix_loop(self, tokens: torch.Tensor, chosen: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        """(N, D) -> (N, D) float32 weighted expert sum, expert by expert over the live slots."""
        if torch.compiler.is_compiling() and not getattr(self.experts, "deltas", None):
            # its sizes depend on the routing: one opaque op of fixed output shape for the compiler
            experts = self.experts
            return expert_loop(tokens, chosen, gates, experts.w1.to(tokens.dtype), experts.w2.to(tokens.dtype),
                               experts.w3.to(tokens.dtype))
        experts = self.experts
        if getattr(experts, "decodes_per_expert", False):
            project = experts.project  # packed experts: decode expert e only, plus its runtime deltas
        else:
            def project(name: str, e: int, rows: torch.Tensor) -> torch.Tensor:
                return F.linear(rows, getattr(experts, name)[e])
        return _loop_mix(tokens, chosen, gates, project, self.router.routing.num_experts)

    def _routed(self, tokens: torch.Tensor) -> torch.Tensor:
        chosen, gates = self.router(tokens)
        if self.use_grouped_mm and _grouped_mm_fits(tokens, self.experts):
            def against_loop(grouped: torch.Tensor) -> str | None:
                n = CHECK_TOKENS
                return kernels.differs(grouped[:n], self._mix_loop(tokens[:n], chosen[:n], gates[:n]), GROUPED_TOLERANCE)

            return kernels.run("grouped_mm", lambda: self._mix_grouped(tokens, chosen, gates),
                               lambda: self._mix_loop(tokens, chosen, gates), device=tokens.device, dtype=tokens.dtype,
                               check=against_loop)
        return self._mix_loop(tokens, chosen, gates)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._routed(x.reshape(-1, self.hidden_size)).to(x.dtype).view(x.shape)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


@kernels.trial_for("grouped_mm")
def _grouped_mm_trial(device: torch.device, dtype: torch.dtype, variant: str = "") -> str | None:
    """`kernels.probe`'s small trial: a 4-expert MoE on 32 tokens in `dtype` on `device` through the
    grouped path, judged by the trial rule; why it cannot be tried at all, or None."""
    if not hasattr(torch, "_grouped_mm"):
        return f"this torch ({torch.__version__}) has no torch._grouped_mm"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"the grouped path runs bf16/fp16 models only, not {dtype}"
    g = torch.Generator().manual_seed(0)
    moe = SparseMoE(64, MoEConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32))
    for p in moe.parameters():
        p.data = torch.randn(p.shape, generator=g) * 0.1
    moe = moe.to(device=device, dtype=dtype)
    with torch.no_grad():
        moe(torch.randn(1, 32, 64, generator=g).to(device=device, dtype=dtype))
    return None
