"""Helpers shared by the TieredStore tests (tiny namespace geometry from tests/conftest.py)."""

from __future__ import annotations

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
