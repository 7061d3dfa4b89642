"""What one call may ask of the sidecar, and the error a call past a limit gets.

Every limit has a name that appears in the error (RESOURCE_EXHAUSTED at the gRPC edge), so a
caller can tell which one to split around or raise. Defaults, and what they bound:

    max_lookup_blocks         16384   block hashes per Lookup (1M tokens of 64-token blocks, ~300 KB)
    max_transfer_blocks       32      blocks per Get, Put or ReserveSlots
    max_transfer_bytes        1 GiB   their bytes (blocks x the namespace's block bytes): the server
                                      holds a Get's or Put's blocks in memory at once, and the client
                                      picks the block size (a block may be up to a host-tier page);
                                      32 V3 blocks are 137 MiB, 32 LMCache 256-token V3 chunks 558 MiB
    max_chunk_bytes           1 MiB   payload bytes per chunk message, both directions; a Get or
                                      ReadSlots asking for less than 64 KiB (or this, if less) gets that
    max_concurrent_transfers  16      Get and Put streams running at once; more are refused, not queued
    max_message_bytes         4 MiB   any one message, enforced by gRPC itself (its own message)
    max_streams_per_client    8       Get and Put streams one client runs at once
    max_leases_per_client     1024    leases (Lookup, GetSlots) one client holds at once
    max_reservations_per_client 8     staging reservations (ReserveSlots) one client holds at once
    max_namespaces            4096    namespaces registered in the sidecar's store (each one costs
                                      memory for good: a client must not register them endlessly)
    stream_idle_timeout_s     30.0    seconds a Get or Put stream (or the native data plane's
                                      ReadSlots) waits on its client for the next message (or to
                                      take one) before it fails DEADLINE_EXCEEDED
    min_stream_bytes_per_s    1 MiB   a Get, Put or ReadSlots stream's floor rate: all its waits
                                      on the client together may exceed stream_idle_timeout_s by
                                      one second per this many bytes moved, else it fails
                                      DEADLINE_EXCEEDED (``StreamPace``; the data plane's own, C++,
                                      for ReadSlots): a client trickling a byte a message cannot
                                      hold a transfer slot for ever

A client is what its ``kvstore-client`` metadata names (``KVStoreClient`` sends a random id per
instance), else its connection's peer address.
"""

from __future__ import annotations

import asyncio
import collections
import heapq
import math
import os
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields
from typing import Callable, Iterator, Mapping

from kvstore.config import ENV_PREFIX, Settings, parse_count, parse_seconds, parse_size, read_setting
from kvstore.errors import InvalidRequest, KVStoreError, NotPermitted, UnknownLease

MESSAGE_OVERHEAD_BYTES = 1 << 10  # room for a chunk's index, offset and framing
MIN_CHUNK_BYTES = 64 << 10  # a Get asking for smaller chunks gets these (dataplane_native: kMinChunkBytes)


class LimitExceeded(KVStoreError):
    """A call asked for more than a ``ServiceLimits`` field allows (backpressure at the edge)."""


class StreamIdle(KVStoreError):
    """A stream waited on its client longer than ``stream_idle_timeout_s`` (DEADLINE_EXCEEDED)."""


class StreamTooSlow(StreamIdle):
    """A stream's client moved its bytes slower than ``min_stream_bytes_per_s`` allows (``StreamPace``)."""


GRPC_MAX_MESSAGE_BYTES = (1 << 31) - 1  # gRPC takes message sizes as a C int


