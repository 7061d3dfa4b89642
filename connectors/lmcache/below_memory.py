"""Reads below the sidecar's memory for the LMCache plugin: the lower tiers' back-off window
(``connectors.lower_tiers``, as for the engine connectors) and the probe hand-over that LMCache's
double lookup needs.

After a Get below memory ran past its deadline while the sidecar answered, lookups count and gets
read only the leading blocks in the host tier until the window has passed. Then the first lookup
that reaches a block below memory counts it, and so do the lookups after it (LMCache looks a prompt
up again before it gets it) until a get reads below memory, at most ``PROBE_HANDOVER_S``: that get
is the probe. Without the hand-over, the retrieve's own lookup would be cut and the window would
never close.

Policy only: the connector makes the calls, counts and logs. Thread-safe.
"""

from __future__ import annotations

import threading
import time
from typing import Sequence

import grpc
import numpy as np

from connectors.lower_tiers import LowerTiers
from kvstore.service.client import KVStoreClient

PROBE_HANDOVER_S = 5.0  # how long the probe a lookup was granted waits for a get to make it
BELOW_MEMORY = "below memory"  # the tier of a hit block past a grant's host-tier slots (the grant names none)


class PastDeadline(Exception):
    """A Get of a block below memory ran past its deadline (``error``: its ``DEADLINE_EXCEEDED``).
    Raised inside ``SidecarSession.call`` so that the session does not take it for a sidecar that
    stopped answering before the connector has asked the sidecar itself."""

    def __init__(self, error: grpc.RpcError):
        super().__init__("a read below memory ran past its deadline")
        self.error = error


def load_in_time(client: KVStoreClient, ns_id: bytes, digest: bytes, block: np.ndarray):
    """``client.load`` of one block, its ``DEADLINE_EXCEEDED`` raised as ``PastDeadline``."""
    try:
        return client.load(ns_id, [digest], [block])
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            raise PastDeadline(exc) from None
        raise


class BelowMemoryWindow:
    def __init__(self, memory_tier: str, load_timeout_s: float) -> None:
        """``memory_tier``: the sidecar's memory tier; ``load_timeout_s``: the deadline of a Get,
        whose overrun opens the window and which sizes it."""
        self._memory_tier = memory_tier
        self._lower_tiers = LowerTiers([memory_tier], load_timeout_s)
        self._lock = threading.Lock()
        self._hung = False  # a read below memory hung, and none has answered since
        self._probe_until = 0.0  # a lookup was let through to blocks below memory: its get probes until then

    def lookup_usable(self, tiers: Sequence[str], blocks: int) -> int:
        """How many of a lookup's ``blocks`` hit blocks (held in ``tiers``) to count: all, or while
        the window is open, those before the first one below memory. A lookup let through to blocks
        below memory while a hang is on record grants the probe (see the module docstring)."""
        with self._lock:
            if self._probe_until > time.monotonic():
                return blocks
        usable = self._lower_tiers.usable(tiers, blocks)
        if usable == blocks and self._lower_tiers.below_memory(tiers[:blocks]):
            with self._lock:
                if self._hung:
                    self._probe_until = time.monotonic() + PROBE_HANDOVER_S
        return usable

    def get_usable(self, in_memory: int, blocks: int) -> int:
        """How many of a get's ``blocks`` (the first ``in_memory`` in host memory) it may read now:
        all, or while the window is open, the ones in memory. A granted probe lets one get through."""
        if in_memory >= blocks:
            return blocks
        with self._lock:
            probe, self._probe_until = self._probe_until > time.monotonic(), 0.0
        if probe:
            return blocks
        tiers = [self._memory_tier] * in_memory + [BELOW_MEMORY] * (blocks - in_memory)
        return self._lower_tiers.usable(tiers, blocks)

    def below_memory(self, tiers: Sequence[str]) -> bool:
        """Whether any of ``tiers`` is below memory."""
        return self._lower_tiers.below_memory(tiers)

    def hung(self) -> bool:
        """A Get below memory ran past its deadline while the sidecar answered: open (or widen) the
        window. True for the first hang since reads below memory last answered."""
        self._lower_tiers.hung()
        with self._lock:
            first, self._hung, self._probe_until = not self._hung, True, 0.0
        return first

    def answered(self) -> bool:
        """A Get below memory answered in time: close the window. True if a hang was on record."""
        self._lower_tiers.answered()
        with self._lock:
            was, self._hung, self._probe_until = self._hung, False, 0.0
        return was
