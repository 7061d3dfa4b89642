"""Helpers shared by the TieredStore tests (tiny namespace geometry from tests/conftest.py)."""

from __future__ import annotations

import threading
import time

import numpy as np

from tests.conftest import payloads_for

SLOTS4 = dict(host_bytes=64 << 10, page_bytes=16 << 10)
DISK_BLOCK = 16 << 10  # footprint of one tiny block on disk


def tokens(start: int, blocks: int) -> np.ndarray:
    return np.arange(start, start + 4 * blocks)


def put_chain(store, ns_id, spec, hashes, parent=None):
    payloads = payloads_for(spec, hashes)
    result = store.put(ns_id, hashes, payloads, parent=parent)
    return payloads, result


def load_all(store, ns_id, spec, hashes, lease_id=None):
    dsts = [np.zeros(spec.block_bytes, np.uint8) for _ in hashes]
    return store.load(ns_id, hashes, dsts, lease_id=lease_id), dsts


def host_resident(store, ns_id, hashes) -> list[bool]:
    """Per block: does the host tier hold it (checked on the tier itself, not through lookup)."""
    host = store.tiers[0]
    return [host.contains(ns_id + h) for h in hashes]


def hold_store_lock(store, seconds: float = 30.0) -> threading.Event:
    """Hold ``store``'s lock on another thread, as one stuck in disk I/O under it would, until
    the returned event is set (or ``seconds`` pass)."""
    unstick, held = threading.Event(), threading.Event()

    def hold():
        with store._lock:
            held.set()
            unstick.wait(seconds)

    threading.Thread(target=hold, name="stuck-under-store-lock", daemon=True).start()
    assert held.wait(5), "could not take the store's lock"
    return unstick


def until(condition, timeout_s: float = 10.0) -> bool:
    """Poll ``condition`` until it holds (True) or ``timeout_s`` passes (False)."""
    end = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True
