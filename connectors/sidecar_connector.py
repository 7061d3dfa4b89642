"""The client connector: the same ``KVConnector`` as ``StoreConnector``, over the gRPC sidecar.

Several engine processes on one host each hold a ``SidecarConnector`` to the same sidecar
(``kvstore serve``) and so share one store: what one engine saves, another loads.

    connector = SidecarConnector("127.0.0.1:50551", namespace)   # or "unix:/run/kvstore.sock"

How each side maps onto the sidecar's calls (``KVStoreClient``), fast path chosen automatically:

- ``lookup``: one ``Lookup`` with a lease (at most ``max_lookup_blocks`` hashes: a longer prompt
  is looked up by its first ones, the hit is a prefix anyway).
- ``start_load``: a background thread calls ``GetSlots``, which leases the whole hit and says
  where its host-tier blocks sit in the sidecar's shared memory. Those are copied straight from
  the mapping into the engine's pages (same host: one copy, no bytes through gRPC). Where the
  segment cannot be mapped (another host or container) the sidecar's native data plane streams
  them instead (``ReadSlots``, ``max_transfer_blocks`` (and ``max_transfer_bytes``) at a time through reused host buffers). The
  rest (disk blocks, or everything when neither works) come through ``Get`` calls of at most
  ``max_transfer_blocks`` blocks into one reused set of host buffers. A copied layer is signalled
  ready only once no slot can have been reused under it: the slots' lease cannot end before its
  TTL has passed since the GetSlots call was made, so when the whole hit is mapped here each layer
  is signalled as soon as it is copied, if that is within half the TTL of the call (``_scatter_layers``:
  layer 0 of the suffix computes while later layers copy, as with ``StoreConnector``). Every other
  layer waits for the slots' lease to be released *successfully* (it was alive through every copy);
  if it expired meanwhile the load fails and the engine recomputes.
- ``save``: copies the pages out into payloads (``connectors._copy_out``, like
  ``StoreConnector``), then a background writer hands them over with ``put_shm`` (staging slots
  in shared memory, verified by the sidecar at commit; ``Put`` where that cannot be used), at
  most ``max_transfer_blocks`` (and ``max_transfer_bytes``) a call.
- ``demote``: a probe ``Lookup`` (no lease, not counted) first; only a block the sidecar lacks is
  saved, as ``save`` does, copied before ``demote`` returns.
- ``report_prefill``: one ``ReportPrefill`` on a background thread, for the sidecar's metrics.

A sidecar that is down, restarting or refusing never crashes the engine: ``lookup`` returns a
0-block hit, a load fails with ``LoadFailed`` (the engine recomputes; so does a load still not
done after ``load_timeout_s``), a save is logged and dropped. A sidecar that answers but whose
disk hangs costs one load its deadline: hits then stop at its host tier for a back-off window
(``connectors.lower_tiers``), as with ``StoreConnector``. The namespace is registered lazily and again after ``NOT_FOUND`` (a restarted sidecar):
``connectors.sidecar_session``.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Sequence

import grpc
import numpy as np

from connectors._copy_out import copy_out
from connectors._pages import (DEFAULT_LOAD_TIMEOUT_S, DEFAULT_LOOKUP_TIMEOUT_S, BackgroundLoad, PageFence,
                              check_call_timeout, check_lease_ttl, check_load_timeout, load_targets,
                              queued_engine_work, save_targets, scatter_layer)
from connectors._save_writer import DEFAULT_MAX_PENDING_SAVE_BYTES, SaveDropped, SaveWriter
from connectors.base import ConnectorHit, KVConnector, LoadFailed, LoadHandle, PageBytes
from connectors.lower_tiers import LowerTiers
from connectors.request_leases import RequestLeases
from connectors.sidecar_session import NOT_ANSWERING, SidecarNotAnswering, SidecarSession, describe
from connectors.store_connector import DEFAULT_LEASE_TTL_S
from kvstore.keys import Namespace
from kvstore.layout import BlockSpec
from kvstore.service.client import KVStoreClient
from kvstore.service.limits import ServiceLimits
from kvstore.tiers.host import HostTier

log = logging.getLogger(__name__)
DEMOTE_PROBE_TIMEOUT_S = 0.05  # an evicting engine's thread waits this long for "does the sidecar hold it?"
DEFAULT_TIMEOUT_S = 30.0


class SidecarConnector(KVConnector):
    def __init__(self, sidecar: str | KVStoreClient, namespace: Namespace, lease_ttl_s: float = DEFAULT_LEASE_TTL_S,
                 read_only: bool = False, timeout_s: float | None = DEFAULT_TIMEOUT_S,
                 limits: ServiceLimits = ServiceLimits(), load_timeout_s: float | None = DEFAULT_LOAD_TIMEOUT_S,
                 lookup_timeout_s: float = DEFAULT_LOOKUP_TIMEOUT_S,
                 max_pending_save_bytes: int = DEFAULT_MAX_PENDING_SAVE_BYTES):
        """``sidecar``: ``HOST:PORT``, ``unix:PATH`` or a client (then the caller closes it).
        ``limits`` must match the sidecar's (transfer batch size, chunk and message sizes):
        ``ServiceLimits.from_env()`` reads the ``KVSTORE_MAX_*`` variables as the sidecar does
        (``connector_from_config`` passes it).
        ``timeout_s`` bounds each call to the sidecar, ``lookup_timeout_s`` a lookup (the engine
        waits on it), ``load_timeout_s`` a whole load, after which the engine gives up on it and
        recomputes (None: no bound). A sidecar that stops answering is skipped for a back-off
        window (``SidecarSession``): lookups are misses at once meanwhile. Saves waiting for the
        sidecar beyond ``max_pending_save_bytes`` are dropped (``SaveWriter``). ``lease_ttl_s``: how
        long a lookup or a load pins its blocks, in (0, ``kvstore.store.MAX_LEASE_TTL_S``]; anything
        else raises ``ValueError`` (the sidecar would refuse every lookup)."""
        check_call_timeout("lookup_timeout_s", lookup_timeout_s)
        check_call_timeout("timeout_s", timeout_s, none_ok=True)
        check_lease_ttl(lease_ttl_s)
        self.lookup_timeout_s = lookup_timeout_s
        self.load_timeout_s = check_load_timeout(load_timeout_s)
        self._owns_client = not isinstance(sidecar, KVStoreClient)
        self.client = KVStoreClient(sidecar, timeout_s=timeout_s, limits=limits) if self._owns_client else sidecar
        self.target = sidecar if self._owns_client else None
        self.namespace = namespace
        self.ns_id = namespace.id  # the store's id of a namespace is its content hash
        self.spec = BlockSpec.of(namespace)
        self.read_only = read_only  # load hits but never save or demote
        self.lease_ttl_s = lease_ttl_s
        self.limits = limits
        self._batch = limits.transfer_blocks(self.spec.block_bytes) or 1  # blocks a Put or Get may carry
        self._lower_tiers = LowerTiers([HostTier.name], self.load_timeout_s)  # the sidecar's one memory tier
        self.session = SidecarSession(self.client, namespace, self.target or "",
                                      meanwhile="the engine serves without it (misses)")
        self._leases = RequestLeases(self.spec.block_size, self._lower_tiers, self._end_lease)
        self._saves = SaveWriter(self._put, "saving blocks to the sidecar failed; they stay uncached", logger=log,
                                 max_pending_bytes=max_pending_save_bytes)
        self._reports = ThreadPoolExecutor(1, thread_name_prefix="kvstore-report")  # off the engine's step
        try:
            self.session.register()
        except Exception as exc:
            self.session.failed("register the namespace", exc)

    @property
    def layout(self) -> BlockSpec:
        return self.spec

    @property
    def namespace_id(self) -> bytes:
        return self.namespace.id

    # ---- lookup side -------------------------------------------------------------------

    def lookup(self, request_id: str, block_hashes: Sequence[bytes]) -> ConnectorHit:
        self.release(request_id)
        hashes = list(block_hashes[: self.limits.max_lookup_blocks])
        try:
            result = self.session.call(lambda: self.client.lookup(self.ns_id, hashes, lease_ttl_s=self.lease_ttl_s,
                                                                  timeout_s=self.lookup_timeout_s),
                                       timeout_s=self.lookup_timeout_s)
        except Exception as exc:
            self.session.failed("look up", exc)
            result = None
        return self._leases.hit(request_id, result)

    # ---- transfer side -----------------------------------------------------------------

    def start_load(self, hit: ConnectorHit, block_hashes: Sequence[bytes], pages: Sequence[int],
                   pool: PageBytes) -> LoadHandle:
        hashes, pages = load_targets(hit, block_hashes, pages)
        engine_work = queued_engine_work(pool, pages)  # on the engine's thread: its stream's work so far
        lease_id = self._leases.take(hit.request_id)
        reading_below = threading.Event()  # set while the load reads blocks below memory
        abandoned = threading.Event()  # the engine gave up on the load

        def fetch_and_copy(layer_done, fence) -> None:
            asked = time.monotonic()  # the slots' lease lasts at least lease_ttl_s from here
            grant = self.client.get_slots(self.ns_id, hashes, self.lease_ttl_s)  # pins the whole hit
            kept = 0  # the slots' copies the load keeps (for the sidecar's metrics): none if it fails
            try:
                in_memory = self.client.slot_views(grant)[: len(hashes)]  # same host: mapped shared memory
                if hashes and len(in_memory) == len(hashes):  # all of it: layer by layer
                    self._scatter_layers(pool, pages, in_memory, fence, layer_done, self._proven_until(asked))
                    done = len(in_memory)
                else:
                    self._scatter(pool, pages[: len(in_memory)], in_memory, fence)
                    done = len(in_memory) or self._stream_into(pool, pages, grant, fence)  # another host: the data plane
                    below = self._lower_tiers.below_memory(hit.tiers[done : len(hashes)])
                    self._fetch_into(pool, hashes[done:], pages[done:], fence, reading_below if below else None,
                                     abandoned)
                kept = done
            finally:
                intact = self.client.release_grant(grant, kept)
            if not intact:  # the lease ran out while we copied: a slot may have been reused meanwhile
                raise LoadFailed(f"the sidecar's lease on {len(hashes)} blocks expired during the copy")
            layer_done(self.spec.num_layers)

        def finish() -> None:  # the lookup's lease: the slots' own lease pinned the copy
            self._end_lease(lease_id)

        def given_up(cancelled: bool) -> None:
            abandoned.set()
            if reading_below.is_set() and not cancelled:  # stuck below memory past the deadline
                self._lower_tiers.hung()

        try:
            return BackgroundLoad(hit.request_id, len(hashes), self.spec.num_layers, fetch_and_copy, finish,
                                  logger=log, deadline_s=self.load_timeout_s, on_abandon=given_up, before=engine_work)
        except BaseException:  # no load thread: nothing else would end the lease taken from the request
            finish()
            raise

    def _stream_into(self, pool: PageBytes, pages: list[int], grant, fence: PageFence) -> int:
        """The grant's slots through the sidecar's data plane, ``max_transfer_blocks`` at a time;
        returns how many leading blocks landed in their pages (0 without a data plane)."""
        count = min(len(grant.slots), len(pages))
        buffers = [np.empty(self.spec.block_bytes, np.uint8) for _ in range(min(self._batch, count))]
        for start in range(0, count, self._batch):
            dsts = buffers[: min(self._batch, count - start)]
            if self.client.stream_slots(grant, dsts, start) != len(dsts):
                return start
            self._scatter(pool, pages[start : start + len(dsts)], dsts, fence)
        return count

    def _fetch_into(self, pool: PageBytes, hashes: list[bytes], pages: list[int], fence: PageFence,
                    reading_below: threading.Event | None = None, abandoned: threading.Event | None = None) -> None:
        """Whole blocks through Get (on disk, or a sidecar whose memory cannot be mapped here), in
        batches of at most ``max_transfer_blocks`` through one reused set of host buffers.
        ``reading_below``, if given (some of them are below memory), is set meanwhile; an answer
        before the load is ``abandoned`` tells the lower tiers' back-off they answer."""
        if reading_below is None or not hashes:
            self._fetch_batches(pool, hashes, pages, fence)
            return
        reading_below.set()
        try:
            self._fetch_batches(pool, hashes, pages, fence)
        finally:
            reading_below.clear()
            if not abandoned.is_set():
                self._lower_tiers.answered()

    def _fetch_batches(self, pool: PageBytes, hashes: list[bytes], pages: list[int], fence: PageFence) -> None:
        buffers = [np.empty(self.spec.block_bytes, np.uint8) for _ in range(min(self._batch, len(hashes)))]
        for start in range(0, len(hashes), self._batch):
            batch, dsts = hashes[start : start + self._batch], buffers[: len(hashes[start : start + self._batch])]
            result = self.client.load(self.ns_id, batch, dsts)
            if result.loaded_blocks < len(batch):
                raise LoadFailed(f"block {batch[result.loaded_blocks].hex()} could not be loaded from the sidecar")
            self._scatter(pool, pages[start : start + self._batch], dsts, fence)

    def _scatter(self, pool: PageBytes, pages: Sequence[int], payloads: Sequence[np.ndarray], fence: PageFence) -> None:
        """Payloads already in memory (the load's buffers, or pinned shared memory) into their pages."""
        with fence:
            for layer in range(self.spec.num_layers):
                scatter_layer(self.spec, pool, layer, pages, payloads)

    def _proven_until(self, asked: float) -> float:
        """Until when a copy out of slots granted by a GetSlots call made at ``asked`` is proven
        intact: half the lease's TTL later (the lease, taken after ``asked``, lasts the whole TTL;
        one host's processes share the monotonic clock's rate)."""
        return asked + self.lease_ttl_s / 2

    def _scatter_layers(self, pool: PageBytes, pages: Sequence[int], slots: Sequence[np.ndarray], fence: PageFence,
                        layer_done, proven_until: float) -> None:
        """Mapped slots into their pages one layer at a time, each layer signalled done (``layer_done``)
        once copied if that was before ``proven_until`` (a ``time.monotonic()`` instant well inside
        the slots' lease: no slot could have been reused under the copy). A layer copied later is
        signalled only after a successful release, as the caller does for the whole load."""
        for layer in range(self.spec.num_layers):
            with fence:
                scatter_layer(self.spec, pool, layer, pages, slots)
            if time.monotonic() < proven_until:
                layer_done(layer + 1)

    def report_prefill(self, request_id: str, saved_tokens: int, computed_tokens: int) -> None:
        try:
            self._reports.submit(self._report, saved_tokens, computed_tokens)
        except RuntimeError:  # closed: a report is metrics only, never worth an engine error
            log.debug("prefill report after close dropped")

    def _report(self, saved_tokens: int, computed_tokens: int) -> None:
        try:
            self.session.call(lambda: self.client.report_prefill(self.ns_id, saved_tokens, computed_tokens))
        except Exception as exc:
            log.debug("reporting a prefill to the sidecar failed: %s", describe(exc))

    def save(self, request_id: str, block_hashes: Sequence[bytes], pages: Sequence[int], pool: PageBytes,
             parent: bytes | None) -> None:
        if not block_hashes or self.read_only:
            return
        pages = save_targets(block_hashes, pages)
        self._saves.save(block_hashes, len(pages) * self.spec.block_bytes, lambda: copy_out(self.spec, pool, pages),
                         parent)

    def demote(self, block_hash: bytes, page: int, pool: PageBytes, parent: bytes | None) -> None:
        """Save the evicted page's block unless the sidecar holds it already (the usual case: the
        engine saved it when it was computed): one probe ``Lookup`` (``KVStoreClient.holds``: no
        lease, no lookup counted) instead of copying every layer of the page out and sending a
        duplicate the sidecar drops, as until session 35. The engine's thread waits for the probe
        at most ``DEMOTE_PROBE_TIMEOUT_S``; a probe that fails or takes longer saves it anyway,
        and counts for nothing in the sidecar's back-off (the save's own call does). No probe
        while the sidecar is being skipped."""
        if self.read_only:
            return
        if not self.session.backoff.retry_in_s():
            try:
                if self.client.holds(self.ns_id, block_hash, timeout_s=DEMOTE_PROBE_TIMEOUT_S):
                    return
            except grpc.RpcError:  # unknown namespace (a restarted sidecar), past the wait...: the save decides
                pass
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
        self._reports.shutdown(wait=True)
        self._leases.release_all()
        if self._owns_client:
            self.client.close()

    def stats(self):
        """The sidecar's ``StoreStats`` (raises ``grpc.RpcError`` if it cannot be reached)."""
        return self.client.stats()

    # ---- internals ---------------------------------------------------------------------

    def _put(self, hashes: list[bytes], payloads: list[np.ndarray], parent: bytes | None) -> None:
        """A save's blocks, batch by batch, until a batch has blocks the store rejected (no room:
        the blocks after them would hang under a missing parent, which no lookup reaches). A
        sidecar not answering drops the rest of them (``SaveDropped``: the writer counts a failed
        save; the session logs the outage once)."""
        for start in range(0, len(hashes), self._batch):
            batch = slice(start, start + self._batch)
            batch_parent = parent if start == 0 else hashes[start - 1]
            try:
                result = self.session.call(partial(self.client.put_shm, self.ns_id, hashes[batch], payloads[batch],
                                                   parent=batch_parent))
            except (grpc.RpcError, SidecarNotAnswering) as exc:
                if isinstance(exc, grpc.RpcError) and exc.code() not in NOT_ANSWERING:
                    raise
                self.session.failed("save", exc)
                raise SaveDropped(f"the sidecar did not answer; {len(hashes) - start} blocks of the save dropped") \
                    from exc
            if result.rejected:
                return

    def _end_lease(self, lease_id: int | None) -> None:
        if lease_id is None:
            return
        try:  # on the engine's thread: bounded like a lookup; skipped while the sidecar is not answering (its TTL ends it)
            self.session.call(lambda: self.client.release(lease_id, timeout_s=self.lookup_timeout_s),
                              needs_namespace=False)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.NOT_FOUND:  # NOT_FOUND: expired or ended meanwhile
                log.debug("releasing lease %d on the sidecar failed: %s", lease_id, describe(exc))
        except Exception as exc:
            log.debug("releasing lease %d on the sidecar failed: %s", lease_id, exc)

