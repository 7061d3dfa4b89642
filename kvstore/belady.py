"""Belady's offline optimum for a prefix cache: the upper bound a replay compares policies with.

Knowing the future, evict the block whose next use is furthest away (never used again first), and
do not admit a block that would be that victim itself (bypass). On prefix chains this respects the
chain order on its own: every request that uses a child also uses its parent, so a parent's next
use is never later than its child's; ties evict the deeper block first.

This maximises block hits, and with equal-size blocks that is the token optimum (the tests check
it against an exhaustive search). A partial last block weighs fewer tokens but counts as a block
here, so with partial blocks it is a close approximation of the token optimum, not exactly it;
in the published traces partial blocks are one per prompt and rarely reused.

It is a bound, not a policy: it reads the whole trace ahead, so it is computed apart from the
store. It knows trace requests and slots, nothing about bytes or tiers.
"""

from __future__ import annotations

import heapq
import math
from typing import Sequence

from kvstore.trace import TraceRequest

NEVER = math.inf


def next_uses(requests: Sequence[TraceRequest]) -> list[list[float]]:
    """``out[i][j]``: index of the next request after ``i`` using block ``j`` of request ``i``."""
    upcoming: dict[int, float] = {}
    out: list[list[float]] = [[] for _ in requests]
    for i in range(len(requests) - 1, -1, -1):
        ids = requests[i].hash_ids
        out[i] = [upcoming.get(h, NEVER) for h in ids]
        for h in ids:
            upcoming[h] = i
    return out


def optimal_hit_tokens(requests: Sequence[TraceRequest], capacity_blocks: int, block_tokens: int) -> int:
    """Token hits of Belady with bypass at ``capacity_blocks`` slots (one block per slot)."""
    future = next_uses(requests)
    resident: dict[int, tuple[float, int]] = {}  # block id -> (next use, depth)
    heap: list[tuple[float, int, int]] = []  # (-next use, -depth, id): furthest, deepest first
    hit_tokens = 0
    for request, uses in zip(requests, future):
        ids = request.hash_ids
        hits = 0
        while hits < len(ids) and ids[hits] in resident:
            hits += 1
        hit_tokens += sum(request.block_tokens(j, block_tokens) for j in range(hits))
        for depth, (block, use) in enumerate(zip(ids, uses)):
            if use == NEVER:
                resident.pop(block, None)  # never needed again: free its slot now
                continue
            resident[block] = (use, depth)
            heapq.heappush(heap, (-use, -depth, block))
        while len(resident) > capacity_blocks:
            neg_use, neg_depth, block = heapq.heappop(heap)
            if resident.get(block) == (-neg_use, -neg_depth):
                del resident[block]
        if len(heap) > 4 * len(resident) + 4096:
            heap = [(-u, -d, b) for b, (u, d) in resident.items()]
            heapq.heapify(heap)
    return hit_tokens


def infinite_hit_tokens(requests: Sequence[TraceRequest], block_tokens: int) -> int:
    """Token hits with unlimited capacity: the most any policy can reach."""
    seen: set[int] = set()
    hit_tokens = 0
    for request in requests:
        ids = request.hash_ids
        hits = 0
        while hits < len(ids) and ids[hits] in seen:
            hits += 1
        hit_tokens += sum(request.block_tokens(j, block_tokens) for j in range(hits))
        seen.update(ids)
    return hit_tokens
