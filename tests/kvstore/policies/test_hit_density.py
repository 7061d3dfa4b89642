"""HitDensity: leaves ranked by learned hit density; it learns which classes of blocks return."""

import random

import pytest

from kvstore.policies import HitDensityPolicy, LRUPolicy, PooledHitDensityPolicy
from kvstore.replay import replay
from kvstore.synthetic_traces import multi_turn_chat
from kvstore.trace import TraceRequest
from tests.kvstore.policies.flood import document_among_one_offs


def k(i: int) -> bytes:
    return i.to_bytes(32, "little")


def test_every_victim_is_offered_once_and_the_admitting_parent_last():
    policy = HitDensityPolicy()
    for i in range(1, 6):
        policy.on_insert(k(i), None, 1)  # five heads: all leaves
    policy.admit(k(6), k(3), 1)  # block 6 is about to be stored under block 3
    offered = [int.from_bytes(v, "little") for v in policy.victims()]
    assert sorted(offered) == [1, 2, 3, 4, 5] and offered[-1] == 3


def test_chains_lose_their_tails_first():
    policy = HitDensityPolicy()
    policy.on_insert(k(1), None, 1)
    policy.on_insert(k(2), k(1), 1)
    policy.on_insert(k(3), k(2), 1)
    victims = policy.victims()
    assert int.from_bytes(next(victims), "little") == 3  # the only leaf
    policy.on_remove(k(3))
    assert int.from_bytes(next(victims), "little") == 2
    victims.close()


def test_it_learns_that_a_re_read_document_is_worth_more_than_one_off_prompts():
    """Every 4th request re-reads a 16-block document; the others are one-off 4-block prompts.
    With 12 slots LRU evicts the document between reads; HitDensity learns to keep it (ReuseARC,
    built for this pattern, keeps it more often: 1,022 blocks hit against 768 here)."""
    trace = document_among_one_offs(600, document_blocks=16, one_off_blocks=4)
    lru = replay(trace, 12 * 512, "lru", with_optimal=False)
    density = replay(trace, 12 * 512, "hit_density", with_optimal=False)
    assert lru.hit_tokens == 0
    assert density.hit_tokens >= 600 * 512  # of 2,384 blocks re-read (Belady: 1,788)


def test_on_multi_turn_chat_it_does_not_lose_to_lru():
    """Chat rewards recency (a next turn comes soon): a policy that only protects proven blocks
    loses there; this one learns that fresh blocks return."""
    trace = [TraceRequest(r["timestamp"], r["input_length"], r["output_length"], tuple(r["hash_ids"]))
             for r in multi_turn_chat(seed=1, n_conversations=300, duration_s=600.0)]
    footprint = len({h for r in trace for h in r.hash_ids}) * 512
    for fraction in (0.05, 0.15):
        capacity = int(footprint * fraction)
        lru = replay(trace, capacity, "lru", with_optimal=False)
        density = replay(trace, capacity, "hit_density", with_optimal=False)
        assert density.hit_tokens >= 0.98 * lru.hit_tokens, (fraction, density.hit_tokens, lru.hit_tokens)


def drive(policies: list, steps: int, capacity: int, seed: int, on_evict, check=lambda: None) -> None:
    """Chains of 1-6 blocks, a third of them re-reading an earlier chain, told to every policy;
    ``on_evict(policies)`` returns the victim whenever the tier is full; ``check()`` runs after
    every event."""
    rng = random.Random(seed)
    chains: list[list[bytes]] = []
    resident: set[bytes] = set()
    next_key = 1
    for _ in range(steps):
        if chains and rng.random() < 0.35:
            chain = rng.choice(chains)
        else:
            chain = [k(next_key + i) for i in range(rng.randint(1, 6))]
            next_key += len(chain)
            chains.append(chain)
        for i, key in enumerate(chain):
            parent = chain[i - 1] if i else None
            if key in resident:
                for policy in policies:
                    policy.on_access(key)
                check()
                continue
            if parent is not None and parent not in resident:
                break  # the prefix was evicted: nothing past it is stored
            for policy in policies:
                policy.admit(key, parent, 1)
            check()
            while len(resident) >= capacity:
                victim = on_evict(policies)
                for policy in policies:
                    policy.on_remove(victim)
                resident.discard(victim)
                check()
            for policy in policies:
                policy.on_insert(key, parent, 1)
            resident.add(key)
            check()


