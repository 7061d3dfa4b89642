"""HF transformers as the oracle: tiny DeepSeek checkpoints with the REAL MLA widths.

Every model keeps kv_lora_rank 512 and qk_rope_head_dim 64 (the cache widths the store handles)
and shrinks everything else. ``build_hf`` seeds, builds and perturbs the HF model so that norms
and the router's correction bias are not at their trivial init; ``save_pretrained`` writes the
checkpoint our engine loads. ``hf_prefill`` returns HF's logits and cache contents for one prompt.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, DeepseekV32Config, DeepseekV32ForCausalLM

from kvstore.quant import hf_rope_to_interleaved

TINY_V3 = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
    num_hidden_layers=3, first_k_dense_replace=1,  # one dense layer, two MoE layers
    num_attention_heads=4, kv_lora_rank=512, qk_rope_head_dim=64, q_lora_rank=32,
    qk_nope_head_dim=32, v_head_dim=32,
    n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=2, n_shared_experts=1,
    routed_scaling_factor=2.5, max_position_embeddings=512, initializer_range=0.1,
)
# 16 indexer heads make exact ties (every head's relu at 0) vanishingly rare; ties would make the
# top-k choice depend on the sort implementation rather than on the model.
TINY_V32 = dict(TINY_V3, index_topk=16, index_n_heads=16, index_head_dim=128)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 64,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.707}


class HFPrefill(NamedTuple):
    logits: torch.Tensor  # [T, vocab]
    latents: list[torch.Tensor]  # per layer [T, 512]
    rope_keys: list[torch.Tensor]  # per layer [T, 64], converted to interleaved
    indexer_keys: list[torch.Tensor] | None  # per layer [T, 128] (V3.2)


def build_hf(seed: int = 0, v32: bool = False, **overrides):
    """A seeded, perturbed, eval-mode HF model in float32."""
    fields = dict(TINY_V32 if v32 else TINY_V3, **overrides)
    torch.manual_seed(seed)
    model = (DeepseekV32ForCausalLM(DeepseekV32Config(**fields)) if v32
             else DeepseekV3ForCausalLM(DeepseekV3Config(**fields)))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.mul_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith("norm.bias"):
                p.add_(0.1 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn_like(b))
    return model.float().eval()


def hf_prefill(model, token_ids: torch.Tensor) -> HFPrefill:
    """token_ids [T] -> HF logits and per-layer cache contents (batch of one)."""
    with torch.no_grad():
        out = model(token_ids[None], use_cache=True)
    layers = out.past_key_values.layers
    indexer = [layer.indexer_keys[0] for layer in layers] if hasattr(layers[0], "indexer_keys") else None
    return HFPrefill(
        logits=out.logits[0],
        latents=[layer.keys[0, 0] for layer in layers],
        rope_keys=[hf_rope_to_interleaved(layer.values[0, 0]) for layer in layers],
        indexer_keys=indexer,
    )


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest absolute difference relative to the reference's largest magnitude."""
    return ((ours.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def prompt(length: int, seed: int = 1, vocab: int = 256) -> torch.Tensor:
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(seed))
