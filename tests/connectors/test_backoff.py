"""Backoff: a peer that stops answering is skipped, probed once per doubling window, and
trusted again on its first answer."""

import threading

import pytest

from connectors.backoff import Backoff


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_calls_go_through_while_the_peer_answers():
    backoff = Backoff(clock=Clock())
    assert all(backoff.allow() for _ in range(5)) and backoff.retry_in_s() == 0


def test_a_peer_not_answering_is_skipped_then_probed_once_per_doubling_window():
    clock = Clock()
    backoff = Backoff(initial_s=1, max_s=4, clock=clock)
    backoff.not_answering()
    assert not backoff.allow() and backoff.retry_in_s() == 1
    windows = []
    for _ in range(4):
        clock.now += backoff.retry_in_s()
        assert backoff.allow(), "the window passed: one probe goes"
        assert not backoff.allow(), "one probe at a time"
        backoff.not_answering()  # the probe failed
        windows.append(backoff.retry_in_s())
    assert windows == [2, 4, 4, 4]
    clock.now += 4
    assert backoff.allow()
    backoff.answered()
    assert backoff.allow() and backoff.allow() and backoff.retry_in_s() == 0


def test_failures_of_calls_in_flight_together_open_one_window():
    clock = Clock()
    backoff = Backoff(initial_s=1, clock=clock)
    for _ in range(8):  # eight calls that were all waiting when the peer hung
        backoff.not_answering()
        clock.now += 0.01
    assert backoff.retry_in_s() == pytest.approx(1 - 0.08), "the first failure opened the window; the rest left it"


def test_an_answer_closes_the_window_at_once():
    backoff = Backoff(clock=Clock())
    backoff.not_answering()
    backoff.answered()  # a call in flight got its answer after all
    assert backoff.allow()


def test_only_one_of_many_threads_probes():
    clock = Clock()
    backoff = Backoff(initial_s=1, clock=clock)
    backoff.not_answering()
    clock.now += 1
    allowed, barrier = [], threading.Barrier(16)

    def caller():
        barrier.wait()
        allowed.append(backoff.allow())

    threads = [threading.Thread(target=caller) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(allowed) == [False] * 15 + [True]


@pytest.mark.parametrize("initial, maximum", [(0, 1), (2, 1), (-1, 5)])
def test_windows_must_be_positive_and_ordered(initial, maximum):
    with pytest.raises(ValueError, match="initial_s <= max_s"):
        Backoff(initial, maximum)


def test_a_probe_never_reported_lapses_after_another_window():
    clock = Clock()
    backoff = Backoff(initial_s=1, clock=clock)
    backoff.not_answering()
    clock.now += 1
    assert backoff.allow()  # a probe whose caller never says how it went
    clock.now += 0.5
    assert not backoff.allow()
    clock.now += 0.5
    assert backoff.allow(), "the lost probe lapsed; another goes"
