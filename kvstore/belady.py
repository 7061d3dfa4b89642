"""Belady's offline optimum for a prefix cache: the upper bound a replay compares policies with.

Knowing the future, evict the block whose next use is furthest away (never used again first), and
do not admit a block that would be that victim itself (bypass). On prefix chains this respects the
chain order on its own: every request that uses a child also uses its parent, so a parent's next
use is never later than its child's; ties evict the deeper block first.

This maximises block hits (the tests check it against an exhaustive search). With equal-size
blocks that is the token optimum too. A partial last block weighs fewer tokens but fills a slot
like a full one, so where partial blocks are hit a policy can gain more tokens than Belady's own
schedule does (keeping full blocks instead). ``optimal_hit_tokens`` is therefore Belady's block
hits counted at a full block each, capped by the infinite-capacity maximum: no policy's token
hits can exceed it. The tokens of Belady's schedule itself, partial blocks at their real size
(``belady_hits``), are at most that and were 0.12 points of the maximum below it on the Mooncake
trace at 3M tokens.

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
    """An upper bound on the token hits of any policy at ``capacity_blocks`` slots (one block per
    slot): Belady's block hits at ``block_tokens`` each, at most the infinite-capacity maximum."""
    blocks, _ = belady_hits(requests, capacity_blocks, block_tokens)
    return bound_of(blocks, block_tokens, infinite_hit_tokens(requests, block_tokens))


def bound_of(hit_blocks: int, block_tokens: int, max_hit_tokens: int) -> int:
    """``optimal_hit_tokens`` from Belady's block hits and the infinite-capacity maximum."""
    return min(hit_blocks * block_tokens, max_hit_tokens)


def belady_hits(requests: Sequence[TraceRequest], capacity_blocks: int, block_tokens: int) -> tuple[int, int]:
    """(block hits, token hits) of Belady with bypass at ``capacity_blocks`` slots."""
    blocks, tokens = belady_schedule(requests, capacity_blocks, block_tokens)
    return blocks, sum(tokens)


def belady_schedule(requests: Sequence[TraceRequest], capacity_blocks: int, block_tokens: int,
                    heap_slack: int = 4096) -> tuple[int, list[int]]:
    """Belady with bypass at ``capacity_blocks`` slots: its block hits, and each request's token hits.
    The heap is rebuilt from the resident blocks when it holds more than 4 items per resident
    block plus ``heap_slack`` (stale items pile up; the same schedule either way; tests set 0 to
    rebuild it often)."""
    future = next_uses(requests)
    resident: dict[int, tuple[float, int]] = {}  # block id -> (next use, depth)
    heap: list[tuple[float, int, int]] = []  # (-next use, -depth, id): furthest, deepest first
    hit_blocks = 0
    hit_tokens = []
    for request, uses in zip(requests, future):
        ids = request.hash_ids
        hits = 0
        while hits < len(ids) and ids[hits] in resident:
            hits += 1
        hit_blocks += hits
        hit_tokens.append(sum(request.block_tokens(j, block_tokens) for j in range(hits)))
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
        if len(heap) > 4 * len(resident) + heap_slack:
            heap = [(-u, -d, b) for b, (u, d) in resident.items()]
            heapq.heapify(heap)
    return hit_blocks, hit_tokens


def infinite_hit_tokens(requests: Sequence[TraceRequest], block_tokens: int) -> int:
    """Token hits with unlimited capacity: the most any policy can reach."""
    return sum(infinite_hits_per_request(requests, block_tokens))


def infinite_hits_per_request(requests: Sequence[TraceRequest], block_tokens: int) -> list[int]:
    """Each request's token hits with unlimited capacity, every earlier request seen."""
    seen: set[int] = set()
    hit_tokens = []
    for request in requests:
        ids = request.hash_ids
        hits = 0
        while hits < len(ids) and ids[hits] in seen:
            hits += 1
        hit_tokens.append(sum(request.block_tokens(j, block_tokens) for j in range(hits)))
        seen.update(ids)
    return hit_tokens
