"""Copying saved blocks out of the engine's pages without holding up the engine's thread.

A ``save`` must leave the engine free to reuse its pages as soon as it returns, and must not
stall the engine's loop (it follows every prefill). ``copy_out`` does both:

- **host pages** (CPU tensors): each block's layers are copied into one page-aligned payload
  before it returns (memory copies; the disk tier writes such a payload with no further copy).
- **CUDA pages**: kernels queued on the engine thread's current stream gather the blocks into
  one device tensor, and a copy stream of its own copies that to pinned host memory. Nothing
  waits on the engine's thread: a later kernel of the engine, or a load that waits for
  ``queued_engine_work``, overwrites the pages only after the gather has read them (stream
  order), and the writer thread calls ``CopiedOut.wait`` before the store reads the payloads.
  Before this, every layer of every block was a synchronous device-to-host copy on the engine's
  thread (61 stream synchronisations per block of a DeepSeek V3). Untested on a GPU: no GPU
  was lent to the session that wrote it; ``gather_on_device`` is exercised here on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from connectors._pages import host_pages
from connectors.base import PageBytes
from kvstore.buffers import aligned_empty
from kvstore.layout import BlockSpec

PAGE_ALIGN = 4096


@dataclass(frozen=True)
class CopiedOut:
    """Blocks copied out of the engine's pages: ``payloads[i]`` ([block_bytes] uint8, layer-major
    as the store lays out a block) holds page ``pages[i]`` once ``wait()`` has returned."""

    payloads: list[np.ndarray]
    wait: Callable[[], None] = lambda: None

    @property
    def nbytes(self) -> int:
        return sum(payload.nbytes for payload in self.payloads)


def copy_out(spec: BlockSpec, pool: PageBytes, pages: Sequence[int]) -> CopiedOut:
    """Copy the blocks held in ``pages`` out of ``pool``; the pages may be reused once it returns
    (for CUDA pages: by work queued after it on the calling thread's stream, or ordered after
    that stream). Call it on the engine's thread."""
    if not pages:
        return CopiedOut([])
    device = pool.layer_page_bytes(0, pages[0]).device
    if device.type == "cuda":
        return _copy_out_of_cuda(spec, pool, pages, device)
    payloads = aligned_payloads(len(pages), spec.block_bytes)
    for layer in range(spec.num_layers):
        offset, size = spec.layer_range(layer)
        for payload, page_bytes in zip(payloads, host_pages(pool, layer, pages)):
            payload[offset : offset + size] = page_bytes
    return CopiedOut(payloads)


def aligned_payloads(count: int, block_bytes: int) -> list[np.ndarray]:
    """``count`` uninitialised [block_bytes] uint8 payloads, each page-aligned (the disk tier
    writes them as they are), carved out of one allocation: a fresh allocation per block costs
    more than the copy into it (page faults; large allocations get huge pages)."""
    stride = -(-block_bytes // PAGE_ALIGN) * PAGE_ALIGN
    whole = aligned_empty(count * stride, PAGE_ALIGN)
    return [whole[i * stride : i * stride + block_bytes] for i in range(count)]


def gather_on_device(spec: BlockSpec, pool: PageBytes, pages: Sequence[int]) -> torch.Tensor:
    """[len(pages), block_bytes] uint8 on the pages' device, row ``i`` the payload of page
    ``pages[i]``: two kernels per layer, queued on the calling thread's current stream."""
    device = pool.layer_page_bytes(0, pages[0]).device
    staged = torch.empty(len(pages), spec.block_bytes, dtype=torch.uint8, device=device)
    layer_pages = getattr(pool, "layer_pages", None)
    # a copy from pageable memory is staged by the driver at once: it waits for no queued kernel
    index = torch.as_tensor(pages, dtype=torch.long).to(device, non_blocking=True)  # [n]
    for layer in range(spec.num_layers):
        offset, size = spec.layer_range(layer)
        rows = layer_pages(layer).index_select(0, index) if layer_pages is not None else \
            torch.stack([pool.layer_page_bytes(layer, page) for page in pages])  # [n, layer_bytes] uint8
        staged[:, offset : offset + size] = rows
    return staged


def _copy_out_of_cuda(spec: BlockSpec, pool: PageBytes, pages: Sequence[int], device: torch.device) -> CopiedOut:
    """``copy_out`` for CUDA pages (module docstring). Untested on a GPU."""
    staged = gather_on_device(spec, pool, pages)  # [n, block_bytes] uint8, on the engine's stream
    host = torch.empty(staged.shape, dtype=torch.uint8, pin_memory=True)  # [n, block_bytes] uint8
    copier = torch.cuda.Stream(device)  # from torch's pool of streams: cheap to ask for
    copier.wait_stream(torch.cuda.current_stream(device))  # after the gather
    with torch.cuda.stream(copier):
        host.copy_(staged, non_blocking=True)
    staged.record_stream(copier)  # the allocator keeps its memory until the copy has read it
    copied = torch.cuda.Event()
    copied.record(copier)
    return CopiedOut([row.numpy() for row in host], copied.synchronize)
