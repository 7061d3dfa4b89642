"""The history behind ``/api/timeseries``: periodic samples of the counters, and rates between them.

A ``Sample`` is what the counters and gauges read at one instant, plus the load latencies seen
since the previous sample. A ``TimePoint`` is the interval between two consecutive samples:
rates are counter deltas over the interval's length, so they stay right however irregular the
sampling is. ``History`` keeps the newest samples in a bounded ring.

This module knows the counter names it reads and nothing about HTTP or how often it is sampled.
"""

from __future__ import annotations

import collections
import math
import threading
from dataclasses import dataclass
from typing import Sequence

from kvstore.service.dashboard.models import LatencyPercentiles, TimePoint
from kvstore.service.dashboard.readings import Totals, by_label, ratio, tier_names, total


@dataclass(frozen=True)
class Sample:
    time_s: float
    lookup_tokens: float
    hit_tokens_by_tier: dict[str, float]
    prefill_saved: float
    evictions_by_tier: dict[str, float]
    used_bytes_by_tier: dict[str, float]
    capacity_bytes_by_tier: dict[str, float]
    load_latency: LatencyPercentiles  # of the loads since the previous sample


def take_sample(totals: Totals, time_s: float, load_latencies_s: Sequence[float]) -> Sample:
    """A sample of ``totals`` read at ``time_s``, with the loads seen since the previous one."""
    tiers = tier_names(totals)
    hits = by_label(totals, "kvstore_hit_tokens_total", "tier")
    evictions = by_label(totals, "kvstore_tier_evictions_total", "tier")
    return Sample(
        time_s=time_s,
        lookup_tokens=total(totals, "kvstore_lookup_tokens_total"),
        hit_tokens_by_tier={tier: hits.get(tier, 0.0) for tier in tiers},
        prefill_saved=total(totals, "kvstore_prefill_tokens_saved_total"),
        evictions_by_tier={tier: evictions.get(tier, 0.0) for tier in tiers},
        used_bytes_by_tier=by_label(totals, "kvstore_tier_used_bytes", "tier"),
        capacity_bytes_by_tier=by_label(totals, "kvstore_tier_capacity_bytes", "tier"),
        load_latency=percentiles(load_latencies_s),
    )


def percentiles(values_s: Sequence[float]) -> LatencyPercentiles:
    """Nearest-rank p50, p90 and p99 of ``values_s`` (the smallest value with at least q% at or below it)."""
    ordered = sorted(values_s)

    def rank(q: float) -> float | None:
        return ordered[max(math.ceil(q / 100 * len(ordered)), 1) - 1] if ordered else None

    return LatencyPercentiles(count=len(ordered), p50=rank(50), p90=rank(90), p99=rank(99))


def point_between(before: Sample, after: Sample) -> TimePoint:
    """The interval ``(before.time_s, after.time_s]`` as rates and ratios of counter deltas."""
    seconds = after.time_s - before.time_s
    assert seconds > 0, f"samples out of order: {before.time_s} then {after.time_s} (History.add's bug)"
    lookups = after.lookup_tokens - before.lookup_tokens
    hits = {tier: v - before.hit_tokens_by_tier.get(tier, 0.0) for tier, v in after.hit_tokens_by_tier.items()}
    return TimePoint(
        time_s=after.time_s,
        interval_s=seconds,
        hit_rate=ratio(sum(hits.values()), lookups),
        hit_rate_by_tier={tier: ratio(v, lookups) for tier, v in hits.items()},
        lookup_tokens_per_s=lookups / seconds,
        prefill_saved_per_s=(after.prefill_saved - before.prefill_saved) / seconds,
        evictions_per_s={tier: (v - before.evictions_by_tier.get(tier, 0.0)) / seconds
                         for tier, v in after.evictions_by_tier.items()},
        used_bytes={tier: int(v) for tier, v in after.used_bytes_by_tier.items()},
        capacity_bytes={tier: int(v) for tier, v in after.capacity_bytes_by_tier.items()},
        load_latency_s=after.load_latency,
    )


class History:
    """The newest ``max_samples`` samples, oldest first. Thread-safe."""

    def __init__(self, max_samples: int):
        assert max_samples >= 2, "a history needs two samples to make one interval"
        self._samples: collections.deque[Sample] = collections.deque(maxlen=max_samples)
        self._lock = threading.Lock()

    def add(self, sample: Sample) -> None:
        """Append ``sample``; one taken at the last one's instant is dropped (nothing new), and one
        taken before it (the wall clock stepped back) starts the history over."""
        with self._lock:
            if self._samples and sample.time_s == self._samples[-1].time_s:
                return
            if self._samples and sample.time_s < self._samples[-1].time_s:
                self._samples.clear()
            self._samples.append(sample)

    def latest(self) -> Sample | None:
        with self._lock:
            return self._samples[-1] if self._samples else None

    def points(self, since_s: float) -> list[TimePoint]:
        """The intervals ending at or after ``since_s``, oldest first."""
        with self._lock:
            samples = list(self._samples)
        return [point_between(a, b) for a, b in zip(samples, samples[1:]) if b.time_s >= since_s]

    def tiers(self) -> list[str]:
        latest = self.latest()
        return list(latest.capacity_bytes_by_tier) if latest else []
