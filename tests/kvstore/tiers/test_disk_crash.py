"""Disk tier under real process failure: a full disk (RLIMIT_FSIZE) and SIGKILL at the index commit
or at random times, in real child processes; the reopened tier serves only complete blocks."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from kvstore.tiers.disk import DiskTier

from tests.kvstore.tiers.disk_helpers import (
    REPO, NBYTES, FP, key_of, index_of, put, reads_exact,
)


# ---- real processes: full disk, SIGKILL ------------------------------------------------------

_PRELUDE = textwrap.dedent(
    """
    import hashlib, json, os, random, resource, signal, sys, time
    sys.path.insert(0, os.environ["KVSTORE_REPO"])
    import numpy as np
    from kvstore.checksum import layer_checksums
    from kvstore.tiers.base import BlockMeta
    from kvstore.tiers.disk import DiskTier

    def key_of(i):
        return i.to_bytes(8, "little") + hashlib.blake2b(i.to_bytes(8, "little"), digest_size=24).digest()

    def payload_of(i, nbytes):
        return np.random.default_rng(i).integers(0, 256, nbytes, dtype=np.uint8)

    def put(tier, i, nbytes, layers=4):
        p = payload_of(i, nbytes)
        return tier.write(key_of(i), p, BlockMeta(p.nbytes, layers, layer_checksums(p, layers), None))
    """
)


def run_child(body: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", _PRELUDE + textwrap.dedent(body), *args],
        capture_output=True, text=True, timeout=timeout, env={**os.environ, "PYTHONPATH": REPO, "KVSTORE_REPO": REPO},
    )


def test_full_disk_efbig_fails_writes_cleanly(tmp_path, open_tier):
    body = """
    path, nbytes, fp = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # so pwrite fails with EFBIG instead of killing us
    tier = DiskTier(path, 64 << 20, segment_bytes=64 << 20)
    for i in range(3):
        assert put(tier, i, nbytes)
    limit = 5 * fp + fp // 2  # room for two more records, then the third is cut part way
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    results = [put(tier, i, nbytes) for i in range(3, 8)]
    seg = os.path.join(path, "segments", "00000001.seg")
    report = {"results": results, "io_errors": tier.stats().io_errors, "size": os.path.getsize(seg),
              "blocks": tier.stats().blocks, "used": tier.used_bytes}
    tier.check_integrity()
    dst = np.empty(nbytes, np.uint8)
    report["reads"] = [bool(tier.read(key_of(i), dst)) and bool(np.array_equal(dst, payload_of(i, nbytes)))
                       for i in range(8)]
    tier.remove(key_of(0))
    report["after_remove"] = put(tier, 8, nbytes)  # still too big for the file-size limit
    tier.check_integrity()
    report["integrity"] = True
    tier.close()
    print(json.dumps(report))
    """
    path = str(tmp_path / "disk")
    result = run_child(body, path, str(NBYTES), str(FP))
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["results"] == [True, True, False, False, False]
    assert report["io_errors"] == 3
    assert report["size"] == 5 * FP  # the partial record was cut back off
    assert report["blocks"] == 5 and report["used"] == 5 * FP
    assert report["reads"] == [True] * 5 + [False] * 3
    assert report["after_remove"] is False and report["integrity"] is True
    # without the limit, the directory reopens cleanly and takes writes again
    tier = open_tier(path)
    assert {index_of(k) for k, _ in tier.items()} == {1, 2, 3, 4}
    assert all(reads_exact(tier, i) for i in (1, 2, 3, 4))
    tier.check_integrity()
    assert put(tier, 5) and reads_exact(tier, 5)
    tier.check_integrity()


_KILL_AT_INDEX_COMMIT = """
path, nbytes = sys.argv[1], int(sys.argv[2])
tier = DiskTier(path, 64 << 20, segment_bytes=64 << 20)
for i in range(5):
    assert put(tier, i, nbytes)

