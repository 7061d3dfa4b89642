"""DeepSeek's mixture of experts: a grouped top-k sigmoid router, routed experts, shared experts.

Routing (DeepSeek-V3 "noaux_tc", numerics as HF): in float32,

    scores  = sigmoid(x @ gate.weight^T)                     [T, E]
    choice  = scores + e_score_correction_bias               (the bias steers selection only)
    groups  = top topk_group of the n_group groups, a group scored by the sum of its top-2 choices
    experts = top num_experts_per_tok of choice inside the kept groups
    weights = scores[experts] (/ their sum if norm_topk_prob) * routed_scaling_factor

The output is ``sum_k weights_k * expert_k(x) + shared_experts(x)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine_adapter.config import ModelConfig
from engine_adapter.mlp import MLP


class Router(nn.Module):
    """Picks ``num_experts_per_tok`` experts per token and their weights; HF name ``mlp.gate``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.empty(config.n_routed_experts, config.hidden_size))
        # Always float32, whatever the model dtype (as HF keeps it).
        self.register_buffer("e_score_correction_bias", torch.zeros(config.n_routed_experts))

    def keep_fp32_(self) -> None:
        self.e_score_correction_bias.data = self.e_score_correction_bias.data.float()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (weights [T, k] float32, expert ids [T, k] int64)."""
        c = self.config
        scores = F.linear(x.float(), self.weight.float()).sigmoid()  # [T, E]
        choice = scores + self.e_score_correction_bias  # [T, E]
        allowed = self._allowed_experts(choice)  # [T, E] bool
        choice = choice.masked_fill(~allowed, float("-inf"))
        experts = choice.topk(c.num_experts_per_tok, dim=-1, sorted=False).indices  # [T, k]
        weights = scores.gather(1, experts)  # [T, k]
        if c.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * c.routed_scaling_factor, experts

    def _allowed_experts(self, choice: torch.Tensor) -> torch.Tensor:
        """choice [T, E] -> [T, E] bool: experts in the topk_group best groups."""
        c = self.config
        grouped = choice.view(choice.shape[0], c.n_group, c.experts_per_group)  # [T, G, E/G]
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, G]
        best = group_scores.topk(c.topk_group, dim=-1, sorted=False).indices  # [T, topk_group]
        kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, best, True)  # [T, G]
        return kept.repeat_interleave(c.experts_per_group, dim=1)  # [T, E]


class MoE(nn.Module):
    """Routed experts plus always-on shared experts; HF names ``gate``, ``experts.i``, ``shared_experts``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate = Router(config)
        self.experts = nn.ModuleList(
            MLP(config.hidden_size, config.moe_intermediate_size) for _ in range(config.n_routed_experts)
        )
        shared_width = config.moe_intermediate_size * config.n_shared_experts
        self.shared_experts = MLP(config.hidden_size, shared_width) if shared_width else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        weights, experts = self.gate(x)  # [T, k] float32, [T, k]
        out = torch.zeros_like(x)  # [T, hidden]
        for expert in experts.unique().tolist():  # only the experts some token picked
            token, slot = (experts == expert).nonzero(as_tuple=True)  # [n], [n]
            y = self.experts[expert](x[token]) * weights[token, slot, None]  # [n, hidden] float32
            out.index_add_(0, token, y.to(out.dtype))
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
