"""Trace replay: the token hit rate a policy gets on a workload, through the store's real code.

Each request is served as an engine would: ``lookup`` of its chained block hashes, ``load`` of the
contiguous hit (which tells the policy of the access and promotes between tiers), then ``put`` of
the missing blocks with their parents. The tiers are ``AccountingTier`` objects (books without
bytes), so the lookup, eviction, admission, demotion and promotion paths are the production
ones; only payload copies are skipped. Background writes are off, so a replay is deterministic.

Every trace block occupies one slot of ``block_tokens`` tokens (pages are fixed-size), while hits
count a partial last block at its real token count. Requests are served in the order given
(``kvstore.trace.read_trace`` gives timestamp order).

Fractions of the infinite-capacity maximum are 1.0 when that maximum is 0 (a trace with no reuse):
every policy, and the optimum, reaches a maximum of nothing.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field, replace
from decimal import Decimal
from fractions import Fraction
from typing import Callable, Sequence

import numpy as np

from kvstore.belady import belady_schedule, bound_of, infinite_hits_per_request
from kvstore.errors import InvalidRequest
from kvstore.hit_rates import TokenHitRates, fraction
from kvstore.keys import Namespace
from kvstore.policies import DEFAULT_POLICY
from kvstore.replay_windows import ReplayWindow, check_window_count, split_windows
from kvstore.replay_workers import replay_in_processes
from kvstore.layout import BlockSpec
from kvstore.store import TieredStore
from kvstore.tiers.accounting import AccountingTier
from kvstore.trace import TraceRequest

# The store's blocks in a replay: one token of one layer of the indexer's fp8 key, the smallest
# real format. A slot stands for a whole trace block (``block_tokens``) whatever its bytes, and
# accounting tiers keep none of them, so a tiny block only spares the put path checksumming a
# scratch buffer nobody reads (with 512-token blocks that was 6% of a replay's time).
_COMPONENTS = ("indexer_fp8",)
_BLOCK_SIZE = 1
LEASE_TTL_S = 3600.0  # a replayed request loads at once; the lease only has to outlive it
MAX_CAPACITY_TOKENS = 10**18  # beyond any cache


@dataclass(frozen=True)
class TierSplit:
    """How the capacity is shared between tiers, fastest first: ``(("host", 0.25), ("disk", 0.75))``."""

    shares: tuple[tuple[str, float], ...] = (("host", 1.0),)

    def __post_init__(self) -> None:
        names = [name for name, _ in self.shares]
        if not self.shares or len(set(names)) != len(names):
            raise InvalidRequest(f"tiers need distinct names, got {names}")
        if not all(0 < share <= 1 for _, share in self.shares) or abs(sum(s for _, s in self.shares) - 1) > 1e-6:
            raise InvalidRequest(f"tier shares must be positive and sum to 1, got {self.shares}")

    @classmethod
    def parse(cls, text: str) -> "TierSplit":
        """``"host=0.25,disk=0.75"`` (or just ``"host"`` for one tier)."""
        parts = text.split(",")
        if len(parts) > 1 and not all("=" in part for part in parts):
            raise InvalidRequest(f"tiers {text!r}: give each tier its share of the capacity, e.g. host=0.25,disk=0.75")
        shares = []
        for part in parts:
            name, _, share = part.strip().partition("=")
            try:
                shares.append((name.strip(), float(share) if share else 1.0))
            except ValueError:
                raise InvalidRequest(f"cannot read tier share {part!r}; example: host=0.25,disk=0.75") from None
        return cls(tuple(shares))


@dataclass(frozen=True)
class ReplayResult(TokenHitRates):
    policy: str
    capacity_tokens: int
    requests: int
    input_tokens: int
    hit_tokens: int
    max_hit_tokens: int
    optimal_hit_tokens: int | None
    tier_hit_tokens: dict[str, int]
    tier_capacity_tokens: dict[str, int]
    write_policy: str
    elapsed_s: float
    extra: dict = field(default_factory=dict)
    windows: tuple[ReplayWindow, ...] = ()  # the trace cut into stretches (``replay(windows=N)``)

    @property
    def optimal_fraction_of_max(self) -> float | None:
        """Belady's bound over the maximum; 1.0 when the maximum is 0, None without the bound."""
        return None if self.optimal_hit_tokens is None else fraction(self.optimal_hit_tokens, self.max_hit_tokens)

    @property
    def optimal_hit_rate(self) -> float | None:
        return None if self.optimal_hit_tokens is None else self.optimal_hit_tokens / max(self.input_tokens, 1)

    def as_dict(self) -> dict:
        out = asdict(self)
        out["windows"] = [window.as_dict() for window in self.windows]
        out.update(hit_rate=self.hit_rate, max_hit_rate=self.max_hit_rate, fraction_of_max=self.fraction_of_max,
                   optimal_hit_rate=self.optimal_hit_rate, optimal_fraction_of_max=self.optimal_fraction_of_max)
        return out


