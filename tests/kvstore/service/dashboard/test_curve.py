"""The LRU hit curve against a brute-force LRU cache simulated at each capacity."""

from __future__ import annotations

import collections
import random
from dataclasses import dataclass

import pytest

from kvstore.service.dashboard.curve import COLD, hit_curve, latest_within, reuse_distances
from kvstore.service.metrics import TrafficRecord


@dataclass(frozen=True)
class Request:
    keys: tuple[bytes, ...]
    block_bytes: int
    block_size: int
    hit_blocks: int = 0  # what the store answered; of a lookup only
    put: bool = False


def simulate_lru(events, capacity_bytes: int) -> int:
    """Hit tokens of an LRU cache of ``capacity_bytes`` that evicts least recently used blocks until
    a new one fits. Every event touches its blocks, inserting absent ones; a lookup hits on its
    blocks up to its first miss, and a block the store missed misses until a put of it."""
    cache: collections.OrderedDict[bytes, int] = collections.OrderedDict()  # least recent first
    missed: set[bytes] = set()
    used = hit_tokens = 0
    for event in events:
        prefix_hits = not event.put
        for key in event.keys:
            present = key in cache
            prefix_hits = prefix_hits and present and key not in missed
            hit_tokens += event.block_size if prefix_hits else 0
            if present:
                cache.move_to_end(key)
                continue
            cache[key] = event.block_bytes
            used += event.block_bytes
            while used > capacity_bytes:
                used -= cache.popitem(last=False)[1]
        if event.put:
            missed.difference_update(event.keys)
        else:
            missed.difference_update(event.keys[:event.hit_blocks])
            missed.update(event.keys[event.hit_blocks:])
    return hit_tokens


def as_served(rng: random.Random, lookups: list[Request]) -> list[Request]:
    """The events an engine makes of ``lookups``: each lookup answered some leading hit (drawn at
    random: the store's own policy is not LRU), then most often a put of the blocks, some lookups
    repeated before it (LMCache), some never put (an abandoned request)."""
    events = []
    for lookup in lookups:
        served = Request(lookup.keys, lookup.block_bytes, lookup.block_size, rng.randint(0, len(lookup.keys)))
        events.append(served)
        if rng.random() < 0.3:
            events.append(served)
        if rng.random() < 0.85:
            events.append(Request(lookup.keys, lookup.block_bytes, lookup.block_size, put=True))
    return events


def key(*parts) -> bytes:
    return "/".join(map(str, parts)).encode().ljust(32, b".")


def chain_trace(rng: random.Random, requests: int) -> list[Request]:
    """Prompts over shared prefixes in two namespaces of different block geometry: each request
    takes a leading part of one of a few popular documents and adds fresh blocks of its own."""
    geometry = {"a": (9216, 4), "b": (30_000, 16)}
    out = []
    for i in range(requests):
        ns = rng.choice("ab")
        doc = min(int(rng.paretovariate(1.2)), 12)  # a few documents, the first ones most popular
        shared = rng.randint(0, 12)
        fresh = rng.randint(0, 3)
        keys = tuple(key(ns, doc, j) for j in range(shared)) + tuple(key(ns, "fresh", i, j) for j in range(fresh))
        out.append(Request(keys, *geometry[ns]))
    return out


def random_trace(rng: random.Random, requests: int) -> list[Request]:
    """No chain structure: blocks drawn at random from a small set, repeats within a request allowed."""
    return [Request(tuple(key("r", rng.randrange(40)) for _ in range(rng.randint(0, 8))), 1000, 8)
            for _ in range(requests)]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("make_trace", [chain_trace, random_trace])
def test_hit_curve_equals_simulated_lru_at_every_capacity(make_trace, seed):
    rng = random.Random(seed)
    trace = as_served(rng, make_trace(rng, 150))
    curve = hit_curve(trace)
    working_set = sum({k: r.block_bytes for r in trace for k in r.keys}.values())
    capacities = sorted({0, 9216, 30_000, 50_000, working_set, 10 * working_set,
                         *(rng.randrange(working_set) for _ in range(8))})
    hits = [curve.hit_tokens(c) for c in capacities]
    assert hits == [simulate_lru(trace, c) for c in capacities]
    assert hits == sorted(hits), "more capacity never loses a hit"
    assert 0 == hits[0] < hits[-1] < curve.tokens  # cold misses: never 100%


