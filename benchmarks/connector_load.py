"""How fast ``StoreConnector`` loads a hit from the host tier into an engine's (CPU) page pool,
against the memcpy ceiling of the same copies.

A DeepSeek-V3 namespace (61 layers, 576 bf16 values per token and layer, 64-token blocks: 4.5
MiB a block). ``--blocks`` blocks are stored in a host tier, then each round looks them up and
loads them layer by layer into a page pool (one uint8 tensor [pages, layer_bytes] per layer) and
waits for the whole load. The ceiling copies the same bytes, one block's layer at a time, from
one flat buffer into the same pages with no store in between. Medians over ``--repeats``.

    .venv/bin/python benchmarks/connector_load.py [--json] [--blocks 64] [--repeats 7]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

from connectors.store_connector import StoreConnector
from kvstore.keys import Namespace, namespace_hashes
from kvstore.layout import DEEPSEEK_V3_COMPONENTS, BlockSpec
from kvstore.store import TieredStore
from kvstore.tiers.host import HostTier

NS = Namespace("deepseek-v3", "bench", num_layers=61, components=DEEPSEEK_V3_COMPONENTS, block_size=64)
SPEC = BlockSpec.of(NS)


class Pages:
    """The engine's page pool as the connector sees it: per layer [pages, layer_bytes] uint8."""

    def __init__(self, pages: int):
        self.layers = [torch.zeros(pages, SPEC.layer_bytes, dtype=torch.uint8) for _ in range(SPEC.num_layers)]

    def layer_page_bytes(self, layer: int, page: int) -> torch.Tensor:
        return self.layers[layer][page]


def load_seconds(connector: StoreConnector, hashes: list[bytes], pages: Pages) -> float:
    started = time.perf_counter()
    hit = connector.lookup("bench", hashes)
    loaded = connector.start_load(hit, hashes, range(len(hashes)), pages).wait()
    elapsed = time.perf_counter() - started
    if loaded != len(hashes):
        raise SystemExit(f"only {loaded} of {len(hashes)} blocks loaded: the host tier is too small")
    return elapsed


def memcpy_seconds(source: np.ndarray, pages: Pages, blocks: int) -> float:
    """The same copies with nothing in between: block ``b``'s layer ``l`` into page ``b`` of layer ``l``."""
    started = time.perf_counter()
    for layer in range(SPEC.num_layers):
        for block in range(blocks):
            offset = block * SPEC.block_bytes + SPEC.layer_range(layer)[0]
            np.copyto(pages.layers[layer][block].numpy(), source[offset : offset + SPEC.layer_bytes])
    return time.perf_counter() - started


def measure(blocks: int, repeats: int) -> dict:
    rng = np.random.default_rng(0)
    payloads = [rng.integers(0, 256, SPEC.block_bytes, dtype=np.uint8) for _ in range(blocks)]
    hashes = namespace_hashes(NS, np.arange(blocks * NS.block_size))
    with tempfile.TemporaryDirectory() as shm_dir:
        store = TieredStore([HostTier(blocks * SPEC.block_bytes * 2, shm_dir=shm_dir)])
        connector = StoreConnector(store, NS)
        try:
            store.put(connector.ns_id, hashes, payloads)
            source, pages = np.concatenate(payloads), Pages(blocks)
            load, ceiling = [], []
            for _ in range(repeats):  # alternating, so both see the same noise
                load.append(load_seconds(connector, hashes, pages))
                ceiling.append(memcpy_seconds(source, pages, blocks))
        finally:
            connector.close()
            store.close()
    nbytes = blocks * SPEC.block_bytes
    load_s, ceiling_s = statistics.median(load), statistics.median(ceiling)
    return {"blocks": blocks, "block_bytes": SPEC.block_bytes, "repeats": repeats,
            "load_s": load_s, "memcpy_s": ceiling_s, "load_gb_s": nbytes / load_s / 1e9,
            "memcpy_gb_s": nbytes / ceiling_s / 1e9, "fraction_of_memcpy": ceiling_s / load_s}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=64, help="blocks per load (default 64: 288 MiB)")
    parser.add_argument("--repeats", type=int, default=7, help="rounds; medians are reported (default 7)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = parser.parse_args(argv)
    if args.blocks < 1 or args.repeats < 1:
        parser.error("--blocks and --repeats must be at least 1")
    result = measure(args.blocks, args.repeats)
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{'path':<28} {'median s':>9} {'GB/s':>7}")
    print(f"{'StoreConnector host load':<28} {result['load_s']:>9.4f} {result['load_gb_s']:>7.2f}")
    print(f"{'memcpy ceiling':<28} {result['memcpy_s']:>9.4f} {result['memcpy_gb_s']:>7.2f}")
    print(f"load / ceiling: {result['fraction_of_memcpy']:.2f}x "
          f"({args.blocks} blocks of {SPEC.block_bytes / 2**20:.1f} MiB, median of {args.repeats})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
