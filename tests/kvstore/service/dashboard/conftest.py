"""Real traffic for the dashboard tests: a real store, its ``ServiceMetrics``, and ``Traffic``.

``Traffic`` drives the store the way the servicer does (put, lookup, load) and records each
call in the metrics with what the store actually answered, so the dashboard reads the same
counters it reads in the sidecar.

Geometry (tiny namespace from tests/conftest.py): 4-token blocks of 9,216 bytes; the host tier
holds 10 of them (12,288-byte slots in 128 KiB), the disk tier 64 (16 KiB each in 1 MiB).
Writes are synchronous, so tier usage is settled when a call returns.
"""

from __future__ import annotations

import numpy as np
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from kvstore.keys import Namespace, namespace_hashes
from kvstore.results import LookupResult
from kvstore.service.dashboard import Dashboard
from kvstore.service.metrics import ServiceMetrics
from tests.conftest import payloads_for, tiny_namespace

HOST_BLOCKS, DISK_BLOCKS = 10, 64
STORE_SIZES = dict(host_bytes=128 << 10, page_bytes=64 << 10, disk_bytes=1 << 20, segment_bytes=1 << 20)
BLOCK_TOKENS, BLOCK_BYTES = 4, 9216


class Traffic:
    """Calls on the real store, recorded in ``metrics`` as the servicer records them."""

    def __init__(self, metrics: ServiceMetrics):
        self.metrics = metrics
        self.store = metrics.store
        self._namespaces: dict[bytes, Namespace] = {}

    def namespace(self, model: str = "tiny-mla") -> bytes:
        namespace = tiny_namespace(model=model)
        ns_id = self.store.register_namespace(namespace)
        self._namespaces[ns_id] = namespace
        return ns_id

    def hashes(self, ns_id: bytes, first_block: int, blocks: int) -> list[bytes]:
        """The ``blocks`` block hashes of the prompt ``4 * first_block, 4 * first_block + 1, ...``:
        prompts with the same start share their leading blocks, other starts share none."""
        tokens = np.arange(BLOCK_TOKENS * first_block, BLOCK_TOKENS * (first_block + blocks))
        return namespace_hashes(self._namespaces[ns_id], tokens)

    def put(self, ns_id: bytes, hashes: list[bytes]) -> None:
        spec = self.store.spec(ns_id)
        result = self.store.put(ns_id, hashes, payloads_for(spec, hashes))
        self.metrics.put(ns_id, hashes, result.stored, result.duplicates, result.rejected,
                         len(hashes) * spec.block_bytes, seconds=0.001)

    def lookup(self, ns_id: bytes, hashes: list[bytes], lease_ttl_s: float | None = None,
               seconds: float = 0.0005) -> LookupResult:
        result = self.store.lookup(ns_id, hashes, lease_ttl_s=lease_ttl_s)
        self.metrics.lookup(ns_id, hashes, result.tiers, seconds)
        return result

    def load(self, ns_id: bytes, hashes: list[bytes], seconds: float = 0.001) -> tuple[str, ...]:
        spec = self.store.spec(ns_id)
        result = self.store.load(ns_id, hashes, [np.zeros(spec.block_bytes, np.uint8) for _ in hashes])
        self.metrics.load_took("bytes", seconds)
        self.metrics.loaded(ns_id, result.tiers, "bytes")
        return result.tiers


@pytest.fixture
def metrics(make_store) -> ServiceMetrics:
    return ServiceMetrics(make_store(background_writes=False, **STORE_SIZES))


@pytest.fixture
def traffic(metrics) -> Traffic:
    return Traffic(metrics)


@pytest.fixture
def dashboard(metrics) -> Dashboard:
    """Sampled by hand (``sample()``); curves recomputed on every call."""
    return Dashboard(metrics, sample_interval_s=0.1, history_s=60.0, curve_refresh_s=0.0)


@pytest.fixture
def client(dashboard):
    """An in-process client of an app serving only the dashboard's router."""
    app = FastAPI()
    app.include_router(dashboard.router)
    with TestClient(app) as c:
        yield c