def test_two_alternating_prompts_hit_once_the_cache_holds_both():
    """A B A B, 10 blocks each: the second A reuses A after 20 distinct blocks (184,320 bytes)."""
    a = Request(tuple(key("a", j) for j in range(10)), 9216, 4, hit_blocks=10)  # the store held both
    b = Request(tuple(key("b", j) for j in range(10)), 9216, 4, hit_blocks=10)
    curve = hit_curve([a, b, a, b])
    assert (curve.requests, curve.accesses, curve.tokens, curve.nbytes) == (4, 40, 160, 40 * 9216)
    assert curve.hit_tokens(20 * 9216 - 1) == 0  # LRU with room for 19: the classic loop that always misses
    assert curve.hit_tokens(20 * 9216) == 80
    assert curve.hit_rate(1 << 30) == 0.5


def test_a_request_hits_only_on_its_prefix():
    """The second request's block 0 misses (it was never seen), so its later reused blocks miss too."""
    first = Request((key(1), key(2)), 10, 1, hit_blocks=2)
    second = Request((key(0), key(1), key(2)), 10, 1, hit_blocks=0)
    assert hit_curve([first, second]).hit_tokens(1000) == 0
    assert hit_curve([first, first]).hit_tokens(1000) == 2


def test_a_lookup_repeated_before_the_put_misses_at_every_capacity():
    """LMCache looks each prompt up twice before it puts what missed: the second lookup hit in the
    estimate (the first had 'inserted' the blocks), so the estimate stood above the observed hit
    rate where the store evicted nothing."""
    prompt = tuple(key("p", j) for j in range(4))
    missed = Request(prompt, 10, 1, hit_blocks=0)
    put = Request(prompt, 10, 1, put=True)
    hit = Request(prompt, 10, 1, hit_blocks=4)
    curve = hit_curve([missed, missed, put, hit, hit])
    assert (curve.requests, curve.accesses, curve.tokens) == (4, 16, 16)
    assert curve.hit_tokens(1 << 40) == 8, "the two lookups after the put, as the store answered"
    assert curve.hit_tokens(39) == 0 and curve.hit_tokens(40) == 8  # the put's 4 blocks must fit
    assert hit_curve([missed, missed]).hit_tokens(1 << 40) == 0
    assert hit_curve([missed, put, missed, missed]).hit_tokens(1 << 40) == 4, "missed again: only once put"


def test_a_block_the_store_hit_stands_for_a_put_made_before_the_window():
    prompt = tuple(key("q", j) for j in range(3))
    hit = Request(prompt, 10, 1, hit_blocks=2)  # the store held the first two blocks
    curve = hit_curve([hit, hit])
    assert curve.hit_tokens(1 << 40) == 2, "the first lookup is cold; the second hits where the store did"


def test_reuse_distances_count_distinct_bytes_since_the_last_use():
    keys = [b"a", b"b", b"c", b"a", b"b", b"b", b"c"]
    sizes = [1, 10, 100, 1, 10, 10, 100]
    assert reuse_distances(keys, sizes) == [COLD, COLD, COLD, 111, 111, 10, 111]


def test_empty_trace():
    curve = hit_curve([])
    assert (curve.tokens, curve.hit_tokens(1 << 40), curve.hit_rate(1 << 40)) == (0, 0, None)


def test_latest_within_keeps_the_newest_requests_up_to_the_access_budget():
    records = [TrafficRecord(float(t), "ns", tuple(key(t, j) for j in range(n)), 10, 1, 0)
               for t, n in enumerate([5, 3, 4, 2])]
    assert [r.time_s for r in latest_within(records, 8)] == [2.0, 3.0]
    assert [r.time_s for r in latest_within(records, 9)] == [1.0, 2.0, 3.0]
    assert [r.time_s for r in latest_within(records, 14)] == [0.0, 1.0, 2.0, 3.0]
    assert [r.time_s for r in latest_within(records, 1)] == [3.0]  # the newest, even over budget
    assert hit_curve(latest_within(records, 8)).accesses == 6
