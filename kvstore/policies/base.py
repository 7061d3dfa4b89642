"""The eviction policy interface and its chain-aware base. Policies order one tier's victims;
they never touch bytes.

A tier holds blocks of prefix chains. Evicting block i of a chain makes blocks i+1... unreachable
(lookups stop at the first miss), so a policy only offers *leaves*: blocks with no resident child
in the same tier. A chain therefore loses its tail before its head, and a parent becomes a
candidate once its last child is gone.

A policy is told about every insert, access and removal of its tier, in that tier's order, and
about the rest of the store's references (blocks other tiers stored or served:
``on_stored_elsewhere``, ``on_hit_elsewhere``); a block copied in from another tier is
``on_move_in``, not a reference.
``victims()`` yields candidates, best victim first; the caller evicts some of them (calling
``on_remove``) and may stop at any time. Subclasses choose the order with one method,
``priority``: the smallest priority is evicted first.
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Iterator



@dataclass(slots=True)
class Entry:
    parent: bytes | None
    nbytes: int
    children: int = 0
    last_access: int = 0
    accesses: int = 0
    version: int = 0  # the clock at its latest queueing; heap items with another version are stale


class EvictionPolicy(ABC):
    """The interface every tier's policy implements."""

    name: str = "abstract"

    @abstractmethod
    def on_insert(self, key: bytes, parent: bytes | None, nbytes: int) -> None:
        """``key`` became resident; ``parent`` is the previous block of its chain (None at a head)."""

    @abstractmethod
    def on_access(self, key: bytes) -> None:
        """``key`` was read (a hit that was loaded). Unknown keys are ignored."""

    @abstractmethod
    def on_remove(self, key: bytes) -> None:
        """``key`` left the tier (evicted, dropped as corrupt, deleted). Unknown keys are ignored."""

    @abstractmethod
    def victims(self, evictable: Callable[[bytes], bool] = lambda k: True) -> Iterator[bytes]:
        """Candidates in eviction order, skipping keys for which ``evictable`` is False.

        Does not mutate the policy's view of residency: keys the caller does not remove stay
        candidates for the next call.
        """

    def admit(self, key: bytes, parent: bytes | None, nbytes: int) -> bool:
        """Whether a new block deserves a slot at all (admission control). Default: always."""
        return True

    def on_bypass(self, key: bytes, parent: bytes | None, nbytes: int) -> None:
        """The tier was offered ``key`` but did not store it: it had no room the policy would give
        (its next victim was ``parent``), or ``parent`` itself was not stored. For the policy's
        statistics the block came and went at once, so it still sees every block of the workload
        (history, ghosts, a selector's miniature caches). Default: ``on_insert`` then ``on_remove``."""
        self.on_insert(key, parent, nbytes)
        self.on_remove(key)

    def size_for_store(self, tier_share: float) -> None:
        """The store tells each tier's policy once, before any event, the share of the store's
        capacity (0 < ``tier_share`` <= 1) its tier holds: a policy that learns from the whole
        store's references and bounds what it remembers by its own resident blocks scales that
        bound by 1 / ``tier_share``. Default: nothing."""

    def on_stored_elsewhere(self, key: bytes, parent: bytes | None, nbytes: int) -> None:
        """A faster tier of the store stored ``key`` (a block of a put): a reference of the whole
        workload, for policies that learn from it. Default: nothing (the tier's own events only)."""

    def on_move_in(self, key: bytes, parent: bytes | None, nbytes: int) -> None:
        """``key`` became resident here as a copy from another tier of the store (a demotion, a
        promotion, a write-through copy). That is no new reference: the store reported the
        reference when it happened (``on_stored_elsewhere``, ``on_hit_elsewhere``). Default:
        ``on_insert``, so policies that learn from their tier's own events alone see it as new
        (exclusive LRU tiers together behave as one LRU)."""
        self.on_insert(key, parent, nbytes)

    def admits_demotion(self, key: bytes, evictable: Callable[[bytes], bool]) -> bool:
        """Whether ``key``, a victim of a faster tier that this full tier would make room for, is
        worth the block it would evict for it (among those ``evictable`` accepts). False: it
        leaves the store instead, so what leaves is the less valuable of the two tiers' victims.
        Default: True (exclusive LRU tiers together behave as one LRU)."""
        return True

    def on_hit_elsewhere(self, key: bytes, parent: bytes | None) -> None:
        """Another tier of the store served a hit on ``key`` (resident here or not): a reference of
        the whole workload, for policies that learn from it. Default: nothing."""

    def has_resident_children(self, key: bytes) -> bool:
        """Whether a block resident in this tier names ``key`` as its parent. Default: False (a
        policy that does not track chains cannot tell)."""
        return False

    def stand_by(self) -> None:
        """Nobody will ask for ``victims`` until further notice (a selector's candidate that does
        not lead): the policy may stop keeping its eviction order up to date, provided the next
        ``victims`` call yields exactly what it would have yielded had it kept it. Every event
        is still told. Default: nothing."""

    @property
    def leader(self) -> str:
        """The name of the policy whose order is in effect: this one (a selector's leading candidate)."""
        return self.name

    def __len__(self) -> int:
        return 0


