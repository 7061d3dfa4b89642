"""PagePool geometry and bytes, and PagedSequenceCache against the contiguous reference."""

from __future__ import annotations

import pytest
import torch

from engine_adapter.config import ModelConfig
from engine_adapter.namespace import namespace_for
from engine_adapter.paged_cache import PagedSequenceCache, PagePool
from kvstore.layout import BlockSpec
from kvstore.quant import pack_indexer_bf16, pack_mla_bf16
from tests.engine_adapter.engine_helpers import Bf16ContiguousCache
from tests.engine_adapter.hf_oracle import TINY_V3, TINY_V32, prompt, rel_err

V3 = ModelConfig.from_hf(TINY_V3)
V32 = ModelConfig.from_hf(TINY_V32)
P = 4  # tokens per page


def entries(n: int, seed: int, with_indexer: bool):
    g = torch.Generator().manual_seed(seed)
    latent, rope = torch.randn(n, 512, generator=g), torch.randn(n, 64, generator=g)  # float32
    return latent, rope, (torch.randn(n, 128, generator=g) if with_indexer else None)


@pytest.mark.parametrize("config", [V3, V32], ids=["v3", "v32"])
def test_layer_bytes_match_the_store_layout(config):
    pool = PagePool(config, num_pages=5, page_size=P)
    spec = BlockSpec.of(namespace_for(config, "m", block_size=P))
    assert pool.layer_bytes == spec.layer_bytes == P * (1152 + (256 if config.is_v32 else 0))
    assert pool.storage[0].shape == (5, spec.layer_bytes) and pool.mla[0].shape == (5, P, 576)
    assert pool.mla[0].dtype == torch.bfloat16
    assert pool.layer_page_bytes(2, 3).data_ptr() == pool.storage[2][3].data_ptr()


@pytest.mark.parametrize("split", [(448, 128), (320, 256), (256, 64)])
def test_a_model_caching_another_latent_and_rope_split_is_refused(split):
    """mla_bf16 is 512 latent values then 64 rope values: another split of the same 576 values
    would be read wrongly by every other reader of the format."""
    with pytest.raises(ValueError, match="512 \\+ 64"):
        PagePool(ModelConfig.from_hf(dict(TINY_V3, kv_lora_rank=split[0], qk_rope_head_dim=split[1])), 5, page_size=P)


@pytest.mark.parametrize("config", [V3, V32], ids=["v3", "v32"])
def test_a_page_is_one_layer_of_a_block_payload_byte_for_byte(config):
    """Pages [3, 1] hold positions [0, 4) and [4, 8): each is the store's component pages, in order."""
    pool = PagePool(config, num_pages=5, page_size=P)
    cache = PagedSequenceCache(pool, [3, 1], dtype=torch.float32)
    latent, rope, indexer = entries(2 * P, seed=0, with_indexer=config.is_v32)
    for layer in range(config.num_hidden_layers):
        cache.append(layer, latent[:5], rope[:5], None if indexer is None else indexer[:5])
        cache.append(layer, latent[5:], rope[5:], None if indexer is None else indexer[5:])
    spec = BlockSpec.of(namespace_for(config, "m", block_size=P))
    for block, page in enumerate([3, 1]):
        rows = slice(block * P, (block + 1) * P)
        expected = [pack_mla_bf16(latent[rows], rope[rows]).flatten()]
        if config.is_v32:
            expected.append(pack_indexer_bf16(indexer[rows]).flatten())
        expected = torch.cat(expected)
        offset, length = spec.component_range(1, "mla_bf16")
        assert length == P * 1152 and offset == spec.layer_bytes  # layer 1 starts one layer in
        assert torch.equal(pool.layer_page_bytes(1, page), expected)


def test_append_read_across_pages_in_compute_dtype():
    pool = PagePool(V32, num_pages=4, page_size=P)
    reads = []
    cache = PagedSequenceCache(pool, [2, 0], dtype=torch.float32, before_read=reads.append)
    latent, rope, indexer = entries(6, seed=1, with_indexer=True)
    for layer in range(3):
        cache.append(layer, latent[:3], rope[:3], indexer[:3])
        cache.append(layer, latent[3:], rope[3:], indexer[3:])  # crosses into page 0
        assert cache.length == (6 if layer == 2 else 0)
    got = cache.read(1)
    assert reads == [1] and got.latent.dtype == torch.float32 and got.latent.shape == (6, 512)
    bf16 = lambda t: t.to(torch.bfloat16).float()
    assert torch.equal(got.latent, bf16(latent)) and torch.equal(got.rope_key, bf16(rope))
    assert torch.equal(got.indexer_key, bf16(indexer))
    assert torch.equal(pool.mla[1][0, 1, :512], latent[5].to(torch.bfloat16))  # position 5 = page 0, slot 1
    cache.truncate(4)
    assert cache.length == 4 and cache.read(0).latent.shape == (4, 512)


def test_a_reused_prefix_is_not_rewritten():
    """length=P: the first page is a hit; appends start at position P, in the second page."""
    pool = PagePool(V3, num_pages=3, page_size=P)
    pool.mla[0][1] = 7.0
    cache = PagedSequenceCache(pool, [1, 2], length=P, dtype=torch.float32)
    latent, rope, _ = entries(2, seed=2, with_indexer=False)
    cache.append(0, latent, rope, None)
    got = cache.read(0)
    assert got.latent.shape == (P + 2, 512) and (got.latent[:P] == 7.0).all()
    assert torch.equal(got.latent[P:], latent.to(torch.bfloat16).float())


def test_caller_mistakes():
    pool = PagePool(V3, num_pages=3, page_size=P)
    cache = PagedSequenceCache(pool, [0])
    latent, rope, indexer = entries(P + 1, seed=3, with_indexer=True)
    with pytest.raises(ValueError, match="need 2 pages, the block table has 1"):
        cache.append(0, latent, rope, None)
    with pytest.raises(ValueError, match="indexer"):
        cache.append(0, latent[:1], rope[:1], indexer[:1])
    with pytest.raises(ValueError, match="empty"):
        cache.read(0)
    with pytest.raises(ValueError, match="exceeds"):
        PagedSequenceCache(pool, [0], length=P + 1)


@pytest.mark.parametrize("pair_name", ["v3", "v32"])
def test_paged_forward_equals_contiguous_bf16_forward(pair_name, request):
    """Prefill in two calls, then decode steps: paged and contiguous (bf16-rounded) logits agree."""
    model = request.getfixturevalue(pair_name).ours
    config = model.config
    token_ids = prompt(40)  # V3.2: past index_topk (16), so the indexer keys matter
    pool = PagePool(config, num_pages=12, page_size=P)
    paged = PagedSequenceCache(pool, [7, 3, 11, 0, 5, 1, 2, 4, 6, 8, 9], dtype=torch.float32)
    reference = Bf16ContiguousCache(config.num_hidden_layers, with_indexer=config.is_v32)
    for start, end in [(0, 21), (21, 37), (37, 38), (38, 39), (39, 40)]:
        positions = torch.arange(start, end)
        ours = model(token_ids[start:end], positions, paged)
        ref = model(token_ids[start:end], positions, reference)
        assert rel_err(ours, ref) < 1e-5
    assert paged.length == 40
    for layer in range(config.num_hidden_layers):
        assert torch.equal(paged.read(layer).latent, reference.read(layer).latent)