class KillAtCommit:
    # the record's bytes are in the segment when the index batch is written: die right there
    def __init__(self, db):
        self._db = db
    def write(self, *args, **kwargs):
        seg = os.path.join(path, "segments", "00000001.seg")
        print(json.dumps({"size_at_commit": os.path.getsize(seg)}), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    def __getattr__(self, name):
        return getattr(self._db, name)

tier._db = KillAtCommit(tier._db)
put(tier, 5, nbytes)
print("survived", flush=True)
"""

_KILL_MID_RECORD = """
path, nbytes = sys.argv[1], int(sys.argv[2])
tier = DiskTier(path, 64 << 20, segment_bytes=64 << 20)
for i in range(5):
    assert put(tier, i, nbytes)
real_pwritev = os.pwritev

def torn_pwritev(fd, buffers, offset):
    # every append (buffered; O_DIRECT in place or through the bounce buffer): only its first two
    # pages, the header and the payload's first page, aligned for either
    first, left = [], 8192
    for buffer in buffers:
        first.append(memoryview(buffer).cast("B")[:left])
        left -= len(first[-1])
    real_pwritev(fd, [b for b in first if len(b)], offset)
    print(json.dumps({"size_at_commit": os.fstat(fd).st_size}), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)

os.pwritev = torn_pwritev
put(tier, 5, nbytes)
print("survived", flush=True)
"""

# the same with page-aligned payloads, which O_DIRECT writes in place (one pwritev, no bounce copy)
_KILL_MID_RECORD_IN_PLACE = """
from kvstore.buffers import aligned_empty
unaligned_payload_of = payload_of

def payload_of(i, nbytes):
    aligned = aligned_empty(nbytes)
    aligned[:] = unaligned_payload_of(i, nbytes)
    return aligned
""" + _KILL_MID_RECORD
_KILLS = [_KILL_AT_INDEX_COMMIT, _KILL_MID_RECORD, _KILL_MID_RECORD_IN_PLACE]
_KILL_IDS = ["at_index_commit", "mid_record", "mid_record_in_place"]


@pytest.mark.parametrize("script", _KILLS, ids=_KILL_IDS)
def test_sigkill_before_the_index_commit(tmp_path, open_tier, script):
    path = str(tmp_path / "disk")
    result = run_child(script, path, str(NBYTES))
    assert result.returncode == -signal.SIGKILL, result.stderr
    assert "survived" not in result.stdout
    size_at_kill = json.loads(result.stdout.splitlines()[0])["size_at_commit"]
    assert size_at_kill > 5 * FP  # the uncommitted record's bytes really were on disk

    tier = open_tier(path, segment_bytes=64 << 20)
    stats = tier.stats()
    assert stats.extra["recovered_truncated_bytes"] == size_at_kill - 5 * FP > 0
    assert {index_of(k) for k, _ in tier.items()} == {0, 1, 2, 3, 4}
    assert all(reads_exact(tier, i) for i in range(5))
    assert not tier.contains(key_of(5))
    assert os.path.getsize(os.path.join(path, "segments", "00000001.seg")) == 5 * FP
    tier.check_integrity()
    for i in range(5, 9):
        assert put(tier, i)
    assert all(reads_exact(tier, i) for i in range(9))
    tier.check_integrity()
    tier.close()
    tier = open_tier(path, segment_bytes=64 << 20)
    assert tier.stats().extra["recovered_truncated_bytes"] == 0
    assert all(reads_exact(tier, i) for i in range(9))
    tier.check_integrity()


@pytest.mark.parametrize("script", _KILLS, ids=_KILL_IDS)
def test_sigkill_then_lost_index_rebuilds_from_what_is_complete(tmp_path, open_tier, script):
    """A crash, then the index is lost too: the rebuild keeps complete records only."""
    path = str(tmp_path / "disk")
    result = run_child(script, path, str(NBYTES))
    assert result.returncode == -signal.SIGKILL, result.stderr
    size_at_kill = json.loads(result.stdout.splitlines()[0])["size_at_commit"]
    shutil.rmtree(os.path.join(path, "index"))
    tier = open_tier(path, segment_bytes=64 << 20)
    stats = tier.stats()
    assert stats.extra["index_rebuilds"] == 1
    if script is _KILL_AT_INDEX_COMMIT:
        # the record was whole and verifies: keeping it is correct (it is block 5's own bytes)
        assert {index_of(k) for k, _ in tier.items()} == set(range(6))
        assert stats.extra["recovered_truncated_bytes"] == 0
    else:
        assert {index_of(k) for k, _ in tier.items()} == set(range(5))
        assert stats.extra["recovered_truncated_bytes"] == size_at_kill - 5 * FP > 0
    assert all(reads_exact(tier, index_of(k)) for k, _ in tier.items())
    tier.check_integrity()
    assert put(tier, 100) and reads_exact(tier, 100)
    tier.check_integrity()


_STREAM = """
path, start = sys.argv[1], int(sys.argv[2])
sizes = [12288, 10000, 24000, 60000]
durable = sys.argv[3] == "1"
tier = DiskTier(path, 2 << 20, segment_bytes=256 << 10, durable=durable)
rng = random.Random(start)
live = [int.from_bytes(k[:8], "little") for k, _ in tier.items()]
print("ready", flush=True)
i = start
while True:
    nbytes = sizes[i % 4]
    while not put(tier, i, nbytes):
        victim = live.pop(rng.randrange(len(live)))
        assert tier.remove(key_of(victim))
    live.append(i)
    if rng.random() < 0.2 and live:
        tier.remove(key_of(live.pop(rng.randrange(len(live)))))
    i += 1
"""


def _check_stream_survivor(path: str) -> int:
    sizes = [12288, 10000, 24000, 60000]
    tier = DiskTier(path, 2 << 20, segment_bytes=256 << 10)
    try:
        keys = [k for k, _ in tier.items()]
        for key in keys:
            i = index_of(key)
            assert key == key_of(i), "the index holds a key nobody wrote"
            assert reads_exact(tier, i, sizes[i % 4]), f"committed block {i} did not read back"
        stats = tier.stats()
        assert stats.checksum_failures == 0 and stats.io_errors == 0
        assert tier.used_bytes <= tier.capacity_bytes
        tier.check_integrity()
        return len(keys)
    finally:
        tier.close()


@pytest.mark.parametrize("durable", [False, True])
def test_sigkill_at_random_times_during_a_stream_of_writes(tmp_path, durable):
    path = str(tmp_path / "disk")
    seed = int.from_bytes(os.urandom(4), "little")
    rng = random.Random(seed)
    survivors = []
    for round_ in range(3):
        child = subprocess.Popen(
            [sys.executable, "-c", _PRELUDE + textwrap.dedent(_STREAM), path, str(round_ * 1_000_000), "1" if durable else "0"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": REPO, "KVSTORE_REPO": REPO},
        )
        try:
            assert child.stdout.readline().strip() == "ready", child.stderr.read()
            time.sleep(rng.uniform(0.05, 0.5))
            assert child.poll() is None, f"stream child died on its own (seed {seed}): {child.stderr.read()}"
            child.send_signal(signal.SIGKILL)
            child.wait(30)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
            child.stdout.close()
            child.stderr.close()
        assert child.returncode == -signal.SIGKILL
        survivors.append(_check_stream_survivor(path))
    assert all(n > 0 for n in survivors), f"seed {seed}: {survivors}"
