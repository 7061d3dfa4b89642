"""Multi-head Latent Attention in the absorbed form, reading and appending the sequence cache.

Per token the layer caches one latent ``c`` (kv_lora_rank = 512) and one rope key (64), shared by
all heads. HF expands ``c`` into per-head keys and values through ``kv_b_proj``; we never do.
``kv_b_proj.weight`` is split per head into W_UK and W_UV and folded into the query and output:

    kv_b_proj.weight  [H * (dn + dv), R]  viewed  [H, dn + dv, R]
      rows [0, dn)        W_UK [H, dn, R]   key   k_nope[s,h] = W_UK[h] @ c[s]
      rows [dn, dn + dv)  W_UV [H, dv, R]   value v[s,h]      = W_UV[h] @ c[s]

    score[h,t,s] = (q_nope[t,h] @ W_UK[h]) . c[s]  +  q_rope[t,h] . rope_key[s]     (x softmax scale)
    out[t,h]     = W_UV[h] @ (sum_s p[h,t,s] c[s])

so attention runs against the 512 + 64 wide cache directly (what FlashMLA does), for prefill and
decode alike. DeepSeek-V3.2 additionally restricts each query to the tokens its indexer picks.

A call runs over a batch of rows split into ``Segment``s (one per sequence cache): the projections
(q, kv_a, o_proj, the indexer's) run over the whole batch, the attention above per segment.
The layer knows the cache only through ``SequenceCache``: nothing about pages or blocks.
"""

from __future__ import annotations

import torch
from torch import nn

from engine_adapter.cache import Segment
from engine_adapter.config import ModelConfig
from engine_adapter.indexer import Indexer, IndexQueries
from engine_adapter.norm import RMSNorm
from engine_adapter.rope import Rotation, softmax_scale


