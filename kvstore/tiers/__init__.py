"""Storage tiers. Each moves bytes for one medium behind the ``Tier`` interface; none knows
about any other tier, about eviction order, or about namespaces beyond the opaque 32-byte key."""

from kvstore.tiers.base import BlockMeta, Tier, TierStats

__all__ = ["BlockMeta", "Tier", "TierStats"]
