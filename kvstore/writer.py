"""Background copies into lower tiers (write-through), off the caller's path.

A bounded queue feeds one thread. When the queue is full the copy runs in the caller instead
(backpressure that slows the producer rather than losing the write). The store pins each block
before it is queued and the job unpins it, so the source cannot be evicted mid-copy.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Callable

log = logging.getLogger(__name__)

Job = Callable[[], None]


class BackgroundWriter:
    def __init__(self, max_pending: int = 256, name: str = "kvstore-writer"):
        self._queue: queue.Queue[Job | None] = queue.Queue(maxsize=max_pending)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self.ran_inline = 0

    def submit(self, job: Job) -> None:
        """Run ``job`` soon on the writer thread, or now if the queue is full."""
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            self.ran_inline += 1
            job()

    def drain(self) -> None:
        """Block until every submitted job has finished."""
        self._queue.join()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                job()
            except Exception:  # a failed lower-tier copy is a lost copy, never a dead writer
                log.exception("background lower-tier write failed")
            finally:
                self._queue.task_done()
