"""Fixtures of the tier tests."""

from __future__ import annotations

import pytest

from kvstore.tiers.disk import DiskTier
from tests.kvstore.tiers.disk_helpers import FP


@pytest.fixture
def open_tier(tmp_path):
    """Factory for disk tiers; every tier still open at the end is closed."""
    made: list[DiskTier] = []

    def make(path=None, capacity: int = 64 << 20, segment_bytes: int = 8 * FP, **kw) -> DiskTier:
        tier = DiskTier(str(path or tmp_path / "disk"), capacity, segment_bytes=segment_bytes, **kw)
        made.append(tier)
        return tier

    yield make
    for tier in made:
        tier.close()
