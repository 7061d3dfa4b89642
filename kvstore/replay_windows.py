"""A replay's hit rate along the trace: the requests cut into stretches of equal count, each with
its own hit rate and infinite-capacity maximum (``kvstore replay --windows N``).

A whole-trace hit rate mixes the cold start, when every cache misses, with the steady state an
operator sizes for; and a policy can win early and lose late. Each window says what share of the
hits its own requests could have had (their maximum with unlimited capacity, every earlier
request seen), the policy kept, and what share Belady's offline schedule kept at the same
capacity: where the two part is where knowing the future pays. (A window's share of Belady's
schedule is no bound on a policy's in that window: the schedule maximises the whole trace's hits,
and a policy may beat it in one stretch by losing in another.)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Sequence

from kvstore.errors import InvalidRequest
from kvstore.hit_rates import TokenHitRates, fraction
from kvstore.trace import TraceRequest


@dataclass(frozen=True)
class ReplayWindow(TokenHitRates):
    """Requests ``first_request`` to ``first_request + requests - 1`` (replay order, from 0)."""

    first_request: int
    requests: int
    first_timestamp: float
    last_timestamp: float
    input_tokens: int
    hit_tokens: int
    max_hit_tokens: int
    optimal_schedule_hit_tokens: int | None = None  # Belady's schedule's token hits (None: not computed)

    @property
    def optimal_schedule_fraction_of_max(self) -> float | None:
        """Belady's schedule's hit tokens over the window's maximum (1.0 when that is 0)."""
        if self.optimal_schedule_hit_tokens is None:
            return None
        return fraction(self.optimal_schedule_hit_tokens, self.max_hit_tokens)

    def as_dict(self) -> dict:
        return {**asdict(self), "hit_rate": self.hit_rate, "max_hit_rate": self.max_hit_rate,
                "fraction_of_max": self.fraction_of_max,
                "optimal_schedule_fraction_of_max": self.optimal_schedule_fraction_of_max}


def check_window_count(count: int, requests: int) -> None:
    """``InvalidRequest`` unless ``count`` windows of a trace of ``requests`` each get one."""
    if count < 1:
        raise InvalidRequest(f"--windows must be at least 1, got {count}")
    if count > requests:
        raise InvalidRequest(f"--windows {count}: the trace holds only {requests} requests, "
                             f"so give at most {requests} windows")


def split_windows(requests: Sequence[TraceRequest], hit_tokens: Sequence[int], max_hit_tokens: Sequence[int],
                  count: int, optimal_schedule_hit_tokens: Sequence[int] | None = None) -> list[ReplayWindow]:
    """``count`` windows of consecutive requests, as equal in size as whole requests allow (sizes
    differ by one at most; the larger ones are spread along the trace, the last is one), from
    each request's hit tokens, its infinite-capacity maximum and, if given, Belady's schedule's
    hits (``belady.belady_schedule``)."""
    check_window_count(count, len(requests))
    optimal = optimal_schedule_hit_tokens
    if not len(requests) == len(hit_tokens) == len(max_hit_tokens) == len(optimal if optimal is not None else requests):
        raise ValueError("one hit count and one maximum per request (caller bug)")
    windows = []
    for i in range(count):
        start, stop = len(requests) * i // count, len(requests) * (i + 1) // count
        windows.append(ReplayWindow(
            first_request=start, requests=stop - start,
            first_timestamp=requests[start].timestamp, last_timestamp=requests[stop - 1].timestamp,
            input_tokens=sum(r.input_length for r in requests[start:stop]),
            hit_tokens=sum(hit_tokens[start:stop]), max_hit_tokens=sum(max_hit_tokens[start:stop]),
            optimal_schedule_hit_tokens=None if optimal is None else sum(optimal[start:stop])))
    return windows
