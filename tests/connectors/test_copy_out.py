"""copy_out: a save's blocks leave the engine's pages before ``save`` returns (host pages), laid
out as the store lays out a block; the device gather lays them out the same way."""

import numpy as np
import pytest
import torch

from connectors._copy_out import copy_out, gather_on_device
from kvstore.keys import Namespace
from kvstore.layout import BlockSpec

NS = Namespace("tiny", "cfg", num_layers=3, components=("mla_bf16", "indexer_bf16"), block_size=4)
SPEC = BlockSpec.of(NS)


class BytePool:
    """Per layer one random uint8 tensor [pages, layer_bytes]."""

    def __init__(self, pages: int):
        gen = torch.Generator().manual_seed(7)
        self.layers = [torch.randint(0, 256, (pages, SPEC.layer_bytes), dtype=torch.uint8, generator=gen)
                       for _ in range(SPEC.num_layers)]

    def layer_page_bytes(self, layer, page):
        return self.layers[layer][page]


class LayerPool(BytePool):
    """The same pages, also offered a layer at a time (``layer_pages``), as ``PagePool`` does."""

    def layer_pages(self, layer):
        return self.layers[layer]


POOLS = [BytePool, LayerPool]


def expected_payload(pool: BytePool, page: int) -> np.ndarray:
    return np.concatenate([pool.layer_page_bytes(layer, page).numpy() for layer in range(SPEC.num_layers)])


@pytest.mark.parametrize("make_pool", POOLS)
def test_host_pages_are_copied_before_copy_out_returns_into_page_aligned_payloads(make_pool):
    pool, pages = make_pool(6), [4, 1, 5]
    expected = [expected_payload(pool, page) for page in pages]
    copied = copy_out(SPEC, pool, pages)
    for layer in pool.layers:  # the engine reuses its pages at once
        layer.zero_()
    copied.wait()
    assert len(copied.payloads) == 3 and copied.nbytes == 3 * SPEC.block_bytes
    for payload, want in zip(copied.payloads, expected):
        assert np.array_equal(payload, want)
        assert payload.ctypes.data % 4096 == 0, "the disk tier writes a page-aligned payload with no copy"


@pytest.mark.parametrize("make_pool", POOLS)
def test_the_device_gather_lays_each_block_out_as_the_host_copy_does(make_pool):
    pool, pages = make_pool(6), [5, 0, 3, 0]
    staged = gather_on_device(SPEC, pool, pages)  # on the pool's device: here the CPU
    assert staged.shape == (4, SPEC.block_bytes) and staged.dtype == torch.uint8
    for row, payload in zip(staged, copy_out(SPEC, pool, pages).payloads):
        assert np.array_equal(row.numpy(), payload)
    assert not np.array_equal(staged[0].numpy(), staged[1].numpy()), "each row its own page"


def test_no_pages_copy_nothing():
    assert copy_out(SPEC, BytePool(1), []).payloads == []
