"""DeepSeek-V3.2: the DSA lightning indexer against HF, and why its keys belong to every block."""

from __future__ import annotations

import torch

from engine_adapter.cache import ContiguousCache
from engine_adapter.config import ModelConfig
from engine_adapter.engine import Engine
from engine_adapter.model import DeepseekForCausalLM
from engine_adapter.paged_cache import PagePool
from engine_adapter.rope import Rotation
from engine_adapter.sequence import Request
from tests.engine_adapter.hf_oracle import TINY_V32, hf_prefill, prompt, rel_err
from tests.engine_adapter.test_model import run

TOPK = TINY_V32["index_topk"]  # 16
T = 6 * TOPK  # prompts several times longer than index_topk


def test_prefill_logits_and_cache_match_hf(v32):
    assert v32.ours.config.is_v32 and v32.ours.config.index_topk == TOPK
    token_ids = prompt(T)
    ref = hf_prefill(v32.hf, token_ids)
    logits, cache = run(v32.ours, token_ids)
    assert rel_err(logits, ref.logits) < 1e-4
    for layer in range(v32.ours.config.num_hidden_layers):
        cached = cache.read(layer)
        assert rel_err(cached.latent, ref.latents[layer]) < 1e-5
        assert rel_err(cached.rope_key, ref.rope_keys[layer]) < 1e-5
        assert rel_err(cached.indexer_key, ref.indexer_keys[layer]) < 1e-5  # same order as HF: no conversion


def test_the_indexer_really_restricts_attention(v32):
    """Past index_topk tokens each query keeps exactly index_topk of the visible ones."""
    attn = v32.ours.model.layers[1].self_attn
    _, cache = run(v32.ours, prompt(T))
    keys = cache.read(1).indexer_key  # [T, 128]
    x = torch.randn(T, v32.ours.config.hidden_size, generator=torch.Generator().manual_seed(0))
    q_latent = attn.q_a_layernorm(attn.q_a_proj(x))
    rotation = Rotation.at(torch.arange(T), v32.ours.inv_freq, v32.ours.attention_factor, torch.float32)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    kept = attn.indexer.select(attn.indexer.queries(x, q_latent, rotation), keys, causal)  # [T, T]
    assert not (kept & ~causal).any()
    assert kept.sum(-1).tolist() == [min(i + 1, TOPK) for i in range(T)]


def test_prefix_then_suffix_then_decode_equals_full_prefill(v32):
    token_ids = prompt(T + 3)
    full, _ = run(v32.ours, token_ids)
    prefix, cache = run(v32.ours, token_ids[: 2 * TOPK + 5])  # a hit longer than index_topk
    suffix, cache = run(v32.ours, token_ids[2 * TOPK + 5 : T], cache, start=2 * TOPK + 5)
    steps = [run(v32.ours, token_ids[p : p + 1], cache, start=p)[0] for p in range(T, T + 3)]
    assert rel_err(torch.cat([prefix, suffix, *steps]), full) < 1e-5


def without_indexer_keys(cache: ContiguousCache) -> ContiguousCache:
    """What a store that saved latents but dropped the indexer component would hand back: zeros."""
    restored = ContiguousCache(cache.num_layers, with_indexer=True)
    for layer in range(cache.num_layers):
        latent, rope_key, indexer_key = cache.read(layer)
        restored.append(layer, latent, rope_key, torch.zeros_like(indexer_key))
    return restored


def suffix_logits(model, token_ids, hit: int, lose_indexer: bool) -> torch.Tensor:
    _, cache = run(model, token_ids[:hit])
    if lose_indexer:
        cache = without_indexer_keys(cache)
    return run(model, token_ids[hit:], cache, start=hit)[0]


def test_a_hit_without_indexer_keys_changes_the_output_past_topk(v32):
    """The indexer key is a block component: latents alone give wrong logits once past index_topk."""
    token_ids = prompt(T)
    intact = suffix_logits(v32.ours, token_ids, 4 * TOPK, lose_indexer=False)
    broken = suffix_logits(v32.ours, token_ids, 4 * TOPK, lose_indexer=True)
    assert rel_err(broken, intact) > 1e-2


def test_within_topk_every_token_is_kept_so_indexer_keys_do_not_matter(v32):
    """Control: while prefix + suffix <= index_topk the indexer keeps every token anyway."""
    token_ids = prompt(TOPK)
    intact = suffix_logits(v32.ours, token_ids, TOPK - 4, lose_indexer=False)
    broken = suffix_logits(v32.ours, token_ids, TOPK - 4, lose_indexer=True)
    assert rel_err(broken, intact) < 1e-6


def test_tied_index_scores_keep_the_same_tokens_cold_and_after_a_prefix_hit():
    """With few index heads many tokens score exactly 0 (every head's ReLU zero), and those ties
    fill the last top-k places. They must go to the same tokens whether the queries ran over the
    whole prompt (cold) or over a cached prefix first (S differs), else a hit changes the output.
    float64, so no rounding difference can stand in for a tie; the seeds are ones where torch's
    topk picked differently (6 of 30 seeds changed their output before)."""
    config = ModelConfig.from_hf(dict(
        vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=16, num_hidden_layers=2,
        first_k_dense_replace=1, num_attention_heads=2, kv_lora_rank=512, qk_rope_head_dim=64, q_lora_rank=32,
        qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=8, n_group=2, topk_group=1, num_experts_per_tok=2,
        n_shared_experts=1, routed_scaling_factor=2.5, rope_theta=10000.0, max_position_embeddings=4096,
        model_type="deepseek_v32", index_n_heads=2, index_head_dim=128, index_topk=6))
    model = DeepseekForCausalLM.random(config, seed=3, dtype=torch.float64)
    for seed in (1, 2, 15, 22, 24, 29):
        tokens = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(seed)).tolist()
        cold = Engine(model, PagePool(config, 32, page_size=4)).run([Request(tokens, 4)])[0]
        engine = Engine(model, PagePool(config, 32, page_size=4))
        engine.run([Request(tokens[:24], 1)])
        [warm] = engine.run([Request(tokens, 4)])
        assert warm.stats.device_hit_tokens == 24
        assert warm.output_ids == cold.output_ids, f"seed {seed}"
