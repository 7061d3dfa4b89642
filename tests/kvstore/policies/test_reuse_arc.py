"""ReuseARC: protection of proven prefixes, counts that survive eviction, ARC adaptation."""

from kvstore.policies import ReuseARCPolicy
from kvstore.replay import replay
from tests.kvstore.policies.flood import document_among_one_offs


def k(i: int) -> bytes:
    return i.to_bytes(32, "little")


def first_victim(policy) -> int:
    victims = policy.victims()
    try:
        return int.from_bytes(next(victims), "little")
    finally:
        victims.close()


def test_a_block_used_twice_outlives_newer_blocks_used_once():
    policy = ReuseARCPolicy()
    policy.on_insert(k(1), None, 1)
    policy.on_access(k(1))  # used twice: protected
    for i in range(2, 6):
        policy.on_insert(k(i), None, 1)  # newer, used once
    assert first_victim(policy) == 2  # LRU would offer block 1


def test_use_counts_survive_eviction():
    """Block 1 is evicted after one use and forgotten by the ghost list (so no ARC adaptation),
    but its use count is kept: back for a second use, it is protected at once, and the newer
    once-used block 5 goes first (LRU would evict block 1, the older one)."""
    policy = ReuseARCPolicy()
    policy.on_insert(k(1), None, 1)
    policy.on_remove(k(1))
    for i in (2, 3, 4):
        policy.on_insert(k(i), None, 1)
    for i in (2, 3, 4):
        policy.on_remove(k(i))  # the ghost list shrinks with the cache: block 1 drops out of it
    assert k(1) not in policy._ghosts and policy._uses[k(1)] == 1
    policy.on_insert(k(1), None, 1)
    policy.on_insert(k(5), None, 1)
    assert first_victim(policy) == 5


def test_probation_target_grows_when_its_victims_come_back():
    policy = ReuseARCPolicy()
    for i in range(4):
        policy.on_insert(k(i), None, 1)
    before = policy._target
    policy.on_remove(k(0))  # evicted from probation...
    policy.on_insert(k(0), None, 1)  # ...and requested again: probation was too small
    assert policy._target > before


def test_chain_tails_still_go_before_heads():
    policy = ReuseARCPolicy()
    policy.on_insert(k(1), None, 1)
    policy.on_insert(k(2), k(1), 1)
    assert first_victim(policy) == 2


def test_on_a_flood_of_one_off_prompts_the_hot_prefix_survives_where_lru_loses_it():
    """Every 4th request re-reads an 8-block document; the others are one-off 8-block prompts.
    With 12 slots LRU keeps evicting the document; ReuseARC keeps it once it has been used twice."""
    trace = document_among_one_offs(200, document_blocks=8, one_off_blocks=8)
    lru = replay(trace, 12 * 512, "lru", with_optimal=False)
    arc = replay(trace, 12 * 512, "reuse_arc", with_optimal=False)
    assert lru.hit_tokens == 0
    assert arc.hit_tokens >= 45 * 8 * 512  # all but the first few re-reads of the document hit


def drive(policies, seed: int, steps: int, capacity: int, on_step=lambda step: None) -> list[bytes]:
    """The same random chains, re-reads and evictions for every one of ``policies`` (each
    evicting by its own ``victims``, which must agree); returns the victims in order."""
    import random

    rng = random.Random(seed)
    resident: set[bytes] = set()
    chains: list[list[bytes]] = []
    evicted: list[bytes] = []
    next_key = 0
    for step in range(steps):
        on_step(step)
        if chains and rng.random() < 0.5:  # re-read the resident prefix of a known chain
            for key in rng.choice(chains):
                if key not in resident:
                    break
                for policy in policies:
                    policy.on_access(key)
            continue
        parent = None
        if chains and rng.random() < 0.3:  # extend a known chain's resident prefix
            chain = rng.choice(chains)
            parent = chain[0] if chain[0] in resident else None
        chain = [parent] if parent is not None else []
        for _ in range(rng.randint(1, 6)):
            key = k(next_key)
            next_key += 1
            while len(resident) >= capacity:
                iterators = [policy.victims(lambda v: v != parent) for policy in policies]
                victims = {next(it) for it in iterators}
                for it in iterators:
                    it.close()
                assert len(victims) == 1, "the policies disagree on the victim"
                victim = victims.pop()
                for policy in policies:
                    policy.on_remove(victim)
                resident.discard(victim)
                evicted.append(victim)
            for policy in policies:
                policy.on_insert(key, parent, 1)
            resident.add(key)
            chain.append(key)
            parent = key
        chains.append(chain)
    return evicted


