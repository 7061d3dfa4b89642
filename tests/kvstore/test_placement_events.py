"""What a tiered store tells each tier's policy: every tier's policy hears every reference of the
store's workload (a block stored or served by another tier too), and a copy moved between tiers
(a demotion, a promotion) is no new reference. So each tier's HitDensity learns the history one
tier of the whole store would, whatever its own share of the blocks."""

import random

import numpy as np
import pytest

from kvstore.policies import HitDensityPolicy, LRUPolicy
from kvstore.replay import TierSplit, replay
from kvstore.store import TieredStore
from kvstore.tiers.accounting import AccountingTier
from kvstore.trace import TraceRequest
from tests.kvstore.store_helpers import load_all, put_chain


def prompts_with_repeats(requests: int, seed: int) -> list[TraceRequest]:
    """Prompts of 1 to 8 blocks, re-sent whole, extended by a turn, or new."""
    rng = random.Random(seed)
    prompts: list[tuple[int, ...]] = []
    fresh = 1
    trace = []
    for i in range(requests):
        roll = rng.random()
        if prompts and roll < 0.4:
            ids = rng.choice(prompts)
        else:
            base = rng.choice(prompts) if prompts and roll < 0.6 else ()
            n = rng.randint(1, 8)
            ids = base + tuple(range(fresh, fresh + n))
            fresh += n
            prompts.append(ids)
        trace.append(TraceRequest(float(i), len(ids) * 512, 0, ids))
    return trace


def replay_two_tiers(trace: list[TraceRequest], blocks: int, host_share: float):
    """Replay ``trace`` through a host and a disk tier of ``blocks`` in all, HitDensity on each."""
    made: list[HitDensityPolicy] = []

    def factory():
        made.append(HitDensityPolicy())
        return made[-1]

    shares = (("host", host_share), ("disk", 1 - host_share))
    return replay(trace, blocks * 512, factory, tiers=TierSplit(shares), with_optimal=False), made


def test_every_tier_remembers_each_block_as_the_other_tiers_do():
    result, (host, disk) = replay_two_tiers(prompts_with_repeats(400, seed=2), 60, 0.25)
    assert result.tier_hit_tokens["host"] > 0 and result.tier_hit_tokens["disk"] > 0  # demoted, hit, promoted
    assert len(host._history) < 1024  # nothing forgotten by either tier
    assert set(host._history) == set(disk._history)
    assert all(host.remembered(key) == disk.remembered(key) for key in host._history)
    assert host._now == disk._now  # one clock: the blocks the store took


def test_a_small_tier_remembers_as_many_blocks_as_the_store_not_as_itself():
    """Histories are bounded per resident block of the whole store (``size_for_store``): a host of
    a tenth of the store forgets the same keys as the disk, not after a tenth of the references."""
    result, (host, disk) = replay_two_tiers(prompts_with_repeats(1500, seed=3), 100, 0.1)
    own_bound = host.history_factor * 10 + 1024  # what a history sized by the host's own blocks keeps
    assert len(host._history) > own_bound and len(disk._history) > own_bound
    # Each bound moves with the blocks its tier holds at the moment (the host held 9 of its 10 for
    # a while here): each remembers the latest references, and a key one forgot a little earlier
    # starts over there when it comes back, so a few records differ.
    smaller, larger = sorted((set(host._history), set(disk._history)), key=len)
    assert smaller <= larger and len(larger) - len(smaller) <= 2 * host.history_factor * 10
    differ = sum(host.remembered(key) != disk.remembered(key) for key in smaller)
    assert differ <= len(smaller) // 50


