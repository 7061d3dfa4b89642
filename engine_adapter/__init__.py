"""The bundled DeepSeek V3/V3.2 decode engine (issue 3).

Model side, one concept per module:

    config.py    ModelConfig from a HF config.json (V3, or V3.2 with the DSA indexer)
    cache.py     SequenceCache: the model's only memory (latent, interleaved rope key, indexer key)
    model.py     DeepseekForCausalLM: forward(token_ids [T], positions [T], cache) -> logits [T, vocab]
    mla.py       absorbed Multi-head Latent Attention over the cached 512-wide latent
    indexer.py   the V3.2 lightning indexer (top-k token selection)
    moe.py       grouped top-k sigmoid router, routed and shared experts
    rope.py      RoPE / YaRN frequencies, interleaved and half-split rotations
    weights.py   HF safetensors loading by tensor name

HF transformers is the oracle in the tests; it is not a runtime dependency. The engine imports
from ``connectors``/``kvstore`` (downwards) and never the other way round.
"""
