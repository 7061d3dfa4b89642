"""Copying saved blocks out of the engine's pages without holding up the engine's thread.

A ``save`` must not stall the engine's loop (it follows every prefill), and the engine must not
reuse a saved page before the save has read it. ``copy_out`` returns a ``CopiedOut`` whose
``wait()`` returns once the pages have been read and the payloads hold them:

- **host pages** (CPU tensors): each block's layers are copied into page-aligned payloads before
  ``copy_out`` returns (memory copies; the disk tier writes such a payload with no further copy),
  a layer of all the pages at a time through the pool's ``layer_pages`` where it has one.
- **CUDA pages**: the process's save stream (``side_stream``), made to wait for the engine
  thread's current stream (the kernels that computed the pages), gathers the blocks on the
  device and copies them to pinned host memory, ``SAVE_CHUNK_BYTES`` at a time: device memory
  for one or two chunks, never a whole long prompt's KV. The pinned payloads live until the
  store has the save: bounded by the writer's ``max_pending_save_bytes`` (a single larger save
  is let in). Nothing waits on the engine's thread, and its kernels do not wait for the copy.
  The engine waits (``KVConnector.wait_copied``) only before it reuses saved pages: when it
  frees a finished request's (long after, as a rule) or demotes an evicted one. Before session
  31 every layer of every block was a synchronous device-to-host copy on the engine's thread.
  Untested on a GPU: no GPU was lent to the session that wrote it; ``gather_on_device`` is
  exercised here on the CPU.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from connectors._pages import host_pages, page_index, side_stream
from connectors._save_writer import CopiedOut
from connectors.base import PageBytes
from kvstore.buffers import aligned_empty
from kvstore.layout import BlockSpec

PAGE_ALIGN = 4096
SAVE_CHUNK_BYTES = 256 << 20  # device memory a CUDA save's gather takes at a time


def copy_out(spec: BlockSpec, pool: PageBytes, pages: Sequence[int]) -> CopiedOut:
    """Copy the blocks held in ``pages`` out of ``pool``, or queue that copy (CUDA pages); call it
    on the engine's thread, after queueing the work that computed the pages."""
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
    ``pages[i]``: two kernels a layer, queued on the calling thread's current stream."""
    device = pool.layer_page_bytes(0, pages[0]).device
    staged = torch.empty(len(pages), spec.block_bytes, dtype=torch.uint8, device=device)
    layer_pages = getattr(pool, "layer_pages", None)
    index = page_index(pages, device) if layer_pages is not None else None  # [n] int64
    for layer in range(spec.num_layers):
        offset, size = spec.layer_range(layer)
        rows = layer_pages(layer).index_select(0, index) if layer_pages is not None else \
            torch.stack([pool.layer_page_bytes(layer, page) for page in pages])  # [n, layer_bytes] uint8
        staged[:, offset : offset + size] = rows
    return staged


def _copy_out_of_cuda(spec: BlockSpec, pool: PageBytes, pages: Sequence[int], device: torch.device) -> CopiedOut:
    """``copy_out`` for CUDA pages (module docstring). Untested on a GPU."""
    copier = side_stream(device, "save")  # one for the process: a save's event also covers those before it
    copier.wait_stream(torch.cuda.current_stream(device))  # after the kernels that computed the pages
    per_chunk = max(1, SAVE_CHUNK_BYTES // spec.block_bytes)
    payloads: list[np.ndarray] = []
    with torch.cuda.stream(copier):  # staging is allocated, used and freed on this stream alone
        for start in range(0, len(pages), per_chunk):
            staged = gather_on_device(spec, pool, pages[start : start + per_chunk])  # [n, block_bytes] uint8
            host = torch.empty(staged.shape, dtype=torch.uint8, pin_memory=True)  # torch caches pinned blocks
            host.copy_(staged, non_blocking=True)
            payloads.extend(row.numpy() for row in host)  # each view keeps ``host`` alive
    copied = torch.cuda.Event()
    copied.record(copier)
    return CopiedOut(payloads, copied.synchronize)
