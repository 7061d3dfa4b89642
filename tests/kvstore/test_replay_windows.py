"""The hit rate along the trace: windows of equal request counts that add up to the whole replay."""

import pytest

from kvstore.belady import belady_hits
from kvstore.errors import InvalidRequest
from kvstore.replay import replay
from kvstore.replay_report import format_windows
from kvstore.replay_windows import split_windows
from kvstore.trace import TraceRequest

B = 512


def req(t, *ids, tokens=None):
    return TraceRequest(float(t), tokens if tokens is not None else B * len(ids), 0, tuple(ids))


def test_windows_cut_the_requests_evenly_and_keep_their_timestamps():
    trace = [req(10 * i, i) for i in range(7)]
    windows = split_windows(trace, [1] * 7, [2] * 7, 3)
    assert [(w.first_request, w.requests) for w in windows] == [(0, 2), (2, 2), (4, 3)]
    assert [(w.first_timestamp, w.last_timestamp) for w in windows] == [(0, 10), (20, 30), (40, 60)]
    assert [(w.hit_tokens, w.max_hit_tokens, w.input_tokens) for w in windows] == [(2, 4, 2 * B), (2, 4, 2 * B),
                                                                                     (3, 6, 3 * B)]
    assert windows[2].fraction_of_max == 0.5


@pytest.mark.parametrize("requests, count", [(3999, 7), (7, 7), (10, 4), (1, 1)])
def test_window_sizes_differ_by_one_at_most_and_cover_every_request(requests, count):
    """One window a request is the most a trace allows (the refusal starts past it)."""
    windows = split_windows([req(i, i) for i in range(requests)], [0] * requests, [0] * requests, count)
    sizes = [w.requests for w in windows]
    assert len(windows) == count and sum(sizes) == requests and max(sizes) - min(sizes) <= 1
    assert [w.first_request for w in windows] == [sum(sizes[:i]) for i in range(count)]


@pytest.mark.parametrize("count, message", [(0, "--windows must be at least 1, got 0"),
                                            (-1, "--windows must be at least 1, got -1"),
                                            (4, "the trace holds only 3 requests, so give at most 3 windows")])
def test_a_window_count_no_trace_can_fill_is_refused(count, message):
    trace = [req(i, i) for i in range(3)]
    with pytest.raises(InvalidRequest, match=message):
        split_windows(trace, [0] * 3, [0] * 3, count)
    if count:  # replay(windows=0) is a replay without windows
        with pytest.raises(InvalidRequest, match=message):
            replay(trace, capacity_tokens=4 * B, windows=count)


def test_a_replay_s_windows_add_up_to_it_and_show_the_cold_start():
    """Four distinct prompts, then each sent again, newest first: the first half can hit nothing
    (its maximum is 0, so all of it is kept); in the second half LRU's 4 slots hold the last two."""
    first = [req(i, 10 * i, 10 * i + 1) for i in range(4)]
    trace = first + [req(4 + i, *r.hash_ids) for i, r in enumerate(reversed(first))]
    result = replay(trace, capacity_tokens=4 * B, policy="lru", windows=2)
    cold, warm = result.windows
    assert (cold.hit_tokens, cold.max_hit_tokens, cold.fraction_of_max) == (0, 0, 1.0)
    assert (warm.hit_tokens, warm.max_hit_tokens, warm.fraction_of_max) == (4 * B, 8 * B, 0.5)
    assert sum(w.hit_tokens for w in result.windows) == result.hit_tokens
    assert sum(w.max_hit_tokens for w in result.windows) == result.max_hit_tokens
    assert sum(w.input_tokens for w in result.windows) == result.input_tokens
    assert [w["fraction_of_max"] for w in result.as_dict()["windows"]] == [1.0, warm.fraction_of_max]


def test_a_replay_without_windows_reports_none():
    result = replay([req(0, 1), req(1, 1)], capacity_tokens=2 * B)
    assert result.windows == () and result.as_dict()["windows"] == []


def test_windows_carry_belady_s_schedule_when_the_bound_is_computed():
    """The schedule's hits per window add up to its whole-trace hits, never exceed a window's
    maximum, and show where knowing the future pays: here LRU's loop over 5 prompts in 4 slots
    hits nothing, while Belady keeps two of them."""
    prompts = [req(i, 10 * i, 10 * i + 1) for i in range(5)]
    trace = [req(len(prompts) * k + i, *p.hash_ids) for k in range(3) for i, p in enumerate(prompts)]
    result = replay(trace, capacity_tokens=4 * B, policy="lru", windows=3)
    schedule = [w.optimal_schedule_hit_tokens for w in result.windows]
    assert sum(schedule) == belady_hits(trace, 4, B)[1] > 0 and schedule[0] == 0  # nothing to hit at first
    assert all(s <= w.max_hit_tokens for s, w in zip(schedule, result.windows))
    assert result.windows[0].optimal_schedule_fraction_of_max == 1.0  # a cold stretch: all of nothing
    assert [w.hit_tokens for w in result.windows] == [0, 0, 0]
    assert [w.optimal_schedule_fraction_of_max for w in result.windows[1:]] == [s / (10 * B) for s in schedule[1:]]
    assert "Belady" in format_windows(result.windows)[1]


def test_windows_without_the_bound_have_no_belady_column():
    trace = [req(i, i % 3) for i in range(6)]
    result = replay(trace, capacity_tokens=2 * B, windows=2, with_optimal=False)
    assert [w.optimal_schedule_hit_tokens for w in result.windows] == [None, None]
    assert result.as_dict()["windows"][0]["optimal_schedule_fraction_of_max"] is None
    assert "Belady" not in "\n".join(format_windows(result.windows))
