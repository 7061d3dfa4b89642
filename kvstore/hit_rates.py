"""Token hit rates of a replay or a stretch of one: against the input and against the maximum."""

from __future__ import annotations


def fraction(part: int, maximum: int) -> float:
    """``part`` of ``maximum``, 1.0 when ``maximum`` is 0 (all of nothing is reached)."""
    return part / maximum if maximum else 1.0


class TokenHitRates:
    """The rates of anything with ``input_tokens``, ``hit_tokens`` and ``max_hit_tokens`` (the
    infinite-capacity maximum's hits)."""

    input_tokens: int
    hit_tokens: int
    max_hit_tokens: int

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / max(self.input_tokens, 1)

    @property
    def max_hit_rate(self) -> float:
        return self.max_hit_tokens / max(self.input_tokens, 1)

    @property
    def fraction_of_max(self) -> float:
        """Hit tokens over the maximum's; 1.0 when the maximum is 0."""
        return fraction(self.hit_tokens, self.max_hit_tokens)
