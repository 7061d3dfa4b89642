"""The LRU hit curve against a brute-force LRU cache simulated at each capacity."""

from __future__ import annotations

import collections
import random
from dataclasses import dataclass

import pytest

from kvstore.service.dashboard.curve import COLD, hit_curve, latest_within, reuse_distances
from kvstore.service.metrics import LookupRecord


@dataclass(frozen=True)
class Request:
    keys: tuple[bytes, ...]
    block_bytes: int
    block_size: int


def simulate_lru(requests, capacity_bytes: int) -> int:
    """Hit tokens of an LRU cache of ``capacity_bytes`` that evicts least recently used blocks until
    a new one fits; a request hits on its blocks up to its first miss."""
    cache: collections.OrderedDict[bytes, int] = collections.OrderedDict()  # least recent first
    used = hit_tokens = 0
    for request in requests:
        prefix_hits = True
        for key in request.keys:
            present = key in cache
            prefix_hits = prefix_hits and present
            hit_tokens += request.block_size if prefix_hits else 0
            if present:
                cache.move_to_end(key)
                continue
            cache[key] = request.block_bytes
            used += request.block_bytes
            while used > capacity_bytes:
                used -= cache.popitem(last=False)[1]
    return hit_tokens


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
    trace = make_trace(rng, 150)
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
    a = Request(tuple(key("a", j) for j in range(10)), 9216, 4)
    b = Request(tuple(key("b", j) for j in range(10)), 9216, 4)
    curve = hit_curve([a, b, a, b])
    assert (curve.requests, curve.accesses, curve.tokens, curve.nbytes) == (4, 40, 160, 40 * 9216)
    assert curve.hit_tokens(20 * 9216 - 1) == 0  # LRU with room for 19: the classic loop that always misses
    assert curve.hit_tokens(20 * 9216) == 80
    assert curve.hit_rate(1 << 30) == 0.5


def test_a_request_hits_only_on_its_prefix():
    """The second request's block 0 misses (it was never seen), so its later reused blocks miss too."""
    first = Request((key(1), key(2)), 10, 1)
    second = Request((key(0), key(1), key(2)), 10, 1)
    assert hit_curve([first, second]).hit_tokens(1000) == 0
    assert hit_curve([first, first]).hit_tokens(1000) == 2


def test_reuse_distances_count_distinct_bytes_since_the_last_use():
    keys = [b"a", b"b", b"c", b"a", b"b", b"b", b"c"]
    sizes = [1, 10, 100, 1, 10, 10, 100]
    assert reuse_distances(keys, sizes) == [COLD, COLD, COLD, 111, 111, 10, 111]


def test_empty_trace():
    curve = hit_curve([])
    assert (curve.tokens, curve.hit_tokens(1 << 40), curve.hit_rate(1 << 40)) == (0, 0, None)


def test_latest_within_keeps_the_newest_requests_up_to_the_access_budget():
    records = [LookupRecord(float(t), "ns", tuple(key(t, j) for j in range(n)), 10, 1, 0)
               for t, n in enumerate([5, 3, 4, 2])]
    assert [r.time_s for r in latest_within(records, 8)] == [2.0, 3.0]
    assert [r.time_s for r in latest_within(records, 9)] == [1.0, 2.0, 3.0]
    assert [r.time_s for r in latest_within(records, 14)] == [0.0, 1.0, 2.0, 3.0]
    assert [r.time_s for r in latest_within(records, 1)] == [3.0]  # the newest, even over budget
    assert hit_curve(latest_within(records, 8)).accesses == 6
