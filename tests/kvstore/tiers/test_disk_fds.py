"""Disk tier under an open-files limit (RLIMIT_NOFILE, set in a real child process): a tier holds
one descriptor per segment file, raises its soft limit to the hard one when it opens, and a
segment it cannot open for want of descriptors is a rejected write, never an exception."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from kvstore.tiers import disk
from kvstore.tiers.disk import DiskTier
from tests.kvstore.tiers.disk_helpers import FP, REPO, put

_CHILD = textwrap.dedent("""
    import json, os, resource, sys
    from kvstore.tiers.disk import DiskTier
    from tests.kvstore.tiers.disk_helpers import FP, key_of, put, reads_exact

    path, soft, hard, blocks = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    tier = DiskTier(path, 1 << 30, segment_bytes=2 * FP)
    report = {"limit": resource.getrlimit(resource.RLIMIT_NOFILE)[0], "open": tier.stats().blocks}
    report["writes"] = [put(tier, i) for i in range(report["open"], report["open"] + blocks)]
    report["io_errors"] = tier.stats().io_errors
    report["reads"] = all(reads_exact(tier, i) for i in range(tier.stats().blocks))
    tier.check_integrity()
    for i in range(8):  # four sealed segments die and give their descriptors back
        assert tier.remove(key_of(i))
    report["after_removals"] = put(tier, 100_000)
    tier.close()
    print(json.dumps(report))
""")


def _run(path, soft: int, hard: int, blocks: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _CHILD, str(path), str(soft), str(hard), str(blocks)],
                          capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": REPO})


def _child(path, soft: int, hard: int, blocks: int) -> dict:
    done = _run(path, soft, hard, blocks)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def test_a_tier_of_many_segments_opens_under_a_low_soft_limit(tmp_path, open_tier):
    """200 segments: before, two descriptors each (three for the active one) and the soft limit
    as it was, so the reopen failed with 'Too many open files'."""
    tier = open_tier(tmp_path / "disk", capacity=1 << 30, segment_bytes=2 * FP)
    for i in range(400):
        assert put(tier, i)
    assert tier.stats().extra["segments"] == 200
    tier.close()
    report = _child(tmp_path / "disk", 64, 256, 2)
    assert report["limit"] == 256 and report["open"] == 400
    assert report["writes"] == [True, True] and report["reads"] and report["after_removals"]
    refused = _run(tmp_path / "disk", 128, 128, 0)  # a hard limit too low: the open says what to change
    assert refused.returncode != 0
    assert "segment files and keeps one descriptor open per file" in refused.stderr
    assert "raise the limit (ulimit -Hn, systemd LimitNOFILE) or use larger segments" in refused.stderr


def test_a_segment_that_cannot_be_opened_for_want_of_descriptors_is_a_rejected_write(tmp_path):
    """Before, the EMFILE of opening the next segment escaped DiskTier.write (and TieredStore.put)."""
    report = _child(tmp_path / "disk", 128, 128, 400)
    stored = report["writes"].index(False)
    assert 100 < stored and report["writes"] == [True] * stored + [False] * (400 - stored)
    assert report["io_errors"] == 400 - stored and report["reads"] and report["after_removals"]


def test_an_open_that_fails_late_keeps_no_segment_open(tmp_path, open_tier, monkeypatch):
    """An open failing after recovery (here the last step) let the directory go but kept the active
    segment's descriptor for as long as anything referenced the half-opened tier (the exception's
    traceback does)."""
    tier = open_tier()
    assert put(tier, 0) and put(tier, 1)
    tier.close()

    def fails(path, capacity_bytes):
        raise OSError(5, "injected: the last step of the open failed")

    monkeypatch.setattr(disk, "warn_if_oversized", fails)
    segments = str(tmp_path / "disk" / "segments")
    with pytest.raises(OSError, match="injected") as caught:
        DiskTier(str(tmp_path / "disk"), 64 << 20)
    assert caught.traceback  # the half-opened tier is still referenced from here
    assert not [fd for fd in os.listdir("/proc/self/fd") if _points_into(fd, segments)]


def _points_into(fd: str, directory: str) -> bool:
    try:
        return os.readlink(f"/proc/self/fd/{fd}").startswith(directory)
    except FileNotFoundError:  # the listing's own descriptor, closed meanwhile
        return False
