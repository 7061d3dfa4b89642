"""BackgroundLoad's deadline and PageFence: an engine never waits on a hung load, and a load it
gave up on never writes into its pages afterwards."""

from __future__ import annotations

import threading
import time
import types

import pytest
import torch

import numpy as np

from connectors._pages import BackgroundLoad, LoadAbandoned, PageFence, queued_engine_work, scatter_layer
from connectors.base import LoadFailed
from tests.connectors.test_copy_out import SPEC, BytePool, expected_payload
from tests.kvstore.store_helpers import until

LAYERS = 3


class Pages:
    """Records each write a load makes, as (layer, time it ended)."""

    def __init__(self):
        self.writes: list[tuple[int, float]] = []

    def write(self, fence: PageFence, layer: int, hold_s: float = 0.0) -> None:
        with fence:
            time.sleep(hold_s)
            self.writes.append((layer, time.monotonic()))


def test_a_load_in_time_signals_each_layer_and_reports_every_block():
    pages, finishes = Pages(), []

    def body(layer_done, fence):
        for layer in range(LAYERS):
            pages.write(fence, layer)
            layer_done(layer + 1)

    handle = BackgroundLoad("r", 4, LAYERS, body, lambda: finishes.append(1), deadline_s=10)
    for layer in range(LAYERS):
        handle.wait_layer(layer)
    assert handle.wait() == 4 and finishes == [1] and [w[0] for w in pages.writes] == [0, 1, 2]


def test_the_load_waits_for_the_engines_queued_work_before_its_first_write():
    queued, order = threading.Event(), []

    def engine_work():  # as a CUDA event's synchronize: returns once the engine's kernels are done
        assert queued.wait(10)
        order.append("engine work done")

    def body(layer_done, fence):
        order.append("first write")
        layer_done(LAYERS)

    handle = BackgroundLoad("r", 1, LAYERS, body, deadline_s=10, before=engine_work)
    time.sleep(0.05)
    assert order == [], "nothing written while the engine's work is queued"
    queued.set()
    assert handle.wait() == 1 and order == ["engine work done", "first write"]


class FakeCudaPool:
    """Pages on a CUDA device as far as ``queued_engine_work`` looks (no GPU here)."""

    def layer_page_bytes(self, layer, page):
        return types.SimpleNamespace(device=torch.device("cuda", 1))


def test_queued_engine_work_records_on_the_calling_threads_stream_of_the_pages_device(monkeypatch):
    recorded = []

    class Event:
        def record(self, stream):
            recorded.append(stream)

        def synchronize(self):
            recorded.append("synchronized")

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: ("stream", device, threading.get_ident()))
    wait = queued_engine_work(FakeCudaPool(), [7])
    assert recorded == [("stream", torch.device("cuda", 1), threading.get_ident())], "the engine thread's stream"
    worker = threading.Thread(target=wait)
    worker.start()
    worker.join(10)
    assert recorded[-1] == "synchronized"
    cpu = types.SimpleNamespace(layer_page_bytes=lambda layer, page: torch.zeros(4, dtype=torch.uint8))
    assert queued_engine_work(cpu, [0]) is None and queued_engine_work(FakeCudaPool(), []) is None


def test_a_hung_load_is_abandoned_at_its_deadline_and_writes_nothing_after():
    pages, finishes, unstick = Pages(), [], threading.Event()

    def body(layer_done, fence):
        pages.write(fence, 0)
        layer_done(1)
        unstick.wait(30)  # a read that hangs
        pages.write(fence, 1)  # the engine has given up: must not land
        layer_done(2)

    started = time.monotonic()
    handle = BackgroundLoad("r", 4, LAYERS, body, lambda: finishes.append(1), deadline_s=0.3)
    handle.wait_layer(0)  # in place before the hang
    with pytest.raises(LoadFailed, match=r"0\.3 s deadline \(1 of 3 layers"):
        handle.wait_layer(1)
    waited = time.monotonic() - started
    assert 0.27 <= waited < 5, waited
    assert handle.wait() == 0, "an abandoned load reports no block"
    handle.wait_layer(0)  # what was in place before stays valid
    unstick.set()
    assert until(lambda: finishes == [1]), "the load ends (and ends its lease) once it is unstuck"
    assert [w[0] for w in pages.writes] == [0], "nothing was written after the engine gave up"


