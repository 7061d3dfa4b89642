"""DeepSeek-V3: our absorbed-MLA engine against HF transformers, and cached prefill against full."""

from __future__ import annotations

import pytest
import torch

from engine_adapter.config import YarnScaling
from engine_adapter.model import DeepseekForCausalLM
from tests.engine_adapter.conftest import make_pair
from tests.engine_adapter.hf_oracle import YARN, hf_prefill, prompt, rel_err

T = 48


def run(model: DeepseekForCausalLM, token_ids: torch.Tensor, cache=None, start: int = 0):
    """Feed token_ids at positions start.. into cache (a new one by default) -> (logits, cache)."""
    cache = model.new_cache() if cache is None else cache
    positions = torch.arange(start, start + token_ids.numel())
    return model(token_ids, positions, cache), cache


def assert_matches_hf(pair, token_ids: torch.Tensor) -> None:
    ref = hf_prefill(pair.hf, token_ids)
    logits, cache = run(pair.ours, token_ids)
    assert rel_err(logits, ref.logits) < 1e-4
    for layer in range(pair.ours.config.num_hidden_layers):
        cached = cache.read(layer)
        assert rel_err(cached.latent, ref.latents[layer]) < 1e-5
        assert rel_err(cached.rope_key, ref.rope_keys[layer]) < 1e-5  # HF order converted to interleaved
        assert cached.indexer_key is None


def test_prefill_logits_and_cache_match_hf(v3):
    assert not v3.ours.config.is_v32
    assert_matches_hf(v3, prompt(T))


def test_direct_q_proj_matches_hf(tmp_path_factory):
    """q_lora_rank None: queries come from one q_proj instead of q_a_proj / q_b_proj."""
    pair = make_pair(tmp_path_factory, "v3_q_proj", q_lora_rank=None)
    assert pair.ours.config.q_lora_rank is None and hasattr(pair.ours.model.layers[0].self_attn, "q_proj")
    assert_matches_hf(pair, prompt(T))


def test_yarn_rope_scaling_matches_hf(tmp_path_factory):
    """YaRN frequencies, the cos/sin attention factor and the softmax mscale all agree with HF."""
    pair = make_pair(tmp_path_factory, "v3_yarn", rope_parameters=dict(YARN))
    yarn = pair.ours.config.rope_scaling
    assert isinstance(yarn, YarnScaling) and yarn.factor == 8.0 and yarn.mscale_all_dim == 0.707
    hf_rotary = pair.hf.model.rotary_emb
    assert torch.equal(pair.ours.inv_freq, hf_rotary.inv_freq)
    assert pair.ours.attention_factor == pytest.approx(hf_rotary.attention_scaling) != 1.0
    hf_scale = pair.hf.model.layers[0].self_attn.scaling
    assert pair.ours.model.layers[0].self_attn.scale == pytest.approx(hf_scale)
    assert_matches_hf(pair, torch.cat([prompt(100), prompt(100, seed=2)]))  # past original_max (64)


def test_prefix_then_suffix_then_decode_equals_full_prefill(v3):
    token_ids = prompt(T + 4)
    full, _ = run(v3.ours, token_ids)
    prefix, cache = run(v3.ours, token_ids[:20])
    suffix, cache = run(v3.ours, token_ids[20:T], cache, start=20)
    steps = [run(v3.ours, token_ids[p : p + 1], cache, start=p)[0] for p in range(T, T + 4)]
    incremental = torch.cat([prefix, suffix, *steps])
    assert cache.length == T + 4
    assert rel_err(incremental, full) < 1e-5


def test_decode_from_an_empty_cache_token_by_token(v3):
    token_ids = prompt(12, seed=3)
    full, full_cache = run(v3.ours, token_ids)
    cache = v3.ours.new_cache()
    steps = torch.cat([run(v3.ours, token_ids[p : p + 1], cache, start=p)[0] for p in range(12)])
    assert rel_err(steps, full) < 1e-5
    assert rel_err(cache.read(2).latent, full_cache.read(2).latent) < 1e-6


def test_bfloat16_runs_close_to_float32(v3):
    """bf16 weights (router bias kept in float32, as HF does) track the float32 logits."""
    bf16 = DeepseekForCausalLM.from_pretrained(v3.directory, dtype=torch.bfloat16)
    assert bf16.dtype == torch.bfloat16
    assert bf16.model.layers[1].mlp.gate.e_score_correction_bias.dtype == torch.float32
    token_ids = prompt(T)
    logits, cache = run(bf16, token_ids)
    assert logits.dtype == torch.bfloat16 and cache.read(0).latent.dtype == torch.bfloat16
    assert rel_err(logits, run(v3.ours, token_ids)[0]) < 0.1


def test_positions_only_rotate_the_cache_stays_in_call_order(v3):
    """The same tokens at other absolute positions give other rope keys but the same latents."""
    token_ids = prompt(8)
    _, at_zero = run(v3.ours, token_ids)
    shifted = v3.ours.new_cache()
    v3.ours(token_ids, torch.arange(100, 108), shifted)
    assert torch.equal(shifted.read(0).latent, at_zero.read(0).latent)
    assert not torch.allclose(shifted.read(0).rope_key, at_zero.read(0).rope_key)


def test_rejects_malformed_inputs(v3):
    with pytest.raises(ValueError, match=r"\[T\]"):
        v3.ours(torch.arange(4)[None], torch.arange(4)[None], v3.ours.new_cache())
    with pytest.raises(ValueError, match=r"\[T\]"):
        v3.ours(torch.arange(4), torch.arange(3), v3.ours.new_cache())
