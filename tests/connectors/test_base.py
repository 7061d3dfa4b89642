"""The connector base class's defaults (connectors/base.py)."""

from __future__ import annotations

import torch

from connectors.base import ConnectorHit, KVConnector, LoadHandle


class Pool:
    """Pages of one layer, as the engine's page pool hands them to a connector."""

    def __init__(self, pages: int, page_bytes: int):
        self.pages = torch.zeros(pages, page_bytes, dtype=torch.uint8)

    def layer_page_bytes(self, layer: int, page: int) -> torch.Tensor:
        return self.pages[page]


class LateCopyingConnector(KVConnector):
    """A connector that copies a save's pages only when it flushes, as the contract allows, and
    keeps the base class's ``demote`` and ``wait_copied``."""

    def __init__(self):
        self.queued: list[tuple[bytes, int, Pool]] = []
        self.stored: dict[bytes, bytes] = {}

    def layout(self):
        raise AssertionError("not called by these tests")

    def lookup(self, request_id, block_hashes) -> ConnectorHit:
        raise AssertionError("not called by these tests")

    def start_load(self, hit, block_hashes, pages, pool) -> LoadHandle:
        raise AssertionError("not called by these tests")

    def save(self, request_id, block_hashes, pages, pool, parent) -> None:
        self.queued.extend((h, page, pool) for h, page in zip(block_hashes, pages))

    def release(self, request_id) -> None:
        pass

    def flush(self) -> None:
        for block_hash, page, pool in self.queued:
            self.stored[block_hash] = pool.layer_page_bytes(0, page).numpy().tobytes()
        self.queued.clear()


def test_the_default_demote_copies_the_page_before_it_returns():
    """The engine reuses a demoted page as soon as ``demote`` returns. A connector whose ``save``
    copies later must not store the page's next contents under the evicted block's hash: the
    default ``demote`` waits for the copy (``wait_copied``). Before, it only called ``save``."""
    pool, connector = Pool(pages=2, page_bytes=16), LateCopyingConnector()
    pool.pages[1] = 7
    connector.demote(b"h" * 16, 1, pool, parent=None)
    pool.pages[1] = 9  # the page now holds another block
    connector.flush()
    assert connector.stored[b"h" * 16] == bytes([7] * 16)
