"""The sidecar's native data plane: the bytes path across hosts, in C++ (``dataplane_native/``).

Python's gRPC tops out near 0.4x a raw loopback TCP stream here however it is tuned (README,
"Sidecar benchmark"), so payload bytes bound for another host leave through a second, native
gRPC server in the sidecar process, the ``kvstore.v1.BlockData`` service:

    GetSlots (Python, control)   leases the hit and, when the data plane runs, registers a grant:
                                 a random token naming the leased slots' regions of the host
                                 tier's segment, ending 50 ms before the lease's TTL
    ReadSlots (C++, data)        presents the token and a range of its slots; their bytes stream
                                 back in order, each chunk copied out of the mapped segment under
                                 the grant's lock after checking it is live; a stream that waits on
                                 its client for stream_idle_timeout_s, or longer in all than its
                                 bytes pay for at min_stream_bytes_per_s, is ended, as Get's is, and
                                 a connection without a stream that long is closed
    Release (Python, control)    revokes the grant (a running stream stops), then ends the lease;
                                 NOT_FOUND means the lease expired and the copies must be
                                 discarded (as for shm)

A listener that stops accepting (gRPC 1.51, after running out of descriptors) is found and the
server restarted on its port by ``dataplane_watchdog.DataPlaneWatchdog`` (``DataPlaneServer.restart``).

``DataPlaneServer`` and ``DataPlaneClient`` wrap the C ABI with ctypes (the library is built by
setup.py from gRPC's Debian C++ packages). ``available()`` is False where it was not built: the
sidecar then advertises no data port and clients take Python's Get, with the same results.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import logging
import os
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Sequence

from kvstore.buffers import byte_view
from kvstore.errors import InvalidRequest, KVStoreError

log = logging.getLogger(__name__)

ABI_VERSION = 7  # kvdp_abi_version() of the library these declarations match
GRANT_BYTES = 16
MAX_CHUNK_BYTES = 16 << 20  # dataplane_native/server.cc: kMaxChunkBytes
PROTOCOL_ERROR = -1  # kvdp_client_read: the stream's bytes did not fit the buffers
NOT_CONNECTED = -2  # kvdp_client_read: no connection was ready within 3 s (or the call's timeout)
_ERR_BYTES = 512
_NOT_FOUND, _UNAVAILABLE = 5, 14  # grpc.StatusCode numbers


class DataPlaneError(KVStoreError):
    """A ReadSlots call failed; ``code`` is its gRPC status number (-1: the bytes did not fit, -2: no
    connection was ready)."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code

    @property
    def expired(self) -> bool:
        """The grant was unknown or its lease had expired: GetSlots again (or take Get)."""
        return self.code == _NOT_FOUND


@lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    here = os.path.dirname(__file__)
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = os.path.join(here, "_dataplane" + suffix)
        if os.path.exists(path):
            lib = ctypes.CDLL(path)
            version = lib.kvdp_abi_version() if hasattr(lib, "kvdp_abi_version") else 1
            if version != ABI_VERSION:  # a stale build: calling it with these signatures would crash
                log.warning("ignoring %s: built from another version of dataplane_native/ (ABI %d, not %d); "
                            "reinstall the package (make) to rebuild it", path, version, ABI_VERSION)
                return None
            return _declare(lib)
    return None


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    c = ctypes
    lib.kvdp_server_start.restype = c.c_void_p
    lib.kvdp_server_start.argtypes = [c.c_char_p, c.c_char_p, c.c_char_p, c.c_char_p, c.c_char_p, c.c_uint32,
                                      c.c_uint32, c.c_uint32, c.c_double, c.c_double, c.POINTER(c.c_int),
                                      c.c_char_p, c.c_size_t]
    lib.kvdp_server_grant.argtypes = [c.c_void_p, c.c_char_p, c.c_size_t, c.c_size_t, c.POINTER(c.c_uint64),
                                      c.POINTER(c.c_uint64), c.c_double, c.c_char_p, c.c_size_t]
    lib.kvdp_server_revoke.argtypes = [c.c_void_p, c.c_char_p, c.c_size_t]
    lib.kvdp_server_counters.argtypes = [c.c_void_p, c.POINTER(c.c_uint64)]
    lib.kvdp_server_shutdown.argtypes = [c.c_void_p, c.c_double]
    lib.kvdp_server_free.argtypes = [c.c_void_p]
    lib.kvdp_client_open.restype = c.c_void_p
    lib.kvdp_client_open.argtypes = [c.c_char_p, c.c_char_p, c.c_char_p, c.c_char_p, c.c_char_p, c.c_size_t]
    lib.kvdp_client_read.argtypes = [c.c_void_p, c.c_char_p, c.c_size_t, c.c_uint32, c.c_size_t, c.POINTER(c.c_void_p),
                                     c.POINTER(c.c_uint64), c.c_uint32, c.c_double, c.c_char_p, c.c_size_t]
    lib.kvdp_client_close.argtypes = [c.c_void_p]
    return lib


