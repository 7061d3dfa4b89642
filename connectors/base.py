"""The engine connector API: how an engine asks the store for cached prefixes and hands it new ones.

Split like vLLM's connector into two sides:

- **lookup side** (scheduler): ``lookup`` says how many leading blocks of a prompt the store can
  serve and takes a lease on them. It changes nothing else and may be called again.
- **transfer side** (worker): ``start_load`` copies the leased blocks into the engine's pages,
  layer by layer, in the background; the engine calls ``LoadHandle.wait_layer(l)`` before it
  reads layer ``l``, so layer 0 of the suffix computes while later layers are still arriving.
  ``save`` hands newly completed full blocks to the store asynchronously (never on the TTFT
  path). ``release`` ends whatever the request still holds (on finish or failure); idempotent.

Ownership: after ``lookup`` the connector holds a lease for the request; ``start_load`` takes it
over and ends it when the load completes or fails; ``release`` ends it if no load came. The
engine owns its pages throughout: ``start_load`` writes only into the pages it was given, and
``save`` copies out of the given pages before returning or before ``wait_copied`` returns.

The page pool is anything that exposes each layer's page bytes in the store's component layout
(``PageBytes``). This module knows blocks, pages and leases, nothing about models.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from kvstore.layout import BlockSpec


class PageBytes(Protocol):
    """The device tier as the connector sees it: one block of one layer = one byte range.

    A pool that keeps each layer in one tensor may also offer ``layer_pages(layer)``, that
    tensor as [num_pages, layer_bytes] uint8: a save then copies each layer of all its pages
    with one call (``connectors._copy_out``) instead of one ``layer_page_bytes`` call a page."""

    def layer_page_bytes(self, layer: int, page: int) -> torch.Tensor:
        """[layer_bytes] uint8 view of page ``page`` of ``layer``, laid out exactly as the store's
        block payload lays out one layer (component pages in namespace order)."""


@dataclass(frozen=True)
class ConnectorHit:
    """What the store can serve for a prompt: the first ``blocks`` blocks, from ``tiers``."""

    request_id: str
    blocks: int
    block_size: int
    tiers: tuple[str, ...]

    @property
    def tokens(self) -> int:
        return self.blocks * self.block_size


class LoadHandle(ABC):
    """A load in flight. ``wait_layer`` blocks until that layer of every block is in place."""

    @abstractmethod
    def wait_layer(self, layer: int) -> None:
        """Return when layer ``layer`` of every loaded block sits in its page; raises ``LoadFailed``
        if the load could not complete (the engine then recomputes those tokens)."""

    @abstractmethod
    def wait(self) -> int:
        """Return when the whole load has finished; the number of blocks actually loaded (0 after a
        failure). May be called any number of times, also after ``LoadFailed``."""

    def cancel(self) -> None:
        """The engine no longer wants the load (it failed, or its request ended): return once
        nothing more will be written into its pages. By default waits for the load to end."""
        self.wait()


class LoadFailed(RuntimeError):
    """A hit could not be loaded (evicted, corrupt, I/O error): recompute instead of reusing."""


class KVConnector(ABC):
    @property
    @abstractmethod
    def layout(self) -> BlockSpec:
        """The geometry of the blocks this connector moves (layers, tokens per block, bytes per
        layer), fixed at construction. An engine refuses a connector whose layout differs from its
        page pool's: a load would fill too few layers or the wrong bytes of each page."""

    @property
    def namespace_id(self) -> bytes | None:
        """The id of the namespace this connector files blocks under, where it knows one: an
        engine warns of a connector over another namespace than its own (its blocks are deleted,
        counted and shown under another model or tenant). Default: None (unknown)."""
        return None

    @abstractmethod
    def lookup(self, request_id: str, block_hashes: Sequence[bytes]) -> ConnectorHit:
        """Longest servable prefix of ``block_hashes``, counted from ``block_hashes[0]`` (an engine
        passes the hashes after its own device hit), leased for this request. Side-effect free
        otherwise; a second call replaces the request's previous lease. A store that cannot answer
        (down, closed, busy) is a 0-block hit, never an exception."""

    @abstractmethod
    def start_load(self, hit: ConnectorHit, block_hashes: Sequence[bytes], pages: Sequence[int],
                   pool: PageBytes) -> LoadHandle:
        """Copy the first ``hit.blocks`` blocks into ``pages`` (one page per block), layer by layer,
        in the background. Ends the request's lease when done."""

    @abstractmethod
    def save(self, request_id: str, block_hashes: Sequence[bytes], pages: Sequence[int], pool: PageBytes,
             parent: bytes | None) -> None:
        """Store full blocks ``block_hashes`` (held in ``pages``) asynchronously; ``parent`` is the
        hash of the block before the first one (None at a prompt's start)."""

    @abstractmethod
    def release(self, request_id: str) -> None:
        """End everything the request still holds. Idempotent; safe after a failure."""

    def demote(self, block_hash: bytes, page: int, pool: PageBytes, parent: bytes | None) -> None:
        """The device tier is about to reuse ``page`` (holding ``block_hash``): keep the block in
        the store's lower tiers. Copies before returning: by default a one-block ``save``, then
        ``wait_copied`` (a ``save`` may copy later, and the page's next contents must not be stored
        under this hash)."""
        self.save("device-eviction", [block_hash], [page], pool, parent)
        self.wait_copied()

    def report_prefill(self, request_id: str, saved_tokens: int, computed_tokens: int) -> None:
        """The request's prefill is done: ``saved_tokens`` came from the store, ``computed_tokens``
        were computed. For the store's metrics only (a sidecar counts them); the in-process store
        keeps no such counter, so by default this does nothing. Never raises."""

    @abstractmethod
    def flush(self) -> None:
        """Wait until every ``save`` so far has reached the store (tests, demos, shutdown: the
        engine itself never waits for the store)."""

    def wait_copied(self) -> None:
        """Wait until every ``save`` so far has been copied out of the engine's pages, so they can
        be reused; the engine calls it before it releases a finished request's pages. Default:
        ``flush``. A connector whose ``save`` copies (or queues its copy) without waiting for the
        store overrides it to wait for the copies alone, which keeps store writes off the
        engine's loop."""
        self.flush()
