"""The in-process connector: ``KVConnector`` over a ``TieredStore`` in the engine's own process.

Loads run on a background thread, layer-major: layer 0 of every hit block, then layer 1, ... so
the engine's forward pass can start layer 0 of the suffix while later layers are still arriving
(``LoadHandle.wait_layer``). A save copies each block's layers out of the engine's pages into
one payload (``connectors._copy_out``: at once from host pages; from CUDA pages by a gather
and an asynchronous copy to pinned memory queued on a copy stream, untested on a GPU, which
``wait_copied`` waits for before the engine reuses the pages); a background writer then puts
them into the store. Nothing of a save runs on the engine's critical path beyond that copy.

Device pages are read and written through ``PageBytes.layer_page_bytes``. Only memory
copies write the engine's pages: out of the host tier's shared memory (zero-copy views the
lookup's lease pins, ``TieredStore.leased_views``), or out of the load's own buffers for disk
blocks. So a load whose read hangs (a stuck disk, the store's lock held) is abandoned after
``load_timeout_s`` and the engine recomputes without waiting for it
(``connectors._pages.BackgroundLoad``). Like a sidecar that is down, a closed store is a miss
(``StoreClosed``), warned about once until it answers again; a caller's mistake the store refuses
(``InvalidRequest``: malformed hashes) still raises. A lease the store fails to end is logged and
left to its TTL.
"""

from __future__ import annotations

import logging
import threading
from typing import Sequence

import numpy as np

from connectors.backoff import Backoff
from connectors._copy_out import copy_out
from connectors._pages import (DEFAULT_LOAD_TIMEOUT_S, DEFAULT_LOOKUP_TIMEOUT_S, BackgroundLoad, check_call_timeout,
                              check_lease_ttl, check_load_timeout, load_targets, queued_engine_work, save_targets,
                              scatter_layer)
from connectors._save_writer import DEFAULT_MAX_PENDING_SAVE_BYTES, SaveWriter
from connectors.base import ConnectorHit, KVConnector, LoadFailed, LoadHandle, PageBytes
from connectors.lower_tiers import LowerTiers
from connectors.request_leases import RequestLeases
from kvstore.errors import KVStoreError, StoreClosed, UnknownLease
from kvstore.keys import Namespace
from kvstore.layout import BlockSpec
from kvstore.results import LookupResult
from kvstore.store import TieredStore

log = logging.getLogger(__name__)
DEFAULT_LEASE_TTL_S = 60.0
DEMOTE_CHECK_WAIT_S = 0.01  # an evicting engine's thread asks whether the store holds the block this long
RELEASE_WAIT_S = 0.05  # the engine's thread waits this long for the store's lock to end a lease, then hands it off


