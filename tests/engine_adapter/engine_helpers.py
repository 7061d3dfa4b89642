"""What the engine tests share: a bf16 reference run, a logit recorder, and a dict-backed connector.

The paged pool keeps bf16, so the reference is a ContiguousCache that rounds what it stores to
bf16: with it, a cold run and the engine compute the same numbers up to float32 reassociation.

``DictConnector`` is a KVConnector over a dict of block payloads (``kvstore.layout`` byte order).
It copies a layer only when the engine waits for that layer, so an engine that read a layer
without waiting would read zeros and produce other logits.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from connectors.base import ConnectorHit, KVConnector, LoadFailed, LoadHandle
from engine_adapter.cache import ContiguousCache
from engine_adapter.namespace import namespace_for
from kvstore.layout import BlockSpec

VOCAB = 256


def prompt_ids(length: int, seed: int = 1) -> list[int]:
    return torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


class Bf16ContiguousCache(ContiguousCache):
    """A ContiguousCache that stores exactly what a bf16 page holds."""

    def append(self, layer, latent, rope_key, indexer_key) -> None:
        def rounded(t):
            return None if t is None else t.to(torch.bfloat16).to(t.dtype)

        super().append(layer, rounded(latent), rounded(rope_key), rounded(indexer_key))


def reference_greedy(model, prompt: list[int], max_new_tokens: int,
                     chunk: int | None = None) -> tuple[list[int], torch.Tensor]:
    """Cold greedy run (prefill in chunks of ``chunk`` tokens, default all, then decode)
    -> (output ids, logits [len(prompt) + n - 1, vocab])."""
    config = model.config
    cache = Bf16ContiguousCache(config.num_hidden_layers, with_indexer=config.is_v32)
    chunk = chunk or len(prompt)
    logits = [model(torch.tensor(prompt[start : start + chunk]), torch.arange(start, min(start + chunk, len(prompt))),
                    cache) for start in range(0, len(prompt), chunk)]
    outputs = [int(logits[-1][-1].argmax())]
    while len(outputs) < max_new_tokens:
        position = len(prompt) + len(outputs) - 1
        logits.append(model(torch.tensor(outputs[-1:]), torch.tensor([position]), cache))
        outputs.append(int(logits[-1][-1].argmax()))
    return outputs, torch.cat(logits)


class Recorder:
    """The model, recording every call and the logits of every position it computes.

    ``rows``: position -> logits, for runs of one request at a time. ``calls``: ("forward", T) or
    ("decode", B) per model call. ``sequence_logits(prompt)``: the logits of a request run among
    others, found by its prompt (its cache must have started empty).
    """

    def __init__(self, model) -> None:
        self.model, self.rows, self.calls = model, {}, []
        self._per_cache: dict[int, tuple[object, dict[int, tuple[int, torch.Tensor]]]] = {}

    def __getattr__(self, name):
        return getattr(self.model, name)

    def __call__(self, token_ids, positions, cache):
        logits = self.model(token_ids, positions, cache)
        self.calls.append(("forward", token_ids.numel()))
        self._record(cache, token_ids, positions, logits)
        return logits

    def forward_decode(self, token_ids, positions, caches):
        logits = self.model.forward_decode(token_ids, positions, caches)
        self.calls.append(("decode", token_ids.numel()))
        for b, cache in enumerate(caches):
            self._record(cache, token_ids[b : b + 1], positions[b : b + 1], logits[b : b + 1])
        return logits

    def logits(self, positions) -> torch.Tensor:
        return torch.stack([self.rows[p] for p in positions])

    def sequence_logits(self, prompt: list[int]) -> torch.Tensor:
        """[positions 0 .. last computed, vocab] of the one cache whose first tokens are ``prompt``."""
        [rows] = [rows for _, rows in self._per_cache.values()
                  if [rows.get(p, (None,))[0] for p in range(len(prompt))] == prompt]
        assert sorted(rows) == list(range(len(rows))), "positions missing: was the cache cold?"
        return torch.stack([rows[p][1] for p in range(len(rows))])

    def _record(self, cache, token_ids, positions, logits) -> None:
        self.rows.update(zip(positions.tolist(), logits))
        _, rows = self._per_cache.setdefault(id(cache), (cache, {}))  # keeps the cache alive: ids stay unique
        rows.update((p, (t, row)) for p, t, row in zip(positions.tolist(), token_ids.tolist(), logits))


class DictHandle(LoadHandle):
    def __init__(self, connector: DictConnector, blocks: list[bytes], pages: Sequence[int], pool) -> None:
        self.connector, self.blocks, self.pages, self.pool = connector, blocks, list(pages), pool
        self.done: set[int] = set()

    def wait_layer(self, layer: int) -> None:
        self.connector.waited.append(layer)
        self._arrive(layer)

    def wait(self) -> int:
        for layer in range(self.pool.num_layers):
            self._arrive(layer)
        return 0 if self.connector.fail_after_every_layer else len(self.blocks)

    def _arrive(self, layer: int) -> None:
        if layer in self.connector.fail_at_layers:
            raise LoadFailed(f"layer {layer} did not arrive")
        if layer not in self.done:
            for payload, page in zip(self.blocks, self.pages):
                start = layer * self.pool.layer_bytes
                self.pool.layer_page_bytes(layer, page).copy_(payload[start : start + self.pool.layer_bytes])
            self.done.add(layer)


def block_layout(model, block_size: int) -> BlockSpec:
    """The layout of the blocks an engine over ``model`` with pages of ``block_size`` tokens holds."""
    return BlockSpec.of(namespace_for(model.config, "deepseek", block_size))


class DictConnector(KVConnector):
    """Blocks of ``layout`` in a dict: hash -> [num_layers * layer_bytes] uint8 payload. Records every call."""

    def __init__(self, layout: BlockSpec) -> None:
        self._layout, self.block_size = layout, layout.block_size
        self.blocks: dict[bytes, torch.Tensor] = {}
        self.parents: dict[bytes, bytes | None] = {}
        self.leases: set[str] = set()
        self.lookups: list[list[bytes]] = []
        self.waited: list[int] = []
        self.fail_at_layers: set[int] = set()
        self.fail_after_every_layer = False  # loads deliver every layer, then wait() reports failure
        self.flushes = 0

    @property
    def layout(self) -> BlockSpec:
        return self._layout

    def lookup(self, request_id: str, block_hashes: Sequence[bytes]) -> ConnectorHit:
        self.lookups.append(list(block_hashes))
        count = 0
        while count < len(block_hashes) and block_hashes[count] in self.blocks:
            count += 1
        self.leases.add(request_id)
        return ConnectorHit(request_id, count, self.block_size, ("dict",) if count else ())

    def start_load(self, hit, block_hashes, pages, pool) -> LoadHandle:
        assert hit.request_id in self.leases and len(block_hashes) == len(pages) == hit.blocks
        self.leases.discard(hit.request_id)
        return DictHandle(self, [self.blocks[h] for h in block_hashes], pages, pool)

    def save(self, request_id, block_hashes, pages, pool, parent) -> None:
        for block_hash, page in zip(block_hashes, pages):
            self.demote(block_hash, page, pool, parent)
            parent = block_hash

    def demote(self, block_hash: bytes, page: int, pool, parent: bytes | None) -> None:
        """Copy one block out of the pool (``KVConnector.demote``'s order: the engine wires it to
        the pool's eviction hook)."""
        layers = [pool.layer_page_bytes(layer, page).clone() for layer in range(pool.num_layers)]
        self.blocks[block_hash] = torch.cat(layers)
        self.parents[block_hash] = parent

    def release(self, request_id: str) -> None:
        self.leases.discard(request_id)

    def flush(self) -> None:
        self.flushes += 1