@dataclass(frozen=True)
class ServiceLimits:
    max_lookup_blocks: int = 16384
    max_transfer_blocks: int = 32
    max_transfer_bytes: int = 1 << 30
    max_chunk_bytes: int = 1 << 20
    max_concurrent_transfers: int = 16
    max_message_bytes: int = 4 << 20
    max_streams_per_client: int = 8
    max_leases_per_client: int = 1024
    max_reservations_per_client: int = 8
    max_namespaces: int = 4096
    stream_idle_timeout_s: float = 30.0
    min_stream_bytes_per_s: int = 1 << 20

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not (value > 0 and math.isfinite(value)):
                raise InvalidRequest(f"{name} must be positive and finite, got {value}")
        if self.max_message_bytes > GRPC_MAX_MESSAGE_BYTES:
            raise InvalidRequest(f"max_message_bytes must be at most {GRPC_MAX_MESSAGE_BYTES} (gRPC's limit: a C int), "
                                 f"got {self.max_message_bytes}")
        if self.max_chunk_bytes + MESSAGE_OVERHEAD_BYTES > self.max_message_bytes:
            raise InvalidRequest(f"max_message_bytes ({self.max_message_bytes}) must exceed max_chunk_bytes "
                                 f"({self.max_chunk_bytes}) by at least {MESSAGE_OVERHEAD_BYTES}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "ServiceLimits":
        """Defaults, then ``KVSTORE_<FIELD>`` variables (``KVSTORE_MAX_TRANSFER_BLOCKS=8``). The
        sidecar and the connectors configured by the same environment read them alike, so an
        engine never sends a batch its sidecar was told to refuse."""
        env = os.environ if environ is None else environ
        given = [(f, key) for f in fields(cls) if (key := ENV_PREFIX + f.name.upper()) in env]
        values = {f.name: read_setting(env, key, _positive(_parser(f.name, f.type))) for f, key in given}
        try:
            return cls(**values)
        except InvalidRequest as exc:  # a rule between fields (a message fits in max_message_bytes)
            raise InvalidRequest(f"{' and '.join(_origin(env, key) for _, key in given)}: {exc}") from None

    def check_blocks(self, name: str, count: int) -> None:
        """Raise ``LimitExceeded`` if ``count`` blocks in one call exceed the limit ``name``."""
        limit = getattr(self, name)
        if count > limit:
            raise LimitExceeded(f"{count} blocks in one call exceed {name}={limit}; split the call")

    def check_transfer(self, count: int, block_bytes: int) -> None:
        """Raise ``LimitExceeded`` if ``count`` blocks of ``block_bytes`` in one Get, Put or
        ReserveSlots exceed ``max_transfer_blocks`` or ``max_transfer_bytes``."""
        self.check_blocks("max_transfer_blocks", count)
        if count * block_bytes > self.max_transfer_bytes:
            most = self.transfer_blocks(block_bytes)
            advice = f"send at most {most} a call" if most else "raise max_transfer_bytes for blocks this size"
            raise LimitExceeded(f"{count} blocks of {block_bytes} bytes in one call ({count * block_bytes} bytes) "
                                f"exceed max_transfer_bytes={self.max_transfer_bytes}; {advice}")

    def transfer_blocks(self, block_bytes: int) -> int:
        """The most blocks of ``block_bytes`` one Get or Put may carry (0: not even one)."""
        return min(self.max_transfer_blocks, self.max_transfer_bytes // block_bytes)

    def check_new_namespace(self, registered: int) -> None:
        """Raise ``LimitExceeded`` if the store already holds ``max_namespaces`` namespaces."""
        if registered >= self.max_namespaces:
            raise LimitExceeded(f"max_namespaces={self.max_namespaces}: the sidecar holds that many namespaces "
                                "(they stay registered until it restarts); raise KVSTORE_MAX_NAMESPACES if "
                                "that many models and tenants are real")

    def channel_options(self) -> list[tuple[str, int]]:
        """gRPC options for both ends: the message size limit, which gRPC enforces itself."""
        return [("grpc.max_receive_message_length", self.max_message_bytes),
                ("grpc.max_send_message_length", self.max_message_bytes)]

    def chunk_bytes(self, requested: int) -> int:
        """The chunk size a Get uses: what the caller asked (0: the maximum), within
        [min(MIN_CHUNK_BYTES, max_chunk_bytes), max_chunk_bytes]. Every message costs the server a
        round through the event loop, so a tiny size is raised instead of sending a byte a message."""
        floor = min(MIN_CHUNK_BYTES, self.max_chunk_bytes)
        return max(min(requested or self.max_chunk_bytes, self.max_chunk_bytes), floor)


def _parser(name: str, kind: str) -> Callable[[str], float | int]:
    """How a limit's setting reads: seconds, bytes (``4MiB``) or a count of things (``16k``, not ``1.5``)."""
    return parse_seconds if kind == "float" else parse_size if "bytes" in name else parse_count


def _positive(parse):
    """``parse``, then ``InvalidRequest`` unless the value is positive and finite."""
    def read(text: str):
        value = parse(text)
        if not (value > 0 and math.isfinite(value)):
            raise InvalidRequest(f"must be positive and finite, got {value}")
        return value
    return read


def _origin(env: Mapping[str, str], key: str) -> str:
    """Where ``key`` was set: its config file's key if ``env`` remembers one, else the variable."""
    return env.origin(key) if isinstance(env, Settings) else key


class StreamPace:
    """One Get or Put stream's waits on its client, against the payload bytes it moved.

    Each wait (for the client's next message, or for it to take one) may last up to
    ``stream_idle_timeout_s`` (``StreamIdle`` past it). All the stream's waits together may exceed
    that only by one second per ``min_stream_bytes_per_s`` bytes moved (``StreamTooSlow``, at the
    next message): a client that trickles, a byte a message each inside the idle timeout, cannot
    hold its transfer slot for ever. The server's own work (store loads, assembling) is not counted.
    Used from the server's event loop only (not thread-safe).
    """

    def __init__(self, limits: ServiceLimits):
        self._limits = limits
        self.waited_s = 0.0
        self.moved_bytes = 0

    async def wait(self, awaitable, what: str):
        """``await awaitable`` (a read from or a write to the client's stream), counting the wait;
        ``StreamIdle`` (the client ``what`` for that long) past ``stream_idle_timeout_s``."""
        timeout_s, started = self._limits.stream_idle_timeout_s, time.monotonic()
        try:
            async with asyncio.timeout(timeout_s):
                return await awaitable
        except TimeoutError:
            raise StreamIdle(f"stream_idle_timeout_s={timeout_s:g}: the client {what} for that long; the stream "
                             "is ended (send or read without pausing, or split the transfer)") from None
        finally:
            self.waited_s += time.monotonic() - started

    def moved(self, nbytes: int) -> None:
        """Count ``nbytes`` moved; ``StreamTooSlow`` if the waits so far exceed what the bytes allow."""
        self.moved_bytes += nbytes
        idle_s, rate = self._limits.stream_idle_timeout_s, self._limits.min_stream_bytes_per_s
        if self.waited_s > idle_s + self.moved_bytes / rate:
            raise StreamTooSlow(f"min_stream_bytes_per_s={rate}: the stream waited {self.waited_s:.1f} s on its client "
                                f"for {self.moved_bytes} bytes; waits past stream_idle_timeout_s={idle_s:g} must be "
                                "paid for at that rate (send or read faster, or split the transfer)")


class TransferSlots:
    """Counts the Get and Put streams in progress, in all and per client; refuses past either
    limit instead of queueing.

    Used from the server's event loop only (not thread-safe).
    """

    def __init__(self, limit: int, per_client: int):
        self.limit = limit
        self.per_client = per_client
        self.active = 0
        self._by_client: collections.Counter[str] = collections.Counter()

    def take(self, client: str = "") -> Callable[[], None]:
        """Take a slot for ``client``, or raise ``LimitExceeded``; returns its release (once is enough:
        again does nothing)."""
        if self.active >= self.limit:
            raise LimitExceeded(f"max_concurrent_transfers={self.limit} Get/Put streams are already running; "
                                "retry shortly or raise the limit")
        if self._by_client[client] >= self.per_client:
            raise LimitExceeded(f"max_streams_per_client={self.per_client}: this client already runs that many "
                                "Get/Put streams; wait for one to finish")
        self.active += 1
        self._by_client[client] += 1
        taken = [True]

        def release() -> None:
            if taken.pop() if taken else False:
                self.active -= 1
                self._by_client[client] -= 1
                if not self._by_client[client]:
                    del self._by_client[client]

        return release

    @contextmanager
    def hold(self, client: str = "") -> Iterator[None]:
        release = self.take(client)
        try:
            yield
        finally:
            release()


class ClientLeases:
    """The leases each client holds, so one client cannot take every lease the store grants.

    A lease counts until its client releases it (or a Get ends it) or its TTL passes. Expired
    leases are forgotten for every client, also those that never call again: each ``add`` and
    ``check`` drops up to ``PURGE_PER_CALL`` of them, oldest deadline first. Used from the
    server's event loop only (not thread-safe).
    """

    PURGE_PER_CALL = 16  # more than the one lease an add brings: the backlog only shrinks

    def __init__(self, per_client: int):
        self.per_client = per_client
        self._expiry: dict[str, dict[int, float]] = collections.defaultdict(dict)  # client -> lease -> deadline
        self._owner: dict[int, str] = {}
        self._deadlines: list[tuple[float, int]] = []  # heap of (deadline, lease); stale once dropped
        self._taking: collections.Counter[str] = collections.Counter()  # client -> leases being taken now

    def check_owner(self, client: str, lease_id: int) -> None:
        """Raise ``NotPermitted`` if another client holds ``lease_id``, ``UnknownLease`` if none does.

        Every lease the service grants is recorded here as soon as the store grants it, so an id
        no client holds was never issued, has ended or expired, or is being granted this instant
        to a caller that does not know it yet: the store must not be asked to end it."""
        if self.held_by(client, lease_id) is None:
            raise UnknownLease(f"lease {lease_id} is unknown, ended or expired")

    def held_by(self, client: str, lease_id: int) -> int | None:
        """``lease_id`` if ``client`` holds it; None if no client does (a Get naming it then reads
        unpinned, as if it named none); ``NotPermitted`` if another client holds it."""
        owner = self._owner.get(lease_id)
        if owner is not None and owner != client:
            raise NotPermitted(f"lease {lease_id} belongs to another client; only its holder may end it")
        return None if owner is None else lease_id

    def check(self, client: str) -> None:
        """Raise ``LimitExceeded`` if ``client`` may not take another lease now (places held by
        ``taking`` count as leases)."""
        self._purge(time.monotonic())
        if self.held(client) + self._taking[client] >= self.per_client:
            raise LimitExceeded(f"max_leases_per_client={self.per_client}: this client holds that many leases; "
                                "release some (or let them expire) before asking for more")

    @contextmanager
    def taking(self, client: str) -> Iterator[None]:
        """Hold one of ``client``'s places while a lease is being taken (``LimitExceeded`` if none is
        free), so that calls awaiting the store at once cannot together overshoot the cap. ``add``
        the lease inside; the place is given back on leaving, whether a lease was taken or not."""
        self.check(client)
        self._taking[client] += 1
        try:
            yield
        finally:
            self._taking[client] -= 1
            if not self._taking[client]:
                del self._taking[client]

    def add(self, client: str, lease_id: int, ttl_s: float) -> None:
        now = time.monotonic()
        self._purge(now)
        self._expiry[client][lease_id] = now + ttl_s
        self._owner[lease_id] = client
        heapq.heappush(self._deadlines, (now + ttl_s, lease_id))
        if len(self._deadlines) > 2 * len(self._owner) + self.PURGE_PER_CALL:
            self._compact()

    def drop(self, lease_id: int) -> None:
        client = self._owner.pop(lease_id, None)
        if client is not None:
            self._expiry[client].pop(lease_id, None)
            if not self._expiry[client]:
                del self._expiry[client]

    def held(self, client: str) -> int:
        leases = self._expiry.get(client)
        if not leases:
            return 0
        now = time.monotonic()
        for lease_id in [lease for lease, deadline in leases.items() if deadline <= now]:
            self.drop(lease_id)
        return len(self._expiry.get(client, ()))

    def _purge(self, now: float) -> None:
        """Drop up to ``PURGE_PER_CALL`` leases whose deadline passed, whoever holds them."""
        for _ in range(self.PURGE_PER_CALL):
            if not self._deadlines or self._deadlines[0][0] > now:
                return
            _, lease_id = heapq.heappop(self._deadlines)
            client = self._owner.get(lease_id)
            if client is not None and self._expiry[client][lease_id] <= now:
                self.drop(lease_id)

    def _compact(self) -> None:
        """Rebuild the heap from the leases still held: released leases leave stale entries behind."""
        self._deadlines = [(deadline, lease) for leases in self._expiry.values() for lease, deadline in leases.items()]
        heapq.heapify(self._deadlines)