def replay(
    requests: Sequence[TraceRequest],
    capacity_tokens: int,
    policy: str = DEFAULT_POLICY,
    tiers: TierSplit = TierSplit(),
    write_policy: str = "on_eviction",
    block_tokens: int = 512,
    with_optimal: bool = True,
    progress: Callable[[int], None] | None = None,
    windows: int = 0,
) -> ReplayResult:
    """Replay ``requests``, in the order given, through a store of ``capacity_tokens`` split over
    ``tiers``; ``InvalidRequest`` if ``tier_slots`` refuses the capacity. ``windows`` > 0 also
    reports the hit rate of that many stretches of the trace (``kvstore.replay_windows``)."""
    slots = tier_slots(capacity_tokens, tiers, block_tokens)
    if windows:
        check_window_count(windows, len(requests))
    namespace = Namespace("replay", "trace", 1, _COMPONENTS, block_size=_BLOCK_SIZE)
    spec = BlockSpec.of(namespace)
    store = TieredStore([AccountingTier(name, n * spec.block_bytes) for name, n in slots.items()],
                        policy=policy, write_policy=write_policy, background_writes=False)
    started = time.perf_counter()
    try:
        ns_id = store.register_namespace(namespace)
        hits, tier_hits = _serve_all(store, ns_id, spec, requests, block_tokens, progress)
        store.check_integrity()
    finally:
        store.close()
    elapsed = time.perf_counter() - started
    total_slots = sum(slots.values())
    max_hits = infinite_hits_per_request(requests, block_tokens)
    optimal = schedule = None
    if with_optimal:
        optimal_blocks, schedule = belady_schedule(requests, total_slots, block_tokens)
        optimal = bound_of(optimal_blocks, block_tokens, sum(max_hits))
    return ReplayResult(
        policy=store.policy_name,
        capacity_tokens=capacity_tokens,
        requests=len(requests),
        input_tokens=sum(r.input_length for r in requests),
        hit_tokens=sum(hits),
        max_hit_tokens=sum(max_hits),
        optimal_hit_tokens=optimal,
        tier_hit_tokens=tier_hits,
        tier_capacity_tokens={name: n * block_tokens for name, n in slots.items()},
        write_policy=write_policy,
        elapsed_s=elapsed,
        windows=tuple(split_windows(requests, hits, max_hits, windows, schedule)) if windows else (),
    )


