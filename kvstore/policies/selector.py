"""Selector: candidate policies kept side by side; eviction follows the one that would hit most on
the live workload, judged by miniature simulations over a sample of its blocks.

Which reuse model ranks blocks best depends on the workload, and a policy cannot tell from its own
statistics whether its model is the right one: HitDensity's split of reused blocks by use count
is worth 1.5 to 2.2 points on multi-turn chat and costs 2.4 on the Mooncake trace. A miniature
cache can tell (Waldspurger et al., "Cache Modeling and Optimization using Miniature
Simulations", USENIX ATC 2017):

- Every candidate is a full policy told every insert, access and removal of the tier (and the
  store's references other tiers took: ``on_stored_elsewhere``, ``on_hit_elsewhere``), so any of
  them can lead at any moment with a complete view; a change of leader moves nothing.
  Candidates that can share one record of the tier (HitDensity kinds) are told each event once.
  One that does not lead stands by (``stand_by``): it may stop keeping its eviction order and
  rebuild it, exactly, when it leads again (ReuseARC's heaps).
- One block in ``sample_one_in`` is sampled, drawn from its own key (spatial sampling, as in
  SHARDS), so a sampled block's references are all seen and the reuse distances scale with the
  miniature. A miniature sees a *thinned chain*: a sampled block's parent there is its nearest
  sampled ancestor, so eviction from the chain's tail and prefix hits still hold in it. The
  selector keeps no record of unsampled blocks outside its tier, so in a lower tier a sampled
  block stored elsewhere under an unsampled parent it does not know heads its thinned chain.
  (Drawing once per chain at its head, as before session 24, sampled everything or nothing on
  workloads whose chains hang under a few shared system prompts.)
- Each candidate also runs a metadata-only cache of 1/``sample_one_in`` of the tier's capacity
  (the most blocks the tier has held) over the references to sampled blocks, those other tiers
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
    """What the selector remembers of a block: its nearest sampled ancestor (its parent in the
    miniatures' thinned chains, None if none is known), its own draw, tier residency."""

    __slots__ = ("up", "sampled", "in_tier")

    def __init__(self, up: bytes | None, sampled: bool) -> None:
        self.up, self.sampled, self.in_tier = up, sampled, False


class TierCandidates:
    """The candidates that rank the tier's own blocks, each told every event of the tier.

    Candidates that can share one record (HitDensity kinds, ``HitDensityPolicy.can_share``) are
    the schemes of one ``HitDensityPolicy``, told each event once: the same decisions as separate
    policies, for one policy's upkeep. Every other candidate keeps its own state.
    """

    def __init__(self, makers: tuple[Callable[[], EvictionPolicy], ...]) -> None:
        shared = [make for make in makers if HitDensityPolicy.can_share((make,))]
        if len(shared) < 2 or not HitDensityPolicy.can_share(shared):
            shared = []
        record = HitDensityPolicy(schemes=shared) if shared else None  # type: ignore[arg-type]  # checked: classes
        # candidate i is ranked by owners[i][0], as its scheme owners[i][1] (None: its own ranking)
        self.owners: list[tuple[EvictionPolicy, int | None]] = [
            (record, shared.index(make)) if make in shared else (make(), None) for make in makers]
        self.policies = list({id(policy): policy for policy, _ in self.owners}.values())  # each once
        self.names = tuple(record.scheme_names[scheme] if scheme is not None else policy.name
                           for policy, scheme in self.owners)
        if len(self.policies) == 1:  # every event straight to the one record: no loop per block
            only = self.policies[0]
            self.on_insert, self.on_access, self.on_remove = only.on_insert, only.on_access, only.on_remove
            self.on_stored_elsewhere, self.on_move_in = only.on_stored_elsewhere, only.on_move_in
            self.on_hit_elsewhere = only.on_hit_elsewhere

    def admit(self, candidate: int, key: bytes, parent: bytes | None, nbytes: int) -> bool:
        """The answer of the policy that ranks ``candidate``; every policy is asked (admission may
        update its state)."""
        ranking = self.owners[candidate][0]
        answer = True
        for policy in self.policies:
            admitted = policy.admit(key, parent, nbytes)
            if policy is ranking:
                answer = admitted
        return answer

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

    def lead(self, candidate: int) -> None:
        """``candidate`` leads now: every policy that does not rank it stands by (``stand_by``)."""
        leading = self.owners[candidate][0]
        for policy in self.policies:
            if policy is not leading:
                policy.stand_by()

    def victims(self, candidate: int, evictable: Callable[[bytes], bool]) -> Iterator[bytes]:
        policy, scheme = self.owners[candidate]
        if scheme is None:
            return policy.victims(evictable)
        return policy.victims_of(scheme, evictable)  # type: ignore[attr-defined]  # the shared record

    def has_resident_children(self, candidate: int, key: bytes) -> bool:
        return self.owners[candidate][0].has_resident_children(key)

    def admits_demotion(self, candidate: int, key: bytes, evictable: Callable[[bytes], bool]) -> bool:
        policy, scheme = self.owners[candidate]
        if scheme is None:
            return policy.admits_demotion(key, evictable)
        return policy.admits_demotion(key, evictable, scheme)  # type: ignore[call-arg]  # the shared record


class _Miniature:
    """A metadata-only cache run by one candidate over the sampled blocks' thinned chains."""

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
    # 1 in 8 since session 25: as good as 1 in 4 on the benchmarks (README, Policies) and a fifth
    # quicker; with chains sampled whole (before session 24), 8 and 16 chose wrong on the Mooncake trace
    sample_one_in = 8
    half_life_fills = 8
    min_miniature = 16  # blocks: a miniature smaller than this learns nothing

    def __init__(self, candidates: tuple[Callable[[], EvictionPolicy], ...] | None = None, seed: int = 0) -> None:
        makers = candidates if candidates is not None else type(self).candidates
        if len(makers) < 2:
            raise ValueError("a selector needs at least two candidate policies")
        self._tier = TierCandidates(makers)
        self._miniatures = [_Miniature(make()) for make in makers]
        self._leader = 0
        self._tier.lead(0)
        self._seed = seed
        self._links: dict[bytes, _Link] = {}  # blocks in the tier or in a miniature
        self._resident = 0
        self._most_resident = 0
        self._since_comparison = 0  # sampled references
        self._decay = 0.5 ** (1.0 / self.half_life_fills)

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
        return self._tier.admit(self._leader, key, parent, nbytes)

    def on_insert(self, key: bytes, parent: bytes | None, nbytes: int) -> None:
        self._tier.on_insert(key, parent, nbytes)
        link = self._enter(key, parent)
        if link.sampled:
            self._simulate(key, link.up)

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
            self._simulate(key, link.up)

    def on_hit_elsewhere(self, key: bytes, parent: bytes | None) -> None:
        """A reference of the store's workload: the miniatures serve it as they serve this tier's."""
        self._tier.on_hit_elsewhere(key, parent)
        self._reference_elsewhere(key, parent)

    def _reference_elsewhere(self, key: bytes, parent: bytes | None) -> None:
        """A reference to ``key`` that this tier did not serve or store, for the miniatures."""
        link = self._links.get(key)
        if link is None:
            if not self._draw(key):
                return
            link = self._links[key] = _Link(self._up(parent), True)
        if link.sampled:
            self._simulate(key, link.up)
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
        """``key``'s record, made resident in the tier (made first, with its own draw and its nearest
        sampled ancestor, if new)."""
        link = self._links.get(key)
        if link is None:
            link = self._links[key] = _Link(self._up(parent), self._draw(key))
        if not link.in_tier:
            link.in_tier = True
            self._resident += 1
            if self._resident > self._most_resident:
                self._most_resident = self._resident
        return link

    # ---- the miniatures ------------------------------------------------------------------------

    def _up(self, parent: bytes | None) -> bytes | None:
        """The nearest sampled block at or above ``parent`` that the selector knows, else None."""
        if parent is None:
            return None
        link = self._links.get(parent)
        if link is None:
            return None
        return parent if link.sampled else link.up

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
                self._tier.lead(best)

    def _forget_if_unused(self, key: bytes, link: _Link) -> None:
        if link.in_tier:
            return
        if link.sampled:  # only sampled blocks enter the miniatures
            for miniature in self._miniatures:  # a loop, not any(): this runs for many blocks removed
                if key in miniature.resident:
                    return
        del self._links[key]
