"""What a device-page eviction costs the engine's thread through ``SidecarConnector.demote``, for a
block the sidecar already holds (the usual case: the engine saved it when it was computed).

A DeepSeek-V3 namespace (61 layers, 4.5 MiB blocks) and a sidecar this script starts (``kvstore
serve``, host tier only). ``--blocks`` blocks are stored; each round demotes every one of them
from an engine page pool, timing each call on the calling thread:

- ``probe``: ``SidecarConnector.demote`` (one probe ``Lookup``; nothing is copied or sent);
- ``save``: the connector's default path before session 35 (``KVConnector.demote``: copy every
  layer of the page out, then wait for the copy; the background writer then sends it with
  ``put_shm`` and the sidecar drops it as a duplicate). The writer is flushed between rounds, out
  of the timed calls, so the figure is the engine thread's wait alone; a second figure times each
  round until the writer is flushed (the duplicates sent), per block.

Rounds alternate the two paths, so both see the same noise; medians over every call.

    .venv/bin/python benchmarks/demote.py [--json] [--blocks 16] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np

from connector_load import NS, SPEC, Pages, stored  # a sibling script: run this one as benchmarks/demote.py
from connectors.base import KVConnector
from kvstore.keys import namespace_hashes


def demote_seconds(demote, hashes: list[bytes], pages: Pages) -> list[float]:
    """Seconds of each ``demote(hash, page, pages, parent)`` call, block ``i`` from page ``i``."""
    seconds = []
    for page, block_hash in enumerate(hashes):
        started = time.perf_counter()
        demote(block_hash, page, pages, hashes[page - 1] if page else None)
        seconds.append(time.perf_counter() - started)
    return seconds


def measure(blocks: int, repeats: int) -> dict:
    rng = np.random.default_rng(0)
    payloads = [rng.integers(0, 256, SPEC.block_bytes, dtype=np.uint8) for _ in range(blocks)]
    hashes = namespace_hashes(NS, np.arange(blocks * NS.block_size))
    with stored(blocks, payloads, hashes, sidecar=True) as connector:
        pages = Pages(blocks)
        for layer in range(SPEC.num_layers):  # the pages hold the blocks, as an engine's would
            rows = pages.layers[layer].numpy()  # [pages, layer_bytes]
            for block in range(blocks):
                start = SPEC.layer_range(layer)[0]
                np.copyto(rows[block], payloads[block][start : start + SPEC.layer_bytes])
        old_save = lambda *args: KVConnector.demote(connector, *args)  # noqa: E731
        probe, save, probe_round, save_round = [], [], [], []
        for _ in range(repeats):
            started = time.perf_counter()
            probe += demote_seconds(connector.demote, hashes, pages)
            connector.flush()
            probe_round.append((time.perf_counter() - started) / blocks)
            started = time.perf_counter()
            save += demote_seconds(old_save, hashes, pages)
            connector.flush()  # the duplicates sent: in the round's figure, not in the calls'
            save_round.append((time.perf_counter() - started) / blocks)
        stats = connector.client.stats()
    probe_s, save_s = statistics.median(probe), statistics.median(save)
    probe_all_s, save_all_s = statistics.median(probe_round), statistics.median(save_round)
    return {"blocks": blocks, "block_bytes": SPEC.block_bytes, "repeats": repeats, "calls": len(probe),
            "probe_s": probe_s, "save_s": save_s, "save_over_probe": save_s / probe_s,
            "probe_with_send_s": probe_all_s, "save_with_send_s": save_all_s,
            "save_over_probe_with_send": save_all_s / probe_all_s,
            "sidecar_duplicates": stats.duplicate_blocks, "sidecar_lookups": stats.lookups}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=16, help="blocks demoted per round (default 16: 72 MiB)")
    parser.add_argument("--repeats", type=int, default=5, help="rounds of each path (default 5)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = parser.parse_args(argv)
    if args.blocks < 1 or args.repeats < 1:
        parser.error("--blocks and --repeats must be at least 1")
    result = measure(args.blocks, args.repeats)
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{'demote of a held block':<44} {'median ms':>10}")
    print(f"{'probe (SidecarConnector.demote)':<44} {result['probe_s'] * 1e3:>10.3f}")
    print(f"{'save (copy out + wait, until session 35)':<44} {result['save_s'] * 1e3:>10.3f}")
    print(f"{'probe, per block of a round until flushed':<44} {result['probe_with_send_s'] * 1e3:>10.3f}")
    print(f"{'save, per block of a round until flushed':<44} {result['save_with_send_s'] * 1e3:>10.3f}")
    print(f"save / probe: {result['save_over_probe']:.1f}x on the engine's thread, "
          f"{result['save_over_probe_with_send']:.1f}x until sent ({result['calls']} calls each, "
          f"{SPEC.block_bytes / 2**20:.1f} MiB blocks); the sidecar dropped {result['sidecar_duplicates']} "
          f"duplicates sent by the save path and counted {result['sidecar_lookups']} lookups")
    return 0


if __name__ == "__main__":
    sys.exit(main())
