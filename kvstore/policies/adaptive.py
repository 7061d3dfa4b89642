"""Adaptive: whichever of three candidate policies the miniature simulations say hits most on the
live workload (the store's default).

The candidates differ in how they model reuse, and each wins on a kind of workload:
- HitDensity with reused blocks split by use count, where the number of past uses predicts the
  next (multi-turn chat with many system prompts);
- HitDensity with reused blocks pooled, where the count misleads (documents re-read at random,
  the Mooncake trace);
- ReuseARC, where recency within two classes (used once, used again) beats learned densities:
  measured on chat over one to five shared system prompts at caches of a few dozen to a few
  hundred blocks (up to 12.6 points of the maximum; why HitDensity loses there is not known).
The two HitDensity kinds share one record of the tier. See ``selector.py`` for how the leader is
chosen and what it costs, and the README for the measurements behind each candidate.
"""

from kvstore.policies.hit_density import HitDensityPolicy, PooledHitDensityPolicy
from kvstore.policies.reuse_arc import ReuseARCPolicy
from kvstore.policies.selector import SelectorPolicy


class AdaptivePolicy(SelectorPolicy):
    name = "adaptive"
    candidates = (HitDensityPolicy, PooledHitDensityPolicy, ReuseARCPolicy)
