"""ContiguousCache: the SequenceCache contract the model relies on."""

from __future__ import annotations

import pytest
import torch

from engine_adapter.cache import ContiguousCache


def tokens(n: int, start: float = 0.0):
    latent = torch.arange(n * 512, dtype=torch.float32).view(n, 512) + start  # [n, 512]
    return latent, latent[:, :64] * 2, latent[:, :128] * 3  # rope [n, 64], indexer [n, 128]


def test_append_read_and_length_across_layers():
    cache = ContiguousCache(2, with_indexer=True)
    assert cache.length == 0
    cache.append(0, *tokens(3))
    assert cache.length == 0 and cache.layer_length(0) == 3  # layer 1 has not caught up
    cache.append(1, *tokens(3))
    cache.append(0, *tokens(2, start=1e6))
    cache.append(1, *tokens(2, start=1e6))
    assert cache.length == 5
    latent, rope_key, indexer_key = cache.read(0)
    assert latent.shape == (5, 512) and rope_key.shape == (5, 64) and indexer_key.shape == (5, 128)
    assert torch.equal(latent[3:], tokens(2, start=1e6)[0])


def test_append_keeps_its_own_copy():
    cache = ContiguousCache(1)
    latent, rope_key, _ = tokens(2)
    cache.append(0, latent, rope_key, None)
    latent.zero_()
    assert cache.read(0).latent.abs().sum() > 0 and cache.read(0).indexer_key is None


def test_caller_mistakes():
    cache = ContiguousCache(1, with_indexer=False)
    latent, rope_key, indexer_key = tokens(2)
    with pytest.raises(ValueError, match="with_indexer=False"):
        cache.append(0, latent, rope_key, indexer_key)
    with pytest.raises(ValueError, match="same tokens"):
        cache.append(0, latent, rope_key[:1], None)
    with pytest.raises(IndexError, match="out of range"):
        cache.append(1, latent, rope_key, None)
    with pytest.raises(ValueError, match="empty"):
        cache.read(0)
    with pytest.raises(ValueError, match="with_indexer=True"):
        ContiguousCache(1, with_indexer=True).append(0, latent, rope_key, None)