def test_schemes_sharing_one_record_evict_exactly_as_each_kind_alone():
    """adaptive's candidates share one HitDensity record: each must still evict what its own
    policy would, through densities refitted (thousands of inserts) and a trimmed history."""
    shared = HitDensityPolicy(schemes=(HitDensityPolicy, PooledHitDensityPolicy))
    alone = [HitDensityPolicy(), PooledHitDensityPolicy()]
    assert shared.scheme_names == ("hit_density", "hit_density_pooled")
    leaders = random.Random(3)
    compared = []

    def evict(policies: list) -> bytes:
        scheme = leaders.randrange(2)  # the leader changes at random
        # now and then every leaf but one is pinned: a sample may miss it, and every leaf is ranked
        leaves = sorted(shared._leaf_at)
        pinned = set(leaders.sample(leaves, len(leaves) - 1)) if leaders.random() < 0.3 else set()
        victims_shared = shared.victims_of(scheme, lambda key: key not in pinned)
        victims_alone = alone[scheme].victims(lambda key: key not in pinned)
        victim = next(victims_shared)
        assert victim == next(victims_alone) and victim not in pinned
        victims_shared.close(), victims_alone.close()
        compared.append(scheme)
        return victim

    drive([shared, *alone], steps=3000, capacity=48, seed=7, on_evict=evict)
    assert len(shared._history) < len(shared._entries) * 8 + 1025 and shared._now > 4 * 1024
    assert compared.count(0) > 1000 and compared.count(1) > 1000


def test_the_history_forgets_the_least_recently_referenced_keys_first():
    """The history's order is a deque with a place per reference, only the latest counting: it
    must forget exactly the keys a history kept in order of last reference would, and stay
    bounded however often keys are referenced again."""
    policy = HitDensityPolicy()
    rng = random.Random(5)
    last_reference = {}
    for step in range(20_000):
        key = k(rng.randrange(3000))  # a re-store of a key evicted at once: a reference, no resident block
        policy.on_insert(key, None, 1)
        policy.on_remove(key)
        last_reference[key] = step
        assert len(policy._order) <= 2 * len(policy._history) + 1025
    newest = sorted(last_reference, key=last_reference.get)[-1024:]
    assert len(policy._history) == 1024 and set(policy._history) == set(newest)
    assert len(policy._seen_last) <= 1025  # a forgotten key's slot is reused: 3,000 keys, never 3,000 slots


def test_the_leaf_set_and_the_censored_counts_agree_with_the_history():
    """Two shortcuts read the history without a lookup per key: each leaf's copy of its record
    (checked after every event), and the censored counts taken at once, in numpy, over every
    remembered key."""
    policy = HitDensityPolicy()
    keeper = k(10**6)  # a leaf never referenced again and never evicted: the history forgets it
    policy.on_insert(keeper, None, 1)
    forgotten = set()

    def leaf_copies_match() -> None:
        assert sorted(policy._leaf_at) == sorted(key for key, e in policy._entries.items() if not e.children)
        for at, key in enumerate(policy._leaves):
            seen = policy.remembered(key)
            if seen is None:
                assert policy._leaf_cls[at] == policy._forgotten
                forgotten.add(key)
            else:
                assert (policy._leaf_cls[at], policy._leaf_last[at]) == seen

    drive([policy], steps=2500, capacity=40, seed=11, check=leaf_copies_match,
          on_evict=lambda policies: next(policies[0].victims(lambda key: key != keeper)))
    expected = [[0.0] * policy.age_buckets for _ in range(policy._fine_classes)]
    for cls, last in map(policy.remembered, policy._history):
        expected[cls][policy._bucket(policy._now - last)] += 1
    assert policy._waiting() == expected
    assert keeper in forgotten and policy._density_of(policy._schemes[0], keeper) == 0.0
    assert sum(map(sum, expected)) == len(policy._history) > 1024
    assert policy._free_slots  # forgotten keys left free slots behind, and the counts left them out


def test_only_hit_density_kinds_that_differ_in_use_classes_can_share_a_record():
    class Wider(HitDensityPolicy):
        samples = 64

    class Reclassing(HitDensityPolicy):
        def _class(self, uses: int, tail: bool, run_length: int = 1) -> int:
            return 0

    for other in (Wider, Reclassing, LRUPolicy):
        with pytest.raises(ValueError, match="differ in use_classes .* only"):
            HitDensityPolicy(schemes=(HitDensityPolicy, other))


