"""Fixtures of the tier tests."""

from __future__ import annotations

import contextlib

import pytest

from kvstore.tiers.disk import DiskTier
from tests.kvstore.tiers.disk_helpers import FP
from tests.kvstore.tiers.tmpfs import mounted_tmpfs


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


@pytest.fixture
def small_tmpfs(tmp_path):
    """Factory: a real tmpfs of the given size under ``tmp_path``; every one is unmounted after."""
    with contextlib.ExitStack() as mounts:
        yield lambda size_bytes: mounts.enter_context(mounted_tmpfs(str(tmp_path / f"tmpfs-{size_bytes}"),
                                                                    size_bytes))
