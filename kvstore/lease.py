"""Leases and pins: what protects a block from eviction while someone is about to read it.

A lease is taken by ``lookup`` and ended by ``load``/``release`` or by its TTL (a client that
dies does not pin blocks forever). Pins are the same counter without a lease object, held by the
store around its own in-flight copies. This module knows keys and clocks, nothing about tiers.
"""

from __future__ import annotations

import heapq
import secrets
import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Iterable


@dataclass(frozen=True)
class Lease:
    id: int
    keys: tuple[bytes, ...]
    expires_at: float


MAX_LEASED_BLOCKS = 1 << 22  # 4,194,304 keys: 310 to 450 MiB at the cap (77 to 113 bytes a leased key, measured)


class LeaseTable:
    """Pin counts per key plus the leases that hold some of them. Not thread-safe on its own:
    the store calls it under its lock.

    Leases are bounded in number (``max_leases``) and in the blocks they hold all together
    (``max_leased_blocks``): a lease keeps its keys for up to its TTL, and one lookup may lease
    thousands of blocks (the same one repeated, even), so a count of leases alone would let
    their keys take the process's memory."""

    def __init__(self, max_leases: int = 65536, clock: Callable[[], float] = time.monotonic,
                 max_leased_blocks: int = MAX_LEASED_BLOCKS):
        self.max_leases = max_leases
        self.max_leased_blocks = max_leased_blocks
        self._leased_blocks = 0  # keys held by leases, a key counted once per lease holding it
        self._clock = clock
        self._pins: Counter[bytes] = Counter()
        self._leases: dict[int, Lease] = {}
        self._deadlines: list[tuple[float, int]] = []  # min-heap of (expires_at, lease id), stale ones too
        self.expired_total = 0

    def __len__(self) -> int:
        return len(self._leases)

    @property
    def leased_blocks(self) -> int:
        """Keys held by live leases, one count per lease holding a key."""
        return self._leased_blocks

    def pin(self, keys: Iterable[bytes]) -> None:
        pins = self._pins
        for key in keys:  # not Counter.update: its Python-level checks cost more than a short list
            pins[key] = pins.get(key, 0) + 1

    def unpin(self, keys: Iterable[bytes]) -> None:
        for key in keys:
            count = self._pins[key] - 1
            assert count >= 0, "unpin without a matching pin (store bug)"
            if count:
                self._pins[key] = count
            else:
                del self._pins[key]

    def is_pinned(self, key: bytes) -> bool:
        return key in self._pins

    def grant(self, keys: Iterable[bytes], ttl_s: float) -> Lease | None:
        """Pin ``keys`` under a new lease; None when ``max_leases`` are already held, or when the
        lease would take the blocks leases hold past ``max_leased_blocks``."""
        self.expire()
        keys = tuple(keys)
        if len(self._leases) >= self.max_leases or self._leased_blocks + len(keys) > self.max_leased_blocks:
            return None
        lease = Lease(self._new_id(), keys, self._clock() + ttl_s)
        self._leased_blocks += len(keys)
        self._leases[lease.id] = lease
        heapq.heappush(self._deadlines, (lease.expires_at, lease.id))
        if len(self._deadlines) > 2 * len(self._leases) + 1024:  # released leases leave stale items
            self._deadlines = [(t, lid) for t, lid in self._deadlines if lid in self._leases]
            heapq.heapify(self._deadlines)
        self.pin(lease.keys)
        return lease

    def _new_id(self) -> int:
        """A random 63-bit id, never 0, unlike every live lease's. Unguessable: clients the sidecar
        cannot tell apart (one unix socket, no ``kvstore-client`` metadata) cannot end each other's
        leases by guessing, and an id kept from before a restart names no lease of the new process."""
        while True:
            lease_id = secrets.randbits(63)
            if lease_id and lease_id not in self._leases:
                return lease_id

    def release(self, lease_id: int) -> bool:
        """End a lease; False when it is unknown (never issued, released, or expired)."""
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            return False
        self._leased_blocks -= len(lease.keys)
        self.unpin(lease.keys)
        return True

    def expire(self) -> int:
        """Release every lease past its TTL; returns how many. Cheap when none is due (a heap peek)."""
        now = self._clock()
        expired = 0
        while self._deadlines and self._deadlines[0][0] <= now:
            _, lease_id = heapq.heappop(self._deadlines)
            lease = self._leases.get(lease_id)  # None, or a later lease given the id: released before its deadline
            if lease is not None and lease.expires_at <= now:
                expired += self.release(lease_id)
        self.expired_total += expired
        return expired

    def keys_of(self, lease_id: int) -> tuple[bytes, ...]:
        lease = self._leases.get(lease_id)
        return lease.keys if lease else ()

    def pinned_keys(self) -> set[bytes]:
        return set(self._pins)
