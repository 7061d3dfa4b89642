"""When a peer stops answering, callers skip it at once instead of each waiting out a timeout.

A sidecar that hangs (stopped, its event loop blocked, its host overloaded) answers no call, and
every call then takes its whole deadline. For an engine's lookup, on the scheduler's path, that
is a stall per request. ``Backoff`` keeps the peer's state: after a call that found it not
answering, calls are refused for a window (``allow()`` is False: the caller treats it as a miss)
that starts at ``initial_s`` and doubles with each failed probe up to ``max_s``. Once a window
has passed, one caller at a time probes; a call that gets any answer closes the window. A probe
whose outcome is never reported (its caller dropped it) lapses after another window.

Policy only: it never calls anything. Thread-safe.
"""

from __future__ import annotations

import threading
import time
from typing import Callable


class Backoff:
    def __init__(self, initial_s: float = 1.0, max_s: float = 15.0, clock: Callable[[], float] = time.monotonic):
        if not 0 < initial_s <= max_s:
            raise ValueError(f"need 0 < initial_s <= max_s, got {initial_s} and {max_s}")
        self._initial_s, self._max_s, self._clock = initial_s, max_s, clock
        self._lock = threading.Lock()
        self._window_s = 0.0  # 0: the peer answers
        self._retry_at = 0.0
        self._probing = False
        self._probe_lapses_at = 0.0

    def allow(self) -> bool:
        """Whether a call may go to the peer now; the first caller after a window is its probe."""
        with self._lock:
            if not self._window_s:
                return True
            now = self._clock()
            if now < self._retry_at or (self._probing and now < self._probe_lapses_at):
                return False
            self._probing, self._probe_lapses_at = True, now + self._window_s
            return True

    def answered(self) -> None:
        """A call got an answer (any answer, an error status too): the peer is back."""
        with self._lock:
            self._window_s, self._probing = 0.0, False

    def not_answering(self) -> None:
        """A call found the peer not answering (unreachable, or past its deadline). Failures of
        calls that were in flight together open one window; a failed probe doubles it."""
        with self._lock:
            now = self._clock()
            if self._window_s and now < self._retry_at and not self._probing:
                return  # a call that started before the window opened
            self._window_s = min(self._max_s, 2 * self._window_s) if self._window_s else self._initial_s
            self._retry_at, self._probing = now + self._window_s, False

    def retry_in_s(self) -> float:
        """Seconds until the next probe may go (0 when calls go through)."""
        with self._lock:
            return max(0.0, self._retry_at - self._clock()) if self._window_s else 0.0
