"""What every connector does alike: page bytes in and out of block payloads, the layer-readiness
handle of a background load, and the background writer of saves.

A block payload is layer-major (``BlockSpec.layer_range(l)`` is layer ``l``'s byte range); a page
of the engine's pool holds one layer of one block (``PageBytes.layer_page_bytes``).
"""

from __future__ import annotations

import logging
import warnings
import queue
import threading
from typing import Callable, Sequence

import numpy as np
import torch

from connectors.base import LoadFailed, LoadHandle, PageBytes
from kvstore.buffers import aligned_empty
from kvstore.layout import BlockSpec

log = logging.getLogger("connectors")


def host_view(t: torch.Tensor) -> np.ndarray:
    """Flat uint8 numpy view of a CPU tensor (a device tensor is copied to the host first)."""
    if t.device.type != "cpu":
        t = t.to("cpu", non_blocking=False)
    return t.reshape(-1).view(torch.uint8).numpy()


def load_targets(hit, block_hashes: Sequence[bytes], pages: Sequence[int]) -> tuple[list[bytes], list[int]]:
    """The hashes and pages of the ``hit.blocks`` blocks a load fills; refuses too few of either."""
    if len(pages) < hit.blocks or len(block_hashes) < hit.blocks:
        raise ValueError(f"{hit.blocks} blocks to load but {len(pages)} pages and {len(block_hashes)} hashes")
    return list(block_hashes[: hit.blocks]), list(pages[: hit.blocks])


def gather_block(spec: BlockSpec, pool: PageBytes, page: int) -> np.ndarray:
    """A fresh [block_bytes] uint8 payload with every layer of ``page``, laid out as the store lays it out."""
    payload = aligned_empty(spec.block_bytes)  # page-aligned: the disk tier writes it with no copy
    for layer in range(spec.num_layers):
        offset, size = spec.layer_range(layer)
        payload[offset : offset + size] = host_view(pool.layer_page_bytes(layer, page))
    return payload


def gather_blocks(spec: BlockSpec, pool: PageBytes, pages: Sequence[int]) -> list[np.ndarray]:
    return [gather_block(spec, pool, page) for page in pages]


def scatter_layer(spec: BlockSpec, pool: PageBytes, layer: int, page: int, payload: np.ndarray) -> None:
    """Write layer ``layer`` of a block payload into ``page`` (a CPU or device page alike)."""
    offset, size = spec.layer_range(layer)
    target = pool.layer_page_bytes(layer, page)  # [layer_bytes] uint8
    target.copy_(_source_tensor(payload[offset : offset + size]).view(target.dtype).reshape(target.shape))


def _source_tensor(source: np.ndarray) -> torch.Tensor:
    """A tensor over ``source`` that is only read (a read-only shared-memory view is fine)."""
    if source.flags.writeable:
        return torch.from_numpy(source)
    with warnings.catch_warnings():  # torch warns that writing would be undefined; we never write
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(source)


class BackgroundLoad(LoadHandle):
    """A load running ``body(layer_done)`` on its own thread.

    ``body`` copies the blocks into their pages and calls ``layer_done(n)`` once layers ``[0, n)``
    of every block are in place (calls must not decrease); it returns normally when the whole load
    is in place. Any exception from ``body`` fails the load (``wait_layer`` raises ``LoadFailed``
    for the layers not yet done), never the engine. ``finish`` runs last, whatever happened (it
    ends the lease).
    """

    def __init__(self, name: str, blocks: int, num_layers: int, body: Callable[[Callable[[int], None]], None],
                 finish: Callable[[], None] = lambda: None, logger: logging.Logger = log):
        self._log = logger
        self._name, self._blocks, self._num_layers = name, blocks, num_layers
        self._body, self._finish = body, finish
        self._done_layers = 0
        self._failed: str | None = None
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=f"kv-load-{name}", daemon=True)
        self._thread.start()

    def _layer_done(self, layers: int) -> None:
        with self._cond:
            self._done_layers = max(self._done_layers, layers)
            self._cond.notify_all()

    def _run(self) -> None:
        try:
            self._body(self._layer_done)
            self._layer_done(self._num_layers)
        except Exception as exc:  # a failed load is a recompute, never a crash of the engine
            self._log.warning("load for %s failed: %s", self._name, exc)
            with self._cond:
                self._failed = str(exc) or type(exc).__name__
                self._cond.notify_all()
        finally:
            self._finish()

    def wait_layer(self, layer: int) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._failed is not None or self._done_layers > layer)
            if self._failed is not None and self._done_layers <= layer:
                raise LoadFailed(self._failed)

    def wait(self) -> int:
        self._thread.join()
        return self._blocks if self._failed is None else 0


class SaveWriter:
    """One background thread that hands queued saves to ``write(hashes, payloads, parent)``.

    A save that fails is logged and dropped (its blocks stay uncached); ``flush`` waits for every
    save queued so far; ``close`` flushes and ends the thread.
    """

    def __init__(self, write: Callable[[list[bytes], list[np.ndarray], bytes | None], None],
                 failed_message: str = "saving blocks to the store failed; they stay uncached",
                 logger: logging.Logger = log):
        self._write, self._failed_message, self._log = write, failed_message, logger
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="kv-save", daemon=True)
        self._thread.start()

    def put(self, hashes: Sequence[bytes], payloads: list[np.ndarray], parent: bytes | None) -> None:
        self._queue.put((list(hashes), payloads, parent))

    def flush(self) -> None:
        self._queue.join()

    def close(self) -> None:
        if not self._thread.is_alive():
            return
        self.flush()
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self._write(*item)
            except Exception:
                self._log.exception(self._failed_message)
            finally:
                self._queue.task_done()
