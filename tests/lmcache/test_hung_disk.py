"""The plugin over a sidecar that answers while its disk hangs: a real sidecar (``create_server``
over a real host and disk store, in this process: ``tests.connectors.sidecar_server``) whose disk
tier's reads wait while a file exists, which the LMCache engine process (``fault_worker.py``'s
``hung_disk``) creates and removes."""

from __future__ import annotations

import os
import time

import pytest

from kvstore.store import TieredStore
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.host import HostTier
from tests.connectors.sidecar_server import Sidecar
from tests.lmcache.conftest import FAULT_WORKER, run_engine

HANG_LIMIT_S = 30  # a stalled read goes on by itself after this (a scenario that failed midway)


def stall_reads_while(tier, path: str) -> None:
    """``tier``'s reads wait while ``path`` exists, as a disk that stops answering; then read."""
    read = tier.read

    def stalled(*args, **kwargs):
        deadline = time.monotonic() + HANG_LIMIT_S
        while os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.01)
        return read(*args, **kwargs)

    tier.read = stalled


@pytest.fixture
def hanging_disk_sidecar(tmp_path):
    """A sidecar whose host tier holds two of the scenarios' chunks (a 5.0 MB block each: two pages
    of 5 MiB), over a disk whose reads hang while the file it yields exists."""
    hang_file = str(tmp_path / "hang")
    store = TieredStore([HostTier(10 << 20, page_bytes=5 << 20, shm_dir=str(tmp_path)),
                         DiskTier(str(tmp_path / "disk"), 64 << 20, segment_bytes=8 << 20)],
                        policy="lru", background_writes=False)
    stall_reads_while(store.tiers[1], hang_file)
    sidecar = Sidecar(store, staging=False)  # its staging pages (1 MiB) fit no chunk: puts go by Put
    yield sidecar, hang_file
    if os.path.exists(hang_file):  # a scenario that failed midway: let the stalled reads finish
        os.remove(hang_file)
    sidecar.stop()
    store.close()


def test_a_hung_disk_costs_one_get_a_deadline_then_hits_stop_at_host_memory_until_a_probe_answers(
        lmcache_py, hanging_disk_sidecar):
    """Before, the Get of a disk block that ran past its deadline counted as the whole sidecar not
    answering: for the session's back-off every get and lookup was a miss, host-memory hits too,
    and after it every get of the prompt waited out the deadline on the disk again."""
    sidecar, hang_file = hanging_disk_sidecar
    result = run_engine(lmcache_py, FAULT_WORKER, scenario="hung_disk", address=sidecar.target, sidecar_pid=0,
                        hang_file=hang_file)
    window, after = result["window"], result["after"]

    assert result["tiers"] == ["host", "host", "disk", "disk"]
    objs, seconds = result["first"]
    assert objs == 2, "the chunks in host memory are served by the get that hung on the disk"
    assert 0.9 <= seconds < 2.5, "it waited one deadline (timeout_s, 1 s) for the disk, not more"

    assert window["contains"][0] == 2, "lookups stop at host memory: LMCache plans no get that would hang"
    assert window["get"] == [2, pytest.approx(0, abs=0.5)], "host-memory hits are served, at once"
    retrieve, seconds = window["retrieve"]
    assert retrieve == {"retrieved": 512, "exact": True} and seconds < 2
    assert window["later_get"] == [2, pytest.approx(0, abs=0.5)], "past the session's back-off: no second hang"
    assert window["later_contains"][0] == 2
    counts = result["window_counts"]
    assert counts["hung_below_memory"] == 1
    assert counts["cut_below_memory"] >= 4 and counts["lookup_cut_below_memory"] >= 4
    assert "call_failures" not in counts, "the sidecar answered all along"

    assert after["contains"][0] == 4, "after the window a lookup counts the disk's chunks again"
    retrieve, seconds = after["retrieve"]
    assert retrieve == {"retrieved": 1024, "exact": True}, "and the request's get reads the disk: the probe"
    assert seconds < 2
    assert after["contains_again"][0] == 4, "the probe answered in time: the window is closed"
    assert after["retrieve_again"][0] == {"retrieved": 1024, "exact": True}
    assert result["counts"]["hung_below_memory"] == 1
    assert "call_failures" not in result["counts"]
    assert result["active_objects"] == 0
