"""HitDensity's age buckets: the table of small ages and the floors agree with the log scale."""

import bisect
import math
import random

from kvstore.policies.age_buckets import age_bucket_floors, small_age_buckets


def bucket(age: int, per_octave: int = 4, buckets: int = 160) -> int:
    return min(buckets - 1, int(per_octave * math.log2(1 + age)))


def test_the_small_ages_table_is_the_log_scale():
    table = small_age_buckets(4, 160)
    assert len(table) == 1 << 17 and all(table[age] == bucket(age) for age in range(0, 1 << 17, 7))


def test_each_age_falls_in_the_bucket_whose_floor_it_last_reaches():
    floors = age_bucket_floors(4, 160)
    assert list(floors) == sorted(floors) and floors[0] == 0
    rng = random.Random(1)
    ages = [*range(2000), *(rng.randrange(1 << 40) for _ in range(2000)), (1 << 40) - 1, 1 << 40]
    for age in ages:
        assert bisect.bisect_right(floors, age) - 1 == bucket(age), age