def available() -> bool:
    """Whether the native library was built (setup.py; needs libgrpc++-dev)."""
    return _library() is not None


def _require() -> ctypes.CDLL:
    lib = _library()
    if lib is None:
        raise KVStoreError("the native data plane was not built: install g++, libgrpc++-dev and pkg-config, "
                           "then reinstall the package (make does both)")
    return lib


def _cstr(value: str | bytes | None) -> bytes | None:
    return value.encode() if isinstance(value, str) else value


def _u64_array(values: Sequence[int]):
    return (ctypes.c_uint64 * len(values))(*values)


@dataclass(frozen=True)
class DataPlaneCounters:
    calls: int
    bytes_sent: int
    refused: int
    cut_short: int
    live_grants: int
    restarts: int = 0  # DataPlaneServer.restart calls that started a new server

    def plus(self, other: "DataPlaneCounters", live: bool = True) -> "DataPlaneCounters":
        """The counts of both; ``other``'s live grants only if ``live`` (a freed server has none)."""
        return DataPlaneCounters(self.calls + other.calls, self.bytes_sent + other.bytes_sent,
                                 self.refused + other.refused, self.cut_short + other.cut_short,
                                 self.live_grants + (other.live_grants if live else 0))


class DataPlaneServer:
    """The BlockData service on ``address`` (``HOST:PORT``; port 0 picks one) over the segment file
    at ``segment_path`` (the host tier's), mapped read-only. ``tls``: (cert chain, key) PEM bytes;
    ``token``: the bearer token every call must carry. Grants are keyed by lease id here. Past
    ``max_streams`` concurrent ReadSlots calls, or ``max_streams_per_client`` of one client (its
    ``kvstore-client`` metadata), a call is RESOURCE_EXHAUSTED naming the limit. A stream that waits
    on its client for ``stream_idle_timeout_s`` (no request sent, or a message not taken: a client
    that stops reading stalls the server's write) is ended DEADLINE_EXCEEDED, within a quarter of
    that (10 ms to 1 s) after, and gives its place back; so is one whose waits together pass
    ``stream_idle_timeout_s`` by more than a second per ``min_stream_bytes_per_s`` bytes it moved
    (``limits.StreamPace``'s rule: a client taking a message just inside the idle timeout each time);
    one whose write is stalled past its grant's deadline is ended NOT_FOUND the same way. A connection with no stream for
    ``stream_idle_timeout_s`` is closed (GOAWAY): one that opens none is never asked for the token."""

    def __init__(self, address: str, segment_path: str, *, tls: tuple[bytes, bytes] | None = None,
                 token: str | None = None, max_chunk_bytes: int = 1 << 20, max_streams: int = 16,
                 max_streams_per_client: int = 8, stream_idle_timeout_s: float = 30.0,
                 min_stream_bytes_per_s: float = float(1 << 20)):
        lib = _require()
        if address.startswith("unix:") or ":" not in address:
            raise InvalidRequest(f"the data plane listens on HOST:PORT, got {address!r}")
        cert, key = (tls[0], tls[1]) if tls else (None, None)
        self._settings = (segment_path.encode(), cert, key, _cstr(token), max_chunk_bytes, max_streams,
                          max_streams_per_client, stream_idle_timeout_s, min_stream_bytes_per_s)
        self._lib = lib
        self._handle, self.port = self._start(address)
        self.host = address.rsplit(":", 1)[0]
        self.restarts = 0
        self._grants: dict[int, tuple[bytes, float]] = {}  # lease id -> (token, deadline)
        self._lock = threading.Lock()  # the grants, and the handle against its freeing
        self._stopping = threading.Lock()  # one stop() or restart() at a time
        self._stopped = False  # by stop(): no restart after it
        self._ended = DataPlaneCounters(0, 0, 0, 0, 0)  # the counters of servers freed (restarts, stop)

    def _start(self, address: str) -> tuple[int, int]:
        """A native server on ``address``: (its handle, the port it bound). ``InvalidRequest`` if it cannot start."""
        err, port = ctypes.create_string_buffer(_ERR_BYTES), ctypes.c_int(0)
        handle = self._lib.kvdp_server_start(address.encode(), *self._settings, ctypes.byref(port), err, _ERR_BYTES)
        if not handle:
            raise InvalidRequest(f"the data plane cannot start: {err.value.decode()}; give --data-address "
                                 "HOST:PORT or 'off'")
        return handle, port.value

    def grant(self, lease_id: int, regions: Sequence[tuple[int, int]], ttl_s: float | None = None, *,
              deadline: float | None = None) -> bytes | None:
        """A fresh token letting ReadSlots calls read ``regions`` ((offset, nbytes) each; any range of
        them, in order) until ``deadline`` (a ``time.monotonic()`` instant; the C++ side reads the
        same clock) or for ``ttl_s`` seconds from now, or until ``revoke``. Give a deadline before
        the lease's, so the grant ends first. None once stopped. Raises ``InvalidRequest`` for a
        region off the segment."""
        if (ttl_s is None) == (deadline is None):
            raise InvalidRequest("give a grant either ttl_s or deadline")
        deadline = time.monotonic() + ttl_s if deadline is None else deadline
        token, err = secrets.token_bytes(GRANT_BYTES), ctypes.create_string_buffer(_ERR_BYTES)
        offsets, sizes = _u64_array([r[0] for r in regions]), _u64_array([r[1] for r in regions])
        with self._lock:
            if self._handle is None:
                return None
            if self._lib.kvdp_server_grant(self._handle, token, len(token), len(regions), offsets, sizes, deadline,
                                           err, _ERR_BYTES):
                raise InvalidRequest(err.value.decode())
            now = time.monotonic()
            self._grants = {k: v for k, v in self._grants.items() if v[1] > now}  # expired ones are gone natively
            self._grants[lease_id] = (token, deadline)
        return token

    def revoke(self, lease_id: int) -> None:
        """Drop the grant of ``lease_id`` if any. Once this returns, no stream reads another byte of
        its slots (a stream in progress ends NOT_FOUND): call it before the lease ends."""
        with self._lock:
            held = self._grants.pop(lease_id, None)
            if held is not None and self._handle is not None:
                self._lib.kvdp_server_revoke(self._handle, held[0], len(held[0]))

    @property
    def serving(self) -> bool:
        """Whether a native server runs now (False after ``stop``, or while a restart failed)."""
        return self._handle is not None

    def counters(self) -> DataPlaneCounters:
        """Totals over every server this object ran (restarts included); ``live_grants`` of the current one."""
        with self._lock:
            total = self._ended if self._handle is None else self._ended.plus(self._native_counters(self._handle))
            return replace(total, restarts=self.restarts)

    def _native_counters(self, handle: int) -> DataPlaneCounters:
        out = (ctypes.c_uint64 * 5)()
        self._lib.kvdp_server_counters(handle, out)
        return DataPlaneCounters(*out)

    def stop(self, grace_s: float = 5.0) -> None:
        """Stop serving: in-flight calls get ``grace_s`` to finish (grants and revocations still work
        meanwhile), then the server is freed. Idempotent and thread-safe."""
        with self._stopping:
            self._stopped = True
            handle = self._handle
            if handle is None:
                return
            self._lib.kvdp_server_shutdown(handle, grace_s)  # not under _lock: grants and revokes go on
            self._free(handle)

    def _free(self, handle: int) -> None:
        """Forget ``handle`` (shut down) and its grants, keeping its counters. Caller holds ``_stopping``."""
        with self._lock:
            self._ended = self._ended.plus(self._native_counters(handle), live=False)
            self._handle = None
            self._grants.clear()
            self._lib.kvdp_server_free(handle)

    def restart(self) -> bool:
        """Replace the native server with a new one on the same port (its listener may have stopped
        accepting: ``DataPlaneWatchdog``). Every grant ends with the old server, and its streams
        stop at once: their clients see the grant gone and fetch those blocks through Get. False
        after ``stop``, and when the new server cannot start (logged; say the process is still out of
        descriptors): the data plane is then off (GetSlots grants nothing, ``serving`` is False)
        until a later ``restart`` succeeds."""
        with self._stopping:
            if self._stopped:
                return False
            if self._handle is not None:
                self._lib.kvdp_server_shutdown(self._handle, 0.0)
                self._free(self._handle)
            try:
                handle, _ = self._start(f"{self.host}:{self.port}")
            except InvalidRequest as exc:
                log.error("the data plane could not be restarted on port %d (%s): it is off, and clients on other "
                          "hosts get blocks through Get, until a restart succeeds", self.port, exc)
                return False
            with self._lock:
                self._handle = handle
            self.restarts += 1
            return True


