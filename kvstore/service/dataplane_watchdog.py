"""Restarts the native data plane when its listener stops accepting connections.

gRPC 1.51's listener (the data plane's, ``dataplane_native/``) never accepts again once one accept
failed for want of a file descriptor (grpc/grpc#20418): a flood of connections beyond the process's
limit, even one that has ended, would leave the data port dead until the sidecar restarts, and every
client on another host would wait out a connection timeout before taking Get. Nothing else notices:
health checks go to the main gRPC port.

So a thread probes the data port from inside the sidecar every ``interval_s``
(``listener_probe.answers_http2``: a new connection whose HTTP/2 handshake must be answered within
``timeout_s``). After ``failures`` unanswered probes in a row it restarts the data plane on the same
port (``DataPlaneServer.restart``): its grants end, and their clients fetch those blocks through Get.
A probe that cannot be made (this process itself is out of descriptors) counts neither way.
"""

from __future__ import annotations

import ipaddress
import logging
import threading

from kvstore.service.dataplane import DataPlaneServer
from kvstore.service.listener_probe import answers_http2

log = logging.getLogger(__name__)


class DataPlaneWatchdog:
    def __init__(self, data_plane: DataPlaneServer, tls: bool, interval_s: float = 10.0, timeout_s: float = 3.0,
                 failures: int = 2):
        self._data_plane, self._tls = data_plane, tls
        self.interval_s, self.timeout_s, self.failures = interval_s, timeout_s, failures
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvstore-dataplane-watchdog", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        unanswered = 0
        while not self._stop.wait(self.interval_s):
            try:
                answered = self.probe()
                if answered is None:
                    continue
                unanswered = 0 if answered else unanswered + 1
                if unanswered >= self.failures and not self._stop.is_set():
                    unanswered = 0
                    self._restart()
            except Exception:  # the watchdog must outlive any one round's surprise
                log.exception("the data plane watchdog's round failed; it goes on probing")

    def probe(self) -> bool | None:
        """Whether the data plane's listener answers now (None: could not tell). A wildcard bind is
        probed at 127.0.0.1 and ::1 (gRPC binds ``[::]`` to IPv4 alone where IPv6 is off): either
        answering is enough."""
        answers = [answers_http2(host, self._data_plane.port, self._tls, self.timeout_s)
                   for host in probe_hosts(self._data_plane.host)]
        if True in answers:
            return True
        return False if False in answers else None

    def _restart(self) -> None:
        log.warning("the data plane on port %d did not answer %d probes in a row (%g s apart): its listener may "
                    "have stopped accepting after running out of file descriptors (raise the sidecar's open-files "
                    "limit, firewall the port to the engine hosts); restarting it", self._data_plane.port,
                    self.failures, self.interval_s)
        if self._data_plane.restart():
            log.warning("restarted the data plane on port %d (restart %d)", self._data_plane.port,
                        self._data_plane.restarts)

    def stop(self) -> None:
        """End the probes; waits for one in progress. Idempotent."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()


def probe_hosts(host: str) -> tuple[str, ...]:
    """Where to reach a listener bound to ``host`` (a data address's host) from this machine."""
    bare = host.strip("[]")
    try:
        address = ipaddress.ip_address(bare)
    except ValueError:  # a host name: as it resolves here
        return (bare,)
    return ("127.0.0.1", "::1") if address.is_unspecified else (bare,)
