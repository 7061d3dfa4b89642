"""kvstore._chain, the C loop of the prefix hash chain: its own argument checks. Its digests are
pinned by the golden vectors in test_keys.py, which run on both loops."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore import keys

pytestmark = pytest.mark.skipif(not keys.native_hashing(), reason="kvstore._chain is not built (needs gcc and libxxhash-dev)")


def test_rejects_a_seed_that_is_not_a_digest():
    from kvstore import _chain

    with pytest.raises(ValueError, match="prev must be 16 bytes"):
        _chain.chain_digests(bytes(15), np.zeros(64, "<u4"), 64)


@pytest.mark.parametrize("count, block_size", [(65, 64), (64, 0), (64, -1)])
def test_rejects_tokens_that_are_not_whole_blocks(count, block_size):
    from kvstore import _chain

    with pytest.raises(ValueError, match="whole blocks"):
        _chain.chain_digests(bytes(16), np.zeros(count, "<u4"), block_size)


def test_no_tokens_give_no_digests():
    from kvstore import _chain

    assert _chain.chain_digests(bytes(16), np.zeros(0, "<u4"), 64) == []


def test_rejects_non_contiguous_buffers():
    from kvstore import _chain

    with pytest.raises((BufferError, TypeError, ValueError)):
        _chain.chain_digests(bytes(16), np.zeros(256, "<u4")[::2], 64)
