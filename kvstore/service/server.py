"""The sidecar process: a grpc.aio server over one ``TieredStore``.

``create_server`` builds and binds a server (tests bind port 0 and read the port back);
``serve`` runs one until SIGTERM or SIGINT, then shuts down gracefully:

    1. health turns NOT_SERVING, /healthz answers 503 (load balancers and probes stop sending work)
    2. the server and the native data plane stop taking calls; in-flight calls and streams get
       ``shutdown_grace_s`` to finish
    3. worker threads still copying for a call are waited for: the event loop's, then the
       transfer threads of Get, Put and CommitSlots (for at most ``TRANSFER_WAIT_S``, then logged)
    4. the staging area closes, then the store: background writes drain and every tier flushes
       (the disk tier's index and segments are durable, so the next start serves what was put)

Beside the KVStore service: the standard health service (grpc.health.v1, "" and
"kvstore.v1.KVStore") and server reflection (so grpcurl and friends need no .proto). Beside the
gRPC port: the HTTP server (kvstore.service.http) with /metrics, /healthz and the dashboard, and
the native data plane (kvstore.service.dataplane) that streams host-tier blocks to other hosts.
Exposure rules (token, TLS) are kvstore.service.security's.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import signal
import socket
import stat
from typing import Callable, Iterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from kvstore.config import StoreConfig
from kvstore.errors import InvalidRequest
from kvstore.open_files import raise_open_files_limit
from kvstore.service import dataplane, security
from kvstore.service.heap import keep_heap_for_transfers
from kvstore.service.config import HTTP_OFF, ServeConfig
from kvstore.service.dataplane import DataPlaneServer
from kvstore.service.dataplane_watchdog import DataPlaneWatchdog
from kvstore.service.limits import ServiceLimits
from kvstore.service.metrics import ServiceMetrics
from kvstore.service.servicer import SERVICE_NAME, KVStoreServicer, add_to_server
from kvstore.service.shm import host_tier
from kvstore.service.staging import StagingArea, open_staging
from kvstore.service.transfer_threads import TransferThreads
from kvstore.store import TieredStore
from kvstore.tiers.shm_segment import remove_stale_segments

log = logging.getLogger(__name__)

# A client host that vanishes (power loss, partition) sends no FIN, and its calls would wait on it
# for ever: the server pings every connection every 30 s, calls or not, and drops one that does
# not answer within 10 s (its calls are cancelled, their transfer slots and leases freed). Clients
# may ping too, as often as every 10 s.
KEEPALIVE_OPTIONS = [
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),  # keep pinging while no data flows: 0 is no cap
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
]
# At shutdown, how long Get/Put/CommitSlots store calls still running (their calls ended) are waited
# for before the staging area and the store close under them: a copy takes well under this, a
# call still running after it is hung on its disk.
TRANSFER_WAIT_S = 10.0


async def create_server(address: str, store: TieredStore, limits: ServiceLimits = ServiceLimits(),
                        health: health_aio.HealthServicer | None = None, *, metrics: ServiceMetrics | None = None,
                        staging: StagingArea | None = None, durable_puts: bool = False, token: str | None = None,
                        tls: tuple[bytes, bytes] | None = None, data_plane: DataPlaneServer | None = None,
                        transfers: TransferThreads | None = None) -> tuple[grpc.aio.Server, int]:
    """A bound, not yet started server with the KVStore, health and reflection services.

    ``address`` is ``HOST:PORT`` (port 0 picks a free one) or ``unix:PATH``. Returns the server and
    the bound port (0 for a unix socket). Raises ``InvalidRequest`` if the address cannot be bound.
    ``token``: every call but health checks needs it; ``tls``: (cert chain, key) PEM bytes.
    ``data_plane``: a started native data plane over the store's host tier, for GetSlots to grant to.
    ``transfers``: the threads Get, Put and CommitSlots copy on (None: the server's own), for the
    caller to shut down before it closes the store.
    """
    servicer = KVStoreServicer(store, limits, metrics, staging, durable_puts, data_plane, transfers)
    interceptors = [security.BearerAuthInterceptor(token, servicer.metrics.refused)] if token else []
    server = grpc.aio.server(options=server_options(limits), interceptors=interceptors)
    if data_plane is not None:
        servicer.metrics.watch_data_plane(data_plane)
    add_to_server(servicer, server)
    health = health or health_aio.HealthServicer()
    await health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    health_name = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
    reflection.enable_server_reflection((SERVICE_NAME, health_name, reflection.SERVICE_NAME), server)
    refuse_a_served_unix_path(address)
    refuse_a_taken_port(address)
    try:
        port = server.add_secure_port(address, security.server_credentials(tls)) if tls else \
            server.add_insecure_port(address)
    except RuntimeError:
        raise _cannot_listen(address, _bind_failure(address)) from None
    return server, 0 if address.startswith("unix:") else port


def server_options(limits: ServiceLimits) -> list[tuple[str, int]]:
    """The gRPC server's options: message sizes, keepalive, and no SO_REUSEPORT (without it a
    second sidecar on this port fails to bind, instead of the kernel splitting the clients
    between two stores)."""
    return [*limits.channel_options(), *KEEPALIVE_OPTIONS, ("grpc.so_reuseport", 0)]


def unix_path(address: str) -> str | None:
    """The file of a ``unix:PATH`` or ``unix:///PATH`` address; None for ``HOST:PORT``."""
    if not address.startswith("unix:"):
        return None
    return address[len("unix://"):] if address.startswith("unix://") else address[len("unix:"):]


