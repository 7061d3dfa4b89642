"""Synthetic traces: valid Mooncake format, seeded, and chained the way real prefix ids are."""

import pytest

from kvstore.synthetic_traces import GENERATORS
from kvstore.trace import parse_request


@pytest.fixture(scope="module", params=sorted(GENERATORS))
def trace(request):
    return request.param, GENERATORS[request.param](seed=3)


def test_every_request_is_a_valid_trace_request_in_time_order(trace):
    _, requests = trace
    parsed = [parse_request(r, 512, f"request {i}") for i, r in enumerate(requests)]
    assert len(parsed) > 100
    assert [p.timestamp for p in parsed] == sorted(p.timestamp for p in parsed)


def test_same_seed_same_trace_other_seed_other_trace(trace):
    kind, requests = trace
    assert GENERATORS[kind](seed=3) == requests
    assert GENERATORS[kind](seed=4) != requests


def test_a_shared_block_id_means_a_shared_prefix(trace):
    """Chained ids: if two requests share block j, they share every block before it too."""
    _, requests = trace
    prefix_of: dict[int, tuple[int, ...]] = {}
    for r in requests:
        ids = r["hash_ids"]
        for j, h in enumerate(ids):
            seen = prefix_of.setdefault(h, tuple(ids[:j]))
            assert seen == tuple(ids[:j])


def test_there_is_reuse_to_find(trace):
    _, requests = trace
    refs = sum(len(r["hash_ids"]) for r in requests)
    distinct = len({h for r in requests for h in r["hash_ids"]})
    assert distinct < 0.8 * refs
