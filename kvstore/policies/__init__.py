"""Eviction policies behind one interface, and the registry the store and CLI choose from.

Add a policy by subclassing ``ChainPolicy`` (or ``EvictionPolicy``) in its own module and
registering it here. ``kvstore replay --sweep`` compares every registered policy.
"""

from kvstore.errors import InvalidRequest
from kvstore.policies.adaptive import AdaptivePolicy
from kvstore.policies.base import ChainPolicy, Entry, EvictionPolicy
from kvstore.policies.hit_density import HitDensityPolicy, PooledHitDensityPolicy
from kvstore.policies.lru import LRUPolicy
from kvstore.policies.reuse_arc import ReuseARCPolicy
from kvstore.policies.selector import SelectorPolicy

POLICIES: dict[str, type[EvictionPolicy]] = {
    p.name: p for p in (LRUPolicy, ReuseARCPolicy, HitDensityPolicy, PooledHitDensityPolicy, AdaptivePolicy)}
DEFAULT_POLICY = AdaptivePolicy.name  # measured against the others in the README's tables


def make_policy(name: str) -> EvictionPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise InvalidRequest(f"unknown eviction policy {name!r}; valid: {', '.join(sorted(POLICIES))}") from None


__all__ = ["POLICIES", "DEFAULT_POLICY", "AdaptivePolicy", "ChainPolicy", "Entry", "EvictionPolicy",
           "HitDensityPolicy", "LRUPolicy", "PooledHitDensityPolicy", "ReuseARCPolicy", "SelectorPolicy", "make_policy"]