class MLAttention(nn.Module):
    """HF name ``self_attn``; its parameter names match the checkpoints."""

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.config, self.layer = config, layer
        self.num_heads = config.num_attention_heads
        self.scale = softmax_scale(config)
        self._build_query(config)
        latent, rope = config.kv_lora_rank, config.qk_rope_head_dim
        self.kv_a_proj_with_mqa = nn.Linear(config.hidden_size, latent + rope, bias=False)
        self.kv_a_layernorm = RMSNorm(latent)
        per_head = config.qk_nope_head_dim + config.v_head_dim
        self.kv_b_proj = nn.Linear(latent, self.num_heads * per_head, bias=False)
        self.o_proj = nn.Linear(self.num_heads * config.v_head_dim, config.hidden_size, bias=False)
        self.indexer = Indexer(config) if config.is_v32 else None

    def _build_query(self, config: ModelConfig) -> None:
        """Low-rank q (q_a_proj, q_a_layernorm, q_b_proj), or a direct q_proj when q_lora_rank is None."""
        width = self.num_heads * config.qk_head_dim
        if config.q_lora_rank is None:
            self.q_proj = nn.Linear(config.hidden_size, width, bias=False)
            return
        self.q_a_proj = nn.Linear(config.hidden_size, config.q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(config.q_lora_rank)
        self.q_b_proj = nn.Linear(config.q_lora_rank, width, bias=False)

    def forward(self, x: torch.Tensor, rotation: Rotation, segments: list[Segment]) -> torch.Tensor:
        """x [N, hidden] of the new tokens of every segment -> [N, hidden].

        The projections run over all N rows at once; each segment then appends its rows to its
        cache and attends over that cache alone.
        """
        q_latent, q_nope, q_rope = self._queries(x, rotation)  # [N, q_lora] or None, [N, H, dn], [N, H, 64]
        entries = self._cache_entries(x, rotation)  # [N, 512], [N, 64], [N, D] or None
        index_queries = None if self.indexer is None else self.indexer.queries(x, q_latent, rotation)
        out = torch.cat([self._attend(segment, q_nope, q_rope, entries, index_queries)
                         for segment in segments])  # [N, H, dv]
        return self.o_proj(out.flatten(1))

    def _attend(self, segment: Segment, q_nope: torch.Tensor, q_rope: torch.Tensor, entries: tuple,
                index_queries: IndexQueries | None) -> torch.Tensor:
        """One sequence: append its T rows of ``entries`` to its cache, attend -> [T, H, dv]."""
        cache, rows = segment
        q_nope, q_rope = q_nope[rows], q_rope[rows]  # [T, H, dn], [T, H, 64]
        cache.append(self.layer, *(None if t is None else t[rows] for t in entries))
        cached = cache.read(self.layer)  # S tokens, the T new ones last
        visible = _causal_mask(q_nope.shape[0], cached.latent.shape[0], q_nope.device)  # [T, S]
        if self.indexer is not None:
            if cached.indexer_key is None:
                raise ValueError("a V3.2 model needs a cache that keeps indexer keys")
            visible = self.indexer.select(index_queries.rows(rows), cached.indexer_key, visible)
        return self._absorbed_attention(q_nope, q_rope, cached.latent, cached.rope_key, visible)

    def _queries(self, x: torch.Tensor, rotation: Rotation):
        """x [T, hidden] -> (q_latent [T, q_lora] or None, q_nope [T, H, dn], q_rope [T, H, 64] rotated)."""
        c = self.config
        q_latent = None if c.q_lora_rank is None else self.q_a_layernorm(self.q_a_proj(x))  # [T, q_lora]
        q = self.q_proj(x) if q_latent is None else self.q_b_proj(q_latent)  # [T, H * qk_head_dim]
        q_nope, q_rope = q.view(-1, self.num_heads, c.qk_head_dim).split(
            [c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)  # [T, H, dn], [T, H, 64]
        return q_latent, q_nope, rotation.interleaved(q_rope)

    def _cache_entries(self, x: torch.Tensor, rotation: Rotation):
        """x [T, hidden] -> (latent [T, 512], rope_key [T, 64] interleaved, indexer_key [T, D] or None)."""
        kv = self.kv_a_proj_with_mqa(x)  # [T, 512 + 64]
        latent = self.kv_a_layernorm(kv[:, : self.config.kv_lora_rank])  # [T, 512]
        rope_key = rotation.interleaved(kv[:, self.config.kv_lora_rank :])  # [T, 64]
        indexer_key = None if self.indexer is None else self.indexer.key(x, rotation)  # [T, D]
        return latent, rope_key, indexer_key

    def _absorbed_attention(
        self,
        q_nope: torch.Tensor,  # [T, H, dn]
        q_rope: torch.Tensor,  # [T, H, 64] interleaved, rotated
        latent: torch.Tensor,  # [S, 512]
        rope_key: torch.Tensor,  # [S, 64] interleaved, rotated
        visible: torch.Tensor,  # [T, S] bool
    ) -> torch.Tensor:
        """-> [T, H, dv]: softmax attention over the latent cache, W_UK and W_UV absorbed."""
        w_uk, w_uv = self._absorbed_weights()  # [H, dn, 512], [H, dv, 512]
        q_latent = torch.einsum("thd,hdr->thr", q_nope, w_uk)  # [T, H, 512]
        scores = torch.einsum("thr,sr->hts", q_latent, latent) + torch.einsum("thp,sp->hts", q_rope, rope_key)
        scores = (scores * self.scale).masked_fill(~visible, float("-inf"))  # [H, T, S]
        probs = scores.softmax(dim=-1, dtype=torch.float32).to(latent.dtype)  # [H, T, S]
        out_latent = torch.einsum("hts,sr->thr", probs, latent)  # [T, H, 512]
        return torch.einsum("thr,hvr->thv", out_latent, w_uv)  # [T, H, dv]

    def _absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj.weight [H * (dn + dv), 512] -> (W_UK [H, dn, 512], W_UV [H, dv, 512]), views."""
        c = self.config
        w = self.kv_b_proj.weight.view(self.num_heads, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
        return w[:, : c.qk_nope_head_dim], w[:, c.qk_nope_head_dim :]


def _causal_mask(new: int, total: int, device: torch.device) -> torch.Tensor:
    """[new, total] bool: the i-th new token (cache index total - new + i) sees indices <= its own."""
    query_index = torch.arange(total - new, total, device=device)[:, None]  # [T, 1]
    return torch.arange(total, device=device)[None, :] <= query_index  # [T, S]