def test_a_hit_is_one_reference_to_every_tier_whether_loaded_whole_or_layer_by_layer(make_store, namespace, spec, chain):
    """Real host and disk tiers: a block the host stored is one reference to each tier's policy
    (the disk's hears of it), and each hit one more, a block loaded layer by layer included (it
    was one reference per layer to the serving tier, and none to the others)."""
    store = make_store(policy=HitDensityPolicy, write_policy="on_eviction")  # write-through's copy raced the check
    ns_id = store.register_namespace(namespace)
    put_chain(store, ns_id, spec, chain[:3])
    host, disk = store._policies
    key = ns_id + chain[0]
    uses = lambda policy: policy._seen_uses[policy._history[key]]  # noqa: E731
    assert store.tiers[0].contains(key) and not store.tiers[1].contains(key)
    assert (uses(host), uses(disk)) == (1, 1)
    for layer in range(spec.num_layers):
        assert store.load_layer(ns_id, chain[0], layer, np.zeros(spec.layer_bytes, np.uint8)) == "host"
    assert (uses(host), uses(disk)) == (2, 2)
    loaded, _ = load_all(store, ns_id, spec, chain[:1])
    assert loaded.tiers == ("host",) and (uses(host), uses(disk)) == (3, 3)


@pytest.mark.parametrize("write_policy, host_keys, disk_keys", [("on_eviction", 8 * 4, 8 * 4 / 3),
                                                               ("write_through", 8 * 3, 8)])
def test_each_policy_is_sized_to_its_tiers_share_of_the_blocks_the_store_holds(write_policy, host_keys, disk_keys):
    """Demoting tiers add up (the host holds a quarter of the store); under write-through the
    disk holds the host's blocks too, so the store holds as many blocks as the disk."""
    store = TieredStore([AccountingTier("host", 100), AccountingTier("disk", 300)], policy=HitDensityPolicy,
                        write_policy=write_policy, background_writes=False)
    try:
        host, disk = store._policies
        assert host._history_per_resident == pytest.approx(host_keys)
        assert disk._history_per_resident == pytest.approx(disk_keys)
    finally:
        store.close()


class RefusesDemotions(LRUPolicy):
    """LRU whose tier admits no demoted block, and notes what it was asked about."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: list[bytes] = []

    def admits_demotion(self, key, evictable) -> bool:
        self.asked.append(key)
        return False


def test_a_demotion_the_lower_tier_does_not_admit_leaves_the_store(namespace, spec, chain):
    """The full lower tier is asked about each demoted victim; one it refuses leaves the store and
    its own blocks stay. A tier with room is not asked."""
    store = TieredStore([AccountingTier("host", 2 * spec.block_bytes), AccountingTier("disk", spec.block_bytes)],
                        policy=RefusesDemotions, write_policy="on_eviction", background_writes=False)
    try:
        ns_id = store.register_namespace(namespace)
        a, b, c, d = (chain[i] for i in range(4))
        for block in (a, b, c):  # c demotes a into the empty disk: nobody asked
            put_chain(store, ns_id, spec, [block])
        host, disk = store._policies
        assert disk.asked == [] and store.tiers[1].contains(ns_id + a)
        put_chain(store, ns_id, spec, [d])  # d's room: b, the host's victim, is refused by the full disk
        assert disk.asked == [ns_id + b]
        assert [store.lookup(ns_id, [h]).hit_blocks for h in (a, b, c, d)] == [1, 0, 1, 1]
        assert store.tiers[1].contains(ns_id + a) and not store.tiers[1].contains(ns_id + b)
        store.check_integrity()
    finally:
        store.close()


def test_a_write_through_copy_is_never_refused(namespace, spec, chain):
    """Under write-through the lower tier holds a copy of every block: it makes room for each
    copy as it always has, and is never asked whether to admit one."""
    store = TieredStore([AccountingTier("host", spec.block_bytes), AccountingTier("disk", spec.block_bytes)],
                        policy=RefusesDemotions, write_policy="write_through", background_writes=False)
    try:
        ns_id = store.register_namespace(namespace)
        for block in chain[:3]:
            put_chain(store, ns_id, spec, [block])
        assert store._policies[1].asked == [] and store.tiers[1].contains(ns_id + chain[2])
    finally:
        store.close()