def default_streams() -> int:
    """Concurrent ReadSlots streams per read: 2 on hosts of 4 cores or more (each end's copies then
    run on more cores: 0.57-0.62x loopback TCP with one stream, 0.71-0.78x with two, on a
    16-core host), 1 below (two streams were no faster on 2 cores)."""
    return 2 if (os.cpu_count() or 1) >= 4 else 1


class DataPlaneClient:
    """A channel to one sidecar's data plane (``HOST:PORT``); thread-safe: ``close`` waits for the
    reads in progress, and a read after it raises ``DataPlaneError`` (UNAVAILABLE). ``streams``:
    how many concurrent ReadSlots calls one ``read`` of several slots is split into."""

    def __init__(self, target: str, *, root_certificates: bytes | None = None, token: str | None = None,
                 client_id: str = "", streams: int = 1):
        if streams < 1:
            raise InvalidRequest(f"streams must be at least 1, got {streams}")
        lib = _require()
        err = ctypes.create_string_buffer(_ERR_BYTES)
        self._handle = lib.kvdp_client_open(target.encode(), root_certificates, _cstr(token), client_id.encode(),
                                            err, _ERR_BYTES)
        if not self._handle:
            raise InvalidRequest(err.value.decode())
        self._lib = lib
        self.target = target
        self.streams = streams
        self._helpers = ThreadPoolExecutor(streams - 1, thread_name_prefix="kvstore-readslots") \
            if streams > 1 else None
        self._reads = 0
        self._idle = threading.Condition()

    def read(self, grant: bytes, dsts: Sequence, first_slot: int = 0, chunk_bytes: int = 0,
             timeout_s: float | None = None) -> None:
        """ReadSlots: the grant's slots ``[first_slot, first_slot + len(dsts))``, in order, into ``dsts``
        (writable buffers of the slots' sizes), over up to ``streams`` concurrent calls of at least
        two slots each. Raises ``DataPlaneError`` on any failure, once every call has ended; ``dsts``
        then hold partial bytes. The GIL is released while bytes move."""
        views = [byte_view(d, writable=True) for d in dsts]
        with self._idle:
            handle = self._handle  # valid until close() sees this read end
            if handle is None:
                raise DataPlaneError(_UNAVAILABLE, f"ReadSlots from {self.target}: the client is closed")
            self._reads += 1
        helpers = []
        try:
            parts = min(self.streams, max(1, len(views) // 2))
            bounds = [len(views) * i // parts for i in range(parts + 1)]
            helpers = [self._helpers.submit(self._read_one, handle, grant, views[lo:hi], first_slot + lo,
                                            chunk_bytes, timeout_s) for lo, hi in zip(bounds[1:-1], bounds[2:])]
            errors = [self._read_one(handle, grant, views[: bounds[1]], first_slot, chunk_bytes, timeout_s)]
        finally:
            wait(helpers)  # every part has stopped writing into dsts before read returns or raises
            with self._idle:
                self._reads -= 1
                self._idle.notify_all()
        errors += [h.result() for h in helpers]  # all done: re-raises a part's unexpected exception
        failed = next((e for e in errors if e is not None), None)
        if failed is not None:
            raise failed

    def _read_one(self, handle: int, grant: bytes, views: list, first_slot: int, chunk_bytes: int,
                  timeout_s: float | None) -> DataPlaneError | None:
        """One ReadSlots call into ``views`` on ``handle``, made again once if it was UNAVAILABLE: the
        server closes a connection idle for its stream_idle_timeout_s, and a call that crosses its
        GOAWAY meets a closed connection (the next one opens a new connection). Not again when no
        connection was ready (``NOT_CONNECTED``: it already waited its bound). The error, or None."""
        pointers = (ctypes.c_void_p * len(views))(*[v.ctypes.data for v in views])
        sizes = _u64_array([v.nbytes for v in views])
        err = ctypes.create_string_buffer(_ERR_BYTES)
        for _ in range(2):
            code = self._lib.kvdp_client_read(handle, grant, len(grant), first_slot, len(views), pointers,
                                              sizes, chunk_bytes, timeout_s or 0.0, err, _ERR_BYTES)
            if code != _UNAVAILABLE:
                break
        return DataPlaneError(code, f"ReadSlots from {self.target}: {err.value.decode()}") if code else None

    def close(self) -> None:
        """Close the channel once the reads in progress are done. Idempotent."""
        with self._idle:
            handle, self._handle = self._handle, None
            self._idle.wait_for(lambda: self._reads == 0)
        if self._helpers is not None:
            self._helpers.shutdown()
        if handle:
            self._lib.kvdp_client_close(handle)

