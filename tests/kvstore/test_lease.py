"""Leases and pins, driven by a fake clock (no sleeping)."""

from __future__ import annotations

import pytest

from kvstore.lease import LeaseTable

A, B, C = b"a" * 32, b"b" * 32, b"c" * 32


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def table(clock) -> LeaseTable:
    return LeaseTable(max_leases=4, clock=clock)


def test_grant_pins_its_keys(table):
    lease = table.grant([A, B], ttl_s=10.0)
    assert lease is not None
    assert lease.keys == (A, B) and lease.expires_at == 1010.0
    assert table.is_pinned(A) and table.is_pinned(B) and not table.is_pinned(C)
    assert table.pinned_keys() == {A, B}
    assert table.keys_of(lease.id) == (A, B)
    assert len(table) == 1


def test_release_unpins_and_a_second_release_returns_false(table):
    lease = table.grant([A, B], ttl_s=10.0)
    assert table.release(lease.id) is True
    assert not table.is_pinned(A) and not table.is_pinned(B)
    assert table.pinned_keys() == set() and len(table) == 0
    assert table.keys_of(lease.id) == ()
    assert table.release(lease.id) is False
    assert table.release(12345) is False  # never issued


def test_lease_ids_are_unique(table):
    ids = [table.grant([A], 1.0).id for _ in range(4)]
    assert len(set(ids)) == 4


def test_ttl_expiry_with_a_fake_clock(table, clock):
    short = table.grant([A], ttl_s=5.0)
    long = table.grant([B], ttl_s=50.0)
    clock.now += 4.999
    assert table.expire() == 0
    assert table.is_pinned(A)
    clock.now += 0.001  # exactly at expires_at: expired
    assert table.expire() == 1
    assert not table.is_pinned(A) and table.is_pinned(B)
    assert table.expired_total == 1
    assert table.release(short.id) is False  # expired leases are unknown
    assert table.keys_of(short.id) == ()
    assert table.release(long.id) is True
    assert table.expired_total == 1  # a release is not an expiry


def test_max_leases_returns_none_until_one_ends(table, clock):
    leases = [table.grant([A], ttl_s=10.0 + i) for i in range(4)]
    assert all(lease is not None for lease in leases)
    assert table.grant([C], ttl_s=10.0) is None
    assert not table.is_pinned(C)  # a refused lease pins nothing
    assert len(table) == 4
    assert table.release(leases[1].id)
    assert table.grant([C], ttl_s=20.0) is not None
    assert table.grant([C], ttl_s=20.0) is None
    clock.now += 10.0  # leases[0] expires; grant sweeps before counting
    assert table.grant([B], ttl_s=10.0) is not None
    assert table.expired_total == 1
    assert len(table) == 4
    assert table.grant([B], ttl_s=10.0) is None


def test_pin_counts_nest(table):
    table.pin([A])
    first = table.grant([A, B], ttl_s=10.0)
    second = table.grant([A], ttl_s=10.0)
    table.unpin([A])
    assert table.is_pinned(A)  # still held by two leases
    assert table.release(first.id)
    assert table.is_pinned(A) and not table.is_pinned(B)
    assert table.release(second.id)
    assert not table.is_pinned(A)


def test_duplicate_keys_in_one_lease_are_counted_twice(table):
    table.pin([C])
    lease = table.grant([C, C], ttl_s=1.0)
    table.unpin([C])
    assert table.is_pinned(C)
    assert table.release(lease.id)
    assert not table.is_pinned(C)


def test_unpin_without_pin_is_a_bug(table):
    with pytest.raises(AssertionError):
        table.unpin([A])
    table.pin([A])
    table.unpin([A])
    with pytest.raises(AssertionError):
        table.unpin([A])


def test_default_clock_is_monotonic_time():
    table = LeaseTable()
    lease = table.grant([A], ttl_s=60.0)
    assert table.expire() == 0 and table.is_pinned(A)
    assert table.release(lease.id)


def test_leases_are_bounded_by_the_blocks_they_hold(clock):
    """A lease holds its keys until it ends: the blocks all leases hold are capped, a key counted
    once per lease (a lookup repeating one hash costs what it names), and an ended lease, released
    or expired, gives its count back."""
    table = LeaseTable(max_leases=100, clock=clock, max_leased_blocks=10)
    first = table.grant([A] * 6, ttl_s=10.0)
    assert first is not None and table.leased_blocks == 6
    assert table.grant([B] * 5, ttl_s=10.0) is None and table.leased_blocks == 6
    assert not table.is_pinned(B)  # a refused lease pins nothing
    second = table.grant([B, C, C, C], ttl_s=20.0)
    assert second is not None and table.leased_blocks == 10
    assert table.release(first.id) and table.leased_blocks == 4
    assert table.grant([A] * 6, ttl_s=10.0) is not None and table.leased_blocks == 10
    clock.now += 15
    assert table.expire() == 1 and table.leased_blocks == 4
    clock.now += 10
    assert table.expire() == 1 and table.leased_blocks == 0 and not table.pinned_keys()
