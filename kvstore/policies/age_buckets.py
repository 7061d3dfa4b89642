"""HitDensity's age buckets: a quarter-power-of-two (by default) log scale of ages, so its model
is scale-free. Tables are computed once per shape and shared by every policy of that shape."""

import functools
import math


@functools.cache
def small_age_buckets(per_octave: int, age_buckets: int) -> tuple[int, ...]:
    """The age bucket of every age below 2**17, shared by all policies of one shape."""
    return tuple(min(age_buckets - 1, int(per_octave * math.log2(1 + age))) for age in range(1 << 17))


@functools.cache
def age_bucket_floors(per_octave: int, age_buckets: int) -> tuple[int, ...]:
    """The least age of every age bucket or a later one: bucket b holds ages from floors[b] up to
    floors[b + 1] (empty where they are equal). The buckets grow with age, so floors do too."""
    small = small_age_buckets(per_octave, age_buckets)

    def bucket(age: int) -> int:
        return small[age] if age < len(small) else min(age_buckets - 1, int(per_octave * math.log2(1 + age)))

    floors = []
    for b in range(age_buckets):
        low, high = (floors[-1] if floors else 0), 1 << 62  # bucket(high) is the last bucket
        while low < high:
            middle = (low + high) // 2
            low, high = (middle + 1, high) if bucket(middle) < b else (low, middle)
        floors.append(low)
    return tuple(floors)