def test_decisions_are_those_of_the_policies_before_the_shared_record():
    """Exact hit tokens on a chat workload where ``adaptive`` changes leader (18 times): any
    change to a decision shows here. Pinned before the speed-ups (4c57410); moved in session 15,
    when the store stopped evicting a block's only parent to make room for it, and in session 20,
    when replay blocks became one token each: the replay's namespace changed, and with it the
    chains ``adaptive``'s miniatures sample. With the old block size, session 20's code still
    gave session 15's figures (seed 2: 3506688, 3449344 and 3483136; it changes no leader now).
    ``adaptive`` moved in session 24, when ReuseARC became its third candidate and its
    miniatures began to sample blocks instead of whole chains (889344 before: at 40 blocks over
    a few system prompts ReuseARC hits 1113600, LRU 804864), and in session 25, when they began
    to sample 1 block in 8 instead of 4 (1098752 before; ReuseARC standing by while it does not
    lead changed nothing)."""
    trace = [TraceRequest(r["timestamp"], r["input_length"], r["output_length"], tuple(r["hash_ids"]))
             for r in multi_turn_chat(seed=3, n_conversations=800, duration_s=600.0)]
    hits = {name: replay(trace, 40 * 512, name, with_optimal=False).hit_tokens
            for name in ("hit_density", "hit_density_pooled", "adaptive")}
    assert hits == {"hit_density": 897024, "hit_density_pooled": 889856, "adaptive": 1069568}


def test_a_tier_told_of_the_stores_and_hits_elsewhere_keeps_the_history_one_tier_keeps():
    """A lower tier's policy hears of blocks a faster tier stored (``on_stored_elsewhere``) and
    of hits it served (``on_hit_elsewhere``): it must remember every block with the class and
    last reference of a policy that stored and served them itself, insertion runs and tails
    included (a block told of as a bypass came and went, which ended its run: every block
    looked like a one-block run)."""
    rng = random.Random(4)
    one, lower = HitDensityPolicy(), HitDensityPolicy()
    chains: list[list[bytes]] = []
    fresh = 1
    for _ in range(300):
        if chains and rng.random() < 0.5:  # a hit on a known prefix, then maybe an extension
            chain = rng.choice(chains)
            for key in chain[:rng.randint(1, len(chain))]:
                one.on_access(key)
                lower.on_hit_elsewhere(key, None)
            if rng.random() < 0.5:
                continue
            parent, new = chain[-1], []
        else:
            parent, new = None, []
            chains.append(new)
        for _ in range(rng.choice((1, 2, 3, 5, 8))):
            key = k(fresh)
            fresh += 1
            one.on_insert(key, parent, 1)
            lower.on_stored_elsewhere(key, parent, 1)
            new.append(key)
            parent = key
        if new is not chains[-1]:
            chain.extend(new)
    one.on_insert(k(fresh), None, 1)  # a new run ends the last one in both
    lower.on_stored_elsewhere(k(fresh), None, 1)
    assert fresh < 1024  # nothing forgotten by either
    assert len(lower) == 0 and set(lower._history) == set(one._history)
    assert all(lower.remembered(key) == one.remembered(key) for key in one._history)
    classes = {one.remembered(key)[0] for key in one._history}
    assert len(classes) >= 6  # runs of several lengths, tails and reused blocks: the check has teeth


def test_a_block_moved_in_is_resident_with_its_history_and_no_new_reference():
    """A demotion or promotion copies a block in from another tier: no reference, so its class,
    last reference and the clock stay as the store's references left them."""
    policy = HitDensityPolicy()
    chain = [k(1), k(2), k(3)]
    for parent, key in zip([None, *chain], chain):
        policy.on_stored_elsewhere(key, parent, 1)
    policy.on_hit_elsewhere(k(1), None)
    before = {key: policy.remembered(key) for key in chain}
    clock = policy._now
    policy.on_move_in(k(1), None, 1)
    policy.on_move_in(k(2), k(1), 1)
    assert {key: policy.remembered(key) for key in chain} == before and policy._now == clock
    assert len(policy) == 2 and list(policy.victims()) == [k(2)]  # k(1) has a resident child


def test_a_demoted_block_is_admitted_only_as_dense_as_the_leaf_it_would_displace():
    """The room a demotion needs goes to it only if its density reaches the sampled victim's:
    a block the history does not remember (density 0) is refused where every leaf is worth more,
    one as dense as the leaves is admitted, and so is any block where no leaf may be evicted."""
    policy = HitDensityPolicy()
    for i in range(1, 6):
        policy.on_insert(k(i), None, 1)  # before the first fit every density is 1.0
    policy.on_stored_elsewhere(k(50), None, 1)
    assert not policy.admits_demotion(k(99))  # never referenced: nothing expected of it
    assert policy.admits_demotion(k(50))
    assert policy.admits_demotion(k(99), lambda key: False)
    policy._schemes[0].density_of_fine_class[policy.remembered(k(50))[0]][:] = [0.5] * policy.age_buckets
    assert not policy.admits_demotion(k(50), lambda key: key != k(50))


