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
