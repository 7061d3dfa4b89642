"""The background writer of saves: what a connector's ``save`` hands over, and when.

A save is copied out of the engine's pages on the engine's thread (``connectors._copy_out``), or
the copy is queued there, and written to the store on the writer's own thread, so the engine
never waits for the store. ``SaveWriter`` decides first whether a save is taken at all (a store
that is not keeping up, a closed connector), so a save that would be dropped costs no copy.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

log = logging.getLogger("connectors")
DEFAULT_MAX_PENDING_SAVE_BYTES = 1 << 30  # saves copied out of the engine's pages, not yet in the store


class SaveDropped(Exception):
    """Raised by a write that dropped its save and has said why itself (a sidecar not answering):
    counted as a failed save, logged at debug level only."""


def _nothing_to_wait_for() -> None:
    return None


@dataclass(frozen=True)
class CopiedOut:
    """Blocks copied out of the engine's pages: ``payloads[i]`` ([block_bytes] uint8, layer-major
    as the store lays out a block) holds the ``i``-th page once ``wait()`` has returned, and from
    then on the pages are no longer read (they may be reused)."""

    payloads: list[np.ndarray]
    wait: Callable[[], None] = _nothing_to_wait_for

    @property
    def nbytes(self) -> int:
        return sum(payload.nbytes for payload in self.payloads)


class SaveWriter:
    """One background thread that hands queued saves to ``write(hashes, payloads, parent)``, each
    once its copy has finished (``CopiedOut.wait``: an asynchronous copy out of device pages).

    A save that fails is dropped (its blocks stay uncached) and counted in ``failed_saves``; the
    first failure of a run of them is logged with its traceback, the rest at debug level, and the
    next save that succeeds says how many failed (a closed store failed every save of a busy
    engine with a traceback each). A copy that fails (a device out of memory) fails its save the
    same way and never raises into the engine. ``flush`` waits for every save queued so far;
    ``close`` flushes and ends the thread. The queue holds at most ``max_pending_bytes`` of
    payloads (one save always fits): a store that stops keeping up (a hung disk, a lock that stays
    held) would otherwise grow the engine's memory without bound. A save beyond it is dropped
    before it is copied, counted in ``dropped_blocks`` and warned about once per episode. So is a
    save after ``close`` (an engine still committing while it shuts down): nothing would write
    it, and a ``flush`` would wait for it forever.

    ``save`` and ``wait_copied`` are called from the engine's thread only.
    """

    def __init__(self, write: Callable[[list[bytes], list[np.ndarray], bytes | None], None],
                 failed_message: str = "saving blocks to the store failed; they stay uncached",
                 logger: logging.Logger = log, max_pending_bytes: int = DEFAULT_MAX_PENDING_SAVE_BYTES):
        if not max_pending_bytes > 0:
            raise ValueError(f"max_pending_save_bytes must be positive, not {max_pending_bytes!r}")
        self._write, self._failed_message, self._log = write, failed_message, logger
        self._max_pending_bytes = max_pending_bytes
        self._pending_bytes = 0
        self._pending_lock = threading.Lock()
        self._dropping = False
        self._closed = False
        self._dropped_after_close = False  # warned of once
        self._uncopied: list[Callable[[], None]] = []  # waits of copies the engine has not waited for
        self.dropped_blocks = 0
        self.failed_saves = 0
        self._failing = 0  # saves failed since the last one that succeeded
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="kv-save", daemon=True)
        self._thread.start()

    def save(self, hashes: Sequence[bytes], nbytes: int, copy: Callable[[], CopiedOut], parent: bytes | None) -> None:
        """Queue the save of ``hashes`` (``nbytes`` of payloads), whose payloads ``copy()`` makes:
        called on this thread, and only if the save is taken."""
        with self._pending_lock:
            if not self._admit(len(hashes), nbytes):
                return
            self._pending_bytes += nbytes
        try:
            copied = copy()
        except Exception:
            with self._pending_lock:
                self._pending_bytes -= nbytes
                self._failed()
            return
        if copied.wait is not _nothing_to_wait_for:
            self._uncopied.append(copied.wait)
        with self._pending_lock:
            if self._closed:  # closed while copying: close's end mark may be queued already
                self._pending_bytes -= nbytes
                self._admit(len(hashes), nbytes)  # counts and warns of the drop
                return
            self._queue.put((list(hashes), copied, parent, nbytes))  # under the lock: before close's end mark

    def put(self, hashes: Sequence[bytes], payloads: list[np.ndarray], parent: bytes | None) -> None:
        """``save`` of payloads the caller has copied already."""
        self.save(hashes, sum(payload.nbytes for payload in payloads), lambda: CopiedOut(payloads), parent)

    def wait_copied(self) -> None:
        """Return once every copy of a save taken so far has finished reading the engine's pages.
        A copy that failed raises nothing here: the writer counts its save as failed."""
        uncopied, self._uncopied = self._uncopied, []
        for wait in uncopied:
            try:
                wait()
            except Exception:
                self._log.debug("a save's copy out of the pages failed; the writer drops that save", exc_info=True)

    def flush(self) -> None:
        self._queue.join()

    def close(self) -> None:
        with self._pending_lock:
            closing = self._closed
            self._closed = True
        if closing:  # closed, or being closed on another thread: return once that is done
            self._thread.join()
            return
        self.flush()
        self._queue.put(None)
        self._thread.join()

    def _admit(self, blocks: int, nbytes: int) -> bool:
        """Whether a save of ``blocks`` blocks and ``nbytes`` is taken; counts and warns of a drop.
        Caller holds ``_pending_lock``."""
        if self._closed:
            self._log.log(logging.DEBUG if self._dropped_after_close else logging.WARNING,
                          "a save after the connector was closed is dropped (its blocks stay uncached)")
            self._dropped_after_close = True
            self.dropped_blocks += blocks
            return False
        if self._pending_bytes and self._pending_bytes + nbytes > self._max_pending_bytes:
            self.dropped_blocks += blocks
            if not self._dropping:
                self._log.warning("saves waiting for the store passed %d bytes: it is not keeping up; new saves "
                                  "are dropped (their blocks stay uncached) until it catches up",
                                  self._max_pending_bytes)
                self._dropping = True
            return False
        if self._dropping:
            self._log.info("the store caught up with saves; %d blocks were dropped meanwhile", self.dropped_blocks)
            self._dropping = False
        return True

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                hashes, copied, parent, nbytes = item
                try:
                    copied.wait()  # a failed copy fails the save: nothing half-copied is stored
                    self._write(hashes, copied.payloads, parent)
                finally:
                    with self._pending_lock:
                        self._pending_bytes -= nbytes
                with self._pending_lock:
                    if self._failing:
                        self._log.info("saving works again; %d saves failed meanwhile", self._failing)
                        self._failing = 0
            except SaveDropped:
                with self._pending_lock:
                    self._failed(reported=True)
            except Exception:
                with self._pending_lock:
                    self._failed()
            finally:
                self._queue.task_done()

    def _failed(self, reported: bool = False) -> None:
        """Count a save that raised (called in its ``except``, holding ``_pending_lock``): a
        traceback for the first of a run, unless the write ``reported`` the failure itself."""
        self.failed_saves += 1
        self._failing += 1
        if self._failing == 1 and not reported:
            self._log.exception("%s (further failures are logged at debug level until a save succeeds)",
                                self._failed_message)
        else:
            self._log.debug(self._failed_message, exc_info=True)
