"""The LMCache keys one connector stored or served, for ``list()``: the sidecar indexes block
hashes, so it cannot name keys itself. The newest ``KNOWN_KEYS`` are kept. Thread-safe."""

from __future__ import annotations

import collections
import threading
from typing import Callable, Iterable

from connectors.lmcache.framing import key_digest

KNOWN_KEYS = 65536  # key strings remembered: about 10 MB


class KnownKeys:
    def __init__(self, limit: int = KNOWN_KEYS) -> None:
        self._limit = limit
        self._keys: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._lock = threading.Lock()

    def remember(self, keys: Iterable[str]) -> None:
        """Note ``keys`` as the newest; the oldest beyond the limit are forgotten."""
        with self._lock:
            for key in keys:
                self._keys[key] = None
                self._keys.move_to_end(key)
            while len(self._keys) > self._limit:
                self._keys.popitem(last=False)

    def present(self, held: Callable[[list[bytes]], int], batch: int, stopped: Callable[[], bool],
                failed: Callable[[Exception], None]) -> list[str]:
        """The remembered keys the sidecar still holds, oldest first. ``held(digests)`` answers how
        many leading digests of one lookup (at most ``batch``) it holds, so each call skips one miss.
        Stops when ``stopped()``; an exception goes to ``failed`` and what was found is returned."""
        with self._lock:
            keys = list(self._keys)
        digests = [key_digest(k) for k in keys]
        found: list[str] = []
        start = 0
        try:
            while start < len(keys) and not stopped():
                chunk = digests[start : start + batch]
                hit = held(chunk)
                found += keys[start : start + hit]
                start += hit if hit == len(chunk) else hit + 1
        except Exception as exc:
            failed(exc)
        return found
