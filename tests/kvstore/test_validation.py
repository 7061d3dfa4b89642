"""The store's input checks as pure functions (the store-level narratives are in test_store_faults.py)."""

import pytest

from kvstore.errors import InvalidRequest
from kvstore.validation import check_chain, check_hashes, closes_loop


def h(i: int) -> bytes:
    return i.to_bytes(16, "little")


def test_hashes_must_be_16_byte_digests():
    check_hashes([h(1), h(2)])
    with pytest.raises(InvalidRequest, match="16-byte digests"):
        check_hashes([h(1), b"short"])


def test_a_chain_may_not_repeat_a_block_or_contain_its_parent():
    check_chain([h(1), h(2)], h(0))
    for blocks, parent in (([h(1), h(1)], None), ([h(1), h(2)], h(2))):
        with pytest.raises(InvalidRequest, match="must be distinct"):
            check_chain(blocks, parent)


def walk(parents: dict[bytes, bytes | None], orphans: set[bytes], new: set[bytes], parent: bytes) -> bool:
    return closes_loop(new, parent, orphans.__contains__, lambda key: parents.get(key))


def test_a_new_block_that_a_resident_descendant_names_as_parent_closes_a_loop():
    # resident: 3 -> 2 -> 1 (1's parent is 9, not resident); new block 9 under parent 3
    parents = {h(3): h(2), h(2): h(1), h(1): h(9)}
    assert walk(parents, {h(9)}, {h(9)}, h(3))
    assert not walk(parents, {h(9)}, {h(8)}, h(3)), "another new block: no loop"


def test_without_resident_children_there_is_no_walk():
    def parent_of(key):
        raise AssertionError("walked although no resident block names a new one as parent")
    assert not closes_loop({h(9)}, h(3), lambda key: False, parent_of)


def test_a_walk_ends_at_a_head_and_at_an_existing_loop():
    assert not walk({h(2): h(1), h(1): None}, {h(9)}, {h(9)}, h(2))
    assert not walk({h(2): h(1), h(1): h(2)}, {h(9)}, {h(9)}, h(2))
