"""LRU over chain leaves: the baseline every other policy is compared with."""

from __future__ import annotations

from kvstore.policies.base import ChainPolicy, Entry


class LRUPolicy(ChainPolicy):
    """Least recently used leaf first: the tail of the coldest chain goes before its head."""

    name = "lru"

    def priority(self, key: bytes, entry: Entry) -> float:
        return entry.last_access
