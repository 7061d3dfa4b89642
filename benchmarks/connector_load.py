"""How fast a connector loads a hit from the host tier into an engine's (CPU) page pool, against
the memcpy ceiling of the same copies.

A DeepSeek-V3 namespace (61 layers, 576 bf16 values per token and layer, 64-token blocks: 4.5
MiB a block). ``--blocks`` blocks are stored in a host tier, then each round looks them up and
loads them layer by layer into a page pool (one uint8 tensor [pages, layer_bytes] per layer),
timing when layer 0 is ready (``wait_layer(0)``: when the engine's layer 0 could start) and when
the whole load is. The ceiling copies the same bytes, one block's layer at a time, from one flat
buffer into the same pages with no store in between. Medians over ``--repeats``.
``StoreConnector`` over an in-process store by default; ``--sidecar`` measures ``SidecarConnector``
against a sidecar this script starts (``kvstore serve``; the hit is copied out of its mapped
shared memory).

    .venv/bin/python benchmarks/connector_load.py [--json] [--blocks 64] [--repeats 7] [--sidecar]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

from connectors.base import KVConnector
from connectors.sidecar_connector import SidecarConnector
from connectors.store_connector import StoreConnector
from kvstore.keys import Namespace, namespace_hashes
from kvstore.layout import DEEPSEEK_V3_COMPONENTS, BlockSpec
from kvstore.service.client import KVStoreClient
from kvstore.service.limits import ServiceLimits
from kvstore.service.local import LocalSidecar
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

    def layer_pages(self, layer: int) -> torch.Tensor:
        """Each layer whole, as ``PagePool`` offers it (``connectors.base.PageBytes``)."""
        return self.layers[layer]


def load_seconds(connector: KVConnector, hashes: list[bytes], pages: Pages) -> tuple[float, float]:
    """(seconds until layer 0 of every block is in place, seconds until the whole load is)."""
    started = time.perf_counter()
    hit = connector.lookup("bench", hashes)
    handle = connector.start_load(hit, hashes, range(len(hashes)), pages)
    handle.wait_layer(0)
    first_layer = time.perf_counter() - started
    loaded = handle.wait()
    elapsed = time.perf_counter() - started
    if loaded != len(hashes):
        raise SystemExit(f"only {loaded} of {len(hashes)} blocks loaded: the host tier is too small")
    return first_layer, elapsed


def memcpy_seconds(source: np.ndarray, pages: Pages, blocks: int) -> float:
    """The same copies with nothing in between: block ``b``'s layer ``l`` into page ``b`` of layer ``l``."""
    started = time.perf_counter()
    for layer in range(SPEC.num_layers):
        rows = pages.layers[layer].numpy()  # [pages, layer_bytes]
        for block in range(blocks):
            offset = block * SPEC.block_bytes + SPEC.layer_range(layer)[0]
            np.copyto(rows[block], source[offset : offset + SPEC.layer_bytes])
    return time.perf_counter() - started


@contextlib.contextmanager
def stored(blocks: int, payloads: list[np.ndarray], hashes: list[bytes], sidecar: bool):
    """A connector whose store's host tier holds ``payloads`` under ``hashes``."""
    with tempfile.TemporaryDirectory() as directory:
        host_mib = 64 * -(-blocks * SPEC.block_bytes * 2 // (64 << 20))  # whole 64 MiB host-tier pages
        if sidecar:
            with LocalSidecar(directory, f"{host_mib}MiB", "0", http_address="off") as running:
                client = KVStoreClient(running.address)
                connector = SidecarConnector(client, NS)
                try:
                    step = ServiceLimits().transfer_blocks(SPEC.block_bytes)  # the sidecar runs the defaults
                    for start in range(0, blocks, step):
                        client.put(connector.ns_id, hashes[start : start + step], payloads[start : start + step],
                                   parent=hashes[start - 1] if start else None)
                    yield connector
                finally:
                    connector.close()
                    client.close()
        else:
            store = TieredStore([HostTier(host_mib << 20, shm_dir=directory)])
            connector = StoreConnector(store, NS)
            try:
                store.put(connector.ns_id, hashes, payloads)
                yield connector
            finally:
                connector.close()
                store.close()


def measure(blocks: int, repeats: int, sidecar: bool = False) -> dict:
    rng = np.random.default_rng(0)
    payloads = [rng.integers(0, 256, SPEC.block_bytes, dtype=np.uint8) for _ in range(blocks)]
    hashes = namespace_hashes(NS, np.arange(blocks * NS.block_size))
    with stored(blocks, payloads, hashes, sidecar) as connector:
        source, pages = np.concatenate(payloads), Pages(blocks)
        first, load, ceiling = [], [], []
        for _ in range(repeats):  # alternating, so both see the same noise
            first_layer_s, load_s = load_seconds(connector, hashes, pages)
            first.append(first_layer_s)
            load.append(load_s)
            ceiling.append(memcpy_seconds(source, pages, blocks))
    nbytes = blocks * SPEC.block_bytes
    first_s, load_s, ceiling_s = statistics.median(first), statistics.median(load), statistics.median(ceiling)
    return {"connector": type(connector).__name__, "blocks": blocks, "block_bytes": SPEC.block_bytes,
            "repeats": repeats, "first_layer_s": first_s, "load_s": load_s, "memcpy_s": ceiling_s,
            "load_gb_s": nbytes / load_s / 1e9, "memcpy_gb_s": nbytes / ceiling_s / 1e9,
            "fraction_of_memcpy": ceiling_s / load_s, "first_layer_fraction_of_load": first_s / load_s}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=64, help="blocks per load (default 64: 288 MiB)")
    parser.add_argument("--repeats", type=int, default=7, help="rounds; medians are reported (default 7)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--sidecar", action="store_true",
                        help="SidecarConnector against a sidecar started here (default: StoreConnector in-process)")
    args = parser.parse_args(argv)
    if args.blocks < 1 or args.repeats < 1:
        parser.error("--blocks and --repeats must be at least 1")
    result = measure(args.blocks, args.repeats, args.sidecar)
    if args.json:
        print(json.dumps(result))
        return 0
    name = result["connector"]
    print(f"{'path':<34} {'median s':>9} {'GB/s':>7}")
    print(f"{name + ': layer 0 ready':<34} {result['first_layer_s']:>9.4f} {'':>7}")
    print(f"{name + ': whole load':<34} {result['load_s']:>9.4f} {result['load_gb_s']:>7.2f}")
    print(f"{'memcpy ceiling':<34} {result['memcpy_s']:>9.4f} {result['memcpy_gb_s']:>7.2f}")
    print(f"load / ceiling: {result['fraction_of_memcpy']:.2f}x; layer 0 ready at "
          f"{result['first_layer_fraction_of_load']:.2f} of the load "
          f"({args.blocks} blocks of {SPEC.block_bytes / 2**20:.1f} MiB, median of {args.repeats})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
