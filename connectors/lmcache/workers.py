"""The threads that make the plugin's blocking sidecar calls, and the gate every call passes.

LMCache calls the plugin on its event loop (the async methods, which ``run`` hands to the threads)
and on threads of its own (the sync lookups, which enter through ``admitted``). A call is admitted
when it enters: ``run``'s when it is submitted on the loop, even if it then waits for a free thread.
Once ``close`` has begun no call enters: each gets its closed answer (a miss, a dropped store) and
never touches the client ``close`` is about to shut (a call on a closed gRPC channel kills the
process in grpcio). ``close`` waits for every admitted call, queued ones included: LMCache does not
wait for its pending puts before it closes the backend, so a put it handed over is written whole.

A coroutine LMCache cancels (its ``blocking_timeout_secs``) cannot stop a thread mid-call: its
``Call`` says ``stopped``, so the function stops before its next sidecar call (a call that had not
started yet still runs, and stops at once), and whatever the function returns anyway goes to the
caller's ``unclaimed`` (objects LMCache will never receive). A call that ``stops_at_close`` (a get,
a lookup: their answers go nowhere after close) says ``stopped`` once closing begins too.

Knows nothing of LMCache or the sidecar: functions, their arguments and their results.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import Any, TypeVar

T = TypeVar("T")


class Call:
    """One call's stop signal, which the function it runs polls between sidecar calls."""

    def __init__(self, workers: Workers, stops_at_close: bool = True):
        self._workers = workers
        self._stops_at_close = stops_at_close
        self._cancelled = threading.Event()

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def stopped(self) -> bool:
        """True once the caller gave up on the result, or (``stops_at_close``) the workers began closing."""
        return self._cancelled.is_set() or (self._stops_at_close and self._workers.closed)


class Workers:
    def __init__(self, threads: int, name: str):
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix=name)
        self._idle = threading.Condition()
        self._inside = 0  # calls admitted and not yet finished, queued ones included
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

    async def run(self, closed_answer: T, fn: Callable[..., T], *args: Any, stops_at_close: bool = True,
                  finished: Callable[[], None] | None = None,
                  unclaimed: Callable[[T], None] | None = None) -> T:
        """``fn(call, *args)`` on a worker thread, admitted now; ``closed_answer`` once closing has begun.

        ``finished()`` runs once the threads are done with ``args`` (``fn`` returned or raised, or
        was never admitted), on whichever thread that happens, before ``close`` can return.
        Cancelled, this stops ``call`` and re-raises ``CancelledError``; ``fn`` still runs (it stops
        at its first check if it had not started), and its result goes to ``unclaimed(result)``
        instead (``fn`` raising: nothing to hand over)."""
        call = Call(self, stops_at_close)
        future = self._submit(call, fn, args, finished)
        if future is None:
            if finished is not None:
                finished()
            return closed_answer
        try:
            return await asyncio.shield(asyncio.wrap_future(future))  # cancelled, fn runs all the same
        except asyncio.CancelledError:
            call.cancel()
            if unclaimed is not None:
                future.add_done_callback(partial(_hand_over, unclaimed=unclaimed))
            raise

    def close(self) -> bool:
        """Blocks until no admitted call is left, then stops the threads. True the first time."""
        with self._idle:
            first = not self.closed
            self.closed = True
            self._idle.wait_for(lambda: self._inside == 0)
        self._pool.shutdown(wait=True)
        return first

    def _submit(self, call: Call, fn: Callable, args: tuple, finished: Callable[[], None] | None) -> Future | None:
        """``fn(call, *args)`` queued and admitted, or None once closing has begun (or the
        interpreter is shutting down: no thread would take it)."""
        with self._idle:
            if self.closed:
                return None
            try:
                future = self._pool.submit(fn, call, *args)
            except RuntimeError:  # "cannot schedule new futures after interpreter shutdown"
                return None
            self._inside += 1
        future.add_done_callback(partial(self._done, finished))
        return future

    def _done(self, finished: Callable[[], None] | None, _: Future) -> None:
        try:
            if finished is not None:
                finished()
        finally:
            self._leave()

    def _leave(self) -> None:
        with self._idle:
            self._inside -= 1
            if self._inside == 0:
                self._idle.notify_all()


def _hand_over(future: Future, unclaimed: Callable[[Any], None]) -> None:
    if future.exception() is None:  # never cancelled: run shields it
        unclaimed(future.result())
