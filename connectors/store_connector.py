"""The in-process connector: ``KVConnector`` over a ``TieredStore`` in the engine's own process.

Loads run on a background thread, layer-major: layer 0 of every hit block, then layer 1, ... so
the engine's forward pass can start layer 0 of the suffix while later layers are still arriving
(``LoadHandle.wait_layer``). Saves gather each block's layers out of the engine's pages into one
payload before ``save`` returns (the engine may reuse its pages at once), then a background
writer puts them into the store: nothing of a save runs on the engine's critical path beyond
that copy.

Device pages are read and written through ``PageBytes.layer_page_bytes`` (CPU tensors here; a
CUDA pool would stage through pinned host memory: untested without a GPU).
"""

from __future__ import annotations

import logging
import threading
from typing import Sequence

import numpy as np
import torch

from connectors._pages import BackgroundLoad, SaveWriter, gather_blocks, host_view, load_targets, scatter_layer
from connectors.base import ConnectorHit, KVConnector, LoadFailed, LoadHandle, PageBytes
from kvstore.errors import UnknownLease
from kvstore.keys import Namespace
from kvstore.store import TieredStore

log = logging.getLogger(__name__)
DEFAULT_LEASE_TTL_S = 60.0


class StoreConnector(KVConnector):
    def __init__(self, store: TieredStore, namespace: Namespace, lease_ttl_s: float = DEFAULT_LEASE_TTL_S,
                 read_only: bool = False):
        self.store = store
        self.read_only = read_only  # load hits but never save or demote (consumer-only engines, A/B runs)
        self.ns_id = store.register_namespace(namespace)
        self.spec = store.spec(self.ns_id)
        self.lease_ttl_s = lease_ttl_s
        self._leases: dict[str, int] = {}
        self._lock = threading.Lock()
        self._saves = SaveWriter(lambda hashes, payloads, parent: self.store.put(self.ns_id, hashes, payloads,
                                                                                 parent=parent), logger=log)

    # ---- lookup side -------------------------------------------------------------------

    def lookup(self, request_id: str, block_hashes: Sequence[bytes]) -> ConnectorHit:
        self.release(request_id)
        result = self.store.lookup(self.ns_id, block_hashes, lease_ttl_s=self.lease_ttl_s)
        if result.lease_id is not None:
            with self._lock:
                self._leases[request_id] = result.lease_id
        blocks = result.hit_blocks if result.lease_id is not None or not result.hit_blocks else 0
        return ConnectorHit(request_id, blocks, self.spec.block_size, result.tiers[:blocks])

    # ---- transfer side -----------------------------------------------------------------

    def start_load(self, hit: ConnectorHit, block_hashes: Sequence[bytes], pages: Sequence[int],
                   pool: PageBytes) -> LoadHandle:
        hashes, pages = load_targets(hit, block_hashes, pages)
        with self._lock:
            lease_id = self._leases.pop(hit.request_id, None)

        top_tier = self.store.tiers[0].name
        below_top = [i for i, tier in enumerate(hit.tiers[: len(hashes)]) if tier != top_tier]

        def copy_layer_major(layer_done) -> None:  # layer 0 of every block, then layer 1, ...
            # Blocks below the top tier (disk) are read whole first: one large verified read per
            # block instead of a small read per layer (which is latency-bound on a disk).
            whole = {i: self._read_whole(hashes[i]) for i in below_top}
            staging = None  # device pools: [blocks, layer_bytes] pinned host bytes, one row per block
            for layer in range(self.spec.num_layers):
                for i, (block_hash, page) in enumerate(zip(hashes, pages)):
                    if i in whole:
                        scatter_layer(self.spec, pool, layer, page, whole[i])
                        continue
                    target = pool.layer_page_bytes(layer, page)  # [layer_bytes] uint8
                    if target.device.type == "cpu":
                        loaded = self.store.load_layer(self.ns_id, block_hash, layer, host_view(target))
                    else:  # a device pool (tested on an H100): stage in pinned memory, copy without blocking
                        if staging is None:
                            staging = torch.empty((len(hashes), target.numel()), dtype=torch.uint8).pin_memory()
                        loaded = self.store.load_layer(self.ns_id, block_hash, layer, staging[i].numpy())
                        target.copy_(staging[i], non_blocking=True)
                    if loaded is None:
                        raise LoadFailed(f"block {block_hash.hex()} layer {layer} could not be loaded")
                if staging is not None:
                    torch.cuda.synchronize()  # the layer's copies have landed before the engine reads it
                layer_done(layer + 1)

        return BackgroundLoad(hit.request_id, len(hashes), self.spec.num_layers, copy_layer_major,
                              lambda: self._end_lease(hit.request_id, lease_id), logger=log)

    def _read_whole(self, block_hash: bytes) -> np.ndarray:
        """One block's verified payload [block_bytes] uint8, read in one piece."""
        payload = np.empty(self.spec.block_bytes, np.uint8)
        if not self.store.load(self.ns_id, [block_hash], [payload]).complete:
            raise LoadFailed(f"block {block_hash.hex()} could not be loaded")
        return payload

    def save(self, request_id: str, block_hashes: Sequence[bytes], pages: Sequence[int], pool: PageBytes,
             parent: bytes | None) -> None:
        if not block_hashes or self.read_only:
            return
        payloads = gather_blocks(self.spec, pool, pages[: len(block_hashes)])  # layer-major, as the store lays it out
        self._saves.put(block_hashes, payloads, parent)

    def release(self, request_id: str) -> None:
        with self._lock:
            lease_id = self._leases.pop(request_id, None)
        self._end_lease(request_id, lease_id)

    def flush(self) -> None:
        self._saves.flush()

    def wait_copied(self) -> None:
        """Nothing to wait for: ``save`` gathers the pages into its own buffers before returning."""

    def close(self) -> None:
        self._saves.close()

    # ---- internals ---------------------------------------------------------------------

    def _end_lease(self, request_id: str, lease_id: int | None) -> None:
        if lease_id is None:
            return
        try:
            self.store.release(lease_id)
        except UnknownLease:
            pass  # expired meanwhile: nothing left to end