class ChainPolicy(EvictionPolicy):
    """Leaf-only eviction over prefix chains; subclasses define ``priority``."""

    def __init__(self) -> None:
        self._entries: dict[bytes, Entry] = {}
        self._heap: list[tuple[float, int, bytes, int]] = []  # (priority, seq, key, version)
        self._clock = 0
        # resident children of keys that are not resident themselves (a child demoted before its
        # parent, a parent dropped while its children stay): the parent starts with this count
        self._orphans: dict[bytes, int] = {}

    @abstractmethod
    def priority(self, key: bytes, entry: Entry) -> float:
        """Smaller is evicted first. Called when a leaf is (re)queued."""

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def has_resident_children(self, key: bytes) -> bool:
        entry = self._entries.get(key)
        return key in self._orphans if entry is None else entry.children > 0

    def on_insert(self, key: bytes, parent: bytes | None, nbytes: int) -> None:
        assert key not in self._entries, "policy told about a block inserted twice (store bug)"
        self._clock += 1
        children = self._orphans.pop(key, 0)
        self._entries[key] = Entry(parent, nbytes, children, last_access=self._clock, accesses=1)
        if parent is not None:
            parent_entry = self._entries.get(parent)
            if parent_entry is not None:
                parent_entry.children += 1
            else:
                self._orphans[parent] = self._orphans.get(parent, 0) + 1
        self._queue(key)

    def on_access(self, key: bytes) -> None:
        entry = self._entries.get(key)
        if entry is None:
            return
        self._clock += 1
        entry.last_access = self._clock
        entry.accesses += 1
        self._queue(key)

    def on_remove(self, key: bytes) -> None:
        entry = self._entries.pop(key, None)
        if entry is None:
            return
        if entry.children:
            self._orphans[key] = entry.children
        if entry.parent is None:
            return
        parent_entry = self._entries.get(entry.parent)
        if parent_entry is not None:
            parent_entry.children -= 1
            self._queue(entry.parent)
        else:
            left = self._orphans.pop(entry.parent) - 1
            if left:
                self._orphans[entry.parent] = left

    def victims(self, evictable: Callable[[bytes], bool] = lambda k: True) -> Iterator[bytes]:
        deferred: list[tuple[float, int, bytes, int]] = []
        try:
            while self._heap:
                item = heapq.heappop(self._heap)
                _, _, key, version = item
                entry = self._entries.get(key)
                if entry is None or entry.version != version or entry.children:
                    continue  # stale: removed, re-queued since, or no longer a leaf
                deferred.append(item)
                if evictable(key):
                    yield key
        finally:
            for item in deferred:
                entry = self._entries.get(item[2])
                if entry is not None and entry.version == item[3]:
                    heapq.heappush(self._heap, item)

    def _queue(self, key: bytes) -> None:
        entry = self._entries[key]
        if entry.children:
            return
        self._clock += 1
        entry.version = self._clock  # unique forever: a re-inserted key never matches its old items
        heapq.heappush(self._heap, (self.priority(key, entry), self._clock, key, entry.version))
        if len(self._heap) > 4 * len(self._entries) + 1024:
            self._compact()

    def _compact(self) -> None:
        """Drop stale heap items (they accumulate with accesses)."""
        self._heap = [
            item
            for item in self._heap
            if (e := self._entries.get(item[2])) is not None and e.version == item[3] and not e.children
        ]
        heapq.heapify(self._heap)
