"""The totals views: ``/api/summary`` and ``/api/namespaces``, built from one ``totals()`` reading.

Pure functions of that reading: no clock (the caller passes the uptime), no store access.
"""

from __future__ import annotations

from kvstore.service.dashboard.models import NamespaceRow, Namespaces, Summary, TierSummary
from kvstore.service.dashboard.readings import Totals, by_label, ratio, tier_names, total

HIT = "kvstore_hit_tokens_total"
LOOKUP = "kvstore_lookup_tokens_total"
SAVED = "kvstore_prefill_tokens_saved_total"
COMPUTED = "kvstore_prefill_tokens_computed_total"


def summary(totals: Totals, uptime_s: float) -> Summary:
    lookup_tokens = total(totals, LOOKUP)
    hits_by_tier = _per_tier(totals, by_label(totals, HIT, "tier"))
    saved, computed = total(totals, SAVED), total(totals, COMPUTED)
    return Summary(
        uptime_s=uptime_s,
        lookups=int(total(totals, "kvstore_lookups_total")),
        lookup_tokens=int(lookup_tokens),
        hit_tokens=int(total(totals, HIT)),
        hit_tokens_by_tier={tier: int(v) for tier, v in hits_by_tier.items()},
        hit_rate=ratio(total(totals, HIT), lookup_tokens),
        hit_rate_by_tier={tier: ratio(v, lookup_tokens) for tier, v in hits_by_tier.items()},
        prefill_tokens_saved=int(saved),
        prefill_tokens_computed=int(computed),
        prefill_saved_fraction=ratio(saved, saved + computed),
        loaded_tokens_by_tier={tier: int(v) for tier, v in
                               _per_tier(totals, by_label(totals, "kvstore_loaded_tokens_total", "tier")).items()},
        tiers=tier_summaries(totals),
        namespaces=int(total(totals, "kvstore_namespaces")),
        leases_active=int(total(totals, "kvstore_leases_active")),
    )


def tier_summaries(totals: Totals) -> list[TierSummary]:
    """Per tier, top first: the store collector's gauges and counters."""
    def of(name: str) -> dict[str, float]:
        return by_label(totals, name, "tier")

    used, capacity, blocks = of("kvstore_tier_used_bytes"), of("kvstore_tier_capacity_bytes"), of("kvstore_tier_blocks")
    evictions, demotions = of("kvstore_tier_evictions_total"), of("kvstore_tier_demotions_total")
    return [TierSummary(name=tier, used_bytes=int(used.get(tier, 0)), capacity_bytes=int(capacity[tier]),
                        blocks=int(blocks.get(tier, 0)), evictions=int(evictions.get(tier, 0)),
                        demotions=int(demotions.get(tier, 0)))
            for tier in tier_names(totals)]


def namespaces(totals: Totals, limit: int) -> Namespaces:
    """The ``limit`` namespace labels with the most lookup tokens (ties by label)."""
    lookup_tokens = by_label(totals, LOOKUP, "namespace")
    lookups = by_label(totals, "kvstore_lookups_total", "namespace")
    hits = by_label(totals, HIT, "namespace")
    saved, computed = by_label(totals, SAVED, "namespace"), by_label(totals, COMPUTED, "namespace")
    labels = set(lookup_tokens) | set(saved) | set(computed)
    ranked = sorted(labels, key=lambda label: (-lookup_tokens.get(label, 0.0), label))
    rows = [NamespaceRow(namespace=label, lookups=int(lookups.get(label, 0)),
                         lookup_tokens=int(lookup_tokens.get(label, 0)), hit_tokens=int(hits.get(label, 0)),
                         hit_rate=ratio(hits.get(label, 0.0), lookup_tokens.get(label, 0.0)),
                         prefill_tokens_saved=int(saved.get(label, 0)),
                         prefill_tokens_computed=int(computed.get(label, 0)))
            for label in ranked[:limit]]
    return Namespaces(total=len(labels), rows=rows)


def _per_tier(totals: Totals, values: dict[str, float]) -> dict[str, float]:
    """``values`` over every tier of the store, top first (0 for a tier without any)."""
    return {tier: values.get(tier, 0.0) for tier in tier_names(totals)}
