"""GrantedSlots on its own: a grant is held until its lease ends, at most its TTL."""

from __future__ import annotations

import time

from kvstore.service.granted_slots import GrantedLoad, GrantedSlots

NS = b"\xaa" * 16


def hashes(n: int) -> list[bytes]:
    return [bytes([i]) * 16 for i in range(n)]


def test_a_grant_is_popped_once_and_counts_what_was_reported_at_most_its_slots():
    granted = GrantedSlots()
    granted.add(7, NS, hashes(3), ttl_s=30)
    load = granted.pop(7)
    assert load == GrantedLoad(NS, tuple(hashes(3)))
    assert (load.copied(None), load.copied(2), load.copied(0), load.copied(9)) == (3, 2, 0, 3)
    assert granted.pop(7) is None, "a lease ends once"
    assert granted.pop(8) is None, "a Lookup's lease granted no slot"


def test_a_grant_never_released_is_forgotten_once_its_ttl_passed():
    granted = GrantedSlots()
    granted.add(1, NS, hashes(2), ttl_s=0.05)
    granted.add(2, NS, hashes(2), ttl_s=30)
    time.sleep(0.1)
    granted.add(3, NS, hashes(1), ttl_s=30)  # adding forgets the expired
    assert len(granted) == 2 and granted.pop(1) is None
    assert granted.pop(2) == GrantedLoad(NS, tuple(hashes(2)))


def test_grants_released_in_time_leave_nothing_behind():
    granted = GrantedSlots()
    for lease_id in range(1000):
        granted.add(lease_id, NS, hashes(1), ttl_s=30)
        assert granted.pop(lease_id) is not None
    assert len(granted) == 0 and len(granted._deadlines) <= 2 * 1 + 16, "the heap of popped grants is compacted"
