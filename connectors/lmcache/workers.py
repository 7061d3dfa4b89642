"""The threads that make the plugin's blocking sidecar calls, and the gate every call passes.

LMCache calls the plugin on its event loop (the async methods, which ``run`` hands to the threads)
and on threads of its own (the sync lookups, which enter through ``admitted``). Once ``close`` has
begun no call enters: each gets its closed answer (a miss, a dropped store) and never touches the
client ``close`` is about to shut (a call on a closed gRPC channel kills the process in grpcio).
``close`` waits for the calls already inside.

A coroutine LMCache cancels (its ``blocking_timeout_secs``) cannot stop a thread mid-call: its
``Call`` says ``stopped``, so the function stops before its next sidecar call, and whatever the
function returns anyway goes to the caller's ``unclaimed`` (objects LMCache will never receive).

Knows nothing of LMCache or the sidecar: functions, their arguments and their results.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


class Call:
    """One call's stop signal, which the function it runs polls between sidecar calls."""

    def __init__(self, workers: Workers):
        self._workers = workers
        self._cancelled = threading.Event()

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def stopped(self) -> bool:
        """True once the caller gave up on the result or the workers began closing."""
        return self._cancelled.is_set() or self._workers.closed


class Workers:
    def __init__(self, threads: int, name: str):
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix=name)
        self._idle = threading.Condition()
        self._inside = 0  # calls admitted and not yet finished
        self.closed = False

    @contextlib.contextmanager
    def admitted(self, call: Call | None = None) -> Iterator[Call | None]:
        """Yields ``call`` (a fresh one if None) while the workers are open, else None: the caller
        then does nothing. ``close`` waits until every admitted block has exited."""
        with self._idle:
            if self.closed:
                call = None
            else:
                call = call or Call(self)
                self._inside += 1
        try:
            yield call
        finally:
            if call is not None:
                self._leave()

    async def run(self, closed_answer: T, fn: Callable[..., T], *args: Any,
                  finished: Callable[[], None] | None = None,
                  unclaimed: Callable[[T], None] | None = None) -> T:
        """``fn(call, *args)`` on a worker thread, admitted; ``closed_answer`` once closing has begun.

        ``finished()`` runs once the threads are done with ``args`` (``fn`` returned or raised, or
        never ran), on whichever thread that happens. Cancelled while ``fn`` runs, this stops
        ``call`` and re-raises ``CancelledError``; ``fn``'s result, when it comes, goes to
        ``unclaimed(result)`` instead (``fn`` raising: nothing to hand over)."""
        call = Call(self)
        try:
            future = self._pool.submit(self._run_admitted, closed_answer, fn, call, *args)
        except RuntimeError:  # shut down between the closed check and here: closed
            if finished is not None:
                finished()
            return closed_answer
        if finished is not None:
            future.add_done_callback(lambda _: finished())
        try:
            return await asyncio.wrap_future(future)  # cancelled, this cancels a future not yet started
        except asyncio.CancelledError:
            call.cancel()
            if unclaimed is not None:
                future.add_done_callback(lambda done: _hand_over(done, unclaimed))
            raise

    def close(self) -> bool:
        """Blocks until no admitted call is left, then stops the threads. True the first time."""
        with self._idle:
            first = not self.closed
            self.closed = True
            self._idle.wait_for(lambda: self._inside == 0)
        self._pool.shutdown(wait=True)  # what is still queued answers closed at once
        return first

    def _run_admitted(self, closed_answer: T, fn: Callable[..., T], call: Call, *args: Any) -> T:
        with self.admitted(call) as admitted:
            return closed_answer if admitted is None else fn(admitted, *args)

    def _leave(self) -> None:
        with self._idle:
            self._inside -= 1
            if self._inside == 0:
                self._idle.notify_all()


def _hand_over(future: Future, unclaimed: Callable[[Any], None]) -> None:
    if not future.cancelled() and future.exception() is None:
        unclaimed(future.result())
