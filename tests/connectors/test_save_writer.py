"""SaveWriter: saves never wait on the engine's thread, never pile up without bound, are copied
only once taken, are stored only once their copy is done, and never raise into the engine."""

from __future__ import annotations

import logging
import threading
import time

import numpy as np

from connectors._save_writer import CopiedOut, SaveDropped, SaveWriter
from tests.kvstore.store_helpers import until


def test_a_save_is_stored_only_once_its_copy_is_done():
    copy_done, written = threading.Event(), []
    saves = SaveWriter(lambda hashes, payloads, parent: written.extend(hashes))
    saves.save([b"a"], 8, lambda: CopiedOut([np.zeros(8, np.uint8)], lambda: copy_done.wait(10)), None)
    time.sleep(0.1)
    assert written == [], "not stored while the copy is in flight"
    copy_done.set()
    saves.flush()
    assert written == [b"a"]
    saves.close()


def test_a_copy_that_fails_fails_its_save_and_never_raises_into_the_engine(caplog):
    """A device out of memory while copying, or a copy that fails later: counted, logged, dropped."""
    written = []

    def out_of_memory():
        raise RuntimeError("CUDA out of memory")

    def failed_wait():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    saves = SaveWriter(lambda hashes, payloads, parent: written.extend(hashes), max_pending_bytes=100)
    with caplog.at_level(logging.WARNING, logger="connectors"):
        saves.save([b"a"], 80, out_of_memory, None)
        saves.save([b"b"], 80, lambda: CopiedOut([np.zeros(80, np.uint8)], failed_wait), None)
        saves.flush()
        saves.save([b"c"], 80, lambda: CopiedOut([np.zeros(80, np.uint8)]), None)
        saves.flush()
    assert written == [b"c"] and saves.failed_saves == 2 and saves.dropped_blocks == 0, \
        "the failed copies' bytes no longer count against the bound"
    assert [str(r.exc_info[1]) for r in caplog.records if r.exc_info] == ["CUDA out of memory"], \
        "the first failure of the run with its traceback"
    saves.wait_copied()  # the engine waits for the failed copy before reusing its pages: no exception
    saves.close()


def test_a_save_that_would_be_dropped_is_never_copied():
    unstick, copies = threading.Event(), []
    saves = SaveWriter(lambda hashes, payloads, parent: unstick.wait(30), max_pending_bytes=100)

    def copy(name):
        copies.append(name)
        return CopiedOut([np.zeros(80, np.uint8)])

    saves.save([b"a"], 80, lambda: copy("a"), None)
    saves.save([b"b"], 80, lambda: copy("b"), None)  # a is pending: b does not fit
    assert copies == ["a"] and saves.dropped_blocks == 1
    unstick.set()
    saves.close()
    saves.save([b"c"], 80, lambda: copy("c"), None)
    assert copies == ["a"] and saves.dropped_blocks == 2, "nor is a save after close"


def test_wait_copied_waits_for_every_copy_taken_since_the_last_wait_once():
    waited = []
    saves = SaveWriter(lambda hashes, payloads, parent: None)
    for name in ("a", "b"):
        saves.save([name.encode()], 8, lambda name=name: CopiedOut([np.zeros(8, np.uint8)],
                                                                    lambda: waited.append(name)), None)
    saves.flush()  # the writer waited for each copy before writing it
    waited.clear()
    saves.wait_copied()
    assert sorted(waited) == ["a", "b"]
    saves.wait_copied()
    assert sorted(waited) == ["a", "b"], "a copy waited for is not waited for again"
    saves.close()


def test_saves_beyond_the_pending_bound_are_dropped_until_the_store_catches_up(caplog):
    """A store that stops keeping up must not grow the engine's memory without bound."""
    unstick, written = threading.Event(), []

    def write(hashes, payloads, parent):
        unstick.wait(30)
        written.extend(hashes)

    saves = SaveWriter(write, max_pending_bytes=3000)
    block = [np.zeros(1000, np.uint8)]
    with caplog.at_level(logging.INFO, logger="connectors"):
        for i in range(10):  # the first is being written (stuck), two more wait, the rest do not fit
            saves.put([bytes([i])], block, None)
        assert saves.dropped_blocks == 7
        unstick.set()
        saves.flush()
        assert written == [bytes([0]), bytes([1]), bytes([2])]
        saves.put([b"x"], block, None)
        saves.flush()
    assert written[-1] == b"x", "saves resume once the store caught up"
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "not keeping up" in warnings[0].getMessage()
    assert any("caught up" in r.getMessage() for r in caplog.records)
    saves.close()