def conditional_densities(reused, ended, waiting, widths):
    """LHD's density at each age bucket, written from its definition rather than from the policy's
    code: for a key that has reached bucket a, the expected hits before it leaves over the expected
    space-time it holds, with Kaplan-Meier hazards (a reuse ends a lifetime; a key forgotten
    unreferenced, or still waiting, is censored: it counts as at risk up to its bucket, then leaves).
    O(buckets**2), each bucket's sums taken from scratch."""
    buckets = len(widths)
    hazard = []
    for b in range(buckets):
        at_risk = sum(reused[c] + ended[c] + waiting[c] for c in range(b, buckets))
        hazard.append(reused[b] / at_risk if at_risk else 0.0)
    out = []
    for a in range(buckets):
        alive, hits, space_time = 1.0, 0.0, 0.0
        for b in range(a, buckets):
            hits += alive * hazard[b]
            space_time += alive * widths[b]
            alive *= 1.0 - hazard[b]
        out.append(hits / space_time if space_time else 0.0)
    return out


@pytest.mark.parametrize("seed", range(3))
def test_densities_are_lhd_s_over_kaplan_meier_hazards(seed):
    """The density fit checked against its definition (before, only pinned hit counts would have
    shown a slip in it: survival never reduced, censored keys left out of the risk set, widths
    ignored, hits taken for density; each of those fails here)."""
    rng = random.Random(seed)
    policy = HitDensityPolicy()
    scheme = policy._schemes[0]
    buckets = policy.age_buckets
    classes = len(scheme.density)
    rows = {name: [[0.0] * buckets for _ in range(classes)] for name in ("reused", "ended", "waiting")}
    for cls in range(classes):
        for name, rows_of in rows.items():
            for b in rng.sample(range(60), 8):  # sparse counts over the first 60 buckets (ages to 2**15)
                rows_of[cls][b] = float(rng.randint(1, 50))
    scheme.reused, scheme.ended = rows["reused"], rows["ended"]
    scheme.density[:] = [[0.0] * buckets for _ in range(classes)]  # rows replaced: the fit must fill them
    scheme.density_of_fine_class = [scheme.density[c] for c in scheme.fold] + [[0.0] * buckets]
    policy._fit(scheme, rows["waiting"])
    for cls in range(classes):
        expected = conditional_densities(rows["reused"][cls], rows["ended"][cls], rows["waiting"][cls], policy._widths)
        assert scheme.density[cls] == pytest.approx(expected, rel=1e-9, abs=1e-300)
        assert expected[0] > 0 and expected[59] != expected[0]  # not trivially flat


def test_the_age_bucket_widths_are_the_bucket_spans():
    """Bucket b holds ages [2**(b/4) - 1, 2**((b+1)/4) - 1): its width is the age span it covers."""
    policy = HitDensityPolicy()
    for b in (0, 1, 7, 40, 159):
        assert policy._widths[b] == pytest.approx(2 ** ((b + 1) / 4) - 2 ** (b / 4))
    assert policy._bucket(0) == 0 and policy._bucket(2 ** 10 - 1) == 40 and policy._bucket(2 ** 10) == 40


def store(policy, key, parent=None):
    assert policy.admit(key, parent, 1)
    policy.on_insert(key, parent, 1)


def test_blocks_are_classed_by_their_run_tail_ness_and_uses_as_documented():
    """Each class from the rule in the module's docstring, key by key: once-used blocks by log2
    run length (capped at 128+) and whether they ended their run; reused ones by 2, 3, 4+ uses."""
    policy = HitDensityPolicy()
    run_class = lambda length, tail: 2 * min(length.bit_length() - 1, policy.run_classes - 1) + tail  # noqa: E731
    used_class = lambda uses: 2 * (policy.run_classes + min(uses - 2, policy.use_classes - 1))  # noqa: E731
    cls = lambda key: policy.remembered(key)[0]  # noqa: E731
    chain = [k(i) for i in range(1, 6)]
    for parent, key in zip([None] + chain, chain):
        store(policy, key, parent)
    long_run = [k(100 + i) for i in range(200)]
    for parent, key in zip([None] + long_run, long_run):  # a new head: the five-block run ends
        store(policy, key, parent)
    assert [cls(key) for key in chain] == [run_class(5, False)] * 4 + [run_class(5, True)]
    policy.on_access(chain[0])  # the 200-block run ends: the class of 128+
    assert cls(long_run[0]) == run_class(200, False) == 2 * (policy.run_classes - 1)
    assert cls(long_run[-1]) == run_class(200, True)
    for uses in (2, 3, 4, 5):
        assert cls(chain[0]) == used_class(uses)
        policy.on_access(chain[0])