def refuse_a_served_unix_path(address: str) -> None:
    """``InvalidRequest`` if ``address`` is a unix socket another process serves, or a file that is no
    socket: gRPC removes whatever is at the path and binds anew, so a second sidecar took a running
    one's socket from it (which went on running, unreachable). A socket nothing answers on (left
    by a process that ended) is replaced."""
    path = unix_path(address)
    if path is None or not os.path.lexists(path):
        return
    if not stat.S_ISSOCK(os.lstat(path).st_mode):
        raise InvalidRequest(f"cannot listen on {address!r}: {path} exists and is not a socket; give another "
                             "unix:PATH or remove it")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(2.0)
        try:
            probe.connect(path)
        except OSError:  # refused (stale), gone meanwhile, or timed out: nothing we would take from
            return
    raise InvalidRequest(f"cannot listen on {address!r}: another process serves that socket (a running sidecar?); "
                         "stop it first or give another unix:PATH")


def _cannot_listen(address: str, reason: str) -> InvalidRequest:
    return InvalidRequest(f"cannot listen on {address!r}: {reason}; "
                          "give another --address HOST:PORT (port 0: any free one) or unix:PATH")


def refuse_a_taken_port(address: str) -> None:
    """``InvalidRequest`` if a plain bind of ``HOST:PORT`` fails (in use, no such local address, a
    host that does not resolve), or a ``unix:PATH``'s directory is missing or not this user's to
    write: gRPC would fail too, but only after logging its own error line to stderr, ahead of ours."""
    if (reason := plain_bind_error(address)) is not None:
        raise _cannot_listen(address, reason)


def plain_bind_error(address: str) -> str | None:
    """The OS's answer to binding ``HOST:PORT`` as gRPC would (SO_REUSEADDR), or why a ``unix:PATH``
    cannot be created; None if it binds (or ``address`` is no ``HOST:PORT``: gRPC's own parsing
    has the say)."""
    host, _, port = address.rpartition(":")
    if (path := unix_path(address)) is not None:
        return _unix_directory_problem(path)
    if not port.isdigit():
        return None
    try:
        with socket.create_server((host.strip("[]"), int(port)), family=_family(host)):
            return None
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            return "address in use"
        return (exc.strerror or str(exc)).split(" (while attempting to bind", 1)[0]  # create_server's own addition


def _unix_directory_problem(path: str) -> str | None:
    """Why a socket cannot be created at ``path`` for want of its directory, or None."""
    directory = os.path.dirname(path) or "."
    if not os.path.isdir(directory):
        return f"the directory {directory} does not exist"
    if not os.access(directory, os.W_OK | os.X_OK):
        return f"this user may not create a socket in {directory}"
    return None


