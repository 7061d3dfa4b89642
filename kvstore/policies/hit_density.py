"""HitDensity: evict the leaf with the least expected hits per unit of cache space-time, with the
reuse statistics learned online from the workload itself.

The idea is LHD (Beckmann et al., NSDI 2018) adapted to prefix chains. Every block belongs to a
class; for each class the policy learns how likely a block is to be referenced again as a function
of its *age* (stored blocks since its last reference), and ranks leaves by *hit density*:

    density(class, age) = P(referenced again | class, survived to age)
                          / E[space-time it still occupies until then | class, age]

The leaf with the least density among a random sample is evicted (``victims``).

Classes, from structure the store sees (no constant fitted to a trace; buckets are powers of two):

- blocks referenced once, by the log2 length of the *insertion run* that stored them (the new part
  of one prompt: a long new context is worth more than a short one-off question) and by whether
  the block ended its run (a prompt's tail, which a next turn extends but rarely re-reads);
- blocks referenced 2, 3, or 4+ times, by tail-ness.

Learning: a bounded history (``history_factor`` x resident, resident and evicted keys alike)
remembers each key's class, last reference and use count. A reference to a remembered key is a
reuse at its age in its class, whether it hit or was stored again after eviction (it would have
hit had it stayed), so the statistics do not depend on the policy's own choices. Keys forgotten
unreferenced end without reuse; keys still waiting are censored (Kaplan-Meier per class). In a
tiered store every tier's policy learns from the whole store's references (``on_stored_elsewhere``,
``on_hit_elsewhere``) and a block demoted or promoted into the tier keeps its record
(``on_move_in``): each tier ranks its blocks by the statistics one tier of the whole store would
learn (its history sized to the whole store, ``size_for_store``), and a full lower tier admits a
demoted block only if it is as dense as the leaf it would evict (``admits_demotion``). Ages
are bucketed on a log scale, so the model is scale-free; densities are recomputed every
``capacity/2`` inserts, O(history) each time, O(1) amortised per insert.

Why it generalises: it learns per workload which classes come back and whether age matters for
them. On the Mooncake trace it learns that tails and append-only suffixes rarely return and
long contexts often do; on multi-turn chat that fresh blocks return soon (where ARC-style
probation loses to LRU). What it cannot learn is *when* a given block returns, which is most
of the gap to Belady's optimum on the Mooncake trace (see the README).

Costs: insert, access and remove O(1) amortised; an eviction samples ``samples`` leaves.
"""

from __future__ import annotations

import math
import random
from array import array
from collections import deque
from typing import Callable, Iterator, Sequence

import numpy as np

from kvstore.policies.age_buckets import age_bucket_floors, small_age_buckets
from kvstore.policies.base import ChainPolicy, Entry

try:  # the sampling loop in C (kvstore/policies/_sampling.c), built by ``pip install`` where it can be
    from kvstore.policies import _sampling
except ImportError:  # no C compiler at install time: the same loop in Python (``_sampled_python``)
    _sampling = None


