"""Shared fixtures: tiny namespaces, deterministic payloads, stores over real tiers in temp dirs."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.keys import Namespace, namespace_hashes
from kvstore.layout import BlockSpec
from kvstore.store import TieredStore
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.host import HostTier


def tiny_namespace(**overrides) -> Namespace:
    """2 layers, 4-token blocks of bf16 MLA (9,216-byte blocks): small enough for many blocks."""
    fields = dict(model="tiny-mla", model_config_hash="cfg0", num_layers=2, components=("mla_bf16",), block_size=4)
    fields.update(overrides)
    return Namespace(**fields)


def payloads_for(spec: BlockSpec, hashes: list[bytes]) -> list[np.ndarray]:
    """One distinct, reproducible payload per block hash (bytes derived from the hash)."""
    out = []
    for block_hash in hashes:
        rng = np.random.default_rng(int.from_bytes(block_hash[:8], "little"))
        out.append(rng.integers(0, 256, spec.block_bytes, dtype=np.uint8))
    return out


@pytest.fixture
def namespace() -> Namespace:
    return tiny_namespace()


@pytest.fixture
def spec(namespace) -> BlockSpec:
    return BlockSpec.of(namespace)


@pytest.fixture
def chain(namespace):
    """Hashes of 10 full blocks of one prompt (tokens 0..39)."""
    return namespace_hashes(namespace, np.arange(40))


@pytest.fixture
def make_store(tmp_path):
    """Factory for stores over a real host tier (shm file in tmp) and a real disk tier (tmp dir)."""
    stores = []

    def make(host_bytes: int | None = 1 << 20, disk_bytes: int | None = 4 << 20, disk_dir=None, **kw) -> TieredStore:
        tiers = []
        if host_bytes:
            tiers.append(HostTier(host_bytes, page_bytes=kw.pop("page_bytes", 64 << 10), shm_dir=str(tmp_path)))
        if disk_bytes:
            tiers.append(DiskTier(str(disk_dir or tmp_path / "disk"), disk_bytes,
                                  segment_bytes=kw.pop("segment_bytes", 1 << 20), durable=kw.pop("durable", False)))
        kw.setdefault("policy", "lru")  # store narratives assert LRU orders; other policies have their own tests
        store = TieredStore(tiers, **kw)
        stores.append(store)
        return store

    yield make
    for store in stores:
        store.close()
