"""The bundled DeepSeek V3/V3.2 decode engine (issue 3).

Model side, one concept per module:

    config.py    ModelConfig from a HF config.json (V3, or V3.2 with the DSA indexer)
    cache.py     SequenceCache: the model's only memory (latent, interleaved rope key, indexer key)
    model.py     DeepseekForCausalLM: forward(token_ids [T], positions [T], cache) -> logits [T, vocab];
                 forward_decode(token_ids [B], positions [B], caches) -> logits [B, vocab], batched
    mla.py       absorbed Multi-head Latent Attention over the cached 512-wide latent
    indexer.py   the V3.2 lightning indexer (top-k token selection)
    moe.py       grouped top-k sigmoid router, routed and shared experts
    rope.py      RoPE / YaRN frequencies, interleaved and half-split rotations
    weights.py   HF safetensors loading by tensor name

Engine side (the model above runs unchanged over a paged cache):

    namespace.py       the store Namespace of the bytes this engine produces (namespace_for)
    fingerprint.py     weights_fingerprint: the weights' part of that namespace
    page_allocator.py  page ids: reference counts, prefix-cache index, LRU eviction with a hook
    paged_cache.py     PagePool (the device tier; connectors.base.PageBytes) and PagedSequenceCache
    sequence.py        Request, RequestStats, RequestOutput, and the Sequence carried through a step
    block_manager.py   a sequence's pages: device prefix reuse, the connector path, commit, release
    scheduler.py       admission, chunked prefill, decode, preemption
    sampling.py        greedy / seeded temperature sampling
    engine.py          Engine: step() = schedule, run the model (decodes batched), post-process; generate()
    tokenizer.py       ByteTokenizer for demos

HF transformers is the oracle in the tests; it is not a runtime dependency. The engine imports
from ``connectors``/``kvstore`` (downwards) and never the other way round.
"""
