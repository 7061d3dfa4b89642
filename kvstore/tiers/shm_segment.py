"""Shared-memory segment files: created, mapped and owned by one process; stale ones swept.

A segment is a file under /dev/shm (any tmpfs) named ``kvstore-[KIND-]PID-RANDOM``, mapped
shared so other processes on the host can map the same bytes. Its owner holds a shared
``flock`` on it for as long as it lives; a process killed with SIGKILL cannot unlink its
segment, but the kernel drops its lock, so ``remove_stale_segments`` can tell a dead owner's file
(the exclusive lock is free) from a live one's, across pid namespaces (containers sharing
/dev/shm) where pids say nothing.

The owner creates the file under a hidden name (``.kvstore-creating-...``), locks it, and only
then renames it to its segment name, so a file under a segment name is locked from the moment it
can be seen. A sidecar killed and restarted at once (a container restart policy) therefore finds
its predecessor's arena stale right away instead of allocating a second one beside it. Only the
empty hidden files of an owner killed between create and rename wait ``STALE_AFTER_S``.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import re
import stat
import time
import uuid

from kvstore.errors import InvalidRequest

SEGMENT_NAME = re.compile(r"^kvstore-(?:[a-z]+-)?\d+-[0-9a-f]{8}$")
CREATING_NAME = re.compile(r"^\.kvstore-creating-\d+-[0-9a-f]{8}$")
STALE_AFTER_S = 60.0  # a younger hidden file may belong to an owner between create and lock

log = logging.getLogger(__name__)


class NoSpaceForSegment(InvalidRequest):
    """The shared-memory directory cannot hold a new segment of the size asked (a configuration
    that does not fit this host); the message names the directory, the bytes needed and free."""


def default_shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"


class Segment:
    """A new segment file of ``nbytes`` in ``shm_dir``, mapped read-write and locked as owned.

    Creating one first sweeps ``shm_dir`` of stale segments (``remove_stale_segments``), so every
    process that maps an arena, sidecar or in-process store alike, cleans up after dead ones.

    Its ``nbytes`` are reserved in the directory at creation (``posix_fallocate``): a directory that
    cannot hold them raises ``NoSpaceForSegment`` and keeps no file, so a segment never turns into a
    SIGBUS on a later write. ``prefault`` also maps every page now (doing it at start keeps that cost
    off the write path). ``close`` unmaps, unlocks and unlinks it.
    """

    def __init__(self, nbytes: int, shm_dir: str | None = None, kind: str = "", name: str | None = None,
                 prefault: bool = False):
        assert nbytes > 0, f"a segment of {nbytes} bytes: its owner checks its capacity first (bug)"
        prefix = f"kvstore-{kind}-" if kind else "kvstore-"
        directory = shm_dir or default_shm_dir()
        remove_stale_segments(directory)  # a dead owner's arena would hold memory this one may need
        self.path = os.path.join(directory, name or f"{prefix}{os.getpid()}-{uuid.uuid4().hex[:8]}")
        self._fd = _create_locked(directory, self.path)
        try:
            os.ftruncate(self._fd, nbytes)
            os.posix_fallocate(self._fd, 0, nbytes)  # tmpfs reserves nothing on ftruncate: a write past
            # the room left would be a SIGBUS, in this process or in any client that maps the file
            flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if prefault else 0)
            self.mmap = mmap.mmap(self._fd, nbytes, flags=flags)
        except BaseException as exc:
            os.close(self._fd)
            os.unlink(self.path)
            if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
                raise NoSpaceForSegment(_no_space(directory, nbytes)) from None
            raise

    def close(self) -> None:
        """Unmap (unless a view is still held: then the mapping goes with it), unlink, unlock."""
        try:
            self.mmap.close()
        except BufferError:
            pass
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        os.close(self._fd)


def _create_locked(directory: str, path: str) -> int:
    """A new empty file at ``path`` holding its owner's shared lock from the moment it is visible
    there (made under a hidden name, locked, then renamed); returns its descriptor."""
    creating = os.path.join(directory, f".kvstore-creating-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    fd = os.open(creating, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        _rename_new(creating, path)
    except BaseException:
        os.close(fd)
        os.unlink(creating)
        raise
    return fd


def _no_space(directory: str, nbytes: int) -> str:
    """What to tell an operator whose shared-memory directory cannot hold ``nbytes`` more."""
    info = os.statvfs(directory)
    return (f"cannot reserve {nbytes} bytes of shared memory in {directory}: {info.f_bavail * info.f_frsize} "
            f"bytes are free there. Free space in {directory} (a process that still maps a removed segment "
            "holds its memory until it unmaps it), lower the host tier or staging capacity (--host-capacity "
            "or KVSTORE_HOST_CAPACITY, --staging-capacity or KVSTORE_STAGING_BYTES), or point KVSTORE_SHM_DIR "
            "at a larger tmpfs (in a container: a larger --shm-size)")


def _rename_new(source: str, target: str) -> None:
    """Rename ``source`` to ``target``, failing if ``target`` exists (as O_EXCL would)."""
    os.link(source, target)  # atomic, and unlike rename it never replaces an existing file
    os.unlink(source)


def remove_stale_segments(shm_dir: str | None = None) -> list[str]:
    """Unlink segment files no live process owns (their owner died without cleaning up); returns them.

    Only regular files of this user are candidates: anything else under a segment name (a FIFO, a
    directory, a link, another user's file; anyone may create them in /dev/shm) is left alone,
    and never opened in a way that could block. A file that cannot be unlinked is logged and kept.
    """
    directory = shm_dir or default_shm_dir()
    removed = []
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if SEGMENT_NAME.match(name) and _is_stale(path, grace_s=0.0) or \
                CREATING_NAME.match(name) and _is_stale(path, grace_s=STALE_AFTER_S):
            try:
                os.unlink(path)
                removed.append(path)
                log.warning("removed the stale shared-memory segment %s of a dead process", path)
            except FileNotFoundError:
                pass
            except OSError as exc:
                log.warning("cannot remove the stale shared-memory segment %s: %s", path, exc.strerror)
    return removed


def _is_stale(path: str, grace_s: float) -> bool:
    """Whether ``path`` is a file of ours, older than ``grace_s``, whose owner's lock is gone."""
    try:
        if not _ours(os.lstat(path)):
            return False
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        info = os.fstat(fd)  # again: the entry may have been replaced since the lstat
        if not _ours(info) or grace_s and time.time() - info.st_mtime < grace_s:
            return False
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True  # nobody holds the owner's shared lock
    except BlockingIOError:
        return False
    finally:
        os.close(fd)  # also drops our lock


def _ours(info: os.stat_result) -> bool:
    return stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid()