def test_abandoning_waits_for_the_write_in_progress():
    """The write that holds the fence when the deadline passes finishes before the engine goes on."""
    pages, in_write, unstick = Pages(), threading.Event(), threading.Event()

    def body(layer_done, fence):
        with fence:
            in_write.set()
            time.sleep(0.5)
            pages.writes.append((0, time.monotonic()))
        layer_done(1)
        unstick.wait(30)  # then a read hangs
        pages.write(fence, 1)

    handle = BackgroundLoad("r", 1, LAYERS, body, deadline_s=0.1)
    assert in_write.wait(5)
    with pytest.raises(LoadFailed):
        handle.wait_layer(LAYERS - 1)
    returned = time.monotonic()
    assert pages.writes and pages.writes[0][1] <= returned, "the engine went on while a write was landing"
    unstick.set()
    assert until(lambda: not handle._thread.is_alive())
    assert [w[0] for w in pages.writes] == [0]


def test_a_load_whose_layers_are_all_in_place_counts_even_if_its_lease_end_hangs():
    unstick = threading.Event()

    def body(layer_done, fence):
        for layer in range(LAYERS):
            with fence:
                pass
            layer_done(layer + 1)

    handle = BackgroundLoad("r", 2, LAYERS, body, lambda: unstick.wait(30), deadline_s=0.2)
    handle.wait_layer(LAYERS - 1)
    assert handle.wait() == 2, "every layer landed: the data is good"
    unstick.set()


def test_a_failing_body_fails_the_layers_not_yet_done():
    def body(layer_done, fence):
        layer_done(1)
        raise OSError("disk gone")

    handle = BackgroundLoad("r", 2, LAYERS, body, deadline_s=None)
    handle.wait_layer(0)
    with pytest.raises(LoadFailed, match="disk gone"):
        handle.wait_layer(1)
    assert handle.wait() == 0


def test_a_layer_the_load_does_not_carry_fails_at_once_never_counts_as_loaded():
    """A connector built for a model of fewer layers: the engine's extra layers were never filled."""
    def body(layer_done, fence):
        layer_done(LAYERS)

    handle = BackgroundLoad("r", 2, LAYERS, body, deadline_s=0.5)
    handle.wait_layer(LAYERS - 1)
    started = time.monotonic()
    with pytest.raises(LoadFailed, match=r"carries layers \[0, 3\), the engine asked for layer 3"):
        handle.wait_layer(LAYERS)
    assert time.monotonic() - started < 0.25, "refused at once, not at the deadline"


def test_a_closed_fence_refuses_writes():
    fence = PageFence()
    with fence:
        pass
    fence.close()
    with pytest.raises(LoadAbandoned):
        with fence:
            pytest.fail("a write ran behind a closed fence")
    fence.close()  # idempotent


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), 1e10])
def test_a_deadline_must_be_positive_seconds_a_wait_can_take(bad):
    with pytest.raises(ValueError, match=r"load_timeout_s must be positive seconds up to \d+, or None"):
        BackgroundLoad("r", 1, LAYERS, lambda layer_done, fence: None, deadline_s=bad)


def test_cancel_returns_at_once_and_nothing_lands_after():
    """What the engine does when it no longer wants a load (abort_load, free): no deadline wait."""
    pages, finishes, unstick = Pages(), [], threading.Event()

    def body(layer_done, fence):
        pages.write(fence, 0)
        layer_done(1)
        unstick.wait(30)
        pages.write(fence, 1)

    handle = BackgroundLoad("r", 2, LAYERS, body, lambda: finishes.append(1), deadline_s=30)
    handle.wait_layer(0)
    started = time.monotonic()
    handle.cancel()
    assert time.monotonic() - started < 1, "cancel waited for the load"
    assert handle.wait() == 0
    with pytest.raises(LoadFailed, match=r"cancelled \(1 of 3 layers"):
        handle.wait_layer(1)
    unstick.set()
    assert until(lambda: finishes == [1])
    assert [w[0] for w in pages.writes] == [0]


