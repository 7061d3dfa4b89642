"""AccountingTier: the books of a tier without its bytes (used by trace replay)."""

import numpy as np
import pytest

from kvstore.errors import InvalidRequest
from kvstore.tiers.accounting import AccountingTier
from kvstore.tiers.base import BlockMeta


def test_capacity_is_enforced_and_space_comes_back():
    tier = AccountingTier("ram", 300)
    meta = BlockMeta(100, 1, ())
    assert all(tier.write(bytes([i]) * 32, np.empty(0, np.uint8), meta) for i in range(3))
    assert not tier.write(b"x" * 32, np.empty(0, np.uint8), meta) and not tier.can_fit(100)
    assert tier.remove(bytes([0]) * 32) and not tier.remove(bytes([0]) * 32)
    assert tier.can_fit(100) and tier.used_bytes == 200 and tier.stats().blocks == 2
    tier.check_integrity()


def test_read_reports_presence_and_leaves_the_buffer_alone():
    tier = AccountingTier("ram", 1000)
    tier.write(b"k" * 32, np.empty(0, np.uint8), BlockMeta(10, 1, (), b"p" * 32))
    dst = np.full(10, 7, np.uint8)
    assert tier.read(b"k" * 32, dst) and (dst == 7).all() and not tier.read(b"q" * 32, dst)
    assert tier.meta(b"k" * 32).parent == b"p" * 32 and [k for k, _ in tier.items()] == [b"k" * 32]


def test_zero_capacity_is_refused():
    with pytest.raises(InvalidRequest, match="positive capacity"):
        AccountingTier("ram", 0)
