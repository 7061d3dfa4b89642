"""Placement across tiers: storing one block of a put in the fastest tier with room, making room
by policy (never by evicting the only copy of the block's parent), writing, publishing (never a
block that would be its own ancestor), write-through, demotion, promotion. No tier I/O happens
under the lock: writes and demotions run between holdings of it, evictions only discard.

``PlacementMixin`` is half of ``TieredStore`` (kept apart to keep each file to one concern). It
expects the host class to provide ``tiers``, ``_policies``, ``_lock`` (re-entrant), ``_leases``,
``_inflight``, ``_put_done`` (a condition of ``_lock``), ``_doomed``, ``_deletions``, ``_placing``,
``_copy_backlog``, ``_counters``, ``_writer``, ``write_policy``, ``_shadows`` and the bookkeeping
methods ``_bits``, ``_publish``, ``_forget`` and ``_bury_doomed``. Methods whose docstring says
"caller holds the lock" must be called under ``_lock``; the others take it themselves and copy
bytes outside it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Callable, NamedTuple

import numpy as np

from kvstore.checksum import layer_checksums
from kvstore.policies import EvictionPolicy
from kvstore.tiers.base import BlockMeta, Tier
from kvstore.validation import closes_loop

log = logging.getLogger(__name__)

# The share of a tier's capacity that blocks waiting for their background write-through copy
# may pin; past it the copy runs in the putting thread (one copy may always wait).
WRITE_THROUGH_BACKLOG = 0.25
PAGE_CANDIDATES = 64  # victims whose pages _empty_a_page chooses among
INFLIGHT_WAIT_S = 10.0  # a put waits this long for another put's write of the same block


class PlacementMixin:
    def _policies_sized(self, factory: Callable[[], EvictionPolicy], write_policy: str) -> list[EvictionPolicy]:
        """One policy per tier, each told its tier's share of the blocks the store can hold: the
        tiers' capacities add up where victims are demoted (``on_eviction``); under
        ``write_through`` the largest tier holds copies of the others' blocks too."""
        policies = [factory() for _ in self.tiers]
        capacities = [tier.capacity_bytes for tier in self.tiers]
        store = sum(capacities) if write_policy == "on_eviction" else max(capacities)
        for capacity, policy in zip(capacities, policies):
            policy.size_for_store(min(1.0, capacity / store) if capacity > 0 and store > 0 else 1.0)
        return policies

    def _put_one(self, ns_id: bytes, block_hash: bytes, view: np.ndarray, meta: BlockMeta, deletions: int) -> str:
        """Store one block of a put in the first tier that admits it and has room: "stored",
        "duplicate" (held already) or "rejected" (also where the namespace was deleted since the
        put began: it had seen ``deletions`` deletions of it). A block another put is writing is
        waited for (up to ``INFLIGHT_WAIT_S``, then rejected): that write may yet fail, and a
        duplicate of a block never stored would let the blocks after it be stored below a gap.
        The policies of the faster tiers, which did not store it, are told it came and went
        (``_bypass``); those of the slower ones that another tier stored it
        (``on_stored_elsewhere``), before any copy of it moves in (write-through, demotion)."""
        key = ns_id + block_hash
        with self._lock:
            deadline = time.monotonic() + INFLIGHT_WAIT_S
            while key in self._inflight and self._put_done.wait(max(0.0, deadline - time.monotonic())):
                pass
            if key in self._doomed or self._deletions[ns_id] != deletions or key in self._inflight:  # doomed: leased
                return "rejected"
            if self._bits(key):
                return "duplicate"
            self._inflight.add(key)
        try:
            for t in range(len(self.tiers)):
                with self._lock:  # policies are not thread-safe, and admit may change one's state
                    admitted = self._policies[t].admit(key, meta.parent, meta.nbytes)
                if admitted and self._place(t, key, view, meta):
                    if t:
                        self._bypass(range(t), key, meta)
                    if t + 1 < len(self.tiers):  # the checks of both, here: this runs for every block stored
                        self._tell_slower_tiers(t, key, meta)
                        self._write_through(key, t, meta)
                    return "stored"
            self._bypass(range(len(self.tiers)), key, meta)
            return "rejected"
        finally:
            with self._lock:
                self._inflight.discard(key)
                self._put_done.notify_all()
                if self._doomed:
                    self._bury_doomed([key])  # its namespace was deleted while it was being written

    def _bypass(self, tiers: range, key: bytes, meta: BlockMeta) -> str:
        """Tell the policies of those ``tiers`` that do not hold ``key`` that it came and went;
        "duplicate" if some tier holds it, else "rejected"."""
        with self._lock:
            bits = self._bits(key)
            for t in tiers:
                if not bits >> t & 1:
                    self._policies[t].on_bypass(key, meta.parent, meta.nbytes)
            return "duplicate" if bits and key not in self._doomed else "rejected"

    def _tell_slower_tiers(self, t: int, key: bytes, meta: BlockMeta) -> None:
        """Tier ``t`` stored ``key``: the policies of the tiers below hear of it (``on_stored_elsewhere``)."""
        if t + 1 < len(self.tiers):
            with self._lock:
                for policy in self._policies[t + 1:]:
                    policy.on_stored_elsewhere(key, meta.parent, meta.nbytes)

    def _note_hit(self, t: int, key: bytes) -> None:
        """Tier ``t`` served a hit on ``key``: its policy is told of the access, the others of a
        reference of the store's workload (``on_hit_elsewhere``). Caller holds the lock."""
        self._policies[t].on_access(key)
        if len(self._policies) > 1:
            parent = self.tiers[t].parent_of(key)
            for u, policy in enumerate(self._policies):
                if u != t:
                    policy.on_hit_elsewhere(key, parent)

    def _promote(self, key: bytes, payload: np.ndarray, source_meta: BlockMeta | None) -> None:
        if source_meta is None:  # dropped meanwhile; the caller's bytes were verified, but not worth a slot
            return
        if payload.nbytes != source_meta.nbytes:  # one layer (load_layer) is not a block
            return
        meta = source_meta if source_meta.checksums else replace(
            source_meta, checksums=layer_checksums(payload, source_meta.num_layers))
        if self._place(0, key, payload, meta, moved=True):
            with self._lock:
                self._counters["promotions_in:0"] += 1

    def _place(self, t: int, key: bytes, payload: np.ndarray, meta: BlockMeta, moved: bool = False,
               demoted: bool = False) -> bool:
        """Make room in tier ``t`` by policy, write, publish (``moved``: a copy from another tier,
        which its policy hears as ``on_move_in``, not as a new block; ``demoted``: a victim of the
        tier above, which enters only if its policy values it as much as the block it would evict
        for it, ``EvictionPolicy.admits_demotion``). False when no room can be made or the
        demotion is not admitted; when
        another thread is writing the same block into the same tier (two promotions of one block,
        say: a tier accepts each block once); or when the block would close a loop with what is
        resident (``_would_loop``), checked at publication, under the lock: two puts racing to
        store ``[A]`` under ``B`` and ``[B]`` under ``A`` both pass ``put``'s check at their start,
        and the second to publish is refused, its bytes removed (the victim evicted to make its
        room is not restored; a race is rare, so the check is not repeated before making room).
        The caller does not hold the lock: room is made, and the block written, outside it."""
        tier = self.tiers[t]
        for _ in range(3):  # a write the medium refused (out of space on the file system, say) is tried again
            claimed = self._claim_room(t, key, meta, demoted)
            if claimed is not True:
                return claimed is None
            try:
                written = tier.write(key, payload, meta)
                if written:
                    with self._lock:
                        if self._would_loop({key}, meta.parent):
                            tier.discard(key)
                            return False
                        self._publish(t, key, meta, moved)
            finally:
                try:
                    tier.unreserve(key)  # the write took the room, unless it raised first
                finally:
                    with self._lock:
                        self._placing.discard((t, key))
            if written:
                return True
        return False

    def _claim_room(self, t: int, key: bytes, meta: BlockMeta, demoted: bool = False) -> bool | None:
        """Make room for ``key`` in tier ``t``, reserve it (``Tier.reserve``: no other thread's
        claim can take it before this write lands) and mark the block as being written there
        (``_placing``): True once room is reserved, None when the tier holds it already, False when
        no room can be made or another thread is writing it there. Victims that are demoted are
        copied down between two holdings of the lock (``_copy_victim_down``), so lookups never wait
        for that copy; a victim its demotion could not move out of the tier is not offered again. A
        demotion is finished (its victim dropped) in the same holding of the lock that claims the
        room."""
        tried: set[bytes] = set()
        demotion = copied = None
        refusals = 0  # reservations the tier refused after room was made (its books moved meanwhile)
        while True:
            with self._lock:
                if demotion is not None and not self._finish_demotion(demotion, *copied):
                    tried.add(demotion.key)
                demotion = None
                if self._bits(key) >> t & 1:
                    return None
                if (t, key) in self._placing:
                    return False
                keep = meta.parent if self._only_copy(t, meta.parent) else None
                room = self._make_room(t, meta.nbytes, keep, meta.parent, tried, key if demoted else None)
                if room is True and not self.tiers[t].reserve(key, meta.nbytes):
                    refusals += 1  # a failed hole punch counted its bytes as dead meanwhile, say: make room again
                    if refusals < 3:
                        continue
                    room = False
                if room is True:
                    self._placing.add((t, key))
                if room is True or room is False:
                    return room
                demotion = room
            copied = self._copy_victim_down(demotion)

    def _only_copy(self, t: int, key: bytes | None) -> bool:
        """Whether evicting ``key`` from tier ``t`` would drop its last copy: no other tier holds
        it and none would take it on eviction. Caller holds the lock."""
        if key is None or self._bits(key) != 1 << t:
            return False
        return not self._demotes(t)

    def _demotes(self, t: int) -> bool:
        """Whether evicting from tier ``t`` first tries to move the block to the tier below."""
        return self.write_policy == "on_eviction" and t + 1 < len(self.tiers)

    def _strands_children(self, t: int, key: bytes) -> bool:
        """Whether dropping tier ``t``'s copy of ``key`` loses its last copy while another tier
        holds a child of it: those children (and their descendants) would be unreachable. A
        tier's policy offers only blocks with no children in that tier, so the other tiers are
        asked. Caller holds the lock."""
        return self._bits(key) == 1 << t and any(
            policy.has_resident_children(key) for u, policy in enumerate(self._policies) if u != t)

    def _evictable(self, t: int):
        """The store's own test of a victim of tier ``t``: not leased, not being written, and not
        the last copy of a block whose children other tiers hold (``_strands_children``; where
        eviction demotes, ``_evict`` checks that once the demotion has failed). Caller holds the lock."""
        guard_children = len(self.tiers) > 1 and not self._demotes(t)
        return lambda k: (not self._leases.is_pinned(k) and k not in self._inflight
                          and not (guard_children and self._strands_children(t, k)))

    def _would_loop(self, keys: set[bytes], parent: bytes | None) -> bool:
        """Whether storing ``keys`` under ``parent`` now closes a loop (``validation.closes_loop``);
        a key some tier holds keeps the parent it has. Caller holds the lock."""
        if parent is None:
            return False
        new = {key for key in keys if not self._bits(key)}
        return closes_loop(new, parent, self._named_as_parent, self._resident_parent)

    def _named_as_parent(self, key: bytes) -> bool:
        """Whether a block resident in any tier names ``key`` as its parent. Caller holds the lock."""
        for policy in self._policies:  # a loop, not any(): this runs for every block stored
            if policy.has_resident_children(key):
                return True
        return False

    def _resident_parent(self, key: bytes) -> bytes | None:
        """The parent of resident ``key``; None at a chain's head or when no tier holds it."""
        bits = self._bits(key)
        return next((tier.parent_of(key) for t, tier in enumerate(self.tiers) if bits >> t & 1), None)

    def _write_through(self, key: bytes, source: int, meta: BlockMeta) -> None:
        """Copy ``key`` from tier ``source`` to every lower tier, pinned meanwhile: in the
        background while the copies queued from ``source`` pin at most ``WRITE_THROUGH_BACKLOG``
        of its capacity (or none is queued), else in the caller (backpressure). A tier full of
        blocks pinned for their copies could only evict the unpinned ones, its hottest."""
        if self.write_policy != "write_through" or source + 1 == len(self.tiers):
            return
        tier = self.tiers[source]
        with self._lock:
            self._leases.pin([key])
            pinned = tier.footprint(meta.nbytes)
            backlog = self._copy_backlog[source]
            queued = self._writer is not None and (
                not backlog or backlog + pinned <= tier.capacity_bytes * WRITE_THROUGH_BACKLOG)
            if queued:
                self._copy_backlog[source] += pinned
            elif self._writer is not None:
                self._counters["write_through_backlog_inline"] += 1
        job = lambda backlog=pinned if queued else 0: self._copy_down(key, source, meta, backlog)  # noqa: E731
        if queued:
            self._writer.submit(job)
        else:
            job()

    def _copy_down(self, key: bytes, source: int, meta: BlockMeta, backlog: int = 0) -> None:
        """Copy pinned ``key`` from tier ``source`` into every lower tier, then unpin it and take
        its ``backlog`` bytes off ``source``'s (``_write_through``). A copy that fails is logged
        and lost, never the caller's error: the block is stored in ``source`` already."""
        try:
            payload = self.tiers[source].view(key)
            if payload is None:
                payload = np.empty(meta.nbytes, np.uint8)
                if not self.tiers[source].read(key, payload):
                    return
            for target in range(source + 1, len(self.tiers)):
                try:
                    self._place(target, key, payload, meta, moved=True)
                except Exception:
                    log.exception("write-through copy to the %s tier failed", self.tiers[target].name)
        finally:
            with self._lock:
                self._leases.unpin([key])
                self._copy_backlog[source] -= backlog
                self._bury_doomed([key])

    def _make_room(self, t: int, nbytes: int, keep: bytes | None = None, parent: bytes | None = None,
                   tried: set[bytes] = frozenset(), demoted: bytes | None = None) -> "bool | Demotion":
        """Evict victims of tier ``t`` (by its policy) until ``nbytes`` fit: True then, or the
        first victim to demote (pinned, a ``Demotion`` for the caller to carry out once it has
        let the lock go). False, with nothing more evicted, once the policy's next victim is
        ``keep``: the parent of the block that needs the room when this tier holds its only copy
        (``_only_copy``), a leaf until that block is stored. Evicting it would leave the block
        unreachable below it, and skipping it would let a chain longer than the tier's free room
        push out blocks its policy values more. No victim goes whose loss strands resident
        children (``_evictable``), nor, where eviction demotes and the tier below has no room for
        it, ``parent`` (the block needing the room is a child of it: ``_finish_demotion`` keeps it), and
        none in ``tried`` (whose demotion left them in place) is offered. False, with nothing
        evicted, when the room is for ``demoted`` (a victim of the tier above) and the policy does
        not admit it (``admits_demotion``): it leaves the store instead. Caller holds the lock."""
        tier = self.tiers[t]
        if tier.footprint(nbytes) > tier.capacity_bytes:
            return False
        if tier.can_fit(nbytes):
            return True
        self._expire_leases()  # a lease past its TTL (its client died) must not keep pinning victims
        if self._drop_shadows(t, nbytes):
            return True
        evictable = self._evictable(t)
        if tried:
            evictable = lambda k, untried=evictable: k not in tried and untried(k)  # noqa: E731
        if demoted is not None and not self._policies[t].admits_demotion(demoted, evictable):
            return False
        if type(tier).eviction_helps is Tier.eviction_helps:  # every victim helps: one pass
            return self._evict_in_order(t, nbytes, evictable, keep, parent) or False
        # A tier of pages cut into slots of one size each first evicts blocks whose slot would
        # hold this one; evicting others helps only once a page of them is empty (_empty_a_page).
        outcome = self._evict_in_order(t, nbytes, lambda k: evictable(k) and tier.eviction_helps(k, nbytes),
                                       keep, parent)
        return self._empty_a_page(t, nbytes, evictable, keep, parent) if outcome is None else outcome

    def _evict_in_order(self, t: int, nbytes: int, eligible, keep: bytes | None,
                        parent: bytes | None) -> "bool | Demotion | None":
        """``_make_room``'s eviction of the policy's victims that ``eligible`` accepts, in its
        order: True once ``nbytes`` fit, a ``Demotion``, False when the next victim is ``keep``,
        None when the victims ran out first. Caller holds the lock."""
        tier = self.tiers[t]
        victims = self._policies[t].victims(eligible)
        try:
            for victim in victims:
                if victim == keep:
                    return False
                demotion = self._evict(t, victim, needed=victim == parent)
                if demotion is not None:
                    return demotion
                if tier.can_fit(nbytes):
                    return True
        finally:
            victims.close()
        return None

    def _empty_a_page(self, t: int, nbytes: int, evictable, keep: bytes | None,
                      parent: bytes | None) -> "bool | Demotion":
        """Room for a size tier ``t`` has no free slot of, and no free page to cut into slots of it:
        one page's blocks go, with their descendants in the tier (a chain loses its tail before its
        head), in the policy's order. The page is among those of the policy's first
        ``PAGE_CANDIDATES`` victims whose blocks and descendants ``evictable`` all accepts (and
        ``keep`` is none of): the one that costs the fewest blocks, the policy's earlier first. False,
        with nothing evicted, when there is none. Evicting victims in order until some page
        happened to empty took most of the tier for one block. Caller holds the lock."""
        tier, policy = self.tiers[t], self._policies[t]
        first_rank: dict[int, int] = {}
        victims = policy.victims(evictable)
        try:
            for rank, victim in zip(range(PAGE_CANDIDATES), victims):
                first_rank.setdefault(tier.page_of(victim), rank)
        finally:
            victims.close()
        children = self._children_in(t)
        costs = {}
        for page in first_rank:
            closure = _with_descendants(tier.page_residents(page), children)
            if closure and keep not in closure and all(map(evictable, closure)):
                costs[page] = closure
        if not costs:
            return False
        closure = costs[min(costs, key=lambda p: (len(costs[p]), first_rank[p]))]
        while closure:  # again while a pass evicts: a policy may not offer a leaf its pass made
            outcome = self._evict_in_order(t, nbytes, lambda k: k in closure and evictable(k), keep, parent)
            if outcome is not None:
                return outcome
            left = {key for key in closure if tier.contains(key)}
            closure = left if len(left) < len(closure) else set()
        return False

    def _children_in(self, t: int) -> dict[bytes, list[bytes]]:
        """Tier ``t``'s resident blocks by parent, for those whose parent it holds too."""
        tier, children = self.tiers[t], {}
        for key, meta in tier.items():
            if meta.parent is not None and tier.contains(meta.parent):
                children.setdefault(meta.parent, []).append(key)
        return children

    def _drop_shadows(self, t: int, nbytes: int) -> bool:
        """Drop tier ``t``'s copies of blocks a faster tier also holds, oldest first, until
        ``nbytes`` fit: nothing is lost, so they go before any victim. Caller holds the lock."""
        if self._shadows is None:
            return False
        tier = self.tiers[t]
        eligible = lambda k: not self._leases.is_pinned(k) and tier.eviction_helps(k, nbytes)  # noqa: E731
        while (key := self._shadows.oldest(t, eligible)) is not None:
            self._drop(t, key)
            if tier.can_fit(nbytes):
                return True
        return False

    def _evict(self, t: int, key: bytes, needed: bool = False) -> "Demotion | None":
        """Remove ``key`` from tier ``t`` and return None; or, where the write policy demotes it
        and no lower tier holds it yet, pin it and return the ``Demotion`` to carry out (``needed``:
        it is the parent of the block being stored). Caller holds the lock."""
        if self._demotes(t) and not self._bits(key) >> (t + 1):
            self._leases.pin([key])
            return Demotion(t, key, needed)
        self._drop(t, key)
        return None

    def _demote(self, demotion: "Demotion") -> bool:
        """Carry out ``demotion``: ``_copy_victim_down`` without the lock, then ``_finish_demotion``
        under it. True when the victim left its tier."""
        copied = self._copy_victim_down(demotion)
        with self._lock:
            return self._finish_demotion(demotion, *copied)

    def _copy_victim_down(self, demotion: "Demotion") -> tuple[bool, bool]:
        """Copy a pinned victim into the tier below; called without the lock, so the copy (a disk
        write, say) holds up no lookup. Returns (demoted, readable): whether the tier below holds
        it now, and whether it could be read at all. On an exception the victim is unpinned."""
        t, key = demotion.tier, demotion.key
        source = self.tiers[t]
        try:
            meta = source.meta(key)
            payload = source.view(key)
            if payload is None and meta is not None:
                payload = np.empty(meta.nbytes, np.uint8)
                payload = payload if source.read(key, payload) else None
            readable = meta is not None and payload is not None
            return readable and self._place(t + 1, key, payload, meta, moved=True, demoted=True), readable
        except BaseException:
            with self._lock:
                self._leases.unpin([key])
                self._bury_doomed([key])
            raise

    def _finish_demotion(self, demotion: "Demotion", demoted: bool, readable: bool) -> bool:
        """Unpin a victim ``_copy_victim_down`` handled and drop it from its tier; True when it left.
        It stays when another reader pinned it meanwhile, or when the tier below had no room and
        dropping it would strand resident children or it is ``needed``. A victim that cannot be
        read for its demotion goes all the same (its chain is broken there anyway). Caller holds
        the lock."""
        t, key = demotion.tier, demotion.key
        self._leases.unpin([key])
        if demoted:
            self._counters[f"demotions_in:{t + 1}"] += 1
        droppable = demoted or not readable or not (demotion.needed or self._strands_children(t, key))
        gone = droppable and bool(self._bits(key) >> t & 1) and not self._leases.is_pinned(key)
        if gone:
            self._drop(t, key)
        self._bury_doomed([key])
        return gone

    def _drop(self, t: int, key: bytes) -> None:
        """Remove ``key`` from tier ``t`` and count the eviction (the tier gives its space back to
        the medium later, outside the lock: ``Tier.discard``). Caller holds the lock."""
        self.tiers[t].discard(key)
        self._forget(key, t)
        self._counters[f"evictions:{t}"] += 1

    def _make_room_for_shrink(self, t: int) -> bool:
        """Evict one victim of tier ``t`` (a tier reopened with less capacity); False when none can go."""
        tried: set[bytes] = set()
        while True:
            with self._lock:
                evictable = self._evictable(t)
                victims = self._policies[t].victims(lambda k: k not in tried and evictable(k))
                try:
                    victim = next(victims, None)
                    demotion = None if victim is None else self._evict(t, victim)
                finally:
                    victims.close()
            if victim is None:
                return False
            if demotion is None or self._demote(demotion):
                return True
            tried.add(victim)


class Demotion(NamedTuple):
    """A victim of tier ``tier``, pinned, to copy into the tier below and then drop
    (``PlacementMixin._copy_victim_down``, ``_finish_demotion``); ``needed``: it is the parent of
    the block that needs the room."""

    tier: int
    key: bytes
    needed: bool


def _with_descendants(keys: list[bytes] | None, children: dict[bytes, list[bytes]]) -> set[bytes]:
    """``keys`` and every descendant ``children`` reaches from them; empty for None."""
    found, stack = set(), list(keys or ())
    while stack:
        key = stack.pop()
        if key not in found:
            found.add(key)
            stack.extend(children.get(key, ()))
    return found