def tier_slots(capacity_tokens: int, tiers: TierSplit, block_tokens: int) -> dict[str, int]:
    """Block slots of each tier at ``capacity_tokens``: each tier's share of the capacity's whole
    blocks, rounded down in exact arithmetic (the shares as written: 0.7 is 7/10), and the blocks
    rounding leaves over go to the last tier, so the tiers hold as many as one tier of that
    capacity. ``InvalidRequest`` unless every tier gets at least one and the capacity is at most
    ``MAX_CAPACITY_TOKENS``."""
    if capacity_tokens > MAX_CAPACITY_TOKENS:
        raise InvalidRequest(f"a capacity of {Decimal(capacity_tokens):.3g} tokens is above 10**18, more than any "
                             "cache holds; check the number")
    if capacity_tokens < block_tokens * len(tiers.shares):
        raise InvalidRequest(f"capacity of {capacity_tokens} tokens is below one {block_tokens}-token block per tier")
    blocks = capacity_tokens // block_tokens
    shares = {name: blocks * Fraction(repr(share)) for name, share in tiers.shares}  # exact: 46080 x 0.7 < 32256 in floats
    for name, share in shares.items():
        if share < 1:
            raise InvalidRequest(f"the {name} tier's share of {capacity_tokens} tokens is below one "
                                 f"{block_tokens}-token block; raise the capacity or its share")
    slots = {name: share // 1 for name, share in shares.items()}
    last = tiers.shares[-1][0]
    slots[last] += blocks - sum(slots.values())
    if slots[last] < 1:  # shares summing a hair above 1 (within TierSplit's tolerance) took its blocks
        raise InvalidRequest(f"tier shares {dict(tiers.shares)} add up to more than 1: the {last} tier would get "
                             f"{slots[last]} of {blocks} blocks at {capacity_tokens} tokens; make them sum to 1")
    return slots


def _serve_all(store: TieredStore, ns_id: bytes, spec: BlockSpec, requests: Sequence[TraceRequest],
               block_tokens: int, progress: Callable[[int], None] | None) -> tuple[list[int], dict[str, int]]:
    """Serve every request; each one's hit tokens, and the hit tokens of each tier."""
    scratch = np.zeros(spec.block_bytes, np.uint8)  # accounting tiers neither read nor write it
    tier_hits = {tier.name: 0 for tier in store.tiers}
    hits = []
    for number, request in enumerate(requests, 1):
        hashes = [h.to_bytes(16, "little") for h in request.hash_ids]  # a trace id as a store block hash
        hit = store.lookup(ns_id, hashes, lease_ttl_s=LEASE_TTL_S)  # as an engine's connector does
        found = hit.hit_blocks
        loaded = store.load(ns_id, hashes[:found], [scratch] * found, lease_id=hit.lease_id) if found else None
        served = loaded.tiers if loaded else ()
        hit_tokens = 0
        for index, tier in enumerate(served):
            tokens = request.block_tokens(index, block_tokens)
            tier_hits[tier] += tokens
            hit_tokens += tokens
        hits.append(hit_tokens)
        done = len(served)
        if done < len(hashes):
            parent = hashes[done - 1] if done else None
            store.put(ns_id, hashes[done:], [scratch] * (len(hashes) - done), parent=parent)
        if progress and number % 256 == 0:
            progress(256)
    if progress:
        progress(len(requests) % 256)
    return hits, tier_hits


def sweep(requests: Sequence[TraceRequest], capacities: Sequence[int], policies: Sequence[str],
          block_tokens: int = 512, progress: Callable[[int], None] | None = None, jobs: int = 1,
          tiers: TierSplit = TierSplit(), with_optimal: bool = True, **kw) -> list[ReplayResult]:
    """``replay`` at every capacity for every policy, capacity by capacity, policies in the order
    given, each once (the optimum is computed once per capacity, unless ``with_optimal`` is
    False). Every capacity is checked (``tier_slots``) before the first replay runs. With ``jobs``
    > 1 the replays run in that many worker processes (``kvstore.replay_workers``), with the same
    results but for their ``elapsed_s`` (a replay is deterministic); policies are then given by
    name, and ``progress`` moves by one whole replay at a time."""
    if jobs < 1:
        raise InvalidRequest(f"jobs must be at least 1, got {jobs}")
    capacities, policies = list(dict.fromkeys(capacities)), list(dict.fromkeys(policies))
    for capacity in capacities:
        tier_slots(capacity, tiers, block_tokens)
    runs = [(capacity, policy, with_optimal and first == 0)
            for capacity in capacities for first, policy in enumerate(policies)]
    kw.update(block_tokens=block_tokens, tiers=tiers)
    if jobs == 1 or len(runs) < 2:
        results = [replay(requests, capacity, policy, with_optimal=optimal, progress=progress, **kw)
                   for capacity, policy, optimal in runs]
    else:
        results = replay_in_processes(requests, runs, jobs, kw, progress)
    if not with_optimal:
        return results
    optimal = {r.capacity_tokens: r.optimal_hit_tokens for r in results if r.optimal_hit_tokens is not None}
    return [r if r.optimal_hit_tokens is not None else _with_optimal(r, optimal[r.capacity_tokens]) for r in results]


def _with_optimal(result: ReplayResult, optimal: int) -> ReplayResult:
    return replace(result, optimal_hit_tokens=optimal)


def default_capacities(requests: Sequence[TraceRequest], block_tokens: int = 512,
                       tiers: TierSplit = TierSplit()) -> list[int]:
    """Capacities from 5% to 100% of the trace's distinct footprint, rounded to whole blocks, and
    none below the smallest that gives each of ``tiers`` a block (``tier_slots``): a small trace's
    curve starts there rather than being refused."""
    distinct = len({h for r in requests for h in r.hash_ids}) * block_tokens
    smallest = block_tokens * max(math.ceil(1 / Fraction(repr(share))) for _, share in tiers.shares)
    return sorted({max(smallest, int(distinct * f) // block_tokens * block_tokens)
                   for f in (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0)})
