"""One variable-size object per fixed-size block: round trips, and every kind of bad block refused."""

from __future__ import annotations

import numpy as np
import pytest

from connectors.lmcache import framing
from connectors.lmcache.framing import HEADER_BYTES, CorruptObject, ObjectMeta, key_digest

KEY = "deepseek-ai/DeepSeek-V3@1@0@-520fcff2946d4d52@bfloat16"
META = ObjectMeta(((1, 2, 3, 576),), ("bfloat16",), "KV_MLA_FMT")
BLOCK_BYTES = HEADER_BYTES + 2 * 4 * 1152  # room for 4 tokens of 2 layers


def framed(payload: np.ndarray, key: str = KEY) -> np.ndarray:
    block = np.full(BLOCK_BYTES, 0xEE, np.uint8)  # stale bytes of an earlier object
    framing.frame(block, key_digest(key), payload, META)
    return block


def payload(nbytes: int = 2 * 3 * 1152) -> np.ndarray:
    return np.random.default_rng(7).integers(0, 256, nbytes, dtype=np.uint8)


def test_the_block_hash_is_xxh3_128_of_the_key_string():
    assert key_digest(KEY).hex() == "f81f8f8be0036ffae2e457555f5b56dc"  # pinned: a change orphans every cache
    assert len(key_digest(KEY)) == 16 and key_digest(KEY) != key_digest(KEY + "@tag%x")


def test_a_smaller_object_round_trips_with_its_metadata_and_zeros_after_it():
    data = payload()
    block = framed(data)
    header = framing.read_header(block, key_digest(KEY))
    assert header.meta == META and header.nbytes == data.nbytes
    assert np.array_equal(framing.body(block, header), data)
    assert not block[HEADER_BYTES + data.nbytes :].any(), "no stale bytes from an earlier object"
    copy = framing.body(block, header).copy()
    framing.verify(copy, header)


def test_a_full_block_object_fits_exactly():
    data = payload(BLOCK_BYTES - HEADER_BYTES)
    header = framing.read_header(framed(data), key_digest(KEY))
    assert header.nbytes == BLOCK_BYTES - HEADER_BYTES


def test_an_object_larger_than_the_block_is_refused_before_anything_is_written():
    block = np.zeros(BLOCK_BYTES, np.uint8)
    with pytest.raises(ValueError, match="does not fit a"):
        framing.frame(block, key_digest(KEY), payload(BLOCK_BYTES), META)
    assert not block.any()


@pytest.mark.parametrize("damage, message", [
    (lambda b: b.__setitem__(slice(0, 8), 0), "no framed object"),
    (lambda b: b.__setitem__(20, b[20] ^ 1), "frames key"),
    (lambda b: b.__setitem__(slice(24, 32), 255), "cannot sit in"),
    (lambda b: b.__setitem__(slice(44, 46), ord("!")), "unreadable object metadata"),
])
def test_a_damaged_header_is_refused(damage, message):
    block = framed(payload())
    damage(block)
    with pytest.raises(CorruptObject, match=message):
        framing.read_header(block, key_digest(KEY))


def test_a_block_of_another_key_is_refused():
    with pytest.raises(CorruptObject, match="frames key"):
        framing.read_header(framed(payload(), key="another@1@0@1@bfloat16"), key_digest(KEY))


def test_a_changed_or_short_copy_fails_verification():
    block = framed(payload())
    header = framing.read_header(block, key_digest(KEY))
    copy = framing.body(block, header).copy()
    copy[100] ^= 1
    with pytest.raises(CorruptObject, match="checksum"):
        framing.verify(copy, header)
    with pytest.raises(CorruptObject, match="where the header says"):
        framing.verify(framing.body(block, header)[:-1].copy(), header)
