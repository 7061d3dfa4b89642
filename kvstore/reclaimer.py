"""Gives the tiers' discarded space back to their media off the store's lock.

Under its lock the store only ``discard``s (``kvstore.tiers.base.Tier``). Most discards make room
for a write into the same tier, which reclaims right after writing its own record. A block deleted while a reader held it
(``TieredStore.delete_namespace``) is discarded later, whenever its last pin ends, with no write
to follow: ``wake`` (cheap, no I/O, callable under the lock) has a thread of this object call
every tier's ``reclaim`` soon after, so the deletion reaches the disk's index within moments,
not at the next write or flush.
"""

from __future__ import annotations

import logging
import threading
from typing import Sequence

from kvstore.tiers.base import Tier

log = logging.getLogger(__name__)


class Reclaimer:
    def __init__(self, tiers: Sequence[Tier], name: str = "kvstore-reclaim"):
        self._tiers = list(tiers)
        self._name = name
        self._due = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None  # started at the first wake
        self._start_lock = threading.Lock()

    def wake(self) -> None:
        """Have every tier reclaim soon (returns at once)."""
        if self._thread is None:
            with self._start_lock:
                if self._thread is None and not self._closed:
                    self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                    self._thread.start()
        self._due.set()

    def close(self) -> None:
        """Stop the thread after the reclaim it may be running; idempotent."""
        with self._start_lock:
            self._closed = True
            thread = self._thread
        self._due.set()
        if thread is not None:
            thread.join()

    def _run(self) -> None:
        while True:
            self._due.wait()
            self._due.clear()
            if self._closed:
                return
            for tier in self._tiers:
                try:
                    tier.reclaim()
                except Exception:  # a tier that fails to reclaim logs and counts it; never a dead thread
                    log.exception("%s tier: reclaiming discarded space failed", tier.name)
