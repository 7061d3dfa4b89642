"""Segment files: owned while their process lives; a dead owner's file is swept, a live one's never."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from kvstore.tiers import shm_segment
from kvstore.tiers.shm_segment import NoSpaceForSegment, Segment, remove_stale_segments

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def age(path: str, seconds: float) -> None:
    past = time.time() - seconds
    os.utime(path, (past, past))


def test_a_sigkilled_owners_segment_is_removed_and_a_live_ones_is_kept(tmp_path):
    owner = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from kvstore.tiers.shm_segment import Segment
        segment = Segment(1 << 16, {str(tmp_path)!r}, kind="staging")
        print(segment.path, flush=True)
        time.sleep(60)
    """)], stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": REPO})
    dead_path = owner.stdout.readline().strip()
    live = Segment(1 << 16, str(tmp_path))
    try:
        assert remove_stale_segments(str(tmp_path)) == [], "the owner is alive: its lock holds"
        owner.send_signal(signal.SIGKILL)
        owner.wait(10)
        assert os.path.exists(dead_path), "SIGKILL left the file behind"
        # at once, not after a grace period: a sidecar restarted right away must not find its
        # predecessor's arena still there and allocate a second one beside it
        assert remove_stale_segments(str(tmp_path)) == [dead_path]
        assert not os.path.exists(dead_path) and os.path.exists(live.path)
    finally:
        owner.kill() if owner.poll() is None else None
        live.close()
    assert not os.path.exists(live.path)


def test_a_segment_name_appears_only_once_its_file_is_locked(tmp_path):
    segment = Segment(1 << 16, str(tmp_path))
    try:
        assert os.listdir(tmp_path) == [os.path.basename(segment.path)], "no hidden file left behind"
        assert remove_stale_segments(str(tmp_path)) == []
    finally:
        segment.close()
    assert os.listdir(tmp_path) == []


def test_young_files_being_created_and_other_names_are_left_alone(tmp_path):
    young = tmp_path / ".kvstore-creating-123-0123abcd"
    young.write_bytes(b"")  # no owner, but it may be between create and lock
    other = tmp_path / "not-ours-123"
    other.write_bytes(b"x")
    age(str(other), 3600)
    assert remove_stale_segments(str(tmp_path)) == []
    age(str(young), shm_segment.STALE_AFTER_S + 1)
    assert remove_stale_segments(str(tmp_path)) == [str(young)]
    assert other.exists()


def sweep_in_a_process(directory: str) -> subprocess.CompletedProcess:
    """``remove_stale_segments(directory)`` in a child, so a sweep that blocks fails the test instead
    of hanging it."""
    code = f"from kvstore.tiers.shm_segment import remove_stale_segments; print(remove_stale_segments({directory!r}))"
    try:
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=20,
                              env={**os.environ, "PYTHONPATH": REPO})
    except subprocess.TimeoutExpired:
        raise AssertionError("the sweep blocked (opened a FIFO without O_NONBLOCK?)") from None


def test_entries_under_segment_names_that_are_no_files_of_ours_are_skipped_never_waited_on(tmp_path):
    """Anyone may create entries in the world-writable /dev/shm: a FIFO once hung the sweep (and so the
    sidecar's start) for ever, a directory aborted it with IsADirectoryError."""
    os.mkfifo(tmp_path / "kvstore-1-0000f1f0")
    os.mkdir(tmp_path / "kvstore-2-000000d1")
    os.symlink(tmp_path / "elsewhere", tmp_path / "kvstore-3-0000071e")
    (tmp_path / "elsewhere").write_bytes(b"")
    theirs = tmp_path / "kvstore-4-0000be17"
    theirs.write_bytes(b"")
    if os.geteuid() == 0:
        os.chown(theirs, 65534, 65534)  # nobody's: root may open it, but it is not ours to remove
    stale = tmp_path / "kvstore-5-00005a1e"
    stale.write_bytes(b"")  # ours, unlocked: the one entry to remove
    done = sweep_in_a_process(str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == repr([str(stale)])
    assert sorted(os.listdir(tmp_path)) == ["elsewhere", "kvstore-1-0000f1f0", "kvstore-2-000000d1",
                                            "kvstore-3-0000071e", "kvstore-4-0000be17"]


def test_a_segment_the_directory_cannot_hold_is_refused_at_creation_naming_the_room_and_leaves_nothing(small_tmpfs):
    """ftruncate reserves nothing on tmpfs: a segment larger than the room left was created, and its
    owner (or a client writing into it) died of SIGBUS at the first write past the room."""
    directory = small_tmpfs(1 << 20)
    with pytest.raises(NoSpaceForSegment) as refused:
        Segment(2 << 20, directory)
    assert f"cannot reserve {2 << 20} bytes of shared memory in {directory}: {1 << 20} bytes are free" \
        in str(refused.value)
    assert "lower the host tier or staging capacity" in str(refused.value)
    assert os.listdir(directory) == [], "the partly created file is removed"
    first = Segment(768 << 10, directory)
    try:
        first.mmap[:] = b"\xab" * (768 << 10)  # every byte backed: no SIGBUS
        with pytest.raises(NoSpaceForSegment, match=f"{256 << 10} bytes are free"):
            Segment(768 << 10, directory)  # the first one's room is taken, though not yet all written
        assert os.listdir(directory) == [os.path.basename(first.path)]
    finally:
        first.close()
