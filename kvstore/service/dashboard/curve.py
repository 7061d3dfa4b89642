"""The hit-rate curve of a workload: its token hit rate under an LRU cache of any capacity.

Mattson's stack algorithm: one pass over the block accesses gives each access its *reuse
distance* in bytes, the bytes of the distinct blocks used since the same block's previous use,
itself included. An LRU cache of ``C`` bytes (evicting least recently used blocks until the
new one fits) always holds exactly the most recent blocks whose bytes fit in ``C``, so an access
hits iff its reuse distance is at most ``C``: one pass answers every capacity at once.

The model (what the brute-force simulation in the tests does too):

- requests come in order; each accesses its blocks in order, and every access makes its block
  the most recently used (inserting it on a miss);
- a request's hit is its *prefix*: the leading blocks up to the first miss (prefix caching);
  so a block counts at ``C`` iff it and every block before it in its request hit at ``C``;
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


class CurveRequest(Protocol):
    """One request of the trace (``LookupRecord`` is one)."""

    keys: Sequence[bytes]  # its blocks, in order
    block_bytes: int  # bytes of each of its blocks
    block_size: int  # tokens of each of its blocks


@dataclass(frozen=True)
class HitCurve:
    """Hit tokens of a trace at any LRU capacity; built by ``hit_curve``, read with ``hit_tokens``.

    ``thresholds`` holds, sorted, the capacity in bytes each hitting access needs (the largest
    reuse distance of its request's prefix up to it); ``cumulative_tokens[i]`` is the tokens of
    the first ``i`` of them.
    """

    requests: int
    accesses: int
    tokens: int
    nbytes: int  # bytes of all accesses (blocks counted once per access)
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


def hit_curve(requests: Sequence[CurveRequest]) -> HitCurve:
    """The hit curve of ``requests`` in order, under the model in the module docstring."""
    keys: list[bytes] = []
    sizes: list[int] = []
    for request in requests:
        keys.extend(request.keys)
        sizes.extend([request.block_bytes] * len(request.keys))
    distances = reuse_distances(keys, sizes)
    thresholds: list[float] = []
    tokens: list[int] = []
    start = 0
    for request in requests:
        needed = 0.0  # capacity the prefix up to this block needs
        for distance in distances[start:start + len(request.keys)]:
            needed = max(needed, distance)
            if needed == COLD:
                break  # no capacity makes the rest of this request's prefix hit
            thresholds.append(needed)
            tokens.append(request.block_size)
        start += len(request.keys)
    order = np.argsort(np.asarray(thresholds, dtype=np.float64), kind="stable")
    cumulative = np.concatenate(([0], np.cumsum(np.asarray(tokens, dtype=np.int64)[order])))
    return HitCurve(
        requests=len(requests),
        accesses=len(keys),
        tokens=sum(len(r.keys) * r.block_size for r in requests),
        nbytes=sum(sizes),
        thresholds=np.asarray(thresholds, dtype=np.float64)[order],
        cumulative_tokens=cumulative.astype(np.int64),
    )


def latest_within(requests: Sequence[CurveRequest], max_accesses: int) -> list[CurveRequest]:
    """The most recent requests (kept in order) whose accesses add up to at most ``max_accesses``.

    Always keeps the newest request, even when it alone is larger: an estimate over one long
    request beats none.
    """
    kept: list[CurveRequest] = []
    total = 0
    for request in reversed(requests):
        total += len(request.keys)
        if kept and total > max_accesses:
            break
        kept.append(request)
    kept.reverse()
    return kept
