"""Selector: candidate policies kept side by side; eviction follows the one that would hit most on
the live workload, judged by miniature simulations over a sample of its chains.

Which reuse model ranks blocks best depends on the workload, and a policy cannot tell from its own
statistics whether its model is the right one: HitDensity's split of reused blocks by use count
is worth 1.5 to 2.2 points on multi-turn chat and costs 2.4 on the Mooncake trace. A miniature
cache can tell (Waldspurger et al., "Cache Modeling and Optimization using Miniature
Simulations", USENIX ATC 2017):

- Every candidate is a full policy told every insert, access and removal of the tier (and the
  store's references other tiers took: ``on_stored_elsewhere``, ``on_hit_elsewhere``), so any of
  them can lead at any moment with a complete view; a change of leader moves nothing.
  Candidates that can share one record of the tier (HitDensity kinds, see ``adaptive``) are
  told each event once.
- One chain in ``sample_one_in`` is sampled, drawn at its head; a block inherits its parent's
  draw, so a sampled chain is sampled whole, as prefix hits need. (A block whose parent the tier
  has not seen, such as a tail demoted before its head, draws for itself.)
- Each candidate also runs a metadata-only cache of 1/``sample_one_in`` of the tier's capacity
  (the most blocks the tier has held) over the references to sampled chains, those other tiers
  took included, so a lower tier's miniatures see the workload, not its demotions. A reference
  to a block the miniature holds is a hit there.
- Hits are counted with exponential decay, a half-life of ``half_life_fills`` miniature fills,
  so a change of workload changes the leader. The candidate with the most leads; a tie keeps the
  current leader.

Costs: every candidate's metadata and per-event work (once for candidates that share a record),
plus 1/``sample_one_in`` of one candidate's again per candidate for its miniature, plus one small
record per block of the tier.
"""

from __future__ import annotations

import zlib
from typing import Callable, Iterator

from kvstore.policies.base import EvictionPolicy
from kvstore.policies.hit_density import HitDensityPolicy


class _Link:
    """What the selector remembers of a block: its parent, its chain's draw, tier residency."""

    __slots__ = ("parent", "sampled", "in_tier")

    def __init__(self, parent: bytes | None, sampled: bool) -> None:
        self.parent, self.sampled, self.in_tier = parent, sampled, False


class SeparateCandidates:
    """Candidates as separate policies, each told every event of the tier."""

    def __init__(self, policies: list[EvictionPolicy]) -> None:
        self.policies = policies
        self.names = tuple(policy.name for policy in policies)

    def admit(self, key: bytes, parent: bytes | None, nbytes: int) -> list[bool]:
        return [policy.admit(key, parent, nbytes) for policy in self.policies]  # admission may update state

    def on_insert(self, key: bytes, parent: bytes | None, nbytes: int) -> None:
        for policy in self.policies:
            policy.on_insert(key, parent, nbytes)

    def on_access(self, key: bytes) -> None:
        for policy in self.policies:
            policy.on_access(key)

    def on_remove(self, key: bytes) -> None:
        for policy in self.policies:
            policy.on_remove(key)

    def size_for_store(self, tier_share: float) -> None:
        for policy in self.policies:
            policy.size_for_store(tier_share)

    def on_stored_elsewhere(self, key: bytes, parent: bytes | None, nbytes: int) -> None:
        for policy in self.policies:
            policy.on_stored_elsewhere(key, parent, nbytes)

    def on_move_in(self, key: bytes, parent: bytes | None, nbytes: int) -> None:
        for policy in self.policies:
            policy.on_move_in(key, parent, nbytes)

    def on_hit_elsewhere(self, key: bytes, parent: bytes | None) -> None:
        for policy in self.policies:
            policy.on_hit_elsewhere(key, parent)

    def victims(self, candidate: int, evictable: Callable[[bytes], bool]) -> Iterator[bytes]:
        return self.policies[candidate].victims(evictable)

    def has_resident_children(self, candidate: int, key: bytes) -> bool:
        return self.policies[candidate].has_resident_children(key)

    def admits_demotion(self, candidate: int, key: bytes, evictable: Callable[[bytes], bool]) -> bool:
        return self.policies[candidate].admits_demotion(key, evictable)


