"""``Tier.reserve``: room set aside for one write counts as used until that write takes it or
``unreserve`` gives it back, on every tier that keeps bytes or books (host, disk, accounting).
Each tier here holds exactly two blocks."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.tiers.accounting import AccountingTier
from kvstore.tiers.host import HostTier
from tests.kvstore.tiers.disk_helpers import FP, NBYTES, key_of, meta_of, payload_of, put

HOST_BYTES = 64 << 10  # one page of slots of 24 KiB: room for two NBYTES blocks, not three


def host(tmp_path, open_tier):
    return HostTier(HOST_BYTES, page_bytes=HOST_BYTES, shm_dir=str(tmp_path))


def disk(tmp_path, open_tier):
    return open_tier(capacity=2 * FP)


def accounting(tmp_path, open_tier):
    return AccountingTier("ram", 2 * NBYTES)


@pytest.fixture(params=[host, disk, accounting])
def tier(request, tmp_path, open_tier):
    made = request.param(tmp_path, open_tier)
    yield made
    if isinstance(made, HostTier):
        made.close()


def test_reserved_room_is_kept_for_its_own_write(tier):
    assert tier.reserve(key_of(1), NBYTES) and tier.reserve(key_of(2), NBYTES)
    assert not tier.can_fit(NBYTES) and not tier.reserve(key_of(3), NBYTES)
    assert not put(tier, 3), "a write without a reservation took reserved room"
    tier.check_integrity()
    assert put(tier, 1) and put(tier, 2)
    assert tier.stats().blocks == 2 and not tier.can_fit(NBYTES)
    tier.check_integrity()


def test_unreserve_gives_the_room_back_and_is_a_no_op_after_the_write(tier):
    empty = tier.used_bytes
    assert tier.reserve(key_of(1), NBYTES) and tier.reserve(key_of(2), NBYTES)
    assert tier.used_bytes > empty
    tier.unreserve(key_of(2))
    assert tier.can_fit(NBYTES)
    assert put(tier, 1)
    tier.unreserve(key_of(1))  # the write took it: the block's room stays counted
    tier.unreserve(key_of(9))  # never reserved
    assert tier.can_fit(NBYTES) and put(tier, 3) and not tier.can_fit(NBYTES)
    assert tier.stats().blocks == 2
    tier.check_integrity()


def test_a_failed_reservation_sets_nothing_aside(tier):
    assert put(tier, 1) and put(tier, 2)
    assert not tier.reserve(key_of(3), NBYTES)
    used = tier.used_bytes
    assert tier.remove(key_of(1))
    assert tier.used_bytes < used and put(tier, 3)
    tier.check_integrity()


def test_a_reserved_host_slot_is_the_one_written(tmp_path):
    tier = HostTier(HOST_BYTES, page_bytes=HOST_BYTES, shm_dir=str(tmp_path))
    try:
        assert tier.reserve(key_of(1), NBYTES)
        reserved = tier._reserved[key_of(1)]
        assert put(tier, 2)  # the other slot
        assert put(tier, 1) and tier.slot_of(key_of(1))[0] == reserved
        dst = np.empty(NBYTES, np.uint8)
        assert tier.read(key_of(1), dst) and np.array_equal(dst, payload_of(1))
        assert tier.read(key_of(2), dst) and np.array_equal(dst, payload_of(2))
        tier.check_integrity()
    finally:
        tier.close()


def test_a_host_copy_that_raises_frees_its_slot(tmp_path):
    tier = HostTier(HOST_BYTES, page_bytes=HOST_BYTES, shm_dir=str(tmp_path))
    try:
        good = payload_of(1)
        floats = np.zeros(NBYTES // 8, np.float64)  # the right size, but no safe cast to bytes: copyto raises
        for reserved in (False, True):
            if reserved:
                assert tier.reserve(key_of(1), NBYTES)
            with pytest.raises(TypeError):
                tier.write(key_of(1), floats, meta_of(good))
            tier.unreserve(key_of(1))  # what the store does after a raise: nothing left to give back
            assert tier.used_bytes == 0 and not tier.contains(key_of(1))
            tier.check_integrity()
        assert put(tier, 1) and put(tier, 2)
    finally:
        tier.close()
