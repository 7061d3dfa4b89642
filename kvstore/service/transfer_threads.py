"""The threads Get and Put streams (and CommitSlots) make their store calls on, apart from the
event loop's default executor that every other call (Lookup, Release, Stats, GetSlots, ...) uses.

A load from a disk that hangs holds its thread until the disk answers, however long after its
client gave up. On the default executor (min(32, CPUs + 4) threads, shared) a handful of such
Gets left no thread for anyone's Lookup: the whole sidecar stopped answering. Here a stream's
transfer slot (``TransferSlots``) is held until its last store call has returned, not only until
the stream ends, and the executor has one thread per slot. So hung calls take at most
``max_concurrent_transfers`` threads of their own, a stream past them is refused
RESOURCE_EXHAUSTED (not queued), and the control calls go on.

    threads = TransferThreads(TransferSlots(limit, per_client))
    with threads.stream(client) as stream:          # LimitExceeded when no slot is free
        result = await stream.run(store.load, ...)   # on a transfer thread
    # the slot is free once the stream has ended and its last call returned
    threads.shutdown(timeout_s)                      # at exit, before the store and staging close

A call cancelled with its stream still runs to its end: ``shutdown`` waits for those, so they do
not copy out of a staging area or into a store that has closed under them. Its threads are daemon
threads: one still hung after ``shutdown`` does not keep the process from exiting (a
``ThreadPoolExecutor``'s threads are joined at exit, so a sidecar stopped with a call hung on its
disk never exited, until session 34).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from concurrent.futures import Future, wait
from typing import Callable, Iterator

from kvstore.errors import StoreClosed
from kvstore.service.limits import ServiceLimits, TransferSlots

log = logging.getLogger(__name__)


class TransferStream:
    """One stream's store calls; its slot's ``release`` runs once it is closed and no call runs.
    Used from the event loop's thread."""

    def __init__(self, submit: Callable[..., Future], release: Callable[[], None]):
        self._submit, self._release = submit, release
        self._running = 0
        self._closed = False

    def run(self, fn, *args) -> asyncio.Future:
        """``fn(*args)`` on a transfer thread. Cancelling what this returns does not stop the call:
        the slot stays taken until it returns. ``StoreClosed`` once the threads are shut down."""
        loop = asyncio.get_running_loop()
        call = self._submit(fn, *args)
        self._running += 1
        call.add_done_callback(lambda _: loop.call_soon_threadsafe(self._returned))
        return asyncio.wrap_future(call)

    def close(self) -> None:
        self._closed = True
        self._release_if_idle()

    def _returned(self) -> None:
        self._running -= 1
        self._release_if_idle()

    def _release_if_idle(self) -> None:
        if self._closed and not self._running:
            self._release()


class DaemonThreadPool:
    """Up to ``workers`` daemon threads running submitted calls in order, started as calls need
    them; what ``ThreadPoolExecutor`` does, but not joined at interpreter exit."""

    def __init__(self, workers: int, name: str):
        self._workers, self._name = workers, name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = threading.Semaphore(0)  # one token per thread waiting for a call
        self._started = 0
        self._lock = threading.Lock()

    def submit(self, fn, *args) -> Future:
        future: Future = Future()
        self._queue.put((future, fn, args))
        if not self._idle.acquire(blocking=False):
            with self._lock:
                if self._started < self._workers:
                    self._started += 1
                    threading.Thread(target=self._work, name=f"{self._name}_{self._started}", daemon=True).start()
        return future

    def shutdown(self) -> None:
        """Idle threads end; a running call's thread ends once its call returns."""
        with self._lock:
            for _ in range(self._started):
                self._queue.put(None)

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            future, fn, args = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as exc:  # the caller's future carries it
                    future.set_exception(exc)
            self._idle.release()


class TransferThreads:
    """``TransferSlots`` with one thread per slot for the streams' store calls."""

    def __init__(self, slots: TransferSlots):
        self.slots = slots
        self._executor = DaemonThreadPool(slots.limit, "kvstore-transfer")
        self._calls: set[Future] = set()  # submitted, not yet returned
        self._shut = False
        self._lock = threading.Lock()  # calls return on their own threads

    @classmethod
    def of(cls, limits: ServiceLimits) -> "TransferThreads":
        """The threads of a server with ``limits`` (its transfer slots)."""
        return cls(TransferSlots(limits.max_concurrent_transfers, limits.max_streams_per_client))

    @contextlib.contextmanager
    def stream(self, client: str = "") -> Iterator[TransferStream]:
        """A slot for ``client``'s stream (``LimitExceeded`` if none is free), kept until the stream
        ends and its last call returned."""
        stream = TransferStream(self._submit, self.slots.take(client))
        try:
            yield stream
        finally:
            stream.close()

    def shutdown(self, timeout_s: float) -> bool:
        """Take no more calls (``StoreClosed``) and wait up to ``timeout_s`` for those submitted to
        return. True once all have; False, logged, when some still run after it (hung on a disk, say):
        they then meet the store and the staging area closing under them. Idempotent."""
        with self._lock:
            self._shut = True
            calls = list(self._calls)
        self._executor.shutdown()
        running = wait(calls, timeout_s).not_done
        if running:
            log.warning("%d Get/Put/CommitSlots store calls still run %.1f s into the shutdown (a hung disk?); "
                        "closing the store under them: they fail", len(running), timeout_s)
        return not running

    def _submit(self, fn, *args) -> Future:
        with self._lock:
            if self._shut:
                raise StoreClosed("the sidecar is shutting down: no more transfers; retry elsewhere or later")
            call = self._executor.submit(fn, *args)
            self._calls.add(call)
        call.add_done_callback(self._returned)
        return call

    def _returned(self, call: Future) -> None:
        with self._lock:
            self._calls.discard(call)
