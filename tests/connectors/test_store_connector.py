"""StoreConnector over a real TieredStore (host + disk in a temp dir) and a byte page pool."""

import os

import numpy as np
import pytest
import torch

from connectors.base import LoadFailed
from connectors.store_connector import StoreConnector
from kvstore.keys import Namespace, namespace_hashes
from kvstore.layout import BlockSpec
from kvstore.store import TieredStore
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.host import HostTier
from kvstore.tiers.segment import HEADER_BYTES

NS = Namespace("tiny", "cfg", num_layers=3, components=("mla_bf16", "indexer_bf16"), block_size=4)
SPEC = BlockSpec.of(NS)


class BytePool:
    """Per layer one uint8 tensor [pages, layer_bytes]: the PageBytes the connector needs."""

    def __init__(self, pages: int, seed: int | None = None):
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        self.layers = [torch.randint(0, 256, (pages, SPEC.layer_bytes), dtype=torch.uint8, generator=gen)
                       if gen else torch.zeros(pages, SPEC.layer_bytes, dtype=torch.uint8)
                       for _ in range(SPEC.num_layers)]

    def layer_page_bytes(self, layer, page):
        return self.layers[layer][page]


def make_store(tmp_path):
    return TieredStore([HostTier(1 << 20, page_bytes=64 << 10, shm_dir=str(tmp_path)),
                        DiskTier(str(tmp_path / "disk"), 8 << 20)], background_writes=False)


@pytest.fixture
def hashes():
    return namespace_hashes(NS, np.arange(4 * 6))  # 6 blocks


def test_save_then_layerwise_load_round_trips_every_byte(tmp_path, hashes):
    store = make_store(tmp_path)
    connector = StoreConnector(store, NS)
    source = BytePool(8, seed=1)
    connector.save("a", hashes, [2, 3, 4, 5, 6, 7], source, parent=None)
    connector.flush()
    hit = connector.lookup("b", hashes)
    assert hit.blocks == 6 and hit.tokens == 24 and set(hit.tiers) == {"host"}
    target = BytePool(8)
    handle = connector.start_load(hit, hashes, [7, 6, 5, 4, 3, 2], target)
    for layer in range(SPEC.num_layers):
        handle.wait_layer(layer)
        for src_page, dst_page in zip([2, 3, 4, 5, 6, 7], [7, 6, 5, 4, 3, 2]):
            assert torch.equal(target.layer_page_bytes(layer, dst_page), source.layer_page_bytes(layer, src_page))
    assert handle.wait() == 6
    assert store.stats().leases_active == 0, "the load ends the lookup's lease"
    connector.close()
    store.close()


def test_hits_come_from_disk_after_a_restart(tmp_path, hashes):
    store = make_store(tmp_path)
    connector = StoreConnector(store, NS)
    source = BytePool(6, seed=2)
    connector.save("a", hashes[:3], [0, 1, 2], source, parent=None)
    connector.save("a", hashes[3:], [3, 4, 5], source, parent=hashes[2])
    connector.close()
    store.close()
    store = make_store(tmp_path)
    connector = StoreConnector(store, NS)
    hit = connector.lookup("b", hashes)
    assert hit.blocks == 6 and set(hit.tiers) == {"disk"}
    target = BytePool(6)
    assert connector.start_load(hit, hashes, range(6), target).wait() == 6
    assert all(torch.equal(target.layers[l], source.layers[l]) for l in range(SPEC.num_layers))
    connector.close()
    store.close()


def test_a_corrupt_block_fails_the_load_instead_of_serving_wrong_bytes(tmp_path, hashes):
    store = TieredStore([DiskTier(str(tmp_path / "disk"), 8 << 20)])  # the only copy is on disk
    connector = StoreConnector(store, NS)
    connector.save("a", hashes[:2], [0, 1], BytePool(2, seed=3), parent=None)
    connector.flush()
    disk = store.tiers[0]
    entry = disk._index[connector.ns_id + hashes[1]]
    path = os.path.join(disk.path, "segments", f"{entry.segment:08d}.seg")
    with open(path, "r+b") as f:
        f.seek(entry.offset + HEADER_BYTES + 10)
        byte = f.read(1)
        f.seek(entry.offset + HEADER_BYTES + 10)
        f.write(bytes([byte[0] ^ 0xFF]))
    hit = connector.lookup("b", hashes[:2])
    assert hit.blocks == 2
    handle = connector.start_load(hit, hashes, [0, 1], BytePool(2))
    with pytest.raises(LoadFailed):
        handle.wait_layer(0)
    assert handle.wait() == 0 and store.stats().leases_active == 0
    assert connector.lookup("c", hashes[:2]).blocks == 1, "the corrupt block is gone; the hit is shorter"
    connector.close()
    store.close()


def test_lookup_replaces_the_previous_lease_and_release_is_idempotent(tmp_path, hashes):
    store = make_store(tmp_path)
    connector = StoreConnector(store, NS)
    connector.save("a", hashes[:2], [0, 1], BytePool(2, seed=4), parent=None)
    connector.flush()
    connector.lookup("r", hashes)
    connector.lookup("r", hashes)
    assert store.stats().leases_active == 1
    connector.release("r")
    connector.release("r")
    assert store.stats().leases_active == 0
    assert connector.lookup("r", [namespace_hashes(NS, np.arange(100, 104))[0]]).blocks == 0
    connector.close()
    store.close()


def test_a_read_only_connector_loads_but_never_saves(tmp_path, hashes):
    store = make_store(tmp_path)
    writer = StoreConnector(store, NS)
    writer.save("a", hashes[:2], [0, 1], BytePool(2, seed=5), parent=None)
    writer.flush()
    reader = StoreConnector(store, NS, read_only=True)
    reader.save("b", hashes[2:4], [0, 1], BytePool(2, seed=6), parent=hashes[1])
    reader.demote(hashes[4], 0, BytePool(1, seed=7), parent=hashes[3])
    reader.flush()
    assert store.stats().stored_blocks == 2
    hit = reader.lookup("c", hashes)
    assert hit.blocks == 2 and reader.start_load(hit, hashes, [0, 1], BytePool(2)).wait() == 2
    for c in (writer, reader):
        c.close()
    store.close()
