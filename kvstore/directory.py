"""The residency directory: which tiers hold which block, per namespace.

One dict probe per block answers a lookup, whatever the number of tiers: each block hash maps to
a bitmask with bit ``t`` set when tier ``t`` (fastest first) holds it. It knows tier indices and
names, nothing about bytes, policies or leases. Not thread-safe on its own: the store calls it
under its lock.
"""

from __future__ import annotations

from typing import Iterator, Sequence

from kvstore.keys import DIGEST_BYTES

MAX_TIERS = 6
_LOWEST_BIT = tuple((bits & -bits).bit_length() - 1 for bits in range(1 << MAX_TIERS))
_NO_BLOCKS: dict[bytes, int] = {}  # an unknown namespace's residency (never written)


class Directory:
    def __init__(self, tier_names: Sequence[str]):
        assert len(tier_names) <= MAX_TIERS, "tier count checked by the store (bug)"
        self._by_namespace: dict[bytes, dict[bytes, int]] = {}
        # name of the fastest tier holding a block, for every possible bitmask
        self._top_name = tuple(tier_names[_LOWEST_BIT[bits]] if bits else "" for bits in range(1 << len(tier_names)))

    def add_namespace(self, ns_id: bytes) -> None:
        self._by_namespace.setdefault(ns_id, {})

    def bits(self, key: bytes) -> int:
        """Bitmask of the tiers holding ``key`` (namespace id + block hash); 0 when none."""
        return self._by_namespace.get(key[:DIGEST_BYTES], _NO_BLOCKS).get(key[DIGEST_BYTES:], 0)

    def top_tiers(self, ns_id: bytes, block_hashes: Sequence[bytes]) -> list[str]:
        """Name of the fastest tier holding each block of the contiguous run from the first."""
        get, top_name = self._by_namespace[ns_id].get, self._top_name
        top: list[str] = []
        append = top.append
        for block_hash in block_hashes:  # hot: one dict probe per block
            bits = get(block_hash, 0)
            if not bits:
                break
            append(top_name[bits])
        return top

    def by_fastest_tier(self, keys: Sequence[bytes], num_tiers: int) -> list[list[bytes]]:
        """``keys`` (namespace id + block hash) split by the fastest tier holding each, in
        order; keys no tier holds are left out."""
        by_tier: list[list[bytes]] = [[] for _ in range(num_tiers)]
        for key in keys:
            bits = self.bits(key)
            if bits:
                by_tier[_LOWEST_BIT[bits]].append(key)
        return by_tier

    def add(self, key: bytes, t: int) -> None:
        residency = self._by_namespace.get(key[:DIGEST_BYTES])
        if residency is None:  # not setdefault(..., {}): that builds a dict on every call
            residency = self._by_namespace[key[:DIGEST_BYTES]] = {}
        block_hash = key[DIGEST_BYTES:]
        residency[block_hash] = residency.get(block_hash, 0) | 1 << t

    def discard(self, key: bytes, t: int) -> None:
        residency = self._by_namespace.get(key[:DIGEST_BYTES], _NO_BLOCKS)
        block_hash = key[DIGEST_BYTES:]
        bits = residency.get(block_hash, 0) & ~(1 << t)
        if bits:
            residency[block_hash] = bits
        elif block_hash in residency:
            del residency[block_hash]

    def keys(self, ns_id: bytes) -> list[bytes]:
        """Every resident key of a namespace (a snapshot)."""
        return [ns_id + h for h in self._by_namespace.get(ns_id, {})]

    def keys_in_tier(self, t: int) -> Iterator[bytes]:
        for ns_id, residency in self._by_namespace.items():
            for block_hash, bits in residency.items():
                if bits >> t & 1:
                    yield ns_id + block_hash
