"""Hits below memory, after a load was given up on while it read them there.

A disk that hangs (a dying device, a stuck network mount) makes every load that reads it wait
out its whole deadline, and the engine's step waits with it. After one such load is given up on,
``LowerTiers`` cuts hits at their first block below memory for a back-off window (``Backoff``):
requests meanwhile load what memory holds and recompute the rest at once. When the window has
passed, one load probes the lower tiers again; a read below memory that answers in time (a
corrupt block too) closes the window, one that hangs again doubles it.

The window is 5 s or twice the load deadline, doubling per failed probe up to 5 minutes or 20
deadlines, the longer of each: long enough that probing costs one request a deadline now and then.

Policy only: the connectors report what their loads saw. Thread-safe.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from connectors.backoff import Backoff


class LowerTiers:
    def __init__(self, memory_tiers: Iterable[str], load_timeout_s: float | None) -> None:
        """``memory_tiers``: names of the tiers whose reads are memory copies (cannot hang on a device)."""
        deadline = load_timeout_s or 0.0
        self.memory_tiers = frozenset(memory_tiers)
        self._backoff = Backoff(initial_s=max(5.0, 2 * deadline), max_s=max(300.0, 20 * deadline))

    def usable(self, tiers: Sequence[str], blocks: int) -> int:
        """How many of a hit's leading ``blocks`` (held in ``tiers``, one name per block) a load may
        read now: all of them, or, while the window is open, those before the first one below memory."""
        in_memory = next((i for i, tier in enumerate(tiers[:blocks]) if tier not in self.memory_tiers), blocks)
        if in_memory < blocks and not self._backoff.allow():
            return in_memory
        return blocks

    def below_memory(self, tiers: Sequence[str]) -> bool:
        """Whether any of ``tiers`` is below memory (a read of it may hang)."""
        return any(tier not in self.memory_tiers for tier in tiers)

    def hung(self) -> None:
        """A load was given up on (not cancelled) while it read below memory."""
        self._backoff.not_answering()

    def answered(self) -> None:
        """A read below memory answered before its load was given up on."""
        self._backoff.answered()
