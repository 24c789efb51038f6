"""Sparse mixture-of-experts FFN of the MoE LingBot DiT.

Routing: sigmoid scores; the score-correction bias steers *which* experts are chosen but the gates
use the unbiased scores; selection is group-limited (a group scores the sum of its two best biased
scores); gates are renormalised and scaled. The router always runs in float32.

Experts: a float32 model computes every expert in float32 (the parity fixtures pin this path). A
bf16/fp16 model may use `torch._grouped_mm`, one kernel for all experts, when the shapes allow it.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .layers import SwiGLU


class Router(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        score_func: str,
        norm_topk_prob: bool,
        n_group: int | None,
        topk_group: int | None,
        route_scale: float,
    ):
        super().__init__()
        if score_func not in ("sigmoid", "softmax"):
            raise ValueError(f"unknown MoE score_func {score_func!r}; expected 'sigmoid' or 'softmax'")
        if n_group and n_group > 1 and (num_experts % n_group or not topk_group):
            raise ValueError(f"num_experts={num_experts} must split into n_group={n_group} groups with topk_group set")
        self.num_experts = num_experts
        self.top_k = top_k
        self.score_func = score_func
        self.norm_topk_prob = norm_topk_prob
        self.n_group = n_group
        self.topk_group = topk_group
        self.route_scale = route_scale
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts), persistent=True)

    def _choose(self, biased: torch.Tensor) -> torch.Tensor:
        if not self.n_group or self.n_group <= 1:
            return biased.topk(self.top_k, dim=-1, sorted=False).indices
        n = biased.shape[0]
        grouped = biased.view(n, self.n_group, -1)
        group_score = grouped.topk(2, dim=-1).values.sum(-1)
        kept = group_score.topk(self.topk_group, dim=-1, sorted=False).indices
        keep = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, kept, True)
        masked = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(n, -1)
        return masked.topk(self.top_k, dim=-1, sorted=False).indices

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(N, D) tokens -> expert indices (N, k) and gates (N, k) in the token dtype."""
        with torch.autocast(tokens.device.type, enabled=False):
            logits = F.linear(tokens.float(), self.weight.float())
        scores = logits.sigmoid() if self.score_func == "sigmoid" else logits.softmax(-1)
        chosen = self._choose(scores + self.e_score_correction_bias.float())
        gates = scores.gather(1, chosen)
        if self.top_k > 1 and self.norm_topk_prob:
            gates = gates / (gates.sum(-1, keepdim=True) + 1e-20)
        return chosen, (gates * self.route_scale).to(tokens.dtype)


class ExpertWeights(nn.Module):
    """Stacked expert weights (w1, w3: [E, I, D]; w2: [E, D, I]). A container: it has no forward."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.w3 = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))


def _grouped_mm_usable(tokens: torch.Tensor, experts: ExpertWeights) -> bool:
    if tokens.dtype not in (torch.bfloat16, torch.float16) or not hasattr(torch, "_grouped_mm"):
        return False
    inner, hidden = experts.w1.shape[1:]
    # _grouped_mm needs 16-byte aligned strides on both matmul dimensions.
    return (inner * tokens.element_size()) % 16 == 0 and (hidden * tokens.element_size()) % 16 == 0


class SparseMoE(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        moe_intermediate_size: int,
        score_func: str,
        norm_topk_prob: bool,
        n_group: int | None,
        topk_group: int | None,
        routed_scaling_factor: float,
        n_shared_experts: int | None,
    ):
        super().__init__()
        self.hidden_size = hidden_size
        self.router = Router(
            hidden_size, num_experts, top_k, score_func, norm_topk_prob, n_group, topk_group, routed_scaling_factor
        )
        self.experts = ExpertWeights(num_experts, hidden_size, moe_intermediate_size)
        self.shared_experts = (
            SwiGLU(hidden_size, moe_intermediate_size * n_shared_experts) if n_shared_experts else None
        )
        self.use_grouped_mm = True

    def _experts_loop(self, tokens: torch.Tensor, counts: list[int]) -> torch.Tensor:
        w1, w2, w3 = self.experts.w1, self.experts.w2, self.experts.w3
        out = []
        for e, chunk in enumerate(tokens.split(counts)):
            if chunk.shape[0]:
                out.append(F.linear(F.silu(F.linear(chunk, w1[e])) * F.linear(chunk, w3[e]), w2[e]))
        return torch.cat(out) if out else tokens.new_zeros(tokens.shape)

    def _experts_grouped(self, tokens: torch.Tensor, counts: list[int]) -> torch.Tensor:
        dtype = tokens.dtype
        offs = torch.tensor(counts, device=tokens.device).cumsum(0).to(torch.int32)
        w1, w2, w3 = (w.to(dtype) for w in (self.experts.w1, self.experts.w2, self.experts.w3))
        h = F.silu(torch._grouped_mm(tokens, w1.transpose(-2, -1), offs=offs))
        h = h * torch._grouped_mm(tokens, w3.transpose(-2, -1), offs=offs)
        return torch._grouped_mm(h, w2.transpose(-2, -1), offs=offs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, self.hidden_size)
        chosen, gates = self.router(tokens)
        n, k = chosen.shape

        flat_gates = gates.reshape(-1)
        flat_experts = chosen.reshape(-1)
        active = (flat_gates != 0).nonzero().squeeze(1)
        order = active[flat_experts[active].argsort(stable=True)]
        counts = torch.bincount(flat_experts[order], minlength=self.router.num_experts).tolist()
        routed_in = tokens[order // k]
        if self.use_grouped_mm and _grouped_mm_usable(routed_in, self.experts):
            routed_out = self._experts_grouped(routed_in, counts)
        else:
            routed_out = self._experts_loop(routed_in, counts)

        # Sum gate * expert output over the k choices in float32, in choice order.
        per_choice = routed_out.new_zeros(n * k, self.hidden_size, dtype=torch.float32)
        per_choice[order] = routed_out.float()
        weights = torch.zeros(n * k, dtype=torch.float32, device=x.device)
        weights[order] = flat_gates[order].float()
        out = (per_choice.view(n, k, -1) * weights.view(n, k, 1)).sum(1).to(x.dtype).view(shape)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