class StoreConnector(KVConnector):
    def __init__(self, store: TieredStore, namespace: Namespace, lease_ttl_s: float = DEFAULT_LEASE_TTL_S,
                 read_only: bool = False, load_timeout_s: float | None = DEFAULT_LOAD_TIMEOUT_S,
                 lookup_timeout_s: float = DEFAULT_LOOKUP_TIMEOUT_S,
                 max_pending_save_bytes: int = DEFAULT_MAX_PENDING_SAVE_BYTES):
        """``load_timeout_s``: how long the engine waits for a load before it gives up on it and
        recomputes (``BackgroundLoad``); None waits forever. ``lookup_timeout_s``: how long a
        lookup waits for the store's lock (never held through disk I/O, but its holder can be
        descheduled) before it answers a miss. Ending a lease never waits on the engine's thread: a busy store's lock
        hands it to a thread of its own. ``max_pending_save_bytes``: saves waiting for the store
        beyond this are dropped (``SaveWriter``). ``lease_ttl_s``: how long a lookup pins its hit
        for the load, in (0, ``kvstore.store.MAX_LEASE_TTL_S``]; anything else raises ``ValueError``."""
        check_call_timeout("lookup_timeout_s", lookup_timeout_s)
        check_lease_ttl(lease_ttl_s)
        self.store = store
        self.load_timeout_s = check_load_timeout(load_timeout_s)
        self.lookup_timeout_s = lookup_timeout_s
        self.read_only = read_only  # load hits but never save or demote (consumer-only engines, A/B runs)
        self.ns_id = store.register_namespace(namespace)
        self.spec = store.spec(self.ns_id)
        self.lease_ttl_s = lease_ttl_s
        self._saves = SaveWriter(lambda hashes, payloads, parent: self.store.put(self.ns_id, hashes, payloads,
                                                                                 parent=parent), logger=log,
                                 max_pending_bytes=max_pending_save_bytes)
        self._lookups_failing = False  # the last lookup raised: warned once, until one answers
        self._store_lock = Backoff(initial_s=1.0, max_s=15.0)  # a lock that stayed held: skip lookups a while
        self._lower_tiers = LowerTiers((tier.name for tier in store.tiers if tier.in_memory), self.load_timeout_s)
        self._leases = RequestLeases(self.spec.block_size, self._lower_tiers, self._end_lease)

    @property
    def layout(self) -> BlockSpec:
        return self.spec

    @property
    def namespace_id(self) -> bytes:
        return self.ns_id

    # ---- lookup side -------------------------------------------------------------------

    def lookup(self, request_id: str, block_hashes: Sequence[bytes]) -> ConnectorHit:
        self.release(request_id)
        return self._leases.hit(request_id, self._store_lookup(block_hashes))

    def _store_lookup(self, block_hashes: Sequence[bytes]) -> LookupResult | None:
        """The store's answer with a lease; None (a miss) while its lock is being skipped or when
        it is closed (logged once until it answers again)."""
        if not self._store_lock.allow():  # held past lookup_timeout_s lately: a miss without a wait
            return None
        try:
            result = self.store.lookup(self.ns_id, block_hashes, lease_ttl_s=self.lease_ttl_s,
                                       wait_s=self.lookup_timeout_s)
        except StoreClosed as exc:
            if not self._lookups_failing:
                log.warning("the store cannot look up blocks (%s: %s); lookups are misses until it answers",
                            type(exc).__name__, exc)
            self._lookups_failing = True
            return None
        if self._lookups_failing:
            log.info("the store answers lookups again")
            self._lookups_failing = False
        self._store_lock.not_answering() if result.busy else self._store_lock.answered()
        return result

    # ---- transfer side -----------------------------------------------------------------

    def start_load(self, hit: ConnectorHit, block_hashes: Sequence[bytes], pages: Sequence[int],
                   pool: PageBytes) -> LoadHandle:
        hashes, pages = load_targets(hit, block_hashes, pages)
        engine_work = queued_engine_work(pool, pages)  # on the engine's thread: its stream's work so far
        lease_id = self._leases.take(hit.request_id)
        reading_below = threading.Event()  # set while the load reads blocks below memory
        abandoned = threading.Event()  # the engine gave up on the load

        def copy_layer_major(layer_done, fence) -> None:  # layer 0 of every block, then layer 1, ...
            # Blocks the lease pins in the host tier are copied straight out of its shared memory,
            # a layer at a time. The rest (disk) are read whole into the load's own buffers first:
            # one large verified read per block instead of a small, latency-bound read per layer.
            views = self.store.leased_views(self.ns_id, hashes, lease_id) if lease_id is not None else []
            below = self._lower_tiers.below_memory(hit.tiers[len(views) : len(hashes)])  # else no verdict on them
            sources = [view for _, view in views] + self._read_below(hashes[len(views):],
                                                                    reading_below if below else None, abandoned)
            for layer in range(self.spec.num_layers):
                with fence:  # memory copies only: a read that hangs never holds the fence
                    scatter_layer(self.spec, pool, layer, pages, sources)
                if views and not self.store.lease_alive(lease_id):  # a slot may have been reused mid-copy
                    raise LoadFailed(f"the lease on {len(hashes)} blocks ended during the copy")
                layer_done(layer + 1)
            for tier in {name for name, _ in views}:
                self.store.record_access(self.ns_id, [h for h, (name, _) in zip(hashes, views) if name == tier], tier)

        def given_up(cancelled: bool) -> None:
            abandoned.set()
            if reading_below.is_set() and not cancelled:  # stuck below memory past the deadline
                self._lower_tiers.hung()  # (a cancel there gives no verdict: a probe lapses)
            self._end_lease(lease_id)  # the fence is closed: nothing reads the views now

        try:
            return BackgroundLoad(hit.request_id, len(hashes), self.spec.num_layers, copy_layer_major,
                                  lambda: self._end_lease(lease_id), logger=log,
                                  deadline_s=self.load_timeout_s, on_abandon=given_up, before=engine_work)
        except BaseException:  # no load thread: nothing else would end the lease taken from the request
            self._end_lease(lease_id)
            raise

    def _read_below(self, hashes: list[bytes], reading: threading.Event | None,
                    abandoned: threading.Event) -> list[np.ndarray]:
        """``hashes``' payloads read whole, with ``reading`` set meanwhile where given (the lookup
        saw some of them below memory). An answer in time (a corrupt block too) then tells the
        lower tiers' back-off they answer; one that comes after the load was given up on
        (``abandoned``) tells it nothing: they answer, but too late. Reads of blocks the lookup
        saw in memory (their lease ended first) tell it nothing either."""
        if reading is None or not hashes:
            return [self._read_whole(h) for h in hashes]
        reading.set()
        try:
            return [self._read_whole(h) for h in hashes]
        finally:
            reading.clear()
            if not abandoned.is_set():
                self._lower_tiers.answered()

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
        pages = save_targets(block_hashes, pages)
        self._saves.save(block_hashes, len(pages) * self.spec.block_bytes, lambda: copy_out(self.spec, pool, pages),
                         parent)

    def demote(self, block_hash: bytes, page: int, pool: PageBytes, parent: bytes | None) -> None:
        """Save the evicted page's block unless the store holds it already: the engine saved it
        when it was computed, so that is the usual case, and the save would copy every layer of
        the page out for a duplicate the store drops. A store lock busy past
        ``DEMOTE_CHECK_WAIT_S`` (the engine's thread is waiting) saves it anyway."""
        if self.read_only:
            return
        try:
            if self.store.holds(self.ns_id, block_hash, wait_s=DEMOTE_CHECK_WAIT_S):
                return
        except StoreClosed:
            return  # nothing would store it
        super().demote(block_hash, page, pool, parent)

    def release(self, request_id: str) -> None:
        self._leases.release(request_id)

    def flush(self) -> None:
        self._saves.flush()

    def wait_copied(self) -> None:
        """Wait for the copies of saves out of CUDA pages (``connectors._copy_out``); host pages
        were copied before ``save`` returned."""
        self._saves.wait_copied()

    def close(self) -> None:
        self._saves.close()
        self._leases.release_all()

    # ---- internals ---------------------------------------------------------------------

    def _end_lease(self, lease_id: int | None) -> None:
        """End ``lease_id`` if there is one; never raises for the store (its TTL ends what this cannot)."""
        if lease_id is None:
            return
        try:
            if not self.store.try_release(lease_id, RELEASE_WAIT_S):  # the lock is held (disk I/O?)
                threading.Thread(target=self._end_lease_blocking, args=(lease_id,), name="kv-lease-end",
                                 daemon=True).start()
        except KVStoreError as exc:
            _lease_not_ended(lease_id, exc)

    def _end_lease_blocking(self, lease_id: int) -> None:
        try:
            self.store.release(lease_id)
        except KVStoreError as exc:
            _lease_not_ended(lease_id, exc)


def _lease_not_ended(lease_id: int, exc: Exception) -> None:
    if not isinstance(exc, UnknownLease):  # unknown: expired meanwhile, nothing left to end
        log.debug("ending lease %d failed (%s: %s); its TTL ends it", lease_id, type(exc).__name__, exc)