@pytest.mark.parametrize("reference", ["on_access", "on_hit_elsewhere"])
def test_a_hit_ends_the_insertion_run(reference):
    """A hit between two stores of one chain splits them into two runs: the first run's last block
    is a tail (it had no child when its run ended), though the chain goes on below it."""
    policy = HitDensityPolicy()
    store(policy, k(9))  # a chain of its own, hit below
    store(policy, k(1))
    store(policy, k(2), k(1))
    getattr(policy, reference)(*((k(9),) if reference == "on_access" else (k(9), None)))
    store(policy, k(3), k(2))  # continues the chain, but the hit ended the run [k(1), k(2)]
    store(policy, k(50))  # ends k(3)'s run of one
    assert policy.remembered(k(2))[0] == 2 * 1 + 1  # a run of 2, the tail
    assert policy.remembered(k(3))[0] == 2 * 0 + 1  # a run of 1 of its own, the tail


def test_a_run_ends_when_the_next_block_is_admitted_before_room_is_made_for_it():
    """The victim for a new head is chosen by classes in which the run before it has ended."""
    policy = HitDensityPolicy()
    for parent, key in zip([None, k(1), k(2), k(3)], [k(1), k(2), k(3), k(4)]):
        store(policy, key, parent)
    assert policy.admit(k(50), None, 1)
    assert [policy.remembered(k(i))[0] for i in range(1, 5)] == [2 * 2] * 3 + [2 * 2 + 1]  # a run of 4


def test_stores_heard_from_another_tier_make_runs_as_the_tier_s_own_do():
    """A lower tier hears the store's puts (``on_stored_elsewhere``), with no ``admit``: a new
    head there ends the run as it does here."""
    policy = HitDensityPolicy()
    for parent, key in zip([None, k(1), k(2)], [k(1), k(2), k(3)]):
        policy.on_stored_elsewhere(key, parent, 1)
    policy.on_stored_elsewhere(k(50), None, 1)
    assert [policy.remembered(k(i))[0] for i in range(1, 4)] == [2 * 1, 2 * 1, 2 * 1 + 1]  # a run of 3


def test_a_re_stored_block_keeps_its_use_class_when_its_run_ends():
    """Stored, evicted and stored again: the second store is a reuse (2 uses). The run it came in
    with must not reclass it as a once-used block."""
    policy = HitDensityPolicy()
    store(policy, k(1))
    store(policy, k(2))  # ends k(1)'s run
    policy.on_remove(k(1))
    store(policy, k(1))
    store(policy, k(3), k(1))
    store(policy, k(4))  # ends the run [k(1), k(3)]
    assert policy.remembered(k(1))[0] == 2 * policy.run_classes  # 2 uses, not a tail
    assert policy.remembered(k(3))[0] == 2 * 1 + 1  # once used: a run of 2, the tail


def test_every_key_forgotten_unreferenced_counts_as_ended():
    policy = HitDensityPolicy()
    policy.history_factor = policy._history_per_resident = 1
    for i in range(3000):  # 3000 one-off heads, 8 resident: the history keeps 8 + 1024
        store(policy, k(i))
        if i >= 8:
            victim = next(policy.victims())
            policy.on_remove(victim)
    ended = sum(map(sum, policy._schemes[0].ended))
    assert ended == 3000 - len(policy._history) and 1024 < len(policy._history) <= 9 + 1024  # its bound


def test_densities_are_refit_every_half_of_the_resident_blocks_and_never_within_1024_stores(monkeypatch):
    policy = HitDensityPolicy()
    refits = []
    fit = policy._reconfigure
    monkeypatch.setattr(policy, "_reconfigure", lambda: (refits.append(policy._now), fit()))
    for i in range(10_000):  # nothing evicted: the resident blocks grow with the clock
        store(policy, k(i))
    assert refits == [1024, 2048, 3072, 4608, 6912]  # then 6912 + 3456 = 10368
