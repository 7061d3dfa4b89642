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
import queue
import threading
from typing import Sequence

import numpy as np
import torch

from connectors.base import ConnectorHit, KVConnector, LoadFailed, LoadHandle, PageBytes
from kvstore.errors import UnknownLease
from kvstore.keys import Namespace
from kvstore.store import TieredStore

log = logging.getLogger(__name__)
DEFAULT_LEASE_TTL_S = 60.0


def _host_view(t: torch.Tensor) -> np.ndarray:
    """Flat uint8 numpy view of a CPU tensor (a device tensor is copied to the host first)."""
    if t.device.type != "cpu":
        t = t.to("cpu", non_blocking=False)
    return t.reshape(-1).view(torch.uint8).numpy()


class _LayerwiseLoad(LoadHandle):
    """Background copy of ``blocks`` blocks into pages, layer by layer."""

    def __init__(self, connector: "StoreConnector", hit: ConnectorHit, hashes: Sequence[bytes],
                 pages: Sequence[int], pool: PageBytes, lease_id: int | None):
        self._connector, self._hit, self._pool = connector, hit, pool
        self._hashes, self._pages, self._lease_id = list(hashes[: hit.blocks]), list(pages[: hit.blocks]), lease_id
        self._num_layers = connector.spec.num_layers
        self._done_layers = 0
        self._failed: str | None = None
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=f"kv-load-{hit.request_id}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        store, ns_id = self._connector.store, self._connector.ns_id
        try:
            for layer in range(self._num_layers):
                for block_hash, page in zip(self._hashes, self._pages):
                    target = self._pool.layer_page_bytes(layer, page)  # [layer_bytes] uint8
                    if store.load_layer(ns_id, block_hash, layer, _host_view(target)) is None:
                        raise LoadFailed(f"block {block_hash.hex()} layer {layer} could not be loaded")
                with self._cond:
                    self._done_layers = layer + 1
                    self._cond.notify_all()
        except Exception as exc:  # a failed load is a recompute, never a crash of the engine
            log.warning("load for %s failed: %s", self._hit.request_id, exc)
            with self._cond:
                self._failed = str(exc)
                self._cond.notify_all()
        finally:
            self._connector._end_lease(self._hit.request_id, self._lease_id)

    def wait_layer(self, layer: int) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._done_layers > layer or self._failed is not None)
            if self._done_layers <= layer:
                raise LoadFailed(self._failed or "load failed")

    def wait(self) -> int:
        self._thread.join()
        return len(self._hashes) if self._failed is None else 0


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
        self._saves: queue.Queue = queue.Queue()
        self._writer = threading.Thread(target=self._write_saves, name="kv-save", daemon=True)
        self._writer.start()

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
        if len(pages) < hit.blocks or len(block_hashes) < hit.blocks:
            raise ValueError(f"{hit.blocks} blocks to load but {len(pages)} pages and {len(block_hashes)} hashes")
        with self._lock:
            lease_id = self._leases.pop(hit.request_id, None)
        return _LayerwiseLoad(self, hit, block_hashes, pages, pool, lease_id)

    def save(self, request_id: str, block_hashes: Sequence[bytes], pages: Sequence[int], pool: PageBytes,
             parent: bytes | None) -> None:
        if not block_hashes or self.read_only:
            return
        payloads = []
        for page in pages[: len(block_hashes)]:
            payload = np.empty(self.spec.block_bytes, np.uint8)  # layer-major, as the store lays it out
            for layer in range(self.spec.num_layers):
                offset, size = self.spec.layer_range(layer)
                payload[offset : offset + size] = _host_view(pool.layer_page_bytes(layer, page))
            payloads.append(payload)
        self._saves.put((list(block_hashes), payloads, parent))

    def release(self, request_id: str) -> None:
        with self._lock:
            lease_id = self._leases.pop(request_id, None)
        self._end_lease(request_id, lease_id)

    def flush(self) -> None:
        self._saves.join()

    def close(self) -> None:
        self.flush()
        self._saves.put(None)
        self._writer.join()

    # ---- internals ---------------------------------------------------------------------

    def _end_lease(self, request_id: str, lease_id: int | None) -> None:
        if lease_id is None:
            return
        try:
            self.store.release(lease_id)
        except UnknownLease:
            pass  # expired meanwhile: nothing left to end

    def _write_saves(self) -> None:
        while True:
            item = self._saves.get()
            try:
                if item is None:
                    return
                hashes, payloads, parent = item
                self.store.put(self.ns_id, hashes, payloads, parent=parent)
            except Exception:
                log.exception("saving blocks to the store failed; they stay uncached")
            finally:
                self._saves.task_done()