class SharedCandidates:
    """Candidates that are the schemes of one ``HitDensityPolicy`` (one record of the tier, each
    event told once): the same decisions as separate policies, for one policy's upkeep."""

    def __init__(self, policy: HitDensityPolicy) -> None:
        self.policy = policy
        self.names = policy.scheme_names
        # every event goes straight to the one record: no frame of this object's own per block
        self.on_insert, self.on_access, self.on_remove = policy.on_insert, policy.on_access, policy.on_remove
        self.on_stored_elsewhere, self.on_move_in = policy.on_stored_elsewhere, policy.on_move_in
        self.on_hit_elsewhere, self.size_for_store = policy.on_hit_elsewhere, policy.size_for_store

    def admit(self, key: bytes, parent: bytes | None, nbytes: int) -> list[bool]:
        return [self.policy.admit(key, parent, nbytes)] * len(self.names)

    def victims(self, candidate: int, evictable: Callable[[bytes], bool]) -> Iterator[bytes]:
        return self.policy.victims_of(candidate, evictable)

    def has_resident_children(self, candidate: int, key: bytes) -> bool:
        return self.policy.has_resident_children(key)

    def admits_demotion(self, candidate: int, key: bytes, evictable: Callable[[bytes], bool]) -> bool:
        return self.policy.admits_demotion(key, evictable, candidate)


class _Miniature:
    """A metadata-only cache run by one candidate over the sampled chains."""

    def __init__(self, policy: EvictionPolicy) -> None:
        self.policy = policy
        self.resident: set[bytes] = set()
        self.hits = 0.0

    def reference(self, key: bytes, parent: bytes | None, capacity: int) -> list[bytes]:
        """Serve one reference: a hit, or a store evicting down to ``capacity``. Returns the evicted keys."""
        if key in self.resident:
            self.hits += 1.0
            self.policy.on_access(key)
            return []
        if not self.policy.admit(key, parent, 1):
            return []
        evicted: list[bytes] = []
        if len(self.resident) >= capacity:
            victims = self.policy.victims(lambda k: k != parent)
            try:
                for victim in victims:
                    self.policy.on_remove(victim)
                    self.resident.discard(victim)
                    evicted.append(victim)
                    if len(self.resident) < capacity:
                        break
            finally:
                victims.close()
        if len(self.resident) < capacity:
            self.resident.add(key)
            self.policy.on_insert(key, parent, 1)
        return evicted