def test_a_settled_load_is_not_cancelled():
    handle = BackgroundLoad("r", 2, LAYERS, lambda layer_done, fence: None, deadline_s=5)
    assert handle.wait() == 2
    handle.cancel()
    assert handle.wait() == 2


def test_after_abandonment_the_handle_never_changes_its_answer():
    """A load whose last layer lands while the deadline passes: what the engine was told stands."""
    in_write, answers = threading.Event(), []

    def body(layer_done, fence):
        with fence:
            in_write.set()
            time.sleep(0.4)  # the deadline passes during this copy
        layer_done(LAYERS)

    handle = BackgroundLoad("r", 1, LAYERS, body, deadline_s=0.1)
    assert in_write.wait(5)
    for _ in range(2):
        try:
            handle.wait_layer(LAYERS - 1)
            answers.append("ready")
        except LoadFailed:
            answers.append("failed")
        time.sleep(0.2)
    assert answers[0] == answers[1] and (handle.wait() == 1) == (answers[0] == "ready")


def test_once_closing_no_new_write_starts():
    """A load copying many small pieces cannot keep the fence from closing."""
    fence, wrote, stop = PageFence(), [], threading.Event()

    def writer():
        try:
            while not stop.is_set():
                with fence:
                    wrote.append(1)
        except LoadAbandoned:
            pass

    thread = threading.Thread(target=writer)
    thread.start()
    time.sleep(0.05)
    before = len(wrote)
    fence.close()
    count = len(wrote)
    time.sleep(0.05)
    stop.set()
    thread.join(5)
    assert count - before <= 2, f"{count - before} writes landed while close waited (the one in progress, at most one more)"
    assert len(wrote) == count, "a write started after close returned"


def test_wait_alone_ends_at_the_deadline_for_a_hung_load():
    unstick = threading.Event()
    started = time.monotonic()  # the deadline counts from the load's start
    handle = BackgroundLoad("r", 2, LAYERS, lambda layer_done, fence: unstick.wait(30), deadline_s=0.3)
    assert handle.wait() == 0
    assert 0.27 <= time.monotonic() - started < 5
    unstick.set()


def test_scatter_layer_writes_layer_l_of_each_payload_into_its_page():
    source, target, pages = BytePool(4), BytePool(4), [3, 0]
    payloads = [expected_payload(source, page) for page in (1, 2)]
    for layer in range(SPEC.num_layers):
        scatter_layer(SPEC, target, layer, pages, payloads)
    assert np.array_equal(expected_payload(target, 3), payloads[0])
    assert np.array_equal(expected_payload(target, 0), payloads[1])


def test_scatter_layer_refuses_a_page_without_its_payload():
    """A sidecar load whose blocks were not all mapped passed every page: on CUDA the pinned rows
    past the payloads were copied in uninitialised."""
    pool = BytePool(3)
    before = expected_payload(pool, 2)
    with pytest.raises(ValueError, match="1 payloads for 2 pages"):
        scatter_layer(SPEC, pool, 0, [1, 2], [np.zeros(SPEC.block_bytes, np.uint8)])
    assert np.array_equal(expected_payload(pool, 2), before)


def test_scatter_layer_refuses_page_bytes_it_cannot_write_in_place():
    """A strided view would be copied, and the load's bytes would land in the copy."""
    columns = torch.zeros(SPEC.layer_bytes, 2, dtype=torch.uint8)  # page p is column p: strided
    pool = types.SimpleNamespace(layer_page_bytes=lambda layer, page: columns[:, page])
    with pytest.raises(ValueError, match="contiguous"):
        scatter_layer(SPEC, pool, 0, [1], [np.ones(SPEC.block_bytes, np.uint8)])
