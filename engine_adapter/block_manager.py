"""A sequence's pages: prefix reuse on admission, growth, registering completed blocks, release.

On admission a sequence with N known tokens (block size P) gets its blocks from three places:

    blocks               source                              pages
    [0, d)               device hit: registered pool pages   pinned (shared with other sequences)
    [d, d + c)           connector hit (host, disk ... tier) new, filled by connector.start_load
    [d + c, ceil(N / P)) the model                           new, written by the forward pass

At most ``(N - 1) // P`` blocks are reused: the last token is always computed, since its logits
give the next token. A block is *committed* once its page holds valid bytes for all layers: it is
registered in the pool under its chained hash (so later requests find it) and, if the model
computed it, handed to ``connector.save``.

The connector, when there is one, is consulted only for the blocks after the device hit:

    lookup(hashes[d:])  ->  allocate  ->  start_load  ->  cache.before_read = handle.wait_layer
    first forward done  ->  handle.wait() == c: register the loaded pages   (finish_load)
    LoadFailed          ->  forget blocks [d, d + c), recompute them       (abort_load)
    blocks computed     ->  save(new blocks)                              (commit)
    finish / preempt    ->  wait_copied() (saves copied out before pages can be reused), release

This module knows pages, hashes and the connector API; nothing about the model or scheduling.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch

from connectors.base import ConnectorHit, KVConnector, LoadFailed, LoadHandle
from engine_adapter.paged_cache import PagedSequenceCache, PagePool
from engine_adapter.sequence import Sequence
from kvstore.keys import Namespace, namespace_hashes
from kvstore.layout import BlockSpec

log = logging.getLogger(__name__)


class PendingLoad(NamedTuple):
    handle: LoadHandle
    first_block: int  # = the device hit, in blocks
    blocks: int


def check_pool_layout(pool: PagePool, namespace: Namespace) -> None:
    """Raise ``ValueError`` unless ``pool``'s pages hold the blocks of the model's ``namespace``: its
    layers, tokens per block and bytes per layer (so its components: a V3.2 model's indexer keys)."""
    ours = BlockSpec.of(namespace)
    if namespace.block_size != pool.page_size:
        raise ValueError(f"namespace block_size {namespace.block_size} != pool page_size {pool.page_size}")
    if (ours.num_layers, ours.layer_bytes) != (pool.num_layers, pool.layer_bytes):
        raise ValueError(f"the page pool holds {pool.num_layers} layers of {pool.layer_bytes} bytes a page, the "
                         f"model's namespace {_describe(ours)}: build the pool from the model's own config")


def check_connector_layout(layout: BlockSpec, namespace: Namespace) -> None:
    """Raise ``ValueError`` unless a connector moving blocks of ``layout`` fills the pages of the
    model's ``namespace`` exactly (``check_pool_layout`` checked the pool against it)."""
    ours = BlockSpec.of(namespace)
    if layout != ours:
        raise ValueError(f"the connector moves blocks of {_describe(layout)}; this engine's page pool holds "
                         f"{_describe(ours)}: build the connector over the engine's namespace, "
                         f"engine_adapter.namespace.namespace_for(model.config, model_name, pool.page_size)")


def warn_of_another_namespace(connector_ns_id: bytes | None, namespace: Namespace) -> None:
    """Warn when the connector files blocks under another namespace than the engine's (None: the
    connector does not say). Hits stay right (block hashes are seeded from the engine's namespace),
    but the blocks are deleted, counted and shown under another model, tenant or weights."""
    if connector_ns_id is not None and connector_ns_id != namespace.id:
        log.warning("the connector files blocks under namespace %s, this engine's is %s (%s): its blocks are "
                    "deleted, counted and shown under the connector's; build the connector over the engine's "
                    "namespace (Engine.namespace)", connector_ns_id.hex(), namespace.id.hex(), namespace.model)


def _describe(spec: BlockSpec) -> str:
    return (f"{spec.num_layers} layers x {spec.block_size} tokens ({'+'.join(spec.components)}, "
            f"{spec.layer_bytes} bytes a layer)")


class BlockManager:
    def __init__(self, pool: PagePool, namespace: Namespace, dtype: torch.dtype,
                 connector: KVConnector | None = None) -> None:
        check_pool_layout(pool, namespace)
        if connector is not None:
            check_connector_layout(connector.layout, namespace)
            warn_of_another_namespace(connector.namespace_id, namespace)
        self.pool, self.namespace, self.dtype, self.connector = pool, namespace, dtype, connector
        self.block_size = pool.page_size
        self._saves_uncopied = False

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def admit(self, seq: Sequence) -> bool:
        """Reuse the longest cached prefix and allocate pages for every other known token.
        False (and nothing held) when the pool cannot take the sequence now. What hashing or the
        connector raises propagates, with nothing held either (no page, no connector lease)."""
        try:
            return self._admit(seq)
        except BaseException:
            self._drop_admission(seq)
            raise

    def _admit(self, seq: Sequence) -> bool:
        self._hash_full_blocks(seq)
        reusable = seq.block_hashes[: (seq.num_tokens - 1) // self.block_size]
        device = self.pool.match_prefix(reusable)
        hit = self._lookup(seq, reusable[len(device):])
        needed = self.pages_for(seq.num_tokens) - len(device)
        if not self.pool.can_allocate(needed, reusing=device):
            if hit is not None:
                self.connector.release(seq.request_id)
            return False
        self.pool.pin(device)
        seq.block_table = device  # held from here: _drop_admission releases what the table lists
        seq.block_table = device + self.pool.allocate(needed)
        seq.committed_blocks = len(device)
        if not seq.stats.preemptions:  # the prompt's hit; a readmission's may hold generated tokens
            seq.stats.device_hit_tokens = len(device) * self.block_size
        loaded = 0 if hit is None else hit.blocks
        seq.cache = PagedSequenceCache(self.pool, seq.block_table, (len(device) + loaded) * self.block_size,
                                       self.dtype)
        if hit is not None:
            self._start_load(seq, hit)
        return True

    def reserve(self, seq: Sequence, num_tokens: int) -> bool:
        """Pages for the next ``num_tokens`` positions of a running sequence; False if none are left."""
        needed = self.pages_for(seq.num_cached_tokens + num_tokens) - len(seq.block_table)
        if needed <= 0:
            return True
        if not self.pool.can_allocate(needed):
            return False
        seq.block_table.extend(self.pool.allocate(needed))  # the cache shares this list
        return True

    def finish_load(self, seq: Sequence) -> None:
        """After the first forward read every layer: the loaded blocks are valid; register them.
        Raises ``LoadFailed`` if fewer blocks arrived than were promised."""
        load = seq.load
        loaded = load.handle.wait()
        if loaded < load.blocks:
            raise LoadFailed(f"{seq.request_id}: {loaded} of {load.blocks} blocks arrived")
        seq.load, seq.cache.before_read = None, None
        end = load.first_block + load.blocks
        self._register(seq, load.first_block, end)
        seq.committed_blocks = end
        if not seq.stats.preemptions:  # as device_hit_tokens: the prompt's first admission only
            seq.stats.connector_hit_tokens = load.blocks * self.block_size

    def abort_load(self, seq: Sequence) -> None:
        """The load failed: forget the loaded blocks (their pages stay the sequence's, to be recomputed)."""
        load = seq.load
        try:
            load.handle.cancel()  # nothing may still be writing into the pages
        except LoadFailed:
            pass
        seq.load, seq.cache.before_read = None, None
        seq.cache.truncate(load.first_block * self.block_size)
        seq.stats.load_failures += 1
        self.connector.release(seq.request_id)

    def commit(self, seq: Sequence) -> None:
        """Register, and save through the connector, the blocks the model has completed since last time."""
        assert seq.load is None, "commit before finish_load: engine bug"
        self._hash_full_blocks(seq)
        first, end = seq.committed_blocks, seq.num_cached_tokens // self.block_size
        if end <= first:
            return
        self._register(seq, first, end)
        seq.committed_blocks = end
        if self.connector is not None:
            self.connector.save(seq.request_id, seq.block_hashes[first:end], seq.block_table[first:end],
                                self.pool, self._parent(seq, first))
            self._saves_uncopied = True

    def prefill_done(self, seq: Sequence) -> None:
        """Tell the connector what the prefill of ``seq`` loaded and computed (for its metrics)."""
        if self.connector is not None:
            self.connector.report_prefill(seq.request_id, seq.stats.connector_hit_tokens,
                                          seq.stats.computed_prompt_tokens)

    def _drop_admission(self, seq: Sequence) -> None:
        """Undo a partial ``admit``: its load, its connector lease and its pages."""
        if seq.load is not None:
            self.abort_load(seq)
        if self.connector is not None:
            self.connector.release(seq.request_id)
        self.pool.release(seq.block_table)
        seq.block_table, seq.cache, seq.committed_blocks = [], None, 0

    def free(self, seq: Sequence) -> None:
        """Release everything the sequence holds; its registered pages stay cached in the pool."""
        if seq.load is not None:
            self.abort_load(seq)
        if self.connector is not None:
            if self._saves_uncopied:  # saved pages must be copied out before they can be reused
                self.connector.wait_copied()
                self._saves_uncopied = False
            self.connector.release(seq.request_id)
        self.pool.release(seq.block_table)
        seq.block_table, seq.cache, seq.committed_blocks = [], None, 0

    def _lookup(self, seq: Sequence, block_hashes: list[bytes]) -> ConnectorHit | None:
        if self.connector is None or not block_hashes:
            return None
        hit = self.connector.lookup(seq.request_id, block_hashes)
        assert hit.block_size == self.block_size and 0 <= hit.blocks <= len(block_hashes), (
            f"connector bug: hit of {hit.blocks} blocks of {hit.block_size} for {len(block_hashes)} of "
            f"{self.block_size}")
        if hit.blocks == 0:
            self.connector.release(seq.request_id)
            return None
        return hit

    def _start_load(self, seq: Sequence, hit: ConnectorHit) -> None:
        first, end = seq.committed_blocks, seq.committed_blocks + hit.blocks
        handle = self.connector.start_load(hit, seq.block_hashes[first:end], seq.block_table[first:end], self.pool)
        seq.load = PendingLoad(handle, first, hit.blocks)
        seq.cache.before_read = handle.wait_layer

    def _register(self, seq: Sequence, first: int, end: int) -> None:
        for i in range(first, end):
            self.pool.register(seq.block_table[i], seq.block_hashes[i], self._parent(seq, i))

    def _hash_full_blocks(self, seq: Sequence) -> None:
        """Extend ``seq.block_hashes`` over every full block of its known tokens."""
        done, full = len(seq.block_hashes), seq.num_tokens // self.block_size
        if full > done:
            tokens = seq.token_ids[done * self.block_size : full * self.block_size]
            seq.block_hashes += namespace_hashes(self.namespace, tokens, parent=self._parent(seq, done))

    @staticmethod
    def _parent(seq: Sequence, block: int) -> bytes | None:
        return seq.block_hashes[block - 1] if block > 0 else None
