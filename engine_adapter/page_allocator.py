"""Page ids of the device pool: reference counts and the in-engine prefix cache.

Every page is in exactly one of three states:

    state      refs  findable by hash  on allocate
    free       0     no                handed out first
    cached     0     yes               evicted (least recently released first), then handed out
    referenced >= 1  maybe             never

A full page is *registered* under its chained block hash while a request references it. When the
last reference goes, a registered page becomes *cached*: a later request with the same prefix finds
it (``match_prefix``) and pins it again; otherwise it waits in LRU order until its space is needed.
A request releases its pages tail first, so within one chain the tail is evicted before its head
(evicting a head would make the blocks behind it unreachable anyway).

``on_evict(block_hash, page, parent_hash)`` is called right before a cached page is reused, while
its bytes are still intact: a connector demotes the block to the host tier there. The page is
out of the hash index by then and is handed out whatever the hook does: an exception from it is
logged and counted (``failed_demotions``), and the block is simply not demoted (a later miss).
So free + cached + referenced == num_pages holds however the hook fails.

This module knows page ids and hashes only: no tensors, no tokens, no requests.
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from typing import NamedTuple

EvictHook = Callable[[bytes, int, "bytes | None"], None]
log = logging.getLogger(__name__)


class OutOfPages(RuntimeError):
    """``allocate`` was asked for more pages than are free or evictable (check ``can_allocate``)."""


class CachedBlock(NamedTuple):
    block_hash: bytes
    parent: bytes | None  # hash of the block before it in its chain; None for a chain's first block


class PageAllocator:
    def __init__(self, num_pages: int, on_evict: EvictHook | None = None) -> None:
        if num_pages <= 0:
            raise ValueError(f"num_pages must be positive, got {num_pages}")
        self.num_pages = num_pages
        self.on_evict = on_evict
        self._refs = [0] * num_pages
        self._free: deque[int] = deque(range(num_pages))
        self._page_of: dict[bytes, int] = {}  # block hash -> its registered page
        self._block_of: dict[int, CachedBlock] = {}  # registered page -> its block
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached pages, least recently released first
        self.failed_demotions = 0  # on_evict calls that raised

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Unreferenced pages still findable by hash."""
        return len(self._evictable)

    @property
    def num_available(self) -> int:
        """Pages ``allocate`` can hand out now: free ones plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    def ref_count(self, page: int) -> int:
        return self._refs[page]

    def match_prefix(self, block_hashes: Sequence[bytes]) -> list[int]:
        """Pages of the longest run of leading ``block_hashes`` that are registered. Mutates nothing."""
        pages = []
        for block_hash in block_hashes:
            page = self._page_of.get(block_hash)
            if page is None:
                break
            pages.append(page)
        return pages

    def can_allocate(self, num_pages: int, reusing: Sequence[int] = ()) -> bool:
        """Whether ``num_pages`` new pages fit after pinning ``reusing`` (cached pages stop being evictable)."""
        pinned_from_cache = sum(1 for page in reusing if self._refs[page] == 0)
        return num_pages + pinned_from_cache <= self.num_available

    def allocate(self, num_pages: int) -> list[int]:
        """``num_pages`` pages with one reference each: free pages first, then evicted cached ones."""
        if num_pages > self.num_available:
            raise OutOfPages(f"asked for {num_pages} pages, {self.num_available} free or evictable")
        pages = [self._take() for _ in range(num_pages)]
        for page in pages:
            self._refs[page] = 1
        return pages

    def pin(self, pages: Sequence[int]) -> None:
        """One more reference on each page (a prefix hit); a cached page stops being evictable."""
        for page in pages:
            assert self._refs[page] > 0 or page in self._evictable, f"pin of free page {page}: caller bug"
            self._refs[page] += 1
            self._evictable.pop(page, None)

    def release(self, pages: Sequence[int]) -> None:
        """Drop one reference on each page, tail first. Registered pages stay cached, others are freed."""
        for page in reversed(pages):
            assert self._refs[page] > 0, f"release of unreferenced page {page}: caller bug"
            self._refs[page] -= 1
            if self._refs[page]:
                continue
            if page in self._block_of:
                self._evictable[page] = None  # most recently released: evicted last
            else:
                self._free.append(page)

    def register(self, page: int, block_hash: bytes, parent: bytes | None) -> bool:
        """Make the full, referenced ``page`` findable under ``block_hash``. False when another page
        already holds that block (two requests computed it at once): this page then stays private."""
        assert self._refs[page] > 0, f"register of unreferenced page {page}: caller bug"
        assert page not in self._block_of, f"page {page} is already registered: caller bug"
        if block_hash in self._page_of:
            return False
        self._page_of[block_hash] = page
        self._block_of[page] = CachedBlock(block_hash, parent)
        return True

    def drop_cached(self) -> int:
        """Forget every cached page: each becomes free and no longer findable by hash (referenced
        pages, registered or not, are untouched). ``on_evict`` is not called: the blocks are dropped,
        not demoted. Returns how many pages were dropped."""
        dropped = list(self._evictable)
        for page in dropped:
            del self._page_of[self._block_of.pop(page).block_hash]
        self._evictable.clear()
        self._free.extend(dropped)
        return len(dropped)

    def block_of(self, page: int) -> CachedBlock | None:
        return self._block_of.get(page)

    def check_integrity(self) -> None:
        """free + referenced + cached == num_pages, and the hash index agrees with itself."""
        referenced = sum(1 for refs in self._refs if refs > 0)
        assert len(self._free) + referenced + len(self._evictable) == self.num_pages, (
            f"page accounting broken: {len(self._free)} free + {referenced} referenced + "
            f"{len(self._evictable)} cached != {self.num_pages}")
        assert len(set(self._free)) == len(self._free), "a page is free twice"
        assert all(self._refs[p] == 0 and p not in self._block_of for p in self._free), "a free page is in use"
        assert all(self._refs[p] == 0 and p in self._block_of for p in self._evictable), "bad cached page"
        assert all(self._page_of[b.block_hash] == p for p, b in self._block_of.items()), "hash index broken"
        assert len(self._page_of) == len(self._block_of), "hash index broken"

    def _take(self) -> int:
        if self._free:
            return self._free.popleft()
        page, _ = self._evictable.popitem(last=False)
        block = self._block_of.pop(page)
        del self._page_of[block.block_hash]
        if self.on_evict is not None:
            self._demote(block, page)
        return page

    def _demote(self, block: CachedBlock, page: int) -> None:
        """``on_evict`` for a page being reused (its bytes still intact); a failure is logged, never raised."""
        try:
            self.on_evict(block.block_hash, page, block.parent)
        except Exception:  # the hook is the caller's (a connector's copy): any failure is a block not demoted
            self.failed_demotions += 1
            if self.failed_demotions == 1:
                log.exception("demoting evicted page %d failed; its block is dropped instead (later failures are "
                              "counted in failed_demotions, logged at debug level)", page)
            else:
                log.debug("demoting evicted page %d failed", page, exc_info=True)
