"""Selector: it follows whichever candidate hits more on the workload it serves."""

import pytest

from kvstore.policies import ChainPolicy, Entry, HitDensityPolicy, LRUPolicy, SelectorPolicy
from kvstore.policies.adaptive import AdaptivePolicy
from kvstore.replay import replay
from kvstore.synthetic_traces import multi_turn_chat
from kvstore.trace import TraceRequest
from tests.kvstore.policies.flood import document_among_one_offs


class MostRecentFirst(ChainPolicy):
    """The most recently used leaf first: right for loops larger than the cache, wrong elsewhere."""

    name = "mru"

    def priority(self, key: bytes, entry: Entry) -> float:
        return -entry.last_access


def k(i: int) -> bytes:
    return i.to_bytes(32, "little")


def loop_over_documents(rounds: int, documents: int, blocks: int) -> list[TraceRequest]:
    """Documents re-read in the same order, round after round."""
    trace = []
    for r in range(rounds):
        for d in range(documents):
            ids = tuple(d * 100 + b for b in range(blocks))
            trace.append(TraceRequest(float(len(trace)), blocks * 512, 0, ids))
    return trace


def replay_with(trace, capacity_blocks, make):
    made = []

    def factory():
        made.append(make())
        return made[-1]

    result = replay(trace, capacity_blocks * 512, factory, with_optimal=False)
    return result.hit_tokens, made[0]


@pytest.mark.parametrize("order", [(LRUPolicy, MostRecentFirst), (MostRecentFirst, LRUPolicy)])
def test_on_a_loop_larger_than_the_cache_it_follows_most_recent_first(order):
    trace = loop_over_documents(rounds=30, documents=40, blocks=4)  # 160 blocks through 64 slots
    lru, _ = replay_with(trace, 64, LRUPolicy)
    mru, _ = replay_with(trace, 64, MostRecentFirst)
    selected, selector = replay_with(trace, 64, lambda: SelectorPolicy(order))
    assert lru == 0 < mru
    assert selector.leader == "mru"
    assert selected >= 0.8 * mru


@pytest.mark.parametrize("order", [(LRUPolicy, MostRecentFirst), (MostRecentFirst, LRUPolicy)])
def test_on_a_re_read_document_among_one_offs_it_follows_lru(order):
    trace = document_among_one_offs(800, document_blocks=8, one_off_blocks=4)
    lru, _ = replay_with(trace, 48, LRUPolicy)
    mru, _ = replay_with(trace, 48, MostRecentFirst)
    selected, selector = replay_with(trace, 48, lambda: SelectorPolicy(order))
    assert lru > mru
    assert selector.leader == "lru"
    assert selected >= 0.9 * lru


def test_it_needs_two_candidates():
    with pytest.raises(ValueError, match="two candidate"):
        SelectorPolicy((LRUPolicy,))


def test_a_tier_emptied_keeps_no_record_outside_the_miniatures():
    selector = SelectorPolicy((LRUPolicy, MostRecentFirst))
    for chain in range(300):
        for b in range(5):
            selector.on_insert(k(chain * 10 + b), k(chain * 10 + b - 1) if b else None, 1)
    assert len(selector) == 1500
    removed = 0
    while True:
        victim = next(selector.victims(), None)
        if victim is None:
            break
        selector.on_remove(victim)
        removed += 1
    assert removed == 1500 and len(selector) == 0
    # each miniature holds at most a quarter of the most the tier held, and nothing else is kept
    assert selector.tracked_blocks <= 2 * 1500 // selector.sample_one_in


def test_adaptive_does_not_lose_to_either_candidate_on_chat():
    trace = [TraceRequest(r["timestamp"], r["input_length"], r["output_length"], tuple(r["hash_ids"]))
             for r in multi_turn_chat(seed=1, n_conversations=300, duration_s=600.0)]
    footprint = len({h for r in trace for h in r.hash_ids}) * 512
    capacity = int(footprint * 0.05)
    density = replay(trace, capacity, "hit_density", with_optimal=False).hit_tokens
    pooled = replay(trace, capacity, "hit_density_pooled", with_optimal=False).hit_tokens
    adaptive = replay(trace, capacity, "adaptive", with_optimal=False).hit_tokens
    assert adaptive >= 0.98 * max(density, pooled), (adaptive, density, pooled)


def test_adaptive_with_candidates_that_cannot_share_a_record_keeps_one_each():
    class Reclassing(HitDensityPolicy):
        def _class(self, uses: int, tail: bool, run_length: int = 1) -> int:
            return 0  # every block in one class

    trace = document_among_one_offs(400, document_blocks=16, one_off_blocks=4)
    for pair in ((HitDensityPolicy, LRUPolicy), (LRUPolicy, Reclassing)):
        adaptive_hits, adaptive = replay_with(trace, 24, lambda: AdaptivePolicy(pair))
        selector_hits, selector = replay_with(trace, 24, lambda: SelectorPolicy(pair))
        assert adaptive_hits == selector_hits > 0 and adaptive.leader == selector.leader
        assert list(adaptive.miniature_hits()) == [p.name for p in pair]


def test_chains_stored_elsewhere_are_sampled_whole_or_not_at_all():
    """A lower tier hears of chains a faster tier stored. The selector keeps no record of
    unsampled blocks outside its tier, so a block whose parent it does not know must not draw
    for itself: its miniatures would see the middle of a chain without its head."""
    policy = AdaptivePolicy()
    sampled = 0
    for c in range(400):
        chain = [k(c * 10 + b) for b in range(4)]
        for parent, key in zip([None, *chain], chain):
            policy.on_stored_elsewhere(key, parent, 1)
        held = [key in policy._links for key in chain]  # the miniatures (16 blocks) hold a chain just stored
        assert held == [policy._draw(chain[0])] * 4
        sampled += held[0]
    assert 50 < sampled < 150 and len(policy) == 0
