"""What a lease's holder may do with it: end it (waiting a bounded time for the store's lock if
asked), read its blocks in place where their tier lends memory, and check it still holds.

``LeaseHolderMixin`` is part of ``TieredStore`` (kept apart to keep each file to one concern).
It expects the host class to provide ``tiers``, ``spec``, ``_lock`` (re-entrant), ``_acquire``,
``_leases``, ``_doomed`` and the bookkeeping methods ``_bits`` and ``_bury_doomed``. Methods
whose docstring says "caller holds the lock" must be called under ``_lock``.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from kvstore.errors import UnknownLease
from kvstore.validation import check_hashes


class LeaseHolderMixin:
    def release(self, lease_id: int) -> None:
        """End a lease. Raises ``UnknownLease`` if it was never issued, released or expired."""
        self.try_release(lease_id, None)

    def try_release(self, lease_id: int, wait_s: float | None) -> bool:
        """``release``, waiting at most ``wait_s`` for the store's lock (see ``lookup``): False
        when it stayed held, the lease then still pinning its blocks."""
        if not self._acquire(wait_s):
            return False
        try:
            self._expire_leases()
            keys = self._lease_keys(lease_id)
            if not self._leases.release(lease_id):
                raise UnknownLease(f"lease {lease_id} is unknown: never issued, already released, or expired")
            self._bury_doomed(keys)
        finally:
            self._lock.release()
        return True

    def leased_views(self, ns_id: bytes, block_hashes: Sequence[bytes], lease_id: int) -> list[tuple[str, np.ndarray]]:
        """Zero-copy views of the leading blocks of ``block_hashes`` that lease ``lease_id`` pins,
        where the tier holding them lends its memory (the host tier's shared memory): per block
        (tier name, read-only [block_bytes] uint8 view), stopping at the first block that is not.

        A view holds its block's bytes only while the lease lives. Copy out of it, then check
        ``lease_alive``: if the lease ended meanwhile (released, or expired past its TTL) the slot
        may have been reused during the copy, which must then be discarded. Counts nothing: tell
        the store what was used with ``record_access``."""
        spec = self.spec(ns_id)
        check_hashes(block_hashes)
        views = []
        with self._lock:
            pinned = set(self._lease_keys(lease_id))
            for block_hash in block_hashes:
                key = ns_id + block_hash
                bits = self._bits(key)
                if key not in pinned or not bits:
                    break
                t = (bits & -bits).bit_length() - 1  # the fastest tier holding it
                view = self.tiers[t].view(key)
                if view is None or view.nbytes != spec.block_bytes:
                    break
                views.append((self.tiers[t].name, view))
        return views

    def lease_alive(self, lease_id: int) -> bool:
        """Whether ``lease_id`` still pins its blocks (not released, not expired). A lease that
        ended never comes back, so True after a copy means the blocks were pinned throughout it."""
        with self._lock:
            return bool(self._lease_keys(lease_id))

    # ---- lease bookkeeping (caller holds the lock) ----------------------------------------

    def _lease_keys(self, lease_id: int) -> tuple[bytes, ...]:
        return self._leases.keys_of(lease_id)

    def _expire_leases(self) -> None:
        """End leases past their TTL, then remove doomed blocks they were the last to pin."""
        self._leases.expire()
        if self._doomed:
            self._bury_doomed(list(self._doomed))

    def _readable_run(self, keys: list[bytes], lease_id: int | None) -> list[bytes]:
        """``keys`` up to the first block deleted meanwhile that ``lease_id`` does not cover: a
        deleted block stays readable only to the lease holders it waits for. Caller holds the lock."""
        if not self._doomed:
            return keys
        leased = set(self._lease_keys(lease_id)) if lease_id is not None else set()
        for i, key in enumerate(keys):
            if key in self._doomed and key not in leased:
                return keys[:i]
        return keys
