"""Room a put made is its own: the store reserves it (``Tier.reserve``) in the same holding of its
lock that made it, so a second put that arrives while the first is still writing makes room of
its own instead of taking the first one's, and no write finds its tier full.

Each store has one tier, full with a 4-block chain; the first put's write waits on an event."""

from __future__ import annotations

import threading

import pytest

from kvstore.keys import namespace_hashes
from tests.kvstore.store_helpers import DISK_BLOCK, SLOTS4, host_resident, put_chain, tokens
from tests.kvstore.test_store_lock_io import in_thread

TIERS = {"host": dict(SLOTS4, disk_bytes=None), "disk": dict(host_bytes=None, disk_bytes=4 * DISK_BLOCK)}


class StuckWrites:
    """Record every write of ``tier`` and whether it stored; the write of ``stuck_key`` waits
    until ``release()`` (``started`` is set when it begins)."""

    def __init__(self, tier, stuck_key: bytes, monkeypatch):
        self.started, self._go = threading.Event(), threading.Event()
        self.results: list[tuple[bytes, bool]] = []
        write = tier.write

        def recorded(key, payload, meta):
            if key == stuck_key:
                self.started.set()
                assert self._go.wait(30), "the stuck write was never released"
            stored = write(key, payload, meta)
            self.results.append((key, stored))
            return stored

        monkeypatch.setattr(tier, "write", recorded)

    def release(self) -> None:
        self._go.set()


@pytest.mark.parametrize("tier_name", sorted(TIERS))
def test_a_put_during_another_puts_write_makes_its_own_room(make_store, namespace, spec, monkeypatch, tier_name):
    store = make_store(**TIERS[tier_name])
    ns_id = store.register_namespace(namespace)
    chain = namespace_hashes(namespace, tokens(0, 4))
    put_chain(store, ns_id, spec, chain)
    tier = store.tiers[0]
    first, second = (namespace_hashes(namespace, tokens(start, 1)) for start in (1000, 2000))
    writes = StuckWrites(tier, ns_id + first[0], monkeypatch)
    putter = in_thread(put_chain, store, ns_id, spec, first)
    try:
        assert writes.started.wait(10), "the first put did not reach its write"
        assert store.stats().tiers[0].evictions == 1  # the first put's room: the chain's tail
        _, result = put_chain(store, ns_id, spec, second)
        assert result.stored == 1
        assert store.stats().tiers[0].evictions == 2, "the second put took the first one's room"
    finally:
        writes.release()
        putter.join(30)
    assert not putter.is_alive()
    assert writes.results == [(ns_id + second[0], True), (ns_id + first[0], True)], "a write found its tier full"
    assert [tier.contains(ns_id + h) for h in chain] == [True, True, False, False]
    assert [tier.contains(ns_id + h) for h in first + second] == [True, True]
    tier.check_integrity()
    if tier_name == "host":
        assert host_resident(store, ns_id, chain) == [True, True, False, False]


@pytest.mark.parametrize("tier_name", sorted(TIERS))
def test_the_room_of_a_write_that_raises_is_given_back(make_store, namespace, spec, monkeypatch, tier_name):
    store = make_store(**TIERS[tier_name])
    ns_id = store.register_namespace(namespace)
    tier = store.tiers[0]
    empty = tier.used_bytes

    def broken(key, payload, meta):
        raise RuntimeError("the device went away")

    monkeypatch.setattr(tier, "write", broken)
    with pytest.raises(RuntimeError, match="went away"):
        put_chain(store, ns_id, spec, namespace_hashes(namespace, tokens(0, 1)))
    assert tier.used_bytes == empty, "the reservation of the failed write was kept"
    tier.check_integrity()
    monkeypatch.undo()
    _, result = put_chain(store, ns_id, spec, namespace_hashes(namespace, tokens(0, 4)))
    assert result.stored == 4, "the tier lost room to the failed write"


@pytest.mark.parametrize("refusals, stored", [(1, 1), (99, 0)])
def test_a_refused_reservation_makes_room_again_and_gives_up_after_three(make_store, namespace, spec, monkeypatch,
                                                                           refusals, stored):
    """A tier may refuse a reservation right after room was made (its books moved meanwhile: a
    failed hole punch counts its bytes as dead, say). The claim makes room again, three times at
    most: the put is refused then, not retried forever."""
    store = make_store(**TIERS["host"])
    ns_id = store.register_namespace(namespace)
    tier = store.tiers[0]
    reserve, calls = tier.reserve, []

    def refusing(key, nbytes):
        calls.append(key)
        return len(calls) > refusals and reserve(key, nbytes)

    monkeypatch.setattr(tier, "reserve", refusing)
    _, result = put_chain(store, ns_id, spec, namespace_hashes(namespace, tokens(0, 1)))
    assert (result.stored, len(calls)) == (stored, min(refusals + 1, 3))
    tier.check_integrity()
