"""The tiered store: the one object behind every entry point, and the only code that knows more
than one tier.

Tiers are ordered fastest first (device, host, disk, remote). For each namespace the store keeps a
directory ``block hash -> bitmask of tiers holding it``, so a lookup costs one dict probe per
block whatever the number of tiers. Policy objects (one per tier) order victims; the store moves
bytes between tiers by two knobs:

- ``write_policy="write_through"``: a block put into one tier is copied to every lower tier in
  the background; ``"on_eviction"``: a victim is demoted to the next tier when it is evicted.
- ``promote_on_hit``: a whole-block load served by a lower tier is copied into the top tier.
  Under ``on_eviction`` the lower copy stays until its tier needs room, and then goes first
  (``kvstore/shadows.py``).

Concurrency: one lock guards the directory, policies and pins; byte copies run outside it, and
so does all disk I/O. A block is pinned (by a lease or by the store itself) whenever bytes are
being read from it, and a pinned block is never evicted or removed. A victim that is demoted is
pinned and copied down between two holdings of the lock (``PlacementMixin._copy_victim_down``), and a tier
evicts under the lock only in its books (``Tier.discard``), giving the space back to the medium
at its next write or ``reclaim``. Callers that must not wait long still bound their wait for the
lock (``lookup(wait_s=)``, ``try_release``): a thread holding it can be descheduled, and a
policy's work under it grows with the tier. Placement lives in ``kvstore/placement.py``, what a
lease's holder may do in ``kvstore/lease_holders.py``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Callable, Sequence

import numpy as np

from kvstore.adoption import parents_first
from kvstore.buffers import byte_view, check_size
from kvstore.directory import MAX_TIERS, Directory
from kvstore.placement import PlacementMixin
from kvstore.checksum import checksums_ahead
from kvstore.errors import InvalidRequest, StoreClosed, UnknownNamespace
from kvstore.keys import Namespace
from kvstore.layout import BlockSpec
from kvstore.lease import MAX_LEASED_BLOCKS, LeaseTable
from kvstore.lease_holders import LeaseHolderMixin
from kvstore.policies import DEFAULT_POLICY, EvictionPolicy, make_policy
from kvstore.reclaimer import Reclaimer
from kvstore.results import LoadResult, LookupResult, PutResult, StoreStats
from kvstore.shadows import ShadowCopies
from kvstore.tiers.base import BlockMeta, Tier
from kvstore.validation import check_chain, check_hashes
from kvstore.writer import BackgroundWriter

WRITE_POLICIES = ("write_through", "on_eviction")
MAX_LEASE_TTL_S = 3600.0  # a lease covers a read that follows its lookup, not storage
log = logging.getLogger(__name__)


class TieredStore(PlacementMixin, LeaseHolderMixin):
    def __init__(
        self,
        tiers: Sequence[Tier],
        policy: str | Callable[[], EvictionPolicy] = DEFAULT_POLICY,
        write_policy: str = "write_through",
        promote_on_hit: bool = True,
        max_leases: int = 65536,
        max_leased_blocks: int = MAX_LEASED_BLOCKS,
        background_writes: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ):
        if not tiers:
            raise InvalidRequest("a store needs at least one tier")
        if write_policy not in WRITE_POLICIES:
            raise InvalidRequest(f"write_policy must be one of {WRITE_POLICIES}, got {write_policy!r}")
        if len(tiers) > MAX_TIERS:
            raise InvalidRequest(f"at most {MAX_TIERS} tiers are supported, got {len(tiers)}")
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise InvalidRequest(f"tier names must be unique, got {names}")
        self.tiers = list(tiers)
        self._tier_index = {name: t for t, name in enumerate(names)}
        factory = policy if callable(policy) else (lambda: make_policy(policy))
        self._policies = self._policies_sized(factory, write_policy)
        self.policy_name = self._policies[0].name
        self.write_policy = write_policy
        self.promote_on_hit = promote_on_hit
        self._namespaces: dict[bytes, tuple[Namespace, BlockSpec]] = {}
        self._directory = Directory(names)
        self._bits = self._directory.bits  # the tiers holding a key, as a bitmask (hot: no wrapper of its own)
        self._inflight: set[bytes] = set()  # keys being put right now
        self._placing: set[tuple[int, bytes]] = set()  # (tier, key) being written by _place right now
        self._copy_backlog = [0] * len(self.tiers)  # bytes of each tier pinned by queued write-through copies
        self._doomed: set[bytes] = set()  # deleted while pinned: removed at the last unpin
        self._deletions: Counter[bytes] = Counter()  # delete_namespace calls per namespace id
        # lower copies of blocks a faster tier also holds, evicted first (on_eviction, two tiers or more)
        self._shadows = ShadowCopies(len(self.tiers)) if write_policy == "on_eviction" and len(self.tiers) > 1 else None
        self._leases = LeaseTable(max_leases, clock, max_leased_blocks)
        self._lock = threading.RLock()
        self._put_done = threading.Condition(self._lock)  # a block left _inflight: its outcome is known
        self._counters: Counter[str] = Counter()
        self._busy_lock = threading.Lock()  # guards the one counter bumped without ``_lock``
        self._busy_lookups = 0
        self._writer = BackgroundWriter() if background_writes and len(self.tiers) > 1 else None
        self._reclaimer = Reclaimer(self.tiers)  # deleted blocks buried at their last unpin
        # hashes the next block of a put while this one is written (``checksums_ahead``)
        self._hasher = ThreadPoolExecutor(2, thread_name_prefix="kvstore-put-hash")
        self._closed = False
        self._adopt_resident_blocks()

    # ---- namespaces --------------------------------------------------------------------

    def register_namespace(self, namespace: Namespace) -> bytes:
        """Make a namespace usable; idempotent. Returns its 16-byte id."""
        if self._closed:
            raise StoreClosed("the store is closed")
        spec = BlockSpec.of(namespace)
        for reason in filter(None, (tier.refusal(spec.block_bytes, spec.num_layers) for tier in self.tiers)):
            raise InvalidRequest(f"a block of {namespace.model} is {spec.block_bytes} bytes in {spec.num_layers} "
                                 f"layers; {reason}")
        with self._lock:
            self._namespaces[namespace.id] = (namespace, spec)
            self._directory.add_namespace(namespace.id)
        return namespace.id

    def spec(self, ns_id: bytes) -> BlockSpec:
        if self._closed:
            raise StoreClosed("the store is closed")
        try:
            return self._namespaces[ns_id][1]
        except KeyError:
            raise UnknownNamespace(f"namespace {ns_id.hex()} is not registered; call register_namespace first") from None

    def namespaces(self) -> list[Namespace]:
        with self._lock:  # register_namespace adds to the dict meanwhile, from another thread
            return [ns for ns, _ in self._namespaces.values()]

    # ---- lookup ------------------------------------------------------------------------

    def lookup(self, ns_id: bytes, block_hashes: Sequence[bytes], lease_ttl_s: float | None = None,
               wait_s: float | None = None, counted: bool = True) -> LookupResult:
        """Longest contiguous run of present blocks; changes nothing but the optional lease.

        ``wait_s`` bounds the wait for the store's lock (held for bookkeeping only, never through
        disk I/O, but a busy machine can deschedule its holder): past it the answer is a miss
        (counted as ``busy_lookups``) instead of a wait. None waits as long as it takes.
        ``counted=False``: not a lookup in the stats (a lease for a load its lookup counted)."""
        spec = self.spec(ns_id)
        if lease_ttl_s is not None and not 0 < lease_ttl_s <= MAX_LEASE_TTL_S:
            raise InvalidRequest(f"lease_ttl_s must be in (0, {MAX_LEASE_TTL_S:g}] seconds, got {lease_ttl_s}: "
                                 "a lease pins its blocks against eviction until it ends or expires")
        if not self._acquire(wait_s):
            with self._busy_lock:
                self._busy_lookups += 1
            return LookupResult(len(block_hashes), spec.block_size, (), busy=True)
        try:
            return self._lookup_locked(ns_id, spec, block_hashes, lease_ttl_s, counted)
        finally:
            self._lock.release()

    def holds(self, ns_id: bytes, block_hash: bytes, wait_s: float | None = None) -> bool:
        """Whether a lookup would hit ``block_hash``, asked without counting a lookup or taking a
        lease (an engine about to demote a device page asks first). False, too, when the lock
        stayed held past ``wait_s`` (see ``lookup``): the caller then stores it as if missing."""
        self.spec(ns_id)
        check_hashes([block_hash])
        if not self._acquire(wait_s):
            return False
        try:
            return bool(self._top_tiers(ns_id, [block_hash]))
        finally:
            self._lock.release()

    def _acquire(self, wait_s: float | None) -> bool:
        return self._lock.acquire() if wait_s is None else self._lock.acquire(timeout=max(0.0, wait_s))

    def _lookup_locked(self, ns_id: bytes, spec: BlockSpec, block_hashes: Sequence[bytes],
                       lease_ttl_s: float | None, counted: bool) -> LookupResult:
        """``lookup`` once it holds the lock."""
        self._expire_leases()
        try:
            top = self._top_tiers(ns_id, block_hashes)
        except TypeError:  # unhashable element: say what is wrong with the input
            check_hashes(block_hashes)
            raise
        # Every hit matched a stored 16-byte digest exactly, so only the rest needs checking:
        # an all-hit lookup pays nothing for validation.
        check_hashes(block_hashes[len(top):])
        if counted:
            self._counters.update({"lookups": 1, "lookup_blocks": len(block_hashes), "hit_blocks": len(top)})
            self._counters.update(f"hit_blocks:{self._tier_index[name]}" for name in top)  # one per block
        lease = None
        if lease_ttl_s is not None and top:
            lease = self._leases.grant([ns_id + h for h in block_hashes[: len(top)]], lease_ttl_s)
        tiers = tuple(top)
        refused = lease_ttl_s is not None and bool(top) and lease is None
        return LookupResult(len(block_hashes), spec.block_size, tiers, lease.id if lease else None, refused)

    def _top_tiers(self, ns_id: bytes, block_hashes: Sequence[bytes]) -> list[str]:
        """The directory's contiguous hit, cut before any block deleted while leased (still
        resident for the lease holder, but no longer a hit). Caller holds the lock."""
        top = self._directory.top_tiers(ns_id, block_hashes)
        if self._doomed:
            for i, block_hash in enumerate(block_hashes[: len(top)]):
                if ns_id + block_hash in self._doomed:
                    return top[:i]
        return top

    # ---- load --------------------------------------------------------------------------

    def load(self, ns_id: bytes, block_hashes: Sequence[bytes], dsts: Sequence, lease_id: int | None = None) -> LoadResult:
        """Copy whole blocks, in order, into ``dsts``; stops at the first block it cannot serve.

        Ends ``lease_id`` (if given) whatever happens.
        """
        try:
            spec = self.spec(ns_id)
            check_hashes(block_hashes)
            if len(dsts) != len(block_hashes):
                raise InvalidRequest(f"{len(block_hashes)} block hashes but {len(dsts)} destination buffers")
            views = [byte_view(d, writable=True) for d in dsts]
            for view in views:
                check_size(view, spec.block_bytes, "destination buffer")
            # Pin the whole run first: promoting block i into a full tier demotes and evicts
            # elsewhere, and must never evict block i+1 of the very chain being loaded.
            keys = [ns_id + h for h in block_hashes]
            with self._lock:
                keys = self._readable_run(keys, lease_id)
                self._leases.pin(keys)
                lower = self._directory.by_fastest_tier(keys, len(self.tiers))
            served: list[str] = []
            try:
                for t, tier_keys in enumerate(lower):  # let tiers that can read ahead start now
                    if tier_keys:
                        self.tiers[t].prefetch(tier_keys)
                for key, view in zip(keys, views):
                    tier = self._load_one(key, view, 0, spec.num_layers, lease_id)
                    if tier is None:
                        break
                    served.append(self.tiers[tier].name)
            finally:
                with self._lock:
                    self._leases.unpin(keys)
                    self._bury_doomed(keys)
                # end the read-ahead runs it started, even after a full load: a block promoted by
                # another thread meanwhile is read from memory, and its run would stay this thread's
                for t in (t for t, tier_keys in enumerate(lower) if tier_keys):
                    self.tiers[t].prefetch([])
            return LoadResult(len(block_hashes), tuple(served), len(served) * spec.block_bytes)
        finally:
            if lease_id is not None:
                with self._lock:
                    keys = self._lease_keys(lease_id)
                    self._leases.release(lease_id)
                    self._bury_doomed(keys)

    def record_access(self, ns_id: bytes, block_hashes: Sequence[bytes], tier: str) -> int:
        """Tell ``tier``'s policy that these resident blocks were read outside ``load`` (the
        sidecar's shared-memory path hands out slots and the client copies). Counts them as
        loaded from that tier. Returns how many were resident there; others are ignored."""
        self.spec(ns_id)
        check_hashes(block_hashes)
        t = self._tier_index.get(tier)
        if t is None:
            raise InvalidRequest(f"no tier named {tier!r}; tiers: {list(self._tier_index)}")
        with self._lock:
            keys = [ns_id + h for h in block_hashes if self._bits(ns_id + h) >> t & 1]
            for key in keys:
                self._note_hit(t, key)
            self._counters[f"loaded_blocks:{t}"] += len(keys)
        return len(keys)

    def load_layer(self, ns_id: bytes, block_hash: bytes, layer: int, dst) -> str | None:
        """Copy one layer of one block into ``dst``; returns the serving tier's name or None (a
        block deleted meanwhile is None too: this call carries no lease to prove its reader)."""
        spec = self.spec(ns_id)
        check_hashes([block_hash])
        spec.layer_range(layer)
        view = byte_view(dst, writable=True)
        check_size(view, spec.layer_bytes, "layer destination buffer")
        tier = self._load_one(ns_id + block_hash, view, int(layer), 1, None)
        return None if tier is None else self.tiers[tier].name

    def _load_one(self, key: bytes, dst: np.ndarray, first_layer: int, num_layers: int,
                  lease_id: int | None) -> int | None:
        """Read ``key`` from its fastest tier; None where no tier serves it, or it was deleted and
        ``lease_id`` does not cover it (checked as it is pinned: a delete cannot slip in between)."""
        with self._lock:
            bits = self._bits(key)
            if not bits or not self._readable_run([key], lease_id):
                return None
            self._leases.pin([key])
        try:
            for t, tier in enumerate(self.tiers):
                if not bits >> t & 1:
                    continue
                if tier.read(key, dst, first_layer, num_layers):
                    with self._lock:
                        if first_layer == 0:  # a layer-wise load counts its block once, at layer 0
                            self._note_hit(t, key)
                            self._counters[f"loaded_blocks:{t}"] += 1
                    if t and self.promote_on_hit and first_layer == 0:
                        self._promote(key, dst, tier.meta(key))
                    return t
                with self._lock:  # the tier dropped it (corrupt, I/O error) or lost it
                    if not tier.contains(key):
                        self._forget(key, t)
            return None
        finally:
            with self._lock:
                self._leases.unpin([key])
                self._bury_doomed([key])

    # ---- put ---------------------------------------------------------------------------

    def put(self, ns_id: bytes, block_hashes: Sequence[bytes], payloads: Sequence, parent: bytes | None = None) -> PutResult:
        """Store consecutive blocks of one chain. ``parent`` is the hash before ``block_hashes[0]``.

        Validates everything before storing anything. A block already present is a duplicate
        (left as is); a block no tier has room for is rejected (backpressure, not an error), and
        so is one a racing put has made its own ancestor meanwhile (``PlacementMixin._place``),
        and every block after a rejected one. Room is never made by evicting a block's parent.
        """
        spec = self.spec(ns_id)
        check_hashes(block_hashes)
        if parent is not None:
            check_hashes([parent])
        check_chain(block_hashes, parent)
        if len(payloads) != len(block_hashes):
            raise InvalidRequest(f"{len(block_hashes)} block hashes but {len(payloads)} payloads")
        views = [byte_view(p) for p in payloads]
        for view in views:
            check_size(view, spec.block_bytes, "block payload")
        with self._lock:
            if parent is not None and self._would_loop({ns_id + h for h in block_hashes}, ns_id + parent):
                raise InvalidRequest(
                    f"parent {parent.hex()} descends from a block of this put: storing it would make a "
                    "block its own ancestor (the parent must be the block before block_hashes[0])")
            deletions = self._deletions[ns_id]  # a delete_namespace from now on rejects the blocks not begun
        outcome = {"stored": 0, "duplicate": 0, "rejected": 0}  # a plain dict: Counter's misses cost a call
        previous = parent
        checksums = checksums_ahead(views, spec.num_layers, self._hasher)
        try:
            for block_hash, view, sums in zip(block_hashes, views, checksums):
                meta = BlockMeta(spec.block_bytes, spec.num_layers, sums, ns_id + previous if previous else None)
                if outcome["rejected"]:  # below a block not stored, no lookup could reach it
                    outcome[self._bypass(range(len(self.tiers)), ns_id + block_hash, meta)] += 1
                else:
                    outcome[self._put_one(ns_id, block_hash, view, meta, deletions)] += 1
                previous = block_hash
        finally:
            checksums.close()
        with self._lock:
            self._counters["puts"] += 1
            self._counters.update({f"{k}_blocks": v for k, v in outcome.items() if v})
        return PutResult(outcome["stored"], outcome["duplicate"], outcome["rejected"])

    # ---- directory bookkeeping (caller holds the lock) ------------------------------------

    def _publish(self, t: int, key: bytes, meta: BlockMeta, moved: bool = False) -> None:
        self._directory.add(key, t)
        (self._policies[t].on_move_in if moved else self._policies[t].on_insert)(key, meta.parent, meta.nbytes)
        if self._shadows is not None:
            self._shadows.update(key, self._bits(key))

    def _forget(self, key: bytes, t: int) -> None:
        self._directory.discard(key, t)
        self._policies[t].on_remove(key)
        if self._shadows is not None:
            self._shadows.update(key, self._bits(key))

    def _bury_doomed(self, keys) -> None:
        """Remove the deleted ``keys`` no lease pins and no put is still writing (it buries its own);
        their space goes back to the media off the lock (``Reclaimer``), so the deletion is durable
        moments later, not at the next write or flush."""
        for key in keys:
            if key in self._doomed and not self._leases.is_pinned(key) and key not in self._inflight:
                self._doomed.discard(key)
                self._remove_everywhere(key)
                self._reclaimer.wake()

    def _remove_everywhere(self, key: bytes) -> None:
        bits = self._bits(key)
        for t, tier in enumerate(self.tiers):
            if bits >> t & 1:
                tier.discard(key)
                self._forget(key, t)

    def _adopt_resident_blocks(self) -> None:
        """Rebuild the directory and policies from what persistent tiers already hold, parents
        before children (``kvstore.adoption``), then shrink a tier over its capacity."""
        for t, tier in enumerate(self.tiers):
            for key, meta in parents_first(tier):
                self._publish(t, key, meta)
            while tier.used_bytes > tier.capacity_bytes and self._make_room_for_shrink(t):
                pass

    # ---- maintenance -------------------------------------------------------------------

    def delete_namespace(self, ns_id: bytes) -> int:
        """Remove every block of a namespace from every tier; returns how many blocks.

        Blocks pinned by a lease or an in-flight copy go as soon as they are unpinned, and blocks
        a ``put`` is still writing go as soon as it has written them; a ``put`` begun before
        stores none of its blocks it had not begun; lookups miss all of them from now on.
        """
        self.spec(ns_id)
        with self._lock:
            self._deletions[ns_id] += 1  # a put begun before stores none of its blocks not yet begun
            keys = self._directory.keys(ns_id)
            for key in keys:
                if self._leases.is_pinned(key):
                    self._doomed.add(key)
                else:
                    self._remove_everywhere(key)
            self._doomed.update(key for key in self._inflight if key.startswith(ns_id))
        for tier in self.tiers:  # the media get the space back now, outside the lock
            tier.reclaim()
        return len(keys)

    def flush(self) -> bool:
        """Wait for background writes, then make every tier's completed writes durable; whether every
        tier succeeded (a tier's failure is logged and counted in its ``io_errors``, never raised)."""
        if self._writer is not None:
            self._writer.drain()
        flushed = [tier.flush() for tier in self.tiers]
        return all(flushed)

    def stats(self) -> StoreStats:
        with self._lock:
            self._expire_leases()
            c = self._counters
            tiers = tuple(
                replace(
                    stats,
                    hit_blocks=c[f"hit_blocks:{t}"],
                    loaded_blocks=c[f"loaded_blocks:{t}"],
                    evictions=c[f"evictions:{t}"],
                    demotions_in=c[f"demotions_in:{t}"],
                    promotions_in=c[f"promotions_in:{t}"],
                    extra={**stats.extra, "policy": self._policies[t].leader},
                )
                for t, stats in enumerate(tier.stats() for tier in self.tiers)
            )
            return StoreStats(
                tiers=tiers,
                namespaces=len(self._namespaces),
                lookups=c["lookups"],
                lookup_blocks=c["lookup_blocks"],
                hit_blocks=c["hit_blocks"],
                puts=c["puts"],
                stored_blocks=c["stored_blocks"],
                duplicate_blocks=c["duplicate_blocks"],
                rejected_blocks=c["rejected_blocks"],
                leases_active=len(self._leases),
                lease_expiries=self._leases.expired_total,
                counters={"writes_run_inline": (self._writer.ran_inline if self._writer else 0)
                                            + self._counters["write_through_backlog_inline"],
                          "busy_lookups": self._busy_lookups},
            )

    def check_integrity(self) -> None:
        """Assert every tier's accounting and that directory, policies and tiers agree.

        Meant for a quiescent store (tests, idle time): call ``flush()`` first. ``StoreClosed``
        after ``close`` (the tiers' books are gone then).
        """
        if self._closed:
            raise StoreClosed("the store is closed: check its integrity before close()")
        with self._lock:
            for t, tier in enumerate(self.tiers):
                tier.check_integrity()
                resident = {key for key, _ in tier.items()} - self._inflight
                listed = set(self._directory.keys_in_tier(t))
                assert resident == listed, f"{tier.name}: directory and tier disagree on {len(resident ^ listed)} blocks"
                assert len(self._policies[t]) == len(listed), f"{tier.name}: policy tracks a different block set"

    def close(self) -> None:
        """Finish background writes, flush and close every tier. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._writer is not None:
            self._writer.drain()
            self._writer.close()
        self._reclaimer.close()
        self._hasher.shutdown(cancel_futures=True)
        for tier in self.tiers:
            try:
                tier.flush()
            finally:
                tier.close()

    def __enter__(self) -> "TieredStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
