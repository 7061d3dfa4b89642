"""The residency directory: which tiers hold which block, asked by whole key or by namespace."""

import random

from kvstore.directory import Directory
from kvstore.keys import DIGEST_BYTES


def test_both_views_of_residency_agree_through_adds_and_discards():
    directory = Directory(["host", "disk", "remote"])
    namespaces = [bytes([n]) * DIGEST_BYTES for n in (1, 2)]
    for ns in namespaces:
        directory.add_namespace(ns)
    hashes = [i.to_bytes(16, "little") for i in range(40)]
    held: dict[bytes, int] = {}  # what a plain model says each key's bitmask is
    rng = random.Random(5)
    for _ in range(3000):
        key, t = rng.choice(namespaces) + rng.choice(hashes), rng.randrange(3)
        if rng.random() < 0.5:
            directory.add(key, t)
            held[key] = held.get(key, 0) | 1 << t
        else:
            directory.discard(key, t)
            held[key] = held.get(key, 0) & ~(1 << t)
        assert directory.bits(key) == held[key]
    for ns in namespaces:
        assert sorted(directory.keys(ns)) == sorted(k for k, bits in held.items() if bits and k.startswith(ns))
        top = directory.top_tiers(ns, hashes)
        for block_hash, name in zip(hashes, top):
            bits = held[ns + block_hash]
            assert name == ("host", "disk", "remote")[(bits & -bits).bit_length() - 1]
        assert len(top) == len(hashes) or not held.get(ns + hashes[len(top)])
    for t in range(3):
        assert sorted(directory.keys_in_tier(t)) == sorted(k for k, bits in held.items() if bits >> t & 1)
    assert directory.bits(namespaces[0] + b"\xff" * 16) == 0


def test_keys_split_by_the_fastest_tier_holding_them_in_order():
    directory = Directory(["host", "disk", "remote"])
    ns = bytes([3]) * DIGEST_BYTES
    directory.add_namespace(ns)
    keys = [ns + i.to_bytes(16, "little") for i in range(6)]
    for key, tiers in zip(keys, [(2,), (1, 2), (), (0, 2), (1,), (0,)]):
        for t in tiers:
            directory.add(key, t)
    assert directory.by_fastest_tier(keys, 3) == [[keys[3], keys[5]], [keys[1], keys[4]], [keys[0]]]