class _Scheme:
    """One way of classing blocks over a policy's shared record: its reuse statistics, its
    densities and its own sampling stream, so it ranks and evicts as a policy of its own would."""

    def __init__(self, kind: type[HitDensityPolicy], fine_classes: int, seed: int) -> None:
        self.name = kind.name
        runs, buckets = kind.run_classes, kind.age_buckets
        # fine class (2 * base + tail, bases past the run classes counting uses) -> this scheme's class
        self.fold = tuple(2 * (base if base < runs else runs + min(base - runs, kind.use_classes - 1)) + tail
                          for base in range(fine_classes // 2) for tail in (0, 1))
        classes = 2 * (runs + kind.use_classes)
        self.reused = [[0.0] * buckets for _ in range(classes)]  # [class][age bucket]
        self.ended = [[0.0] * buckets for _ in range(classes)]  # forgotten unreferenced
        self.density = [[1.0] * buckets for _ in range(classes)]
        # [fine class, or the forgotten class last][age bucket]: rows shared with self.density
        self.density_of_fine_class = [self.density[c] for c in self.fold] + [[0.0] * buckets]
        self.rng = random.Random(seed)


class HitDensityPolicy(ChainPolicy):
    """Evicts the sampled leaf of least hit density (see the module's docstring).

    ``schemes`` (default: this class alone) runs several HitDensity kinds, which differ only in
    how they class reused blocks, over one shared record of the tier: ``victims_of(i)`` is what
    ``schemes[i]`` alone would evict, at the cost of one history, not one per kind. ``adaptive``
    uses it for its candidates. ``victims`` is the first scheme's.
    """

    name = "hit_density"
    samples = 32  # leaves sampled per eviction (LHD samples 64; 32 was indistinguishable)
    per_octave = 4  # age buckets per doubling of age
    age_buckets = 4 * 40  # ages up to 2**40 stored blocks
    history_factor = 8  # keys remembered (resident and evicted) per resident block, as ReuseARC's ghosts
    use_classes = 3  # referenced 2, 3, 4+ times
    run_classes = 8  # log2 run length of once-referenced blocks: 1, 2-3, ..., 128+
    first_reconfigure = 1024  # inserts before the first densities; then every max(1024, resident/2)

    _shared = ("samples", "per_octave", "age_buckets", "history_factor", "run_classes", "first_reconfigure")

    @staticmethod
    def can_share(kinds: Sequence[object]) -> bool:
        """True if ``kinds`` can be the schemes of one record: HitDensity classes that change
        nothing but constants, and of those nothing but ``use_classes`` (and their name)."""
        def only_constants(kind: type) -> bool:
            own = kind.__mro__[:kind.__mro__.index(HitDensityPolicy)]
            return all(not callable(v) for c in own for k, v in vars(c).items() if not k.startswith("__"))

        if not all(isinstance(kind, type) and issubclass(kind, HitDensityPolicy) and only_constants(kind)
                   for kind in kinds):
            return False
        return all(getattr(kind, a) == getattr(kinds[0], a) for kind in kinds for a in HitDensityPolicy._shared)

    def __init__(self, seed: int = 0x1D, schemes: Sequence[type[HitDensityPolicy]] = ()) -> None:
        super().__init__()
        kinds = tuple(schemes) or (type(self),)
        if schemes and not self.can_share((type(self), *kinds)):
            raise ValueError(f"{', '.join(getattr(k, '__name__', str(k)) for k in kinds)} cannot share one record: "
                             "schemes are HitDensity classes that differ in use_classes (and name) only")
        self.name = kinds[0].name  # the kind ``victims`` evicts as
        self._fine_use_classes = max(kind.use_classes for kind in kinds)
        self._leaves: list[bytes] = []  # resident leaves, for O(1) sampling (the base heap is unused)
        self._leaf_at: dict[bytes, int] = {}
        # each leaf's class and last reference, beside _leaves, so a sample reads them without a
        # lookup in the (much larger) history; a leaf the history forgot has class _forgotten
        self._leaf_cls = array("H")
        self._leaf_last = array("q")
        self._now = 0  # the insert clock
        self._fine_classes = 2 * (self.run_classes + self._fine_use_classes)  # the history's classes
        self._forgotten = self._fine_classes  # the class of a leaf the history no longer remembers: density 0
        # The history: each remembered key's slot in four arrays, so the censored counts are taken
        # in numpy over the arrays (a walk over one object per key took a microsecond a key). A
        # free slot (in _free_slots) has class _forgotten, which no count includes.
        self._history: dict[bytes, int] = {}
        self._seen_cls = array("H")  # [slot] the key's fine class
        self._seen_last = array("q")  # [slot] its last reference
        self._seen_uses = array("q")  # [slot] its references
        self._seen_stale = array("q")  # [slot] its places in _order that are not its latest reference
        self._free_slots: list[int] = []
        # The history's order, oldest reference first: every reference appends its key, and only a
        # key's last place counts (``_seen_stale`` counts the others). The oldest are forgotten from
        # the front of this deque: a dict kept in that order walks over the dead slots its removals
        # leave at its front on every ``next(iter(...))``, tens of microseconds at 100k keys.
        self._order: deque[bytes] = deque()
        self._run: list[bytes] = []  # keys stored by the current insertion run
        self._last_inserted: bytes | None = None
        self._admitting_parent: bytes | None = None  # the parent of the block being stored: never its victim
        self._schemes = [_Scheme(kind, self._fine_classes, seed) for kind in kinds]
        self._widths = [2 ** ((b + 1) / self.per_octave) - 2 ** (b / self.per_octave) for b in range(self.age_buckets)]
        self._bucket_of_small_age = small_age_buckets(self.per_octave, self.age_buckets)
        self._age_bucket_floors = age_bucket_floors(self.per_octave, self.age_buckets)
        self._next_reconfigure = self.first_reconfigure
        self._history_per_resident: float = self.history_factor  # keys remembered per resident block (``size_for_store``)
        # _class(uses, False) of a new block and of one referenced again (index: uses, the last for more)
        self._class_by_uses = tuple(self._class(uses, False) for uses in range(self._fine_use_classes + 2))

    @property
    def scheme_names(self) -> tuple[str, ...]:
        return tuple(scheme.name for scheme in self._schemes)

    # ---- classes and ages ------------------------------------------------------------------

    def _class(self, uses: int, tail: bool, run_length: int = 1) -> int:
        if uses <= 1:
            base = min(max(run_length, 1).bit_length() - 1, self.run_classes - 1)
        else:
            base = self.run_classes + min(uses - 2, self._fine_use_classes - 1)
        return 2 * base + tail

    def _bucket_slow(self, age: int) -> int:
        return min(self.age_buckets - 1, int(self.per_octave * math.log2(1 + age)))

    def _bucket(self, age: int) -> int:
        return self._bucket_of_small_age[age] if age < len(self._bucket_of_small_age) else self._bucket_slow(age)

    # ---- the leaf set (replaces the base class's heap) ---------------------------------------

    def priority(self, key: bytes, entry: Entry) -> float:
        return 0.0  # unused: eviction samples leaves by density

    def _queue(self, key: bytes) -> None:
        if not self._entries[key].children and key not in self._leaf_at:
            self._leaf_at[key] = len(self._leaves)
            self._leaves.append(key)
            slot = self._history.get(key)
            self._leaf_cls.append(self._forgotten if slot is None else self._seen_cls[slot])
            self._leaf_last.append(0 if slot is None else self._seen_last[slot])

    def _drop_leaf(self, key: bytes) -> None:
        at = self._leaf_at.pop(key, None)
        if at is None:
            return
        last, cls, last_reference = self._leaves.pop(), self._leaf_cls.pop(), self._leaf_last.pop()
        if at < len(self._leaves):
            self._leaves[at], self._leaf_cls[at], self._leaf_last[at] = last, cls, last_reference
            self._leaf_at[last] = at

    def _note_leaf(self, key: bytes, slot: int | None) -> None:
        """Copy ``key``'s history (its slot; None: forgotten) beside it in the leaf set, if it is a leaf."""
        at = self._leaf_at.get(key)
        if at is not None:
            self._leaf_cls[at] = self._forgotten if slot is None else self._seen_cls[slot]
            self._leaf_last[at] = 0 if slot is None else self._seen_last[slot]

    # ---- statistics --------------------------------------------------------------------------

    def _reference(self, key: bytes) -> None:
        """A hit on ``key`` or a store of it: a reuse at its age if the history remembers it."""
        history, now, classes, lasts = self._history, self._now, self._seen_cls, self._seen_last
        slot = history.get(key)
        if slot is None:
            cls = self._class_by_uses[1]
            if self._free_slots:
                slot = history[key] = self._free_slots.pop()
                classes[slot], lasts[slot], self._seen_uses[slot], self._seen_stale[slot] = cls, now, 1, 0
            else:
                history[key] = len(classes)
                classes.append(cls)
                lasts.append(now)
                self._seen_uses.append(1)
                self._seen_stale.append(0)
        else:
            bucket = self._bucket(now - lasts[slot])
            cls = classes[slot]
            for scheme in self._schemes:
                scheme.reused[scheme.fold[cls]][bucket] += 1
            uses = self._seen_uses[slot] = self._seen_uses[slot] + 1
            by_uses = self._class_by_uses
            cls = classes[slot] = by_uses[min(uses, len(by_uses) - 1)]
            lasts[slot] = now
            self._seen_stale[slot] += 1  # its earlier place in the order
        self._order.append(key)
        at = self._leaf_at.get(key)  # _note_leaf, inlined: every reference comes here
        if at is not None:
            self._leaf_cls[at], self._leaf_last[at] = cls, now
        if len(history) > self._history_per_resident * len(self._entries) + 1024:
            self._forget_oldest()
        elif len(self._order) > 2 * len(history) + 1024:
            self._compact_order()

    def _forget_oldest(self) -> None:
        """Forget the keys referenced least recently until the history is back to its bound:
        each ends without reuse at its age."""
        history, order, stale = self._history, self._order, self._seen_stale
        while len(history) > self._history_per_resident * len(self._entries) + 1024:
            key = order.popleft()
            slot = history[key]
            if stale[slot]:  # referenced again since: its latest place is further on
                stale[slot] -= 1
                continue
            del history[key]
            bucket, cls = self._bucket(self._now - self._seen_last[slot]), self._seen_cls[slot]
            for scheme in self._schemes:
                scheme.ended[scheme.fold[cls]][bucket] += 1
            self._seen_cls[slot] = self._forgotten
            self._free_slots.append(slot)
            self._note_leaf(key, None)

    def _compact_order(self) -> None:
        """Keep only each key's latest place in the history's order (O(order), every so often)."""
        latest: deque[bytes] = deque()
        history, stale = self._history, self._seen_stale
        for key in self._order:
            slot = history[key]
            if stale[slot]:
                stale[slot] -= 1
            else:
                latest.append(key)
        self._order = latest

    def _end_run(self) -> None:
        """The current insertion run ended: class its once-referenced blocks by the run's length."""
        run, tail = self._run, self._last_inserted
        self._run, self._last_inserted = [], None
        for key in run:
            slot = self._history.get(key)
            if slot is not None and self._seen_uses[slot] == 1:
                entry = self._entries.get(key)
                self._seen_cls[slot] = self._class(1, key == tail and (entry is None or not entry.children), len(run))
                self._note_leaf(key, slot)

    def _reconfigure(self) -> None:
        """Densities per class and age bucket from reuses, endings and keys still waiting."""
        waiting = self._waiting()
        for scheme in self._schemes:
            scheme_waiting = [[0.0] * self.age_buckets for _ in scheme.density]
            for fine, rows in zip(scheme.fold, waiting):
                folded = scheme_waiting[fine]
                for b, count in enumerate(rows):
                    folded[b] += count
            self._fit(scheme, scheme_waiting)
        self._next_reconfigure = self._now + max(self.first_reconfigure, len(self._entries) // 2)

    def _fit(self, scheme: _Scheme, waiting: list[list[float]]) -> None:
        """Kaplan-Meier per class of ``scheme``, then each age bucket's density."""
        buckets = self.age_buckets
        for reused, ended, still, density in zip(scheme.reused, scheme.ended, waiting, scheme.density):
            at_risk = [0.0] * (buckets + 1)  # keys that reached each age bucket
            for b in range(buckets - 1, -1, -1):
                at_risk[b] = at_risk[b + 1] + reused[b] + ended[b] + still[b]
            survival, hazard, alive = [0.0] * buckets, [0.0] * buckets, 1.0
            for b in range(buckets):
                survival[b] = alive
                hazard[b] = reused[b] / at_risk[b] if at_risk[b] > 0 else 0.0
                alive *= 1.0 - hazard[b]
            hits = lifetime = 0.0
            for b in range(buckets - 1, -1, -1):
                hits += survival[b] * hazard[b]
                lifetime += survival[b] * self._widths[b]
                density[b] = hits / lifetime if lifetime > 0 else 0.0

    def _waiting(self) -> list[list[float]]:
        """Keys the history remembers, not referenced again yet (censored), per fine class and
        age bucket: a key's bucket is the last whose floor its age reaches."""
        lasts = np.frombuffer(self._seen_last, np.int64)  # [slots]
        classes = np.frombuffer(self._seen_cls, np.uint16).astype(np.int64)  # [slots]; free: _forgotten
        buckets = np.searchsorted(self._age_bucket_floors, self._now - lasts, side="right") - 1  # [slots]
        counts = np.bincount(classes * self.age_buckets + buckets, minlength=(self._fine_classes + 1) * self.age_buckets)
        remembered = counts[:self._fine_classes * self.age_buckets]  # the free slots' row left out
        return remembered.reshape(self._fine_classes, self.age_buckets).astype(float).tolist()

    def remembered(self, key: bytes) -> tuple[int, int] | None:
        """``key``'s fine class and last reference if the history remembers it, else None."""
        slot = self._history.get(key)
        return None if slot is None else (self._seen_cls[slot], self._seen_last[slot])

    def _density_of(self, scheme: _Scheme, key: bytes) -> float:
        seen = self.remembered(key)
        if seen is None:  # forgotten (a tiny tier only): as little worth as anything
            return 0.0
        cls, last = seen
        return scheme.density_of_fine_class[cls][self._bucket(self._now - last)]

    # ---- the policy interface ----------------------------------------------------------------

    def admit(self, key: bytes, parent: bytes | None, nbytes: int) -> bool:
        if parent is None or parent != self._last_inserted:
            self._end_run()
        self._admitting_parent = parent
        return True

    def on_insert(self, key: bytes, parent: bytes | None, nbytes: int) -> None:
        self._note_store(key, parent)
        super().on_insert(key, parent, nbytes)
        if parent is not None:
            self._drop_leaf(parent)
        self._admitting_parent = None
        if self._now >= self._next_reconfigure:
            self._reconfigure()

    def size_for_store(self, tier_share: float) -> None:
        """Remember ``history_factor`` keys per block of the whole store, not of this tier: its
        statistics are the store's (``on_stored_elsewhere``), and a small tier's history would
        forget keys long before the store's other tiers do."""
        if not 0 < tier_share <= 1:
            raise ValueError(f"a tier's share of the store is in (0, 1], got {tier_share}")
        self._history_per_resident = self.history_factor / tier_share

    def on_stored_elsewhere(self, key: bytes, parent: bytes | None, nbytes: int) -> None:
        """A store in the history, its insertion run included, with no residency here: the
        history a tier of the whole store's size would keep. (``on_bypass``, a block this tier
        refused, still comes and goes through residency, as it always has.)"""
        self._note_store(key, parent)
        if self._now >= self._next_reconfigure:
            self._reconfigure()

    def _note_store(self, key: bytes, parent: bytes | None) -> None:
        """The store took ``key`` (here or in another tier): a reference on the insert clock, in
        the insertion run that ``parent`` continues (or a new one)."""
        if parent is None or parent != self._last_inserted:
            self._end_run()
        self._now += 1
        self._reference(key)
        self._run.append(key)
        self._last_inserted = key

    def on_access(self, key: bytes) -> None:
        if key not in self._entries:
            return
        self._end_run()
        self._reference(key)
        # not the base class's: its recency and heap are LRU's, and a resident leaf is in the leaf set already

    def on_move_in(self, key: bytes, parent: bytes | None, nbytes: int) -> None:
        """Resident here with the history the store's references gave it, ranked as one tier
        holding the whole store would rank it: no reference of its own, so the clock, the
        insertion run and the statistics stay as they are."""
        ChainPolicy.on_insert(self, key, parent, nbytes)
        if parent is not None:
            self._drop_leaf(parent)

    def admits_demotion(self, key: bytes, evictable: Callable[[bytes], bool] = lambda k: True,
                        scheme: int = 0) -> bool:
        """Whether ``key``'s density (its record from the store's references) reaches that of the
        sampled leaf this tier would evict (by ``schemes[scheme]``)."""
        ranking = self._schemes[scheme]
        victim = self._least_dense(ranking, evictable)
        return victim is None or self._density_of(ranking, key) >= self._density_of(ranking, victim)

    def on_hit_elsewhere(self, key: bytes, parent: bytes | None) -> None:
        self._end_run()
        self._reference(key)

    def on_remove(self, key: bytes) -> None:
        if key in self._entries:  # a removal ends no insertion run: the run is the store's, not this tier's
            self._drop_leaf(key)
        super().on_remove(key)

    def victims(self, evictable: Callable[[bytes], bool] = lambda k: True) -> Iterator[bytes]:
        """Sampled leaves, least density first (by the first scheme); each leaf at most once per
        call, the parent of the block being stored last of all."""
        return self.victims_of(0, evictable)

    def victims_of(self, scheme: int, evictable: Callable[[bytes], bool] = lambda k: True) -> Iterator[bytes]:
        """Sampled leaves, least density by ``schemes[scheme]`` first; each leaf at most once
        per call, the parent of the block being stored last of all."""
        ranking = self._schemes[scheme]
        offered: set[bytes] = set()
        while True:
            victim = self._least_dense(
                ranking, lambda k: k not in offered and k != self._admitting_parent and evictable(k))
            if victim is None:
                victim = self._least_dense(ranking, lambda k: k not in offered and evictable(k))
            if victim is None:
                return
            offered.add(victim)
            yield victim

    def _least_dense(self, scheme: _Scheme, eligible: Callable[[bytes], bool]) -> bytes | None:
        """The sampled leaf of least density by ``scheme`` that ``eligible`` accepts; every leaf
        is looked at when the sample held none. Most of the policy's time: the sampling loop runs
        in C where ``kvstore.policies._sampling`` is built (``native_sampling``), with the same
        draws and comparisons as ``_sampled_python``, so the same leaf comes out."""
        if not self._leaves:
            return None
        if _sampling is not None:
            best = _sampling.least_dense(self.samples, scheme.rng.random, self._leaves, self._leaf_cls,
                                         self._leaf_last, scheme.density_of_fine_class, self._bucket_of_small_age,
                                         self._now, self._bucket_slow, eligible)
        else:
            best = self._sampled_python(scheme, eligible)
        if best is None:  # the sample held nothing eligible: look at every leaf
            candidates = [key for key in self._leaves if eligible(key)]
            best = min(candidates, key=lambda key: self._density_of(scheme, key), default=None)
        return best

    def _sampled_python(self, scheme: _Scheme, eligible: Callable[[bytes], bool]) -> bytes | None:
        """The sampled leaf of least density that ``eligible`` accepts, or None: ``_density_of``
        inlined over the leaf set's own copy of each leaf's history. A sample is
        ``leaves[int(random() * n)]``, as ``choices()`` draws."""
        leaves = self._leaves
        n = len(leaves)
        classes, lasts, densities, now = self._leaf_cls, self._leaf_last, scheme.density_of_fine_class, self._now
        small, random_ = self._bucket_of_small_age, scheme.rng.random
        smallest_slow = len(small)
        best, best_density = None, math.inf
        for _ in range(min(self.samples, n)):
            at = int(random_() * n)
            age = now - lasts[at]
            density = densities[classes[at]][small[age] if age < smallest_slow else self._bucket_slow(age)]
            if density < best_density and eligible(leaves[at]):
                best, best_density = leaves[at], density
        return best


def native_sampling() -> bool:
    """Whether HitDensity's sampling loop runs in C (``kvstore.policies._sampling`` is built)."""
    return _sampling is not None


class PooledHitDensityPolicy(HitDensityPolicy):
    """HitDensity with every block referenced twice or more in one class (per tail-ness).

    Splitting reused blocks by use count (2, 3, 4+) helps where the count predicts the next reuse
    (multi-turn chat: +1.5 to +2.2 points at small capacities) and misleads where it does not
    (the Mooncake trace: 51.7% of the maximum at 3M tokens split, 54.1% pooled). ``adaptive``
    runs both and follows the better one on the live workload.
    """

    name = "hit_density_pooled"
    use_classes = 1
