"""What every connector does alike: page bytes into the engine's pages and the layer-readiness
handle of a background load (``connectors._copy_out`` copies a save out of the pages,
``connectors._save_writer`` writes it to the store).

A block payload is layer-major (``BlockSpec.layer_range(l)`` is layer ``l``'s byte range); a page
of the engine's pool holds one layer of one block (``PageBytes.layer_page_bytes``).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Iterator, Sequence

import numpy as np
import torch

from connectors.base import LoadFailed, LoadHandle, PageBytes
from kvstore.layout import BlockSpec
from kvstore.store import MAX_LEASE_TTL_S

log = logging.getLogger("connectors")
DEFAULT_LOAD_TIMEOUT_S = 30.0  # far beyond a healthy load (GB/s), well short of a hung request
DEFAULT_LOOKUP_TIMEOUT_S = 1.0  # a lookup is on the engine's scheduling path; a healthy one takes ms


def check_load_timeout(seconds: float | None) -> float | None:
    """A load deadline as the connectors take it: positive seconds, or None for no deadline."""
    if seconds is not None and not 0 < seconds <= threading.TIMEOUT_MAX:
        raise ValueError(f"load_timeout_s must be positive seconds up to {threading.TIMEOUT_MAX:.0f}, or None "
                         f"(no deadline), not {seconds!r}")
    return seconds


def check_call_timeout(name: str, seconds: float | None, none_ok: bool = False) -> float | None:
    """A bound on one call as the connectors take it: positive seconds up to ``threading.TIMEOUT_MAX``
    (beyond, a wait overflows: every call would raise, or time out at once), or None where ``none_ok``."""
    if seconds is None and none_ok:
        return None
    if seconds is None or not 0 < seconds <= threading.TIMEOUT_MAX:
        raise ValueError(f"{name} must be positive seconds up to {threading.TIMEOUT_MAX:.0f}"
                         f"{', or None (no bound)' if none_ok else ''}, not {seconds!r}")
    return seconds


def check_lease_ttl(seconds: float) -> float:
    """A lease TTL as the store grants it: positive seconds up to its ``MAX_LEASE_TTL_S``. (Any
    other is refused by the store at every lookup: a connector would wedge or only ever miss.)"""
    if not 0 < seconds <= MAX_LEASE_TTL_S:
        raise ValueError(f"lease_ttl_s must be in (0, {MAX_LEASE_TTL_S:g}] seconds (the store's longest lease), "
                         f"not {seconds!r}")
    return seconds


def host_view(t: torch.Tensor) -> np.ndarray:
    """Flat uint8 numpy view of a contiguous CPU tensor (a copy of a strided one would take the
    writes meant for the pool's pages)."""
    if not t.is_contiguous():
        raise ValueError(f"page bytes must be contiguous to be copied in place, got strides {t.stride()} for "
                         f"shape {tuple(t.shape)}: layer_page_bytes must return a view of the pool's memory")
    return t.view(-1).view(torch.uint8).numpy()


def load_targets(hit, block_hashes: Sequence[bytes], pages: Sequence[int]) -> tuple[list[bytes], list[int]]:
    """The hashes and pages of the ``hit.blocks`` blocks a load fills; refuses too few of either."""
    if len(pages) < hit.blocks or len(block_hashes) < hit.blocks:
        raise ValueError(f"{hit.blocks} blocks to load but {len(pages)} pages and {len(block_hashes)} hashes")
    return list(block_hashes[: hit.blocks]), list(pages[: hit.blocks])


def save_targets(block_hashes: Sequence[bytes], pages: Sequence[int]) -> list[int]:
    """The pages of a save's ``block_hashes``, one each; refuses too few (the save would fail later,
    on the writer's thread, and store nothing)."""
    if len(pages) < len(block_hashes):
        raise ValueError(f"{len(block_hashes)} blocks to save but {len(pages)} pages")
    return list(pages[: len(block_hashes)])


def host_pages(pool: PageBytes, layer: int, pages: Sequence[int]) -> Iterator[np.ndarray]:
    """A writable [layer_bytes] uint8 numpy view of each of ``pages`` in ``layer`` of a host pool.
    Through ``layer_pages`` where the pool has it: a torch call per page (``layer_page_bytes``)
    costs more than the copy of a 72 KiB page (``benchmarks/save_copy.py``)."""
    layer_pages = getattr(pool, "layer_pages", None)
    if layer_pages is not None:
        rows = layer_pages(layer).numpy()  # [num_pages, layer_bytes] uint8
        return (rows[page] for page in pages)
    return (host_view(pool.layer_page_bytes(layer, page)) for page in pages)


def page_index(pages: Sequence[int], device: torch.device) -> torch.Tensor:
    """[n] int64 page ids on ``device``, copied without waiting (from pinned memory on a GPU:
    a copy from pageable memory may wait for the stream's queued work)."""
    index = torch.tensor(list(pages), dtype=torch.long)
    if device.type == "cuda":
        index = index.pin_memory()  # torch's caching host allocator: cheap after the first
    return index.to(device, non_blocking=True)


def scatter_layer(spec: BlockSpec, pool: PageBytes, layer: int, pages: Sequence[int],
                  payloads: Sequence[np.ndarray]) -> None:
    """Write layer ``layer`` of ``payloads[i]`` into page ``pages[i]``; returns once every copy has
    landed, so the engine may read the layer and a load's fence may open. Host pages: numpy
    copies (torch's ``copy_`` on a load's thread is ~9x slower: intra-op threads). CUDA pages:
    ``_scatter_to_cuda``. Raises ``ValueError`` unless there is one payload a page."""
    if len(pages) != len(payloads):
        raise ValueError(f"{len(payloads)} payloads for {len(pages)} pages: a page without its payload would keep "
                         "stale bytes")
    if not pages:
        return
    offset, size = spec.layer_range(layer)
    device = pool.layer_page_bytes(layer, pages[0]).device
    if device.type != "cpu":
        _scatter_to_cuda(pool, layer, pages, [payload[offset : offset + size] for payload in payloads], device)
        return
    for target, payload in zip(host_pages(pool, layer, pages), payloads):
        np.copyto(target, payload[offset : offset + size])


def _scatter_to_cuda(pool: PageBytes, layer: int, pages: Sequence[int], slices: Sequence[np.ndarray],
                     device: torch.device) -> None:
    """One layer's ``slices`` into their CUDA pages: gathered into pinned rows (torch caches
    pinned blocks), copied without blocking on a stream of their own, and waited for. Never on the
    load thread's current stream: the legacy default stream would wait for the engine's kernels,
    and they for it, so no layer could compute while later ones load. Before session 31 the
    ``SidecarConnector`` copied each page of each layer synchronously from pageable memory there.
    Untested on a GPU: no GPU was lent to the session that wrote it."""
    rows = torch.empty((len(pages), slices[0].nbytes), dtype=torch.uint8, pin_memory=True)  # [n, layer_bytes]
    for row, piece in zip(rows.numpy(), slices):
        row[:] = piece
    copier = side_stream(device, "load")
    with torch.cuda.stream(copier):
        layer_pages = getattr(pool, "layer_pages", None)
        if layer_pages is not None:  # one copy and one kernel for the whole layer
            layer_pages(layer).index_copy_(0, page_index(pages, device), rows.to(device, non_blocking=True))
        else:
            for page, row in zip(pages, rows):
                pool.layer_page_bytes(layer, page).copy_(row, non_blocking=True)
    landed = torch.cuda.Event()  # waits for these copies (and earlier loads'), not for later work on the stream
    landed.record(copier)
    landed.synchronize()


_SIDE_STREAM_PRIORITY = {"load": -1, "save": 0}  # lower is sooner: a load holds up a prefill, a save nothing
_side_streams: dict[tuple[torch.device, str], torch.cuda.Stream] = {}
_side_streams_lock = threading.Lock()


def side_stream(device: torch.device, role: str) -> torch.cuda.Stream:
    """The process's one stream for ``role`` ("load" or "save") on ``device``, made once: a stream
    asked of torch per copy comes round-robin out of a small pool, so loads would now and then
    queue on the saves' stream, behind up to a gigabyte of device-to-host copies. Loads get the
    higher priority. Untested on a GPU."""
    with _side_streams_lock:
        key = (device, role)
        if key not in _side_streams:
            _side_streams[key] = torch.cuda.Stream(device, priority=_SIDE_STREAM_PRIORITY[role])
        return _side_streams[key]


def queued_engine_work(pool: PageBytes, pages: Sequence[int]) -> Callable[[], None] | None:
    """Called on the engine's thread as a load starts: a wait for the work the engine has queued so
    far on its current CUDA stream of the pages' device (kernels that may still read the pages for
    the blocks they held before), for the load's thread to run before its first write into them.
    The load's thread has a current stream of its own, so ordering after that one would not do.
    None for pages in host memory. Untested on a GPU: no GPU was lent to the session that wrote it."""
    device = pool.layer_page_bytes(0, pages[0]).device if pages else None
    if device is None or device.type != "cuda":
        return None
    queued = torch.cuda.Event()
    queued.record(torch.cuda.current_stream(device))
    return queued.synchronize


class LoadAbandoned(LoadFailed):
    """The engine stopped waiting for a load (past its deadline): nothing more lands in its pages."""


class PageFence:
    """Admits a load's writes into the engine's pages until the engine gives up on the load.

    Each write runs inside ``with fence:`` and must be a memory copy out of bytes the load already
    holds (its own buffers, or shared memory it has pinned), never a store call or I/O: ``close``
    waits for the write in progress, so it is bounded only if writes are; no write starts once
    ``close`` has been called (a lock alone would let the load's thread take it again first).
    After ``close`` every write raises ``LoadAbandoned``, so pages the engine recomputes are
    never overwritten late.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._closing = False  # set before close takes the lock: no new write starts
        self._closed = False

    def __enter__(self) -> None:
        if self._closing:
            raise LoadAbandoned("the engine gave up on this load; its pages are no longer ours")
        self._lock.acquire()
        if self._closed:
            self._lock.release()
            raise LoadAbandoned("the engine gave up on this load; its pages are no longer ours")

    def __exit__(self, *exc) -> None:
        self._lock.release()

    def close(self) -> None:
        self._closing = True
        with self._lock:
            self._closed = True


class BackgroundLoad(LoadHandle):
    """A load running ``body(layer_done, fence)`` on its own thread, waited for at most ``deadline_s``.

    ``body`` copies the blocks into their pages, each write inside ``with fence:`` (``PageFence``:
    reads from the store go into the load's own buffers first), and calls ``layer_done(n)`` outside
    the fence once layers ``[0, n)`` of every block are in place (calls must not decrease); it
    returns normally when the whole load is in place. Any exception from ``body`` fails the load
    (``wait_layer`` raises ``LoadFailed`` for the layers not yet done), never the engine.
    ``finish`` runs last, whatever happened (it ends the lease). ``before``, if given, runs on the
    load's thread first (``queued_engine_work``: the engine's work on the pages has finished).

    A load not done ``deadline_s`` after it started (a disk read that hangs, a store lock that
    stays held) is abandoned by the first wait that runs out: its fence closes, so whatever it still
    does later writes nothing into the engine's pages, and the load counts as failed unless every
    layer was already in place. The engine then recomputes those pages at once instead of hanging
    with the load. ``deadline_s=None`` waits forever. ``cancel`` abandons at once. A load failed
    either way calls ``on_abandon(cancelled)`` once, on the thread that gave up on it.
    """

    def __init__(self, name: str, blocks: int, num_layers: int,
                 body: Callable[[Callable[[int], None], PageFence], None],
                 finish: Callable[[], None] = lambda: None, logger: logging.Logger = log,
                 deadline_s: float | None = None, on_abandon: Callable[[bool], None] = lambda cancelled: None,
                 before: Callable[[], None] | None = None):
        self._log = logger
        self._before = before
        self._name, self._blocks, self._num_layers = name, blocks, num_layers
        self._body, self._finish, self._on_abandon = body, finish, on_abandon
        self._deadline_s = check_load_timeout(deadline_s)
        self._deadline = None if deadline_s is None else time.monotonic() + deadline_s
        self._fence = PageFence()
        self._done_layers = 0
        self._failed: str | None = None
        self._settled = False  # body and finish have returned
        self._abandoned = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=f"kv-load-{name}", daemon=True)
        self._thread.start()

    def _layer_done(self, layers: int) -> None:
        with self._cond:
            if self._abandoned:  # what the engine was told at abandonment stands
                return
            self._done_layers = max(self._done_layers, layers)
            self._cond.notify_all()

    def _run(self) -> None:
        try:
            if self._before is not None:
                self._before()
            self._body(self._layer_done, self._fence)
            self._layer_done(self._num_layers)
        except Exception as exc:  # a failed load is a recompute, never a crash of the engine
            if not isinstance(exc, LoadAbandoned):
                self._log.warning("load for %s failed: %s", self._name, exc)
            with self._cond:
                self._failed = self._failed or str(exc) or type(exc).__name__
                self._cond.notify_all()
        finally:
            try:
                self._finish()
            finally:
                with self._cond:
                    self._settled = True
                    self._cond.notify_all()

    def wait_layer(self, layer: int) -> None:
        """A layer outside ``[0, num_layers)`` raises ``LoadFailed`` at once: the load carries no
        such layer, so those pages would be read unfilled (a connector built for another model)."""
        if not 0 <= layer < self._num_layers:
            raise LoadFailed(f"the load for {self._name} carries layers [0, {self._num_layers}), "
                             f"the engine asked for layer {layer}")
        if not self._wait_until(lambda: self._failed is not None or self._done_layers > layer):
            self._abandon()
        with self._cond:
            if self._failed is not None and self._done_layers <= layer:
                raise LoadFailed(self._failed)

    def wait(self) -> int:
        if not self._wait_until(lambda: self._settled or self._abandoned):
            self._abandon()
        with self._cond:
            complete = self._failed is None and self._done_layers >= self._num_layers
        return self._blocks if complete else 0

    def cancel(self) -> None:
        """Give up on the load now, unless it has settled: nothing lands in its pages after this
        returns (the write in progress, a memory copy, finishes first)."""
        with self._cond:
            if self._settled:
                return
        self._abandon(cancelled=True)

    def _wait_until(self, ready: Callable[[], bool]) -> bool:
        """Whether ``ready()`` held before the deadline (always, in the end, without one)."""
        with self._cond:
            remaining = None if self._deadline is None else max(0.0, self._deadline - time.monotonic())
            return self._cond.wait_for(ready, timeout=remaining)

    def _abandon(self, cancelled: bool = False) -> None:
        """Close the fence; fail the load unless it is complete, and then tell ``on_abandon``."""
        self._fence.close()  # waits for a write in progress; none lands after this
        with self._cond:
            first = not self._abandoned
            self._abandoned = True
            gave_up = self._failed is None and self._done_layers < self._num_layers
            if gave_up:
                why = "the load was cancelled" if cancelled else \
                    f"the load did not finish within its {self._deadline_s:g} s deadline"
                self._failed = f"{why} ({self._done_layers} of {self._num_layers} layers in place)"
                if not cancelled:
                    self._log.warning("load for %s abandoned: %s; the engine recomputes it", self._name, self._failed)
            self._cond.notify_all()
        if first and gave_up:
            self._on_abandon(cancelled)
