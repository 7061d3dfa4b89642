"""The hit-rate curve of a workload: its token hit rate under an LRU cache of any capacity.

Mattson's stack algorithm: one pass over the block accesses gives each access its *reuse
distance* in bytes, the bytes of the distinct blocks used since the same block's previous use,
itself included. An LRU cache of ``C`` bytes (evicting least recently used blocks until the
new one fits) always holds exactly the most recent blocks whose bytes fit in ``C``, so an access
hits iff its reuse distance is at most ``C``: one pass answers every capacity at once.

The model (what the brute-force simulation in the tests does too):

- events come in order, lookups and puts; each touches its blocks in order, and every touch
  makes its block the most recently used (inserting it if absent: an engine puts what a lookup
  missed, so a lookup's miss stands for the put that follows it);
- only lookups count; a lookup's hit is its *prefix*: the leading blocks up to the first miss
  (prefix caching), so a block counts at ``C`` iff it and every block before it in its lookup
  hit at ``C``;
- a block the store itself missed (beyond the hit it answered) cannot hit again, at any
  capacity, until a put of it: a lookup repeated before that put (LMCache looks up each prompt
  twice, when scheduling and when retrieving) misses in any cache. A block the store hit stands
  for a put, whenever it was;
- the cache starts empty: the first use of a block in the trace is a miss at every capacity.

Distances come from a Fenwick tree over access times holding each block's size at the time
of its latest access: O(log n) per access, pure Python, about a microsecond per tree step.

This module knows block keys, sizes and token counts; nothing about tiers, the store's own
eviction policy, metrics or HTTP.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np

COLD = math.inf  # reuse distance of a block's first access


class CurveEvent(Protocol):
    """One lookup or put of the trace (``TrafficRecord`` is one)."""

    keys: Sequence[bytes]  # its blocks, in order
    block_bytes: int  # bytes of each of its blocks
    block_size: int  # tokens of each of its blocks
    hit_blocks: int  # of a lookup: the leading blocks the store answered as a hit
    put: bool  # a put: it touches its blocks and counts nothing


@dataclass(frozen=True)
class HitCurve:
    """Hit tokens of a trace at any LRU capacity; built by ``hit_curve``, read with ``hit_tokens``.

    ``thresholds`` holds, sorted, the capacity in bytes each hitting access needs (the largest
    reuse distance of its request's prefix up to it); ``cumulative_tokens[i]`` is the tokens of
    the first ``i`` of them.
    """

    requests: int  # lookups
    accesses: int  # blocks looked up
    tokens: int  # of the blocks looked up
    nbytes: int  # bytes of the blocks looked up (counted once per lookup)
    thresholds: np.ndarray  # [hitting accesses] float64, ascending
    cumulative_tokens: np.ndarray  # [hitting accesses + 1] int64

    def hit_tokens(self, capacity_bytes: float) -> int:
        """Tokens that would hit in an LRU cache of ``capacity_bytes``; monotone in the capacity."""
        return int(self.cumulative_tokens[np.searchsorted(self.thresholds, capacity_bytes, side="right")])

    def hit_rate(self, capacity_bytes: float) -> float | None:
        """Token hit rate at ``capacity_bytes``; None for an empty trace."""
        return self.hit_tokens(capacity_bytes) / self.tokens if self.tokens else None


class _Fenwick:
    """Prefix sums over positions ``0..n-1`` with point updates, both O(log n)."""

    def __init__(self, n: int):
        self._tree = [0] * (n + 1)

    def add(self, position: int, value: int) -> None:
        tree, i = self._tree, position + 1
        while i < len(tree):
            tree[i] += value
            i += i & -i

    def prefix(self, position: int) -> int:
        """Sum of positions ``0..position`` (0 when ``position`` is -1)."""
        tree, i, total = self._tree, position + 1, 0
        while i > 0:
            total += tree[i]
            i -= i & -i
        return total


def reuse_distances(keys: Sequence[bytes], sizes: Sequence[int]) -> list[float]:
    """LRU stack distance in bytes of every access (``COLD`` for a first use).

    ``sizes[i]`` is the bytes of block ``keys[i]``; a key must keep one size. The distance of
    access ``t`` to a key last used at ``p`` is the bytes of the distinct keys used in ``[p, t)``
    (its own included): the sizes the tree holds at positions ``p..t-1``.
    """
    tree = _Fenwick(len(keys))
    last: dict[bytes, int] = {}
    resident = 0  # bytes of all distinct keys seen so far (the sum of the whole tree)
    out: list[float] = []
    for t, (key, size) in enumerate(zip(keys, sizes)):
        p = last.get(key)
        if p is None:
            out.append(COLD)
            resident += size
        else:
            out.append(resident - tree.prefix(p - 1))
            tree.add(p, -size)
        tree.add(t, size)
        last[key] = t
    return out


def hit_curve(events: Sequence[CurveEvent]) -> HitCurve:
    """The hit curve of the lookups among ``events`` in order, under the model in the module docstring."""
    keys: list[bytes] = []
    sizes: list[int] = []
    for event in events:
        keys.extend(event.keys)
        sizes.extend([event.block_bytes] * len(event.keys))
    distances = reuse_distances(keys, sizes)
    thresholds: list[float] = []
    tokens: list[int] = []
    missed: set[bytes] = set()  # blocks the store missed and no put has stored since
    start = 0
    lookups = [event for event in events if not event.put]
    for event in events:
        span = distances[start:start + len(event.keys)]
        start += len(event.keys)
        if event.put:
            missed.difference_update(event.keys)
            continue
        needed = 0.0  # capacity the prefix up to this block needs
        for key, distance in zip(event.keys, span):
            needed = max(needed, COLD if key in missed else distance)
            if needed == COLD:
                break  # no capacity makes the rest of this lookup's prefix hit
            thresholds.append(needed)
            tokens.append(event.block_size)
        missed.difference_update(event.keys[:event.hit_blocks])
        missed.update(event.keys[event.hit_blocks:])
    order = np.argsort(np.asarray(thresholds, dtype=np.float64), kind="stable")
    cumulative = np.concatenate(([0], np.cumsum(np.asarray(tokens, dtype=np.int64)[order])))
    return HitCurve(
        requests=len(lookups),
        accesses=sum(len(event.keys) for event in lookups),
        tokens=sum(len(event.keys) * event.block_size for event in lookups),
        nbytes=sum(len(event.keys) * event.block_bytes for event in lookups),
        thresholds=np.asarray(thresholds, dtype=np.float64)[order],
        cumulative_tokens=cumulative.astype(np.int64),
    )


def latest_within(events: Sequence[CurveEvent], max_accesses: int) -> list[CurveEvent]:
    """The most recent events (kept in order) whose blocks add up to at most ``max_accesses``.

    Always keeps the newest event, even when it alone is larger: an estimate over one long
    lookup beats none.
    """
    kept: list[CurveEvent] = []
    total = 0
    for event in reversed(events):
        total += len(event.keys)
        if kept and total > max_accesses:
            break
        kept.append(event)
    kept.reverse()
    return kept
