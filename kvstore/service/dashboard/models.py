"""The dashboard's JSON: pydantic models of every ``/api`` response (FastAPI publishes their schema).

Rates are fractions in [0, 1] and None (JSON null) when their denominator is zero: no lookups
yet, or none in that interval. Token and byte counts are integers; times are Unix seconds.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class TierSummary(BaseModel):
    name: str
    used_bytes: int
    capacity_bytes: int
    blocks: int
    evictions: int = Field(description="Blocks evicted from the tier by policy, since start")
    demotions: int = Field(description="Blocks demoted into the tier from the one above, since start")


class Summary(BaseModel):
    """Totals since the sidecar started, and the store's state now."""

    uptime_s: float
    lookups: int
    lookup_tokens: int = Field(description="Tokens asked about by Lookup calls")
    hit_tokens: int = Field(description="Tokens of the contiguous hits of Lookup calls")
    hit_tokens_by_tier: dict[str, int] = Field(description="hit_tokens by the tier serving them")
    hit_rate: float | None = Field(description="hit_tokens / lookup_tokens")
    hit_rate_by_tier: dict[str, float | None]
    prefill_tokens_saved: int = Field(description="Prefill tokens engines loaded instead of computing")
    prefill_tokens_computed: int
    prefill_saved_fraction: float | None = Field(description="saved / (saved + computed)")
    loaded_tokens_by_tier: dict[str, int] = Field(description="Tokens handed to clients: sent by Get, or copied from "
                                                 "GetSlots' slots (counted at their Release)")
    tiers: list[TierSummary] = Field(description="Top tier first")
    namespaces: int
    leases_active: int


class LatencyPercentiles(BaseModel):
    """Nearest-rank percentiles in seconds of the calls in an interval; None when there were none."""

    count: int
    p50: float | None
    p90: float | None
    p99: float | None


class TimePoint(BaseModel):
    """One history interval, ending at ``time_s``; rates come from counter deltas over it."""

    time_s: float
    interval_s: float
    hit_rate: float | None
    hit_rate_by_tier: dict[str, float | None] = Field(description="Hit tokens served by each tier / lookup tokens")
    lookup_tokens_per_s: float
    prefill_saved_per_s: float
    evictions_per_s: dict[str, float]
    used_bytes: dict[str, int] = Field(description="Bytes used per tier at time_s")
    capacity_bytes: dict[str, int]
    load_latency_s: LatencyPercentiles


class Timeseries(BaseModel):
    window_s: float
    sample_interval_s: float
    tiers: list[str]
    points: list[TimePoint] = Field(description="Oldest first")


class NamespaceRow(BaseModel):
    namespace: str = Field(description="Label MODEL/ID8, or 'other' past the label limit")
    lookups: int
    lookup_tokens: int
    hit_tokens: int
    hit_rate: float | None
    prefill_tokens_saved: int
    prefill_tokens_computed: int


class Namespaces(BaseModel):
    total: int = Field(description="Namespace labels with any traffic")
    rows: list[NamespaceRow] = Field(description="By lookup tokens, most first")


class CurvePoint(BaseModel):
    capacity_factor: float = Field(description="Capacity / the store's current capacity")
    capacity_bytes: int
    capacity_tokens: int | None = Field(description="At the window's bytes per token; None without traffic")
    hit_tokens: int
    hit_rate: float | None


class HitRateCurve(BaseModel):
    """What the token hit rate of the recent lookups would be at other capacities."""

    estimator: Literal["lru_stack_distance"] = "lru_stack_distance"
    note: str
    window_requests: int = Field(description="Lookups the estimate replayed (the most recent ones)")
    window_blocks: int
    window_tokens: int
    window_start_s: float | None
    window_end_s: float | None
    observed_hit_rate: float | None = Field(description="The hit rate those lookups actually got")
    current_capacity_bytes: int
    capacity_rule: str = Field(description="How the current capacity is derived from the tiers")
    current: CurvePoint = Field(description="The estimate at the current capacity")
    points: list[CurvePoint] = Field(description="By capacity, smallest first")