def test_a_run_of_failing_saves_logs_one_traceback_and_says_how_many_failed_once_saving_works(caplog):
    """A store closed under a busy engine failed every save, each with a traceback."""
    broken, written = [True], []

    def write(hashes, payloads, parent):
        if broken[0]:
            raise RuntimeError("the store is closed")
        written.extend(hashes)

    saves = SaveWriter(write)
    with caplog.at_level(logging.DEBUG, logger="connectors"):
        for i in range(50):
            saves.put([bytes([i])], [np.zeros(10, np.uint8)], None)
        saves.flush()
        broken[0] = False
        saves.put([b"x"], [np.zeros(10, np.uint8)], None)
        saves.flush()
    assert saves.failed_saves == 50 and written == [b"x"]
    loud = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(loud) == 1 and loud[0].exc_info is not None, "one traceback for the run"
    assert sum(r.levelno == logging.DEBUG and r.exc_info is not None for r in caplog.records) == 49
    assert any("saving works again; 50 saves failed meanwhile" in r.getMessage() for r in caplog.records)
    saves.close()


def test_one_save_larger_than_the_bound_still_goes():
    written = []
    saves = SaveWriter(lambda hashes, payloads, parent: written.extend(hashes), max_pending_bytes=10)
    saves.put([b"a"], [np.zeros(100, np.uint8)], None)
    saves.flush()
    assert written == [b"a"] and saves.dropped_blocks == 0
    saves.close()


def test_a_save_after_close_is_dropped_and_counted_and_flush_does_not_hang(caplog):
    """Before, it was queued for the ended thread: never written, and the next flush waited forever."""
    written = []
    saves = SaveWriter(lambda hashes, payloads, parent: written.extend(hashes))
    saves.put([b"a"], [np.zeros(8, np.uint8)], None)
    saves.close()
    with caplog.at_level("WARNING"):
        saves.put([b"b", b"c"], [np.zeros(8, np.uint8)] * 2, None)
        saves.put([b"d"], [np.zeros(8, np.uint8)], None)
    flushed = threading.Thread(target=saves.flush, daemon=True)
    flushed.start()
    flushed.join(5)
    assert not flushed.is_alive(), "flush after close returned"
    assert written == [b"a"] and saves.dropped_blocks == 3
    assert sum("after the connector was closed" in r.getMessage() for r in caplog.records) == 1
    saves.close()  # again: nothing to do


def test_a_save_the_write_dropped_and_reported_is_counted_without_a_traceback(caplog):
    """A sidecar not answering: its session warns once; before, such saves counted as written."""
    down = [True]

    def write(hashes, payloads, parent):
        if down[0]:
            raise SaveDropped("the sidecar did not answer")

    saves = SaveWriter(write)
    with caplog.at_level(logging.DEBUG, logger="connectors"):
        for i in range(3):
            saves.put([bytes([i])], [np.zeros(8, np.uint8)], None)
        saves.flush()
        down[0] = False
        saves.put([b"x"], [np.zeros(8, np.uint8)], None)
        saves.flush()
    assert saves.failed_saves == 3
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], "the write said why already"
    assert any("saving works again; 3 saves failed meanwhile" in r.getMessage() for r in caplog.records)
    saves.close()


def test_a_second_close_returns_only_once_the_first_has_written_everything():
    release, written = threading.Event(), []

    def write(hashes, payloads, parent):
        release.wait(10)
        written.extend(hashes)

    saves = SaveWriter(write)
    saves.put([b"a"], [np.zeros(8, np.uint8)], None)
    first = threading.Thread(target=saves.close)
    first.start()
    assert until(lambda: saves._closed)
    second = threading.Thread(target=saves.close)
    second.start()
    second.join(0.2)
    assert second.is_alive(), "the second close waits for the first"
    release.set()
    first.join(5)
    second.join(5)
    assert not second.is_alive() and written == [b"a"]
