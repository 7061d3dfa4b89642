"""Adaptive: HitDensity with reused blocks split by use count or pooled, whichever the miniature
simulations say hits more on the live workload (the store's default).

The two candidates differ in one modelling choice only, and each wins on a kind of workload:
the split where the number of past uses predicts the next (multi-turn chat), the pool where it
misleads (documents re-read at random, the Mooncake trace). See ``selector.py`` for how the
leader is chosen and what it costs.
"""

from typing import Callable

from kvstore.policies.base import EvictionPolicy
from kvstore.policies.hit_density import HitDensityPolicy, PooledHitDensityPolicy
from kvstore.policies.selector import SelectorPolicy, SeparateCandidates, SharedCandidates


class AdaptivePolicy(SelectorPolicy):
    name = "adaptive"
    candidates = (HitDensityPolicy, PooledHitDensityPolicy)

    def _tier_candidates(self, makers: tuple[Callable[[], EvictionPolicy], ...]
                         ) -> SeparateCandidates | SharedCandidates:
        """HitDensity kinds (the default candidates) share one record of the tier; others each keep their own."""
        if HitDensityPolicy.can_share(makers):
            return SharedCandidates(HitDensityPolicy(schemes=makers))  # type: ignore[arg-type]  # checked: classes
        return super()._tier_candidates(makers)
