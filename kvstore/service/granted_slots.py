"""The slots GetSlots granted, held until their lease ends: when the ``shm`` path counts a load.

Only the client knows how many granted slots it took. One that can neither map the host tier's
segment nor reach the data plane takes none and gets every block through Get; one whose copy
fails its checksums (``load_shm(verify=True)``) gets that block and the rest through Get. Get
counts what it sends (path ``bytes``), so a GetSlots that counted its slots too counted those
blocks twice. Instead GetSlots records its grant here and the lease's end decides:

    Release with copied_blocks=N    min(N, granted slots) blocks from the host tier count
    Release without copied_blocks   every granted slot counts (a client older than the field:
                                    a block it then took through Get counts twice, as before)
    Release answering NOT_FOUND     nothing: the lease expired, the copies are void and the
                                    client gets the blocks through Get
    a Get presenting the lease      nothing here: that Get counts what it sends
    the TTL passing unreleased      nothing (a client that died or gave up); forgotten on a
                                    later ``add``

It knows grants and their deadlines only: not the store, not the metrics (the servicer counts).
Used from the server's event loop only (not thread-safe), like ``limits.ClientLeases``.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class GrantedLoad:
    """The leading hit blocks ``block_hashes`` of namespace ``ns_id`` whose slots a GetSlots call
    granted, uncounted yet."""

    ns_id: bytes
    block_hashes: tuple[bytes, ...]

    @property
    def slots(self) -> int:
        return len(self.block_hashes)

    def copied(self, reported: int | None) -> int:
        """The blocks to count at a successful Release that reported ``reported`` (None: unset)."""
        return self.slots if reported is None else min(reported, self.slots)


class GrantedSlots:
    """Lease id -> its ``GrantedLoad`` until ``pop`` (the lease ended) or its TTL passes."""

    def __init__(self):
        self._loads: dict[int, tuple[GrantedLoad, float]] = {}  # lease -> (load, deadline)
        self._deadlines: list[tuple[float, int]] = []  # heap of (deadline, lease); stale once popped

    def add(self, lease_id: int, ns_id: bytes, block_hashes: Sequence[bytes], ttl_s: float) -> None:
        """Hold a grant of the slots of ``block_hashes`` under ``lease_id`` for at most ``ttl_s``
        seconds from now (no earlier than the store's lease on it ends: the store took it before
        this call)."""
        now = time.monotonic()
        self._forget_expired(now)
        self._loads[lease_id] = (GrantedLoad(ns_id, tuple(block_hashes)), now + ttl_s)
        heapq.heappush(self._deadlines, (now + ttl_s, lease_id))
        if len(self._deadlines) > 2 * len(self._loads) + 16:  # mostly popped grants: rebuild
            self._deadlines = [(deadline, lease) for lease, (_, deadline) in self._loads.items()]
            heapq.heapify(self._deadlines)

    def pop(self, lease_id: int) -> GrantedLoad | None:
        """Forget ``lease_id``'s grant and return it; None for a lease without granted slots (a
        Lookup's, a GetSlots that found no host-tier block) or one already popped or expired."""
        held = self._loads.pop(lease_id, None)
        return held[0] if held is not None else None

    def __len__(self) -> int:
        return len(self._loads)

    def _forget_expired(self, now: float) -> None:
        """Drop every grant whose deadline passed, and the heap entries of grants already popped."""
        while self._deadlines and self._deadlines[0][0] <= now:
            _, lease_id = heapq.heappop(self._deadlines)
            held = self._loads.get(lease_id)
            if held is not None and held[1] <= now:
                del self._loads[lease_id]
