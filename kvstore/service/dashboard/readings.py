"""Reading ``ServiceMetrics.totals()``: one value, or values summed by one label.

``totals()`` maps a sample name to ``{sorted (label, value) tuple: value}``. These helpers sum
over every label they are not asked to keep, so a reader never depends on which other labels a
metric carries. A metric with no samples yet reads as 0 (or an empty dict): a counter that has
never been incremented has not been created either.
"""

from __future__ import annotations

Totals = dict[str, dict[tuple, float]]


def total(totals: Totals, name: str) -> float:
    """Sum of every sample of ``name``; 0 when it has none."""
    return sum(totals.get(name, {}).values())


def by_label(totals: Totals, name: str, label: str) -> dict[str, float]:
    """Samples of ``name`` summed per value of ``label`` (samples without it are left out)."""
    out: dict[str, float] = {}
    for labels, value in totals.get(name, {}).items():
        key = dict(labels).get(label)
        if key is not None:
            out[key] = out.get(key, 0.0) + value
    return out


def tier_names(totals: Totals) -> list[str]:
    """The store's tiers, top first (the order the store collector reports them in)."""
    return list(by_label(totals, "kvstore_tier_capacity_bytes", "tier"))


def ratio(numerator: float, denominator: float) -> float | None:
    """``numerator / denominator``, or None when there is nothing to divide by."""
    return numerator / denominator if denominator > 0 else None
