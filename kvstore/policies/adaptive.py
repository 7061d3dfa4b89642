"""Adaptive: HitDensity with reused blocks split by use count or pooled, whichever the miniature
simulations say hits more on the live workload (the store's default).

The two candidates differ in one modelling choice only, and each wins on a kind of workload:
the split where the number of past uses predicts the next (multi-turn chat), the pool where it
misleads (documents re-read at random, the Mooncake trace). See ``selector.py`` for how the
leader is chosen and what it costs.
"""

from kvstore.policies.hit_density import HitDensityPolicy, PooledHitDensityPolicy
from kvstore.policies.selector import SelectorPolicy


class AdaptivePolicy(SelectorPolicy):
    name = "adaptive"
    candidates = (HitDensityPolicy, PooledHitDensityPolicy)
