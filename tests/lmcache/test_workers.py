"""The plugin's worker threads and their gate (``connectors/lmcache/workers.py``): real threads and
a real event loop, no LMCache. A function blocks on an event to stand for a slow sidecar call."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from connectors.lmcache.workers import Workers

WAIT_S = 10.0


@pytest.fixture
def workers():
    workers = Workers(2, "test-workers")
    yield workers
    workers.close()


class SlowCall:
    """A worker function that waits for ``release`` (a sidecar call under way), notes whether its
    call said stopped after the wait, and returns ``result``."""

    def __init__(self, result):
        self.result = result
        self.started = threading.Event()
        self.release = threading.Event()
        self.stopped_after_wait: bool | None = None

    def __call__(self, call):
        self.started.set()
        assert self.release.wait(WAIT_S)
        self.stopped_after_wait = call.stopped
        return self.result


def test_a_cancelled_run_stops_its_call_and_hands_the_late_result_to_unclaimed(workers):
    slow, unclaimed, finished = SlowCall(["obj-1", "obj-2"]), [], threading.Event()

    async def cancel_while_running():
        task = asyncio.ensure_future(workers.run([], slow, unclaimed=unclaimed.append, finished=finished.set))
        await asyncio.to_thread(slow.started.wait, WAIT_S)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel_while_running())
    assert unclaimed == [] and not finished.is_set(), "the thread is still inside the call"
    slow.release.set()
    assert finished.wait(WAIT_S)
    assert slow.stopped_after_wait is True
    assert unclaimed == [["obj-1", "obj-2"]]


def test_a_run_that_is_not_cancelled_returns_its_result_and_leaves_unclaimed_alone(workers):
    slow, unclaimed = SlowCall(["obj"]), []
    slow.release.set()

    assert asyncio.run(workers.run([], slow, unclaimed=unclaimed.append)) == ["obj"]
    assert slow.stopped_after_wait is False and unclaimed == []


def test_after_close_run_answers_closed_without_calling_and_still_reports_finished(workers):
    workers.close()
    calls, finished = [], []

    answer = asyncio.run(workers.run("closed", calls.append, finished=lambda: finished.append(1)))

    assert answer == "closed" and calls == [] and finished == [1]


def test_close_waits_for_an_admitted_call_and_admits_none_after():
    workers = Workers(1, "test-workers")
    inside, leave, closed_at = threading.Event(), threading.Event(), []

    def caller():
        with workers.admitted() as call:
            assert call is not None
            inside.set()
            assert leave.wait(WAIT_S)

    thread = threading.Thread(target=caller)
    thread.start()
    assert inside.wait(WAIT_S)
    closer = threading.Thread(target=lambda: closed_at.append(workers.close()))
    closer.start()
    time.sleep(0.2)
    assert closed_at == [], "close returned while a call was inside"
    with workers.admitted() as late:
        assert late is None, "admitted after close began"
    leave.set()
    thread.join(WAIT_S)
    closer.join(WAIT_S)
    assert closed_at == [True]
    assert workers.close() is False, "a second close is a no-op"


def test_close_runs_a_put_queued_behind_a_busy_thread_whole_and_waits_for_it():
    """LMCache closes the backend without waiting for its puts: one it handed over before close
    must still be written, although no thread had taken it up when close began."""
    workers, busy, put = Workers(1, "test-workers"), SlowCall("busy"), SlowCall(None)
    put.release.set()
    closed_at = []

    async def close_behind_a_queued_put():
        running = asyncio.ensure_future(workers.run("closed", busy))
        await asyncio.to_thread(busy.started.wait, WAIT_S)
        queued = asyncio.ensure_future(workers.run("closed", put, stops_at_close=False))
        await asyncio.sleep(0.1)
        closer = asyncio.ensure_future(asyncio.to_thread(lambda: closed_at.append(workers.close())))
        await asyncio.sleep(0.2)
        assert closed_at == [] and not put.started.is_set(), "close waits; the put is still queued"
        busy.release.set()
        return await running, await queued, await closer

    assert asyncio.run(close_behind_a_queued_put()) == ("busy", None, None)
    assert put.started.is_set() and put.stopped_after_wait is False, "the put ran, and was never told to stop"
    assert closed_at == [True]


def test_closing_stops_a_running_get_but_not_a_running_put(workers):
    get, put = SlowCall(["obj"]), SlowCall(None)

    async def close_while_both_run():
        calls = asyncio.gather(workers.run([], get), workers.run(None, put, stops_at_close=False))
        await asyncio.to_thread(lambda: get.started.wait(WAIT_S) and put.started.wait(WAIT_S))
        closer = asyncio.ensure_future(asyncio.to_thread(workers.close))
        await asyncio.sleep(0.1)
        get.release.set()
        put.release.set()
        await closer
        return await calls

    assert asyncio.run(close_while_both_run()) == [["obj"], None]
    assert get.stopped_after_wait is True, "a get's answer goes nowhere after close: it may stop"
    assert put.stopped_after_wait is False, "a put LMCache handed over is written whole"