def _bind_failure(address: str) -> str:
    """Why ``address`` cannot be bound (gRPC's error does not say): the OS's answer to a plain bind."""
    return plain_bind_error(address) or "is it in use?"


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if host.startswith("[") else socket.AF_INET


def bound_address(address: str, port: int) -> str:
    """``address`` with the port the server actually bound (differs when 0 was asked for)."""
    return address if address.startswith("unix:") else f"{address.rsplit(':', 1)[0]}:{port}"


async def serve(config: ServeConfig, store_config: StoreConfig, ready: Callable[[str], None] = print,
                http_ready: Callable[[str], None] = print) -> None:
    """Serve one store until SIGTERM or SIGINT; ``ready`` gets the bound gRPC address once
    listening, ``http_ready`` the dashboard's URL (not called when HTTP is off)."""
    keep_heap_for_transfers()
    # Every connection holds a descriptor, and gRPC 1.51's data plane never accepts again once
    # one accept fails for want of one (dataplane_native/transport.h): not only for a disk tier.
    raise_open_files_limit("every connection to the sidecar's ports holds one descriptor")
    token = security.load_token(config.token, config.token_file)
    if config.protect_metrics and token is None:  # else /metrics would answer anyone, as if unprotected
        raise InvalidRequest("--protect-metrics (KVSTORE_PROTECT_METRICS) needs a bearer token for /metrics to "
                             "ask for: give --token-file FILE or KVSTORE_TOKEN")
    tls = security.read_tls(config.tls_cert, config.tls_key)
    security.check_exposure("--address", config.address, token, tls is not None, config.allow_plaintext)
    data_address = config.data_plane_address()
    if data_address is not None:
        security.check_exposure("--data-address", data_address, token, tls is not None, config.allow_plaintext)
    if config.http_address != HTTP_OFF:
        security.check_exposure("--http-address", config.http_address, token, tls is not None,
                                config.allow_plaintext)
    check_durable_puts(config, store_config)
    refuse_a_taken_port(config.address)  # before a large host tier takes seconds to prefault (create_server again)
    shm_dir = store_config.host.shm_dir if store_config.host else None
    remove_stale_segments(shm_dir)  # creating a segment sweeps too; this also covers a sidecar that maps none
    store = await asyncio.to_thread(store_config.open_store)  # a large host tier takes seconds to prefault
    staging = http = sampler = data_plane = watchdog = None
    transfers = TransferThreads.of(config.limits)
    try:
        staging = open_staging(config.staging_bytes, shm_dir)
        data_plane = start_data_plane(data_address, store, config.limits, token, tls)
        if data_plane is not None and config.data_plane_probe_s > 0:
            watchdog = DataPlaneWatchdog(data_plane, tls is not None, interval_s=config.data_plane_probe_s)
        health = health_aio.HealthServicer()
        metrics = ServiceMetrics(store)
        server, port = await create_server(config.address, store, config.limits, health, metrics=metrics,
                                           staging=staging, durable_puts=config.durable_puts, token=token, tls=tls,
                                           data_plane=data_plane, transfers=transfers)
        serving = asyncio.Event()
        if config.http_address != HTTP_OFF:
            from kvstore.service.dashboard import Dashboard  # FastAPI and uvicorn load only when HTTP is on
            from kvstore.service.http import HttpServer, create_http_app

            dashboard = Dashboard(metrics)
            app = create_http_app(metrics, token, config.protect_metrics, dashboard, serving=serving.is_set,
                                  local_only=security.is_local_address(config.http_address))
            http = HttpServer(app, config.http_address, (config.tls_cert, config.tls_key) if tls else None)
            url = await http.start()
            sampler = asyncio.create_task(dashboard.run())
        with _stop_signals(signal.SIGTERM, signal.SIGINT) as stop:  # before the ready line: a SIGTERM
            await server.start()  # right after it ends the sidecar gracefully too
            serving.set()
            ready(bound_address(config.address, port))
            if http is not None:
                http_ready(url)
            await stop.wait()
        log.info("shutting down: %.1f s for in-flight calls", config.shutdown_grace_s)
        serving.clear()
        await health.enter_graceful_shutdown()
        stopping = [server.stop(config.shutdown_grace_s)]
        if watchdog is not None:  # beside the rest: a restart it is making finishes before stop() takes over
            stopping.append(asyncio.to_thread(watchdog.stop))
        if data_plane is not None:  # its streams get the same grace, at the same time
            stopping.append(asyncio.to_thread(data_plane.stop, config.shutdown_grace_s))
        await asyncio.gather(*stopping)
        await asyncio.get_running_loop().shutdown_default_executor()  # store calls still copying
    finally:
        if sampler is not None:
            sampler.cancel()
        if http is not None:
            await http.stop()
        if watchdog is not None:
            watchdog.stop()
        if data_plane is not None:
            data_plane.stop(0)  # a no-op after a graceful shutdown
        transfers.shutdown(TRANSFER_WAIT_S)  # their copies use what closes below (blocking, as the closes do)
        if staging is not None:
            staging.close()
        try:
            if config.check_integrity_on_exit:
                _check_integrity(store)
        finally:
            store.close()


