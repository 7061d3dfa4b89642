"""The DSA lightning indexer of DeepSeek-V3.2: which cached tokens each query attends to.

Per layer it owns a small key per token (the ``indexer_key`` cache component) and, per query,
scores every visible cached token and keeps the ``index_topk`` best:

    key    k[s]    = LayerNorm(wk(x_s)), half-split RoPE on dims [0, qk_rope_head_dim)   [S, D]
    query  q[t,h]  = wq_b(q_latent_t),   the same RoPE                                   [T, H, D]
    weight w[t,h]  = weights_proj(x_t) / sqrt(H)                      (float32)         [T, H]
    score  I[t,s]  = sum_h w[t,h] * relu(q[t,h] . k[s] / sqrt(D))                        [T, S]

then the top ``index_topk`` visible tokens by I (all of them when fewer are visible; of tied scores
the earliest positions, so a suffix over a cached prefix keeps what a cold run keeps). ``key`` and
``queries`` are projections and run over a whole batch; ``select`` runs per sequence, against that
sequence's cached keys.

Numerics follow HF transformers 5.23, which (like vLLM) applies no Hadamard rotation and keeps keys
unquantised: DeepSeek's reference and SGLang rotate q and k by a Hadamard matrix and quantise to
fp8. The rotation is orthogonal, so scores agree up to fp8 rounding, but cached key bytes differ.
Since DeepSeek's Nov-2025 fix the indexer's RoPE is half-split (NeoX), unlike MLA's interleaved.

The key depends on the hidden state, not on the MLA latent: it cannot be rebuilt from the latent,
and without it a query past ``index_topk`` tokens picks the wrong tokens.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from engine_adapter.config import ModelConfig
from engine_adapter.rope import Rotation


class IndexQueries(NamedTuple):
    """The indexer's side of T queries; computed for a whole batch, sliced per sequence by ``rows``."""

    q: torch.Tensor  # [T, H, D] float32, RoPE applied
    weights: torch.Tensor  # [T, H] float32, weights_proj(x) / sqrt(H)

    def rows(self, rows: slice) -> IndexQueries:
        return IndexQueries(self.q[rows], self.weights[rows])


class Indexer(nn.Module):
    """HF name ``self_attn.indexer``: ``wq_b``, ``wk``, ``k_norm`` (LayerNorm), ``weights_proj``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.head_dim = config.index_n_heads, config.index_head_dim
        self.rope_dim, self.topk = config.qk_rope_head_dim, config.index_topk
        self.wq_b = nn.Linear(config.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(config.hidden_size, self.n_heads, bias=False)  # kept float32

    def keep_fp32_(self) -> None:
        self.weights_proj.float()

    def key(self, x: torch.Tensor, rotation: Rotation) -> torch.Tensor:
        """x [T, hidden] -> indexer keys [T, D] for the cache."""
        return self._rope(self.k_norm(self.wk(x)), rotation)  # [T, D]

    def queries(self, x: torch.Tensor, q_latent: torch.Tensor, rotation: Rotation) -> IndexQueries:
        """x [T, hidden], q_latent [T, q_lora_rank] (q_a_layernorm(q_a_proj(x))) -> the T queries."""
        q = self.wq_b(q_latent).view(x.shape[0], self.n_heads, self.head_dim)  # [T, H, D]
        q = self._rope(q, rotation).float()
        head_weights = self.weights_proj(x.to(self.weights_proj.weight.dtype)).float()  # [T, H]
        return IndexQueries(q, head_weights * self.n_heads**-0.5)

    def select(
        self,
        queries: IndexQueries,  # T queries of one sequence
        keys: torch.Tensor,  # [S, D], all cached indexer keys of this layer
        visible: torch.Tensor,  # [T, S] bool, the causal mask
    ) -> torch.Tensor:
        """-> [T, S] bool: True where the query keeps the token (always a subset of ``visible``)."""
        scores = self._scores(queries, keys).masked_fill(~visible, float("-inf"))  # [T, S]
        # A stable sort, not topk: a token every head's ReLU zeroes scores exactly 0.0, and where
        # fewer than topk tokens score above it such ties fill the last places. topk breaks ties
        # by the row's width, so a suffix computed over a cached prefix (S = prefix length) would
        # keep other tokens than a cold run (S = whole prompt) and change the outputs. The stable
        # sort keeps the earliest positions, whatever S; the masked columns sort last.
        top = scores.sort(dim=-1, descending=True, stable=True).indices[:, : min(self.topk, keys.shape[0])]  # [T, k]
        picked = torch.zeros_like(visible).scatter(-1, top, True)  # [T, S]
        return picked & visible

    def _scores(self, queries: IndexQueries, keys: torch.Tensor) -> torch.Tensor:
        """-> index scores I [T, S] float32 (see the module docstring)."""
        per_head = torch.matmul(queries.q, keys.float().T) * self.head_dim**-0.5  # [T, H, S]
        per_head = F.relu(per_head)
        return torch.matmul(queries.weights.unsqueeze(-2), per_head).squeeze(-2)  # [T, S]

    def _rope(self, t: torch.Tensor, rotation: Rotation) -> torch.Tensor:
        """Half-split RoPE on the first rope_dim dims of t [T, ..., D]; the rest passes through."""
        rotated = rotation.half_split(t[..., : self.rope_dim])
        return torch.cat([rotated, t[..., self.rope_dim :]], dim=-1)
