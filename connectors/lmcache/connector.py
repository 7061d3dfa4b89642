"""LMCache's remote connector over the kvstore sidecar.

Each LMCache object is one block of the namespace of its LMCache configuration (``namespace.py``),
framed with its metadata and checksum (``framing.py``), under the block hash
``xxh3_128(CacheEngineKey.to_string())``; every block is its own chain head (no parent). How each
LMCache call maps onto the sidecar (``KVStoreClient``):

    exists, exists_sync,          one Lookup of the keys' hashes; its contiguous hit is the count
    batched_contains,             of leading keys present, which is LMCache's prefix semantics
    batched_async_contains        (``pin`` is not needed: a get leases what it copies); only those
                                  in host memory while reads below memory are backed off
    get, batched_get,             GetSlots leases the leading present blocks and locates those in
    batched_get_non_blocking      the host tier's shared memory: each is copied from the mapping
                                  straight into a MemoryObj that LMCache allocates (one copy), or
                                  on another host streamed by the sidecar's native data plane
                                  into a scratch block; the rest (disk, or no data plane) come
                                  through Get into a scratch block (not those below memory while
                                  reads there are backed off)
    put, batched_put              each object framed into a scratch block, then put_shm (staging
                                  slots in shared memory, verified by the sidecar; Put where that
                                  cannot be used)
    ping                          RegisterNamespace (idempotent; re-registers after a restart)
    list                          the keys this connector stored or served that the sidecar still
                                  holds (it indexes hashes, so it cannot name other processes' keys)

A sidecar that answers but whose disk hangs costs one get a deadline (``timeout_s``, the bound on
each of its calls, Get included): a Get below memory that runs past it while the sidecar still
answers a lookup (within ``lookup_timeout_s``) opens a back-off window on reads below memory
(``below_memory.py``). Meanwhile lookups count and gets read only the leading blocks held in the
host tier, so LMCache loads what memory holds and recomputes the rest at once, and host-memory hits
are still served. A sidecar that does not answer the lookup either is backed off whole, as for any
call it does not answer (``SidecarSession``). ``list`` reports keys in any tier: it plans no get.

Every object is verified after it is copied into LMCache's memory (its key digest, size and
checksum), and its stored description before (``chunk_meta``: the shapes, dtypes and format this
configuration writes), so a stale shared-memory slot, a short read or a wrong block is a miss.
Nothing raises into LMCache: a sidecar that is down, a corrupt object, no free memory, a call after
``close`` are all misses (gets, lookups) or dropped stores (puts), logged and counted in ``counts()``.

Ownership: a returned MemoryObj holds one reference, LMCache's; the objects of a get LMCache gave
up on (cancelled) are freed here. ``put`` takes a reference of its own on each object for as long
as a worker thread reads it (LMCache's wrapper drops its reference once ``put`` returns or is
cancelled) and drops it after. Threads (``workers.py``): LMCache runs the async methods on its event
loop and the sync lookups on its own threads; the blocking sidecar calls run on ``workers``
threads, and a cancelled call stops before its next sidecar call. ``close`` never blocks the loop,
and writes every put LMCache handed over before it.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
from functools import partial
from typing import List, Sequence

import grpc
import numpy as np
from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector

from connectors.lmcache import framing
from connectors.lmcache.below_memory import BelowMemoryWindow, PastDeadline, load_in_time
from connectors.lmcache.chunk_meta import ChunkGeometry, dtype_name, object_meta, require_whole_chunks
from connectors.lmcache.config import PluginConfig, warn_if_hash_seed_random
from connectors.lmcache.framing import CorruptObject, key_digest
from connectors.lmcache.known_keys import KnownKeys
from connectors.lmcache.rebuild import rebuild
from connectors.lmcache.namespace import lmcache_namespace
from connectors.lmcache.workers import Call, Workers
from connectors.sidecar_session import SidecarSession, not_answering
from kvstore.buffers import byte_view
from kvstore.layout import BlockSpec
from kvstore.results import LookupResult
from kvstore.service.client import KVStoreClient
from kvstore.service.limits import ServiceLimits
from kvstore.tiers.host import HostTier

log = logging.getLogger(__name__)
PING_CLOSED = grpc.StatusCode.CANCELLED.value[0]  # ping's answer once the connector is closed


class KVStoreConnector(RemoteConnector):
    def __init__(self, config, metadata, loop: asyncio.AbstractEventLoop, local_cpu_backend,
                 settings: PluginConfig, limits: ServiceLimits = ServiceLimits()):
        """Connects lazily: a sidecar that is down now only makes every call a miss until it answers.
        Raises ``InvalidRequest`` for LMCache settings whose objects it cannot serve (``require_whole_chunks``)."""
        require_whole_chunks(config)
        warn_if_hash_seed_random()
        super().__init__(config, metadata)  # meta_shapes, meta_dtypes, meta_fmt, full_chunk_size_bytes
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        self.settings = settings
        self.namespace = lmcache_namespace(metadata.model_name, metadata.chunk_size, self.full_chunk_size_bytes,
                                           self._identity(metadata), settings.cache_salt, settings.weights_hash)
        self.spec = BlockSpec.of(self.namespace)
        self.client = KVStoreClient(settings.address, timeout_s=settings.timeout_s, limits=limits,
                                    token=settings.bearer_token(), root_certificates=settings.root_certificates(),
                                    shared_memory=settings.shared_memory)
        self.session = SidecarSession(self.client, self.namespace, settings.address, meanwhile="LMCache sees misses")
        # A Get below memory waits at most timeout_s (the client's bound on every call): that is the
        # deadline whose overrun opens the lower tiers' window, and what sizes it.
        self._below_memory = BelowMemoryWindow(HostTier.name, settings.timeout_s)  # the sidecar's one memory tier
        self._batch = limits.max_transfer_blocks
        self._lookup_batch = limits.max_lookup_blocks
        self.geometry = ChunkGeometry(tuple(self.meta_shapes), tuple(self.meta_dtypes), self.meta_fmt)
        self._workers = Workers(settings.workers, "kvstore-lmcache")
        self._scratch = threading.local()  # one [block_bytes] uint8 buffer per worker thread
        self._known = KnownKeys()
        self._counts: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()

    def _identity(self, metadata) -> dict[str, str]:
        """Everything besides model and chunk size that decides an object's bytes."""
        return {"kv_shape": "x".join(map(str, metadata.kv_shape)), "use_mla": str(bool(metadata.use_mla)).lower(),
                "shapes": ";".join("x".join(map(str, s)) for s in self.meta_shapes),
                "dtypes": ",".join(dtype_name(d) for d in self.meta_dtypes), "fmt": self.meta_fmt.name}

    # ---- lookups -----------------------------------------------------------------------

    async def exists(self, key: CacheEngineKey) -> bool:
        return await self._workers.run(0, self._count_present, [key]) == 1

    def exists_sync(self, key: CacheEngineKey) -> bool:
        return self.batched_contains([key]) == 1

    def support_batched_contains(self) -> bool:
        return True

    def batched_contains(self, keys: List[CacheEngineKey]) -> int:
        """How many leading ``keys`` the sidecar holds (0 when it cannot be reached or after close;
        only those in its host memory while reads below memory are backed off); runs on the
        caller's thread."""
        with self._workers.admitted() as call:
            return 0 if call is None else self._count_present(call, keys)

    def _count_present(self, call: Call, keys: List[CacheEngineKey]) -> int:
        digests = [key_digest(k.to_string()) for k in keys]
        found = 0
        try:
            for start in range(0, len(digests), self._lookup_batch):
                if call.stopped:
                    break
                batch = digests[start : start + self._lookup_batch]
                result = self._lookup(batch)
                hit = self._lookup_usable(result.tiers, result.hit_blocks)
                found += hit
                if hit < len(batch):
                    break
        except Exception as exc:
            self._failed("look up objects", exc)
        return found

    def _lookup(self, digests: list[bytes]) -> LookupResult:
        """Leading ``digests`` the sidecar holds, and their tiers; waits at most ``lookup_timeout_s``
        (registration too)."""
        bound = self.settings.lookup_timeout_s
        return self.session.call(partial(self.client.lookup, self.session.ns_id, digests, timeout_s=bound),
                                 timeout_s=bound)

    def _lookup_usable(self, tiers: Sequence[str], blocks: int) -> int:
        """How many of a lookup's ``blocks`` hit blocks (held in ``tiers``) to count
        (``BelowMemoryWindow.lookup_usable``), so that LMCache does not plan a get that would wait
        on a hung disk; what was cut counts in ``lookup_cut_below_memory``."""
        usable = self._below_memory.lookup_usable(tiers, blocks)
        if usable < blocks:
            self._count(lookup_cut_below_memory=blocks - usable)
        return usable

    def support_batched_async_contains(self) -> bool:
        return True

    async def batched_async_contains(self, lookup_id: str, keys: List[CacheEngineKey], pin: bool = False) -> int:
        return await self._workers.run(0, self._count_present, keys)

    # ---- gets --------------------------------------------------------------------------

    async def get(self, key: CacheEngineKey) -> MemoryObj | None:
        return (await self.batched_get([key]))[0]

    def support_batched_get(self) -> bool:
        return True

    async def batched_get(self, keys: List[CacheEngineKey]) -> List[MemoryObj | None]:
        """The objects of the leading keys present, then None for the rest."""
        objs = await self._get(keys)
        return objs + [None] * (len(keys) - len(objs))

    def support_batched_get_non_blocking(self) -> bool:
        return True

    async def batched_get_non_blocking(self, lookup_id: str, keys: List[CacheEngineKey]) -> List[MemoryObj]:
        return await self._get(keys)

    async def _get(self, keys: List[CacheEngineKey]) -> List[MemoryObj]:
        """The objects of the leading keys present. Cancelled (LMCache stopped waiting), the worker
        stops before its next sidecar call and the objects it rebuilt anyway are freed here."""
        return await self._workers.run([], self._get_leading, keys, unclaimed=self._free_unclaimed)

    def _get_leading(self, call: Call, keys: List[CacheEngineKey]) -> List[MemoryObj]:
        digests = [key_digest(k.to_string()) for k in keys]
        objs: list[MemoryObj] = []
        try:
            for start in range(0, len(digests), self._batch):
                if call.stopped:
                    break
                batch = digests[start : start + self._batch]
                objs += self._get_batch(call, batch)
                if len(objs) < start + len(batch):
                    break
        except Exception as exc:  # what was copied and verified before the failure stays valid
            self._failed("get objects", exc)
        self._count(hits=len(objs))
        self._known.remember(k.to_string() for k in keys[: len(objs)])
        return objs

    def _get_batch(self, call: Call, digests: List[bytes]) -> List[MemoryObj]:
        """The leading objects of ``digests`` (at most max_transfer_blocks), shared memory (or the
        data plane) first; fewer once ``call`` is stopped."""
        grant = self.session.call(partial(self.client.get_slots, self.session.ns_id, digests,
                                          self.settings.lease_ttl_s))
        if grant.lease_id is None:  # nothing present, or no lease to be had: then Get copes alone
            return self._fetch(call, digests, in_memory=0) if grant.lease_refused else []  # tiers unknown
        objs: list[MemoryObj] = []
        from_slots = 0  # the objects rebuilt from the grant's slots (for the sidecar's metrics)
        try:
            slots = self.client.slot_views(grant)  # the leading hit blocks in mapped host memory
            if not slots and grant.slots:  # another host: the data plane streams them
                objs, complete = self._stream(call, grant, digests)
                from_slots = len(objs)
                self._count(hits_data_plane=len(objs))
                if not complete:
                    return objs
                return objs + self._fetch(call, digests[len(objs) : grant.hit_blocks], len(grant.slots) - len(objs))
            for digest, slot in zip(digests, slots):
                obj = None if call.stopped else self._rebuild(digest, slot)
                if obj is None:
                    break
                objs.append(obj)
            from_slots = len(objs)
            self._count(hits_shared_memory=len(objs))
            if len(objs) < len(slots):
                return objs
            return objs + self._fetch(call, digests[len(objs) : grant.hit_blocks], len(grant.slots) - len(objs))
        except BaseException:
            _free(objs)
            from_slots = 0
            raise
        finally:
            self._release(grant, from_slots)

    def _stream(self, call: Call, grant, digests: List[bytes]) -> tuple[List[MemoryObj], bool]:
        """The grant's slots through the data plane, one at a time into the scratch block. Returns
        the objects and whether every slot was served (False: an object was corrupt, there was no
        memory or ``call`` stopped, so the caller stops there; a failed stream leaves the rest to Get)."""
        block = self._scratch_block()
        objs: list[MemoryObj] = []
        try:
            for index, digest in enumerate(digests[: len(grant.slots)]):
                if call.stopped:
                    return objs, False
                if self.client.stream_slots(grant, [block], index) != 1:
                    break
                obj = self._rebuild(digest, block)
                if obj is None:
                    return objs, False
                objs.append(obj)
        except BaseException:
            _free(objs)
            raise
        return objs, True

    def _fetch(self, call: Call, digests: List[bytes], in_memory: int) -> List[MemoryObj]:
        """The leading objects of ``digests`` through Get, one block at a time into the scratch
        block, until ``call`` stops. The first ``in_memory`` are in the host tier; the others may be
        below memory (on disk): while the lower tiers' window is open the get stops before them, and
        a Get of one that passes its deadline ends the get there (``_load_below_memory``)."""
        block = self._scratch_block()
        objs: list[MemoryObj] = []
        try:
            for index, digest in enumerate(digests[: self._get_usable(max(0, in_memory), len(digests))]):
                if call.stopped:
                    break
                if index < in_memory:
                    loaded = self.session.call(partial(self.client.load, self.session.ns_id, [digest], [block]))
                else:
                    loaded = self._load_below_memory(digest, block)
                obj = self._rebuild(digest, block) if loaded is not None and loaded.complete else None
                if obj is None:
                    break
                objs.append(obj)
        except BaseException:
            _free(objs)
            raise
        return objs

    def _get_usable(self, in_memory: int, blocks: int) -> int:
        """How many of a get's ``blocks`` (the first ``in_memory`` in host memory) it may read now
        (``BelowMemoryWindow.get_usable``); the rest count in ``cut_below_memory``."""
        usable = self._below_memory.get_usable(in_memory, blocks)
        if usable < blocks:
            self._count(cut_below_memory=blocks - usable)
        return usable

    def _load_below_memory(self, digest: bytes, block: np.ndarray):
        """Get of one block that may be below memory: its ``LoadResult``, or None when the Get ran
        past its deadline (``timeout_s``) while the sidecar itself answers (a lookup, within
        ``lookup_timeout_s``): its disk hangs, so the lower tiers' window opens and the session's
        does not (host-memory hits keep being served). If the sidecar does not answer either, the
        Get's error is raised, as any call's: the session backs off the whole sidecar. A Get that
        answered in time, from below memory or with nothing (a block dropped as corrupt), closes
        the lower tiers' window."""
        try:
            loaded = self.session.call(partial(load_in_time, self.client, self.session.ns_id, digest, block))
        except PastDeadline as late:
            if not self._sidecar_answers(digest):
                raise late.error from None
            self._below_memory_hung(digest)
            return None
        if not loaded.tiers or self._below_memory.below_memory(loaded.tiers):
            self._below_memory_answered()
        return loaded

    def _sidecar_answers(self, digest: bytes) -> bool:
        """Whether the sidecar answers a lookup (it reads no tier) within ``lookup_timeout_s``; one
        that does not opens the session's back-off."""
        try:
            self._lookup([digest])
        except Exception as exc:
            return not not_answering(exc)
        return True

    def _below_memory_hung(self, digest: bytes) -> None:
        first = self._below_memory.hung()
        self._count(hung_below_memory=1)
        (log.warning if first else log.debug)(
            "kvstore sidecar %s: reading block %s below memory did not answer within %g s (timeout_s) while "
            "the sidecar answers; gets and lookups stop at its host memory for a while, then one get tries again",
            self.settings.address, digest.hex(), self.settings.timeout_s)

    def _below_memory_answered(self) -> None:
        if self._below_memory.answered():
            log.info("kvstore sidecar %s: reads below memory answer again", self.settings.address)

    def _rebuild(self, digest: bytes, block: np.ndarray) -> MemoryObj | None:
        """A verified copy of the object framed in ``block`` in memory LMCache allocates
        (``rebuild``); None when the block is not a valid object of ``digest`` or there is no
        memory (both counted)."""
        try:
            obj = rebuild(block, digest, self.geometry, self.local_cpu_backend)
        except CorruptObject as exc:
            return self._corrupt(digest, exc)
        if obj is None:
            self._count(no_memory=1)
        return obj

    def _release(self, grant, copied_blocks: int) -> None:
        try:
            self.client.release_grant(grant, copied_blocks)
        except Exception as exc:  # the lease ends by its TTL; every copy was verified on its own
            log.debug("releasing a lease on the kvstore sidecar failed: %s", exc)

    # ---- puts --------------------------------------------------------------------------

    async def put(self, key: CacheEngineKey, memory_obj: MemoryObj) -> None:
        await self.batched_put([key], [memory_obj])

    def support_batched_put(self) -> bool:
        return True

    async def batched_put(self, keys: List[CacheEngineKey], memory_objs: List[MemoryObj]) -> None:
        """Store the objects, in order, until one fails. Holds a reference on each while a worker
        may read it, so a cancelled put never reads memory LMCache has handed out again; cancelled,
        it stores no object after the one under way. A put that came before ``close`` is stored
        whole (close waits for it); one after it stores nothing. Every object not stored counts in
        ``put_failures``."""
        for obj in memory_objs:
            obj.ref_count_up()
        ran = await self._workers.run(False, self._put_all, keys, memory_objs, stops_at_close=False,
                                      finished=partial(_free, memory_objs))
        if not ran:
            self._count(put_failures=len(keys))

    def _put_all(self, call: Call, keys: List[CacheEngineKey], objs: List[MemoryObj]) -> bool:
        """True: it ran, and counted each object's outcome (``call`` stops only when cancelled)."""
        put = self.client.put_shm if self.settings.shared_memory else self.client.put
        block = self._scratch_block()
        for done, (key, obj) in enumerate(zip(keys, objs)):
            if call.stopped:
                self._count(put_failures=len(keys) - done)
                return True
            digest = key_digest(key.to_string())
            try:
                framing.frame(block, digest, byte_view(obj.byte_array), object_meta(obj))
            except ValueError as exc:  # it does not fit a block: not an object this configuration writes
                log.warning("not storing %s on the kvstore sidecar: %s", key.to_string(), exc)
                self._count(put_failures=1)
                continue
            try:
                result = self.session.call(partial(put, self.session.ns_id, [digest], [block]))
            except Exception as exc:
                self._failed("store objects", exc)
                self._count(put_failures=len(keys) - done)
                return True
            self._count(stored=result.stored, duplicates=result.duplicates, rejected=result.rejected)
            if not result.rejected:
                self._known.remember([key.to_string()])
        return True

    # ---- the rest of the interface -----------------------------------------------------

    def support_ping(self) -> bool:
        return True

    async def ping(self) -> int:
        """0 when the sidecar answers, else the gRPC status code's number (14: UNAVAILABLE)."""
        return await self._workers.run(PING_CLOSED, self._ping)

    def _ping(self, call: Call) -> int:
        try:
            self.session.register()
        except Exception as exc:
            self._failed("answer a ping", exc)
            code = getattr(exc, "code", None)
            return code().value[0] if callable(code) else -1
        return 0

    async def list(self) -> List[str]:
        return await self._workers.run([], self._list_known)

    def _list_known(self, call: Call) -> List[str]:
        return self._known.present(lambda digests: self._lookup(digests).hit_blocks,  # any tier: list plans no get
                                   self._lookup_batch, lambda: call.stopped,
                                   lambda exc: self._failed("list objects", exc))

    def remove_sync(self, key: CacheEngineKey) -> bool:
        """False, always: the sidecar drops single blocks only by eviction (DeleteNamespace drops all)."""
        return False

    async def close(self) -> None:
        """Idempotent, and off LMCache's loop: calls from now on answer closed (misses, no-ops,
        ``PING_CLOSED``) at once; the calls that came before finish, queued ones included (a get or
        lookup before its next sidecar call, a put whole: LMCache does not wait for its pending
        puts), then the client closes."""
        await asyncio.to_thread(self._close)

    def _close(self) -> None:
        if self._workers.close():
            self.client.close()

    def counts(self) -> dict[str, int]:
        """What this connector did so far: stored, duplicates, rejected, put_failures, hits,
        hits_shared_memory, hits_data_plane, unclaimed (objects of cancelled gets, freed here),
        corrupt, no_memory, call_failures; and for a hung disk: hung_below_memory (Gets of a block
        below memory given up at their deadline while the sidecar answered), cut_below_memory (hit
        blocks gets left unread, and lookup_cut_below_memory keys lookups left uncounted, because
        they sit below memory while the lower tiers' back-off window is open)."""
        with self._lock:
            return dict(self._counts)

    def __repr__(self) -> str:
        return f"<KVStoreConnector {self.settings.address} {self.namespace.model}/{self.session.ns_id.hex()[:8]}>"

    # ---- internals ---------------------------------------------------------------------

    def _scratch_block(self) -> np.ndarray:
        block = getattr(self._scratch, "block", None)
        if block is None:
            block = self._scratch.block = np.empty(self.spec.block_bytes, np.uint8)
        return block

    def _count(self, **deltas: int) -> None:
        with self._lock:
            self._counts.update(deltas)

    def _failed(self, what: str, exc: Exception) -> None:
        self._count(call_failures=1)
        self.session.failed(what, exc)

    def _free_unclaimed(self, objs: List[MemoryObj]) -> None:
        """Free the objects of a get whose caller was cancelled: nobody else holds them."""
        _free(objs)
        self._count(unclaimed=len(objs))

    def _corrupt(self, digest: bytes, exc: CorruptObject) -> None:
        log.warning("kvstore sidecar: block %s is not a valid LMCache object (%s); it counts as a miss",
                    digest.hex(), exc)
        self._count(corrupt=1)


def _free(objs: list[MemoryObj]) -> None:
    for obj in objs:
        obj.ref_count_down()
