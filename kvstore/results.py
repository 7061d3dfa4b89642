"""Small immutable results that cross the store's boundary (never its internals)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvstore.tiers.base import TierStats


@dataclass(frozen=True)
class LookupResult:
    """Longest contiguous run of present blocks from the first one.

    ``tiers[i]`` names the tier that serves hit block ``i`` (the highest one holding it).
    ``lease_id`` is set when a lease was asked for and granted; it pins exactly the hit blocks.
    """

    num_blocks: int
    block_size: int
    tiers: tuple[str, ...]
    lease_id: int | None = None
    lease_refused: bool = False  # a lease was asked for but a lease limit (leases, or blocks leased) was reached
    busy: bool = False  # not looked up: the store's lock stayed held past the caller's ``wait_s``

    @property
    def hit_blocks(self) -> int:
        return len(self.tiers)

    @property
    def hit_tokens(self) -> int:
        return self.hit_blocks * self.block_size


@dataclass(frozen=True)
class LoadResult:
    """How many of the requested blocks were copied, in order, and from which tier each came.

    A load stops at the first block it cannot serve (missing, or dropped as corrupt), so the
    caller's buffers ``[0, loaded_blocks)`` hold verified bytes. Buffer ``loaded_blocks`` may hold
    the bytes that failed verification (they were read into it before the check) and must not be
    used; the ones after it are untouched.
    """

    requested_blocks: int
    tiers: tuple[str, ...]
    nbytes: int

    @property
    def loaded_blocks(self) -> int:
        return len(self.tiers)

    @property
    def complete(self) -> bool:
        return self.loaded_blocks == self.requested_blocks


@dataclass(frozen=True)
class PutResult:
    stored: int
    duplicates: int
    rejected: int  # no tier admitted it or had room (all candidates pinned): backpressure


@dataclass(frozen=True)
class StoreStats:
    tiers: tuple[TierStats, ...]
    namespaces: int
    lookups: int
    lookup_blocks: int
    hit_blocks: int
    puts: int
    stored_blocks: int
    duplicate_blocks: int
    rejected_blocks: int
    leases_active: int
    lease_expiries: int
    counters: dict = field(default_factory=dict)

    def tier(self, name: str) -> TierStats:
        for stats in self.tiers:
            if stats.name == name:
                return stats
        raise KeyError(f"no tier named {name!r}; tiers: {[s.name for s in self.tiers]}")
