"""The contract every registered policy keeps, checked against a model of the resident chains."""

import random

import pytest

from kvstore.policies import POLICIES, make_policy


def k(i: int) -> bytes:
    return i.to_bytes(32, "little")


@pytest.mark.parametrize("name", sorted(POLICIES))
@pytest.mark.parametrize("seed", range(3))
def test_victims_are_resident_evictable_leaves_and_nothing_is_lost(name, seed):
    rng = random.Random(seed)
    policy = make_policy(name)
    parent_of: dict[int, int | None] = {}
    resident: set[int] = set()
    next_id = 0
    for _ in range(3000):
        op = rng.random()
        if op < 0.45 or not resident:  # insert a block under a resident block or as a new head
            parent = rng.choice(sorted(resident)) if resident and rng.random() < 0.7 else None
            parent_of[next_id] = parent
            policy.on_insert(k(next_id), None if parent is None else k(parent), 100)
            resident.add(next_id)
            next_id += 1
        elif op < 0.75:
            policy.on_access(k(rng.choice(sorted(resident))))
        else:  # evict up to 3 victims, some refused by the caller
            blocked = {b for b in resident if rng.random() < 0.2}
            leaves = {b for b in resident if not any(parent_of[c] == b for c in resident)}
            taken = 0
            for victim in policy.victims(lambda key: int.from_bytes(key, "little") not in blocked):
                block = int.from_bytes(victim, "little")
                assert block in leaves and block not in blocked, "a victim must be an evictable resident leaf"
                resident.discard(block)
                policy.on_remove(victim)
                leaves = {b for b in resident if not any(parent_of[c] == b for c in resident)}
                taken += 1
                if taken == 3:
                    break
    assert len(policy) == len(resident)
    offered = {int.from_bytes(v, "little") for v in policy.victims()}
    leaves = {b for b in resident if not any(parent_of[c] == b for c in resident)}
    assert offered == leaves, "every resident leaf stays a candidate; nothing else is offered"


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_a_policy_knows_which_keys_resident_blocks_name_as_parent(name):
    """The store's loop check asks this of every tier (``TieredStore._would_loop``)."""
    policy = make_policy(name)
    policy.on_insert(b"child", b"parent", 1)  # the parent is not in this tier
    assert policy.has_resident_children(b"parent") and not policy.has_resident_children(b"child")
    policy.on_insert(b"parent", None, 1)
    assert policy.has_resident_children(b"parent")
    policy.on_remove(b"child")
    assert not policy.has_resident_children(b"parent")