def test_a_policy_that_stood_by_ranks_exactly_as_one_that_kept_its_order():
    """``stand_by`` drops the heaps; the next ``victims`` rebuilds them. Stood by at random moments
    (several evictions may pass between), it must pick every victim as a policy that never did."""
    import random

    kept, lazy = ReuseARCPolicy(), ReuseARCPolicy()
    rng = random.Random(7)
    victims = drive([kept, lazy], seed=3, steps=3000, capacity=60,
                    on_step=lambda step: lazy.stand_by() if rng.random() < 0.2 else None)
    assert len(victims) > 1000
    assert list(kept.victims()) == list(lazy.victims())


def test_the_probation_target_moves_by_arc_s_rule():
    """ARC (Megiddo and Modha, FAST 2003): a ghost of probation back moves the target up by
    max(1, protected ghosts / probation ghosts), one of protected moves it down by the inverse
    ratio, and each ghost leaves its list when it comes back. 20 resident blocks that stay keep
    the ghost lists' bound (the resident count) out of the way."""
    policy = ReuseARCPolicy()
    for i in range(100, 120):
        policy.on_insert(k(i), None, 1)
    for i in range(1, 7):
        policy.on_insert(k(i), None, 1)
    for i in range(1, 5):
        policy.on_access(k(i))  # 1-4 protected, 5-6 on probation
    for i in range(1, 7):
        policy.on_remove(k(i))  # ghosts: 4 of protected, 2 of probation
    assert policy._target == 0
    policy.on_insert(k(5), None, 1)  # probation's ghost: up by max(1, 4 / 2)
    assert policy._target == 2
    policy.on_insert(k(1), None, 1)  # protected's ghost: down by max(1, 1 / 4)
    assert policy._target == 1
    policy.on_insert(k(6), None, 1)  # probation's ghost: up by max(1, 3 / 1)
    assert policy._target == 4
    policy.on_insert(k(2), None, 1)  # protected's ghost, with none of probation left: down by 1
    assert policy._target == 3


def test_probation_gives_the_victim_only_while_it_is_above_its_target():
    policy = ReuseARCPolicy()
    policy.on_insert(k(1), None, 1)
    policy.on_access(k(1))  # protected
    policy.on_insert(k(2), None, 1)  # probation
    policy.on_insert(k(3), None, 1)
    policy.on_remove(k(3))
    policy.on_insert(k(3), None, 1)  # back from probation's ghosts: target 1, and protected (2 uses)
    assert policy._target == 1 and len(policy._entries) - len(policy._protected) == 1
    assert first_victim(policy) == 1  # probation at its target: protected's least recent goes
    policy.on_insert(k(4), None, 1)  # probation above its target now
    assert first_victim(policy) == 2


def test_the_ghost_lists_hold_as_many_keys_as_the_tier_holds_blocks():
    policy = ReuseARCPolicy()
    for i in range(1, 6):
        policy.on_insert(k(i), None, 1)
    sizes = []
    for i in range(1, 6):
        policy.on_remove(k(i))
        sizes.append(len(policy._ghosts))
    assert sizes == [1, 2, 3, 2, 1]  # at most the blocks resident before each removal
    assert policy._ghost_sizes == (1, 0) and list(policy._ghosts) == [k(5)]


def test_the_target_moves_down_by_the_ghost_ratio_and_stays_within_the_tier():
    policy = ReuseARCPolicy()
    for i in range(100, 120):
        policy.on_insert(k(i), None, 1)
    for i in range(1, 8):
        policy.on_insert(k(i), None, 1)
    policy.on_access(k(7))  # protected
    for i in range(1, 8):
        policy.on_remove(k(i))  # ghosts: 6 of probation, 1 of protected
    for i in (1, 2, 3):
        policy.on_insert(k(i), None, 1)  # up by max(1, 1/6), max(1, 1/5), max(1, 1/4)
    assert policy._target == 3
    policy.on_insert(k(7), None, 1)  # protected's ghost: down by max(1, 3 / 1)
    assert policy._target == 0

    small = ReuseARCPolicy()
    for i in range(100, 103):
        small.on_insert(k(i), None, 1)
    for j in range(10):  # each block back from probation's ghosts: up by at least 1 each time...
        small.on_insert(k(j), None, 1)
        small.on_remove(k(j))
        small.on_insert(k(j), None, 1)
        small.on_remove(k(j))
    assert small._target == 3  # ...but never past the blocks resident when it moves