def check_durable_puts(config: ServeConfig, store_config: StoreConfig) -> None:
    """Refuse ``--durable-puts`` where a put does not reach the disk tier before it is answered:
    without one, or under ``on_eviction`` (a put lands in the host tier alone and reaches the disk
    only when evicted, so a crash would lose blocks the sidecar had called durable)."""
    if not config.durable_puts:
        return
    if store_config.disk is None:
        raise InvalidRequest("durable puts need a disk tier: give --disk-capacity, or drop --durable-puts")
    if store_config.host is not None and store_config.write_policy != "write_through":
        raise InvalidRequest(f"durable puts need write_policy write_through, not {store_config.write_policy!r}: "
                             "under on_eviction a put reaches the disk only when the host tier evicts it")


def start_data_plane(address: str | None, store: TieredStore, limits: ServiceLimits, token: str | None,
                     tls: tuple[bytes, bytes] | None) -> DataPlaneServer | None:
    """The native data plane over the store's host tier at ``address``; None when it is off, there
    is no host tier, or the library was not built (then other hosts get blocks through Get)."""
    host = host_tier(store)
    if address is None or host is None:
        return None
    if (reason := plain_bind_error(address)) is not None:  # before gRPC logs its own line of it
        raise InvalidRequest(f"the data plane cannot start: cannot listen on {address}: {reason}; "
                             "give --data-address HOST:PORT or 'off'")
    if not dataplane.available():
        log.warning("the native data plane was not built (needs g++, libgrpc++-dev, pkg-config at install): "
                    "clients on other hosts get blocks through the slower Python Get")
        return None
    data_plane = DataPlaneServer(address, host.segment_path, tls=tls, token=token,
                                 max_chunk_bytes=min(limits.max_chunk_bytes, dataplane.MAX_CHUNK_BYTES),
                                 max_streams=limits.max_concurrent_transfers,
                                 max_streams_per_client=limits.max_streams_per_client,
                                 stream_idle_timeout_s=limits.stream_idle_timeout_s,
                                 min_stream_bytes_per_s=limits.min_stream_bytes_per_s)
    log.info("native data plane on %s", bound_address(address, data_plane.port))
    return data_plane


class IntegrityCheckFailed(Exception):
    """``check_integrity_on_exit`` found books that disagree (a store bug)."""


def _check_integrity(store) -> None:
    store.flush()
    try:
        store.check_integrity()
    except AssertionError as exc:
        raise IntegrityCheckFailed(f"integrity check failed at shutdown: {exc}") from exc


@contextlib.contextmanager
def _stop_signals(*signals: signal.Signals) -> Iterator[asyncio.Event]:
    """An event set by any of ``signals`` while the block runs; outside it they act as before (a
    second SIGTERM during the shutdown's grace ends the process at once)."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
    try:
        yield stop
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)
