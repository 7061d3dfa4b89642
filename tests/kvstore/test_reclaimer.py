"""Reclaimer: a wake has every tier reclaim on the reclaimer's thread; a failing tier is logged,
never the end of the thread; close stops it. Real disk tiers in a temp dir."""

from __future__ import annotations

import threading

import pytest

from kvstore.reclaimer import Reclaimer
from kvstore.tiers.disk import DiskTier
from tests.kvstore.store_helpers import until
from tests.kvstore.tiers.disk_helpers import key_of, put


@pytest.fixture
def open_tier():
    made = []

    def make(path):
        made.append(DiskTier(str(path), 64 << 20))
        return made[-1]

    yield make
    for tier in made:
        tier.close()


def pending(tier) -> bool:
    return bool(tier._unindexed or tier._holes)


def test_a_wake_reclaims_every_tier_off_the_callers_thread(open_tier, tmp_path):
    tiers = [open_tier(tmp_path / "a"), open_tier(tmp_path / "b")]
    for tier in tiers:
        assert put(tier, 1) and tier.discard(key_of(1)) and pending(tier)
    reclaimer = Reclaimer(tiers)
    assert not any(t.name == "kvstore-reclaim" for t in threading.enumerate())  # started by the first wake
    reclaimer.wake()
    assert until(lambda: not any(pending(tier) for tier in tiers), 10)
    reclaimer.close()
    assert not any(t.name == "kvstore-reclaim" for t in threading.enumerate())
    reclaimer.close()  # idempotent


def test_a_tier_whose_reclaim_fails_does_not_stop_the_next_one(open_tier, tmp_path, monkeypatch, caplog):
    failing, healthy = open_tier(tmp_path / "a"), open_tier(tmp_path / "b")
    for tier in (failing, healthy):
        assert put(tier, 1) and tier.discard(key_of(1))
    real = failing.reclaim
    calls = []

    def fails_once():
        calls.append(1)
        if len(calls) == 1:
            raise OSError("injected: the device went away")
        real()

    monkeypatch.setattr(failing, "reclaim", fails_once)
    reclaimer = Reclaimer([failing, healthy])
    try:
        reclaimer.wake()
        assert until(lambda: not pending(healthy), 10)
        assert pending(failing) and "reclaiming discarded space failed" in caplog.text
        reclaimer.wake()  # the thread lives on
        assert until(lambda: not pending(failing), 10)
    finally:
        reclaimer.close()
