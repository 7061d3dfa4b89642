"""``/api/hit_rate_curve``: the recent lookups' LRU hit curve, read at capacities around the store's.

The store's *current capacity* is the bytes of distinct blocks it can hold: under write-through
every lower tier holds a copy of what the tiers above hold, so it is the largest tier; under
write-on-eviction the tiers hold mostly different blocks, so it is their sum.

The estimate is an LRU one starting from an empty cache (see ``curve.py``); it differs from what
the store does by its own eviction policy, its tier layout, and the blocks it held before the
window began (their first use in the window counts as a miss). The observed hit rate of the
same lookups sits beside it for comparison.
"""

from __future__ import annotations

import threading
import time
from typing import Sequence

from kvstore.service.dashboard.curve import hit_curve, latest_within
from kvstore.service.dashboard.models import CurvePoint, HitRateCurve
from kvstore.service.dashboard.readings import ratio
from kvstore.service.metrics import TrafficRecord

CAPACITY_FACTORS = tuple(2 ** (k / 2) for k in range(-6, 7))  # 1/8x .. 8x in half octaves, 1x included
MAX_ACCESSES = 65_536  # blocks looked up or put, replayed per estimate: about a third of a second of CPU
WRITE_THROUGH_RULE = "largest tier (write-through: lower tiers copy upper ones)"
ON_EVICTION_RULE = "sum of tiers (write-on-eviction: tiers hold different blocks)"
NOTE = ("LRU estimate: Mattson stack distances over the most recent lookups and puts in order, a "
        "lookup hitting on the prefix of blocks that hit, a block the store missed hitting again only once "
        "put, from an empty cache, capacities in payload bytes. "
        "The store's own policy, its tiers (slot and header overheads) and the blocks it held before the "
        "window make the real hit rate differ.")


def current_capacity(capacity_by_tier: dict[str, float], write_policy: str) -> tuple[int, str]:
    """The bytes of distinct blocks the tiers hold together, and the rule that gave it."""
    if write_policy == "write_through":
        return int(max(capacity_by_tier.values(), default=0)), WRITE_THROUGH_RULE
    return int(sum(capacity_by_tier.values())), ON_EVICTION_RULE


def curve_report(records: Sequence[TrafficRecord], capacity_bytes: int, capacity_rule: str) -> HitRateCurve:
    """The hit curve of the newest ``records``, lookups and puts (at most ``MAX_ACCESSES`` blocks)."""
    window = latest_within(records, MAX_ACCESSES)
    curve = hit_curve(window)
    observed = sum(r.hit_blocks * r.block_size for r in window)

    def point(factor: float) -> CurvePoint:
        nbytes = round(capacity_bytes * factor)
        return CurvePoint(capacity_factor=factor, capacity_bytes=nbytes,
                          capacity_tokens=nbytes * curve.tokens // curve.nbytes if curve.nbytes else None,
                          hit_tokens=curve.hit_tokens(nbytes), hit_rate=curve.hit_rate(nbytes))

    return HitRateCurve(
        note=NOTE, window_requests=curve.requests, window_blocks=curve.accesses, window_tokens=curve.tokens,
        window_start_s=window[0].time_s if window else None, window_end_s=window[-1].time_s if window else None,
        observed_hit_rate=ratio(observed, curve.tokens), current_capacity_bytes=capacity_bytes,
        capacity_rule=capacity_rule, current=point(1.0), points=[point(f) for f in CAPACITY_FACTORS],
    )


class CurveCache:
    """The last report, recomputed only when the lookups or the capacity changed, and then at
    most once per ``refresh_s`` (a report replays up to ``MAX_ACCESSES`` accesses). Thread-safe."""

    def __init__(self, refresh_s: float):
        self.refresh_s = refresh_s
        self._lock = threading.Lock()
        self._key: tuple | None = None
        self._report: HitRateCurve | None = None
        self._computed_s = 0.0

    def get(self, records: Sequence[TrafficRecord], capacity_bytes: int, capacity_rule: str) -> HitRateCurve:
        key = (len(records), records[-1].time_s if records else None, capacity_bytes)
        with self._lock:
            fresh = self._report is not None and (key == self._key or
                                                  time.monotonic() - self._computed_s < self.refresh_s)
            if not fresh:
                self._report = curve_report(records, capacity_bytes, capacity_rule)
                self._key, self._computed_s = key, time.monotonic()
            return self._report