class SelectorPolicy(EvictionPolicy):
    """Follows whichever of ``candidates`` hits most in its miniature. Subclasses name the candidates."""

    name = "selector"
    candidates: tuple[Callable[[], EvictionPolicy], ...] = ()
    sample_one_in = 4  # 8 and 16 pick the wrong candidate on some samples of the Mooncake trace
    half_life_fills = 8
    min_miniature = 16  # blocks: a miniature smaller than this learns nothing

    def __init__(self, candidates: tuple[Callable[[], EvictionPolicy], ...] | None = None, seed: int = 0) -> None:
        makers = candidates if candidates is not None else type(self).candidates
        if len(makers) < 2:
            raise ValueError("a selector needs at least two candidate policies")
        self._tier = self._tier_candidates(makers)
        self._miniatures = [_Miniature(make()) for make in makers]
        self._leader = 0
        self._seed = seed
        self._links: dict[bytes, _Link] = {}  # blocks in the tier or in a miniature
        self._resident = 0
        self._most_resident = 0
        self._since_comparison = 0  # sampled references
        self._decay = 0.5 ** (1.0 / self.half_life_fills)

    def _tier_candidates(self, makers: tuple[Callable[[], EvictionPolicy], ...]
                         ) -> SeparateCandidates | SharedCandidates:
        """The candidates that rank the tier's own blocks. Subclasses may share their upkeep."""
        return SeparateCandidates([make() for make in makers])

    # ---- what the selector exposes -------------------------------------------------------------

    @property
    def leader(self) -> str:
        """The name of the candidate eviction follows now."""
        return self._tier.names[self._leader]

    def miniature_hits(self) -> dict[str, float]:
        """Decayed hits per candidate in its miniature, by candidate name."""
        return {name: m.hits for name, m in zip(self._tier.names, self._miniatures)}

    @property
    def tracked_blocks(self) -> int:
        """Blocks the selector keeps a record of: those in the tier or in a miniature."""
        return len(self._links)

    def __len__(self) -> int:
        return self._resident

    # ---- the policy interface ----------------------------------------------------------------

    def admit(self, key: bytes, parent: bytes | None, nbytes: int) -> bool:
        """Every candidate is asked (admission may update its state); the leader's answer holds."""
        return self._tier.admit(key, parent, nbytes)[self._leader]

    def on_insert(self, key: bytes, parent: bytes | None, nbytes: int) -> None:
        self._tier.on_insert(key, parent, nbytes)
        link = self._enter(key, parent)
        if link.sampled:
            self._simulate(key, link.parent)

    def size_for_store(self, tier_share: float) -> None:
        self._tier.size_for_store(tier_share)  # the miniatures model a tier of their own: their bounds stay

    def on_stored_elsewhere(self, key: bytes, parent: bytes | None, nbytes: int) -> None:
        """A block a faster tier stored: a reference the miniatures serve."""
        self._tier.on_stored_elsewhere(key, parent, nbytes)
        self._reference_elsewhere(key, parent)

    def on_move_in(self, key: bytes, parent: bytes | None, nbytes: int) -> None:
        """Resident here, copied from another tier: the miniatures saw its reference already."""
        self._tier.on_move_in(key, parent, nbytes)
        self._enter(key, parent)

    def on_access(self, key: bytes) -> None:
        self._tier.on_access(key)
        link = self._links.get(key)
        if link is not None and link.in_tier and link.sampled:
            self._simulate(key, link.parent)

    def on_hit_elsewhere(self, key: bytes, parent: bytes | None) -> None:
        """A reference of the store's workload: the miniatures serve it as they serve this tier's."""
        self._tier.on_hit_elsewhere(key, parent)
        self._reference_elsewhere(key, parent)

    def _reference_elsewhere(self, key: bytes, parent: bytes | None) -> None:
        """A reference to ``key`` that this tier did not serve or store, for the miniatures."""
        link = self._links.get(key)
        if link is None:
            # the selector keeps no record of unsampled blocks outside the tier: a block whose
            # parent it does not know is taken as unsampled, so no chain is sampled in part
            parent_link = self._links.get(parent) if parent is not None else None
            if not (parent_link.sampled if parent_link is not None else parent is None and self._draw(key)):
                return
            link = self._links[key] = _Link(parent, True)
        if link.sampled:
            self._simulate(key, link.parent)
            self._forget_if_unused(key, link)

    def on_remove(self, key: bytes) -> None:
        self._tier.on_remove(key)
        link = self._links.get(key)
        if link is None or not link.in_tier:
            return
        link.in_tier = False
        self._resident -= 1
        self._forget_if_unused(key, link)

    def victims(self, evictable: Callable[[bytes], bool] = lambda k: True) -> Iterator[bytes]:
        return self._tier.victims(self._leader, evictable)

    def has_resident_children(self, key: bytes) -> bool:
        return self._tier.has_resident_children(self._leader, key)

    def admits_demotion(self, key: bytes, evictable: Callable[[bytes], bool]) -> bool:
        return self._tier.admits_demotion(self._leader, key, evictable)

    def _enter(self, key: bytes, parent: bytes | None) -> _Link:
        """``key``'s record, made resident in the tier (made first, with its chain's draw, if new)."""
        link = self._links.get(key)
        if link is None:
            link = self._links[key] = _Link(parent, self._draws(key, parent))
        if not link.in_tier:
            link.in_tier = True
            self._resident += 1
            if self._resident > self._most_resident:
                self._most_resident = self._resident
        return link

    # ---- the miniatures ------------------------------------------------------------------------

    def _draws(self, key: bytes, parent: bytes | None) -> bool:
        """Whether ``key``'s chain is sampled: its parent's draw where the selector knows the parent."""
        parent_link = self._links.get(parent) if parent is not None else None
        return parent_link.sampled if parent_link is not None else self._draw(key)

    def _draw(self, key: bytes) -> bool:
        return zlib.crc32(key, self._seed) % self.sample_one_in == 0

    def _simulate(self, key: bytes, parent: bytes | None) -> None:
        """One reference to a sampled block, served by every miniature; then maybe a new leader."""
        capacity = max(self.min_miniature, self._most_resident // self.sample_one_in)
        for miniature in self._miniatures:
            for evicted in miniature.reference(key, parent, capacity):
                link = self._links.get(evicted)
                if link is not None:
                    self._forget_if_unused(evicted, link)
        self._since_comparison += 1
        if self._since_comparison >= capacity:  # one miniature fill: decay, then compare
            self._since_comparison = 0
            for miniature in self._miniatures:
                miniature.hits *= self._decay
            best = max(range(len(self._miniatures)), key=lambda i: self._miniatures[i].hits)
            if self._miniatures[best].hits > self._miniatures[self._leader].hits:
                self._leader = best

    def _forget_if_unused(self, key: bytes, link: _Link) -> None:
        if link.in_tier:
            return
        for miniature in self._miniatures:  # a loop, not any(): this runs for most blocks removed
            if key in miniature.resident:
                return
        del self._links[key]
