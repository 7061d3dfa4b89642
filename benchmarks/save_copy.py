"""How long a save holds the engine's thread: ``copy_out`` of a save's blocks from a CPU page
pool, against the memcpy ceiling of the same bytes.

A DeepSeek-V3 namespace (61 layers, 576 bf16 values per token and layer, 64-token blocks: 4.5
MiB a block). ``--blocks`` blocks at scattered pages of a page pool (one uint8 tensor [pages,
layer_bytes] per layer) are copied out the two ways ``connectors._copy_out`` knows: a layer at a
time through ``layer_pages`` (what ``PagePool`` offers), and page by page through
``layer_page_bytes`` (a pool without it). The ceiling copies the same bytes with one memcpy into
fresh page-aligned payloads (``aligned_payloads``: the copy must allocate them as well). The three
alternate round by round; medians over ``--repeats``.

    .venv/bin/python benchmarks/save_copy.py [--json] [--blocks 32] [--repeats 9]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Callable

import numpy as np
import torch

from connectors._copy_out import aligned_payloads, copy_out
from kvstore.keys import Namespace
from kvstore.layout import DEEPSEEK_V3_COMPONENTS, BlockSpec

NS = Namespace("deepseek-v3", "bench", num_layers=61, components=DEEPSEEK_V3_COMPONENTS, block_size=64)
SPEC = BlockSpec.of(NS)


class PageByPage:
    """A page pool that offers only ``layer_page_bytes``: per layer [pages, layer_bytes] uint8."""

    def __init__(self, pages: int):
        gen = torch.Generator().manual_seed(0)
        self.layers = [torch.randint(0, 256, (pages, SPEC.layer_bytes), dtype=torch.uint8, generator=gen)
                       for _ in range(SPEC.num_layers)]

    def layer_page_bytes(self, layer: int, page: int) -> torch.Tensor:
        return self.layers[layer][page]


class LayerAtATime(PageByPage):
    """The same pool, also offering each layer whole (``layer_pages``), as ``PagePool`` does."""

    def layer_pages(self, layer: int) -> torch.Tensor:
        return self.layers[layer]


def seconds(run: Callable[[], object]) -> float:
    started = time.perf_counter()
    run()
    return time.perf_counter() - started


def memcpy_into_fresh_buffers(source: np.ndarray, blocks: int) -> list[np.ndarray]:
    payloads = aligned_payloads(blocks, SPEC.block_bytes)
    for i, payload in enumerate(payloads):
        np.copyto(payload, source[i * SPEC.block_bytes : (i + 1) * SPEC.block_bytes])
    return payloads


def measure(blocks: int, repeats: int) -> dict:
    pages = list(range(1, 3 * blocks, 3))  # scattered, as an engine's pages are
    by_page, by_layer = PageByPage(3 * blocks), LayerAtATime(3 * blocks)
    by_layer.layers = by_page.layers  # the same bytes
    source = np.random.default_rng(0).integers(0, 256, blocks * SPEC.block_bytes, dtype=np.uint8)
    expected = copy_out(SPEC, by_page, pages).payloads
    if not all(np.array_equal(a, b) for a, b in zip(expected, copy_out(SPEC, by_layer, pages).payloads)):
        raise AssertionError("the two copies disagree")
    runs = {"layer_pages": lambda: copy_out(SPEC, by_layer, pages),
            "page_by_page": lambda: copy_out(SPEC, by_page, pages),
            "memcpy": lambda: memcpy_into_fresh_buffers(source, blocks)}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            times[name].append(seconds(run))
    nbytes = blocks * SPEC.block_bytes
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    return {"blocks": blocks, "block_bytes": SPEC.block_bytes, "repeats": repeats,
            **{f"{name}_s": s for name, s in medians.items()},
            **{f"{name}_gb_s": nbytes / s / 1e9 for name, s in medians.items()},
            "layer_pages_fraction_of_memcpy": medians["memcpy"] / medians["layer_pages"],
            "speedup_over_page_by_page": medians["page_by_page"] / medians["layer_pages"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=32, help="blocks per save (default 32: 144 MiB)")
    parser.add_argument("--repeats", type=int, default=9, help="rounds; medians are reported (default 9)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = parser.parse_args(argv)
    if args.blocks < 1 or args.repeats < 1:
        parser.error("--blocks and --repeats must be at least 1")
    result = measure(args.blocks, args.repeats)
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{'copy out of the pages':<34} {'median s':>9} {'GB/s':>7}")
    for name, label in (("layer_pages", "a layer at a time (layer_pages)"), ("page_by_page", "page by page"),
                        ("memcpy", "memcpy ceiling")):
        print(f"{label:<34} {result[name + '_s']:>9.4f} {result[name + '_gb_s']:>7.2f}")
    print(f"a layer at a time: {result['layer_pages_fraction_of_memcpy']:.2f}x the ceiling, "
          f"{result['speedup_over_page_by_page']:.2f}x page by page "
          f"({args.blocks} blocks of {SPEC.block_bytes / 2**20:.1f} MiB, median of {args.repeats})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
