"""The lease each request holds from its lookup until its load takes it over or it is released.

A lookup's answer becomes the engine's hit here: a hit whose lease was refused is a miss (a load
without a lease could read blocks evicted meanwhile), and while reads below memory hang lately
(``LowerTiers``) the hit stops at its first block there. A lease on a hit cut to nothing is ended
at once. Both connectors keep their leases here; how a lease is ended is theirs (``end_lease``).

Thread-safe: the engine's scheduler looks up and releases while loads take leases over.
"""

from __future__ import annotations

import threading
from typing import Callable

from connectors.base import ConnectorHit
from connectors.lower_tiers import LowerTiers
from kvstore.results import LookupResult


class RequestLeases:
    def __init__(self, block_size: int, lower_tiers: LowerTiers, end_lease: Callable[[int], None]) -> None:
        """``end_lease(lease_id)`` ends a lease in the store; it must not raise."""
        self.block_size = block_size
        self.lower_tiers = lower_tiers
        self._end_lease = end_lease
        self._leases: dict[str, int] = {}
        self._lock = threading.Lock()

    def hit(self, request_id: str, result: LookupResult | None) -> ConnectorHit:
        """The hit ``result`` (None: no answer, a miss) gives ``request_id``, whose lease is kept
        for its load. Call ``release(request_id)`` first: this replaces nothing."""
        if result is None:
            return ConnectorHit(request_id, 0, self.block_size, ())
        leased = result.lease_id is not None
        if leased:
            with self._lock:
                self._leases[request_id] = result.lease_id
        blocks = result.hit_blocks if leased else 0
        usable = self.lower_tiers.usable(result.tiers, blocks)
        if usable < blocks:  # a read below memory hung lately: do not make this request wait on one
            blocks = usable
            if not blocks:
                self.release(request_id)
        return ConnectorHit(request_id, blocks, self.block_size, tuple(result.tiers[:blocks]))

    def take(self, request_id: str) -> int | None:
        """The request's lease, now the caller's to end (a load takes it over); None if it has none."""
        with self._lock:
            return self._leases.pop(request_id, None)

    def release(self, request_id: str) -> None:
        """End the request's lease, if it holds one. Idempotent."""
        lease_id = self.take(request_id)
        if lease_id is not None:
            self._end_lease(lease_id)

    def release_all(self) -> None:
        """End every lease still held (the connector is closing)."""
        with self._lock:
            leases, self._leases = list(self._leases.values()), {}
        for lease_id in leases:
            self._end_lease(lease_id)
