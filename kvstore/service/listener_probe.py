"""Whether a gRPC listener still accepts connections: the HTTP/2 handshake's first step, by hand.

A connection to a listening port completes in the kernel whether or not the server ever accepts
it, so a plain connect proves nothing. ``answers_http2`` sends the HTTP/2 client preface and an
empty SETTINGS frame and waits for the server's SETTINGS frame, which a gRPC server sends as soon
as it has accepted the connection (after the TLS handshake, with ``tls``). It needs no token and
makes no call, so it works whatever the server's authentication, and it checks no certificate:
it asks only whether the listener answers.
"""

from __future__ import annotations

import errno
import socket
import ssl
import time

_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_EMPTY_SETTINGS = bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])  # length 0, type SETTINGS, no flags, stream 0
_SETTINGS = 4
# errors that say nothing about the listener: this process is out of descriptors, or the host
# name or address family cannot be used here
_CANNOT_TELL = (errno.EMFILE, errno.ENFILE, errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT, errno.ENETUNREACH)


def answers_http2(host: str, port: int, tls: bool, timeout_s: float) -> bool | None:
    """True if the listener at ``host:port`` accepted a connection and its HTTP/2 server sent its
    SETTINGS frame within ``timeout_s``; False if it refused, reset or stayed silent; None when
    this process could not even try (out of file descriptors itself, a name it cannot resolve, an
    address family the host lacks)."""
    deadline = time.monotonic() + timeout_s
    try:
        with socket.create_connection((host.strip("[]"), port), timeout=timeout_s) as raw:
            conn = _tls(raw, host, deadline) if tls else raw
            conn.settimeout(max(0.001, deadline - time.monotonic()))
            conn.sendall(_PREFACE + _EMPTY_SETTINGS)
            return _first_frame_type(conn, deadline) == _SETTINGS
    except socket.gaierror:
        return None
    except OSError as exc:  # ssl.SSLError and socket.timeout are OSErrors too
        return None if exc.errno in _CANNOT_TELL else False


def _tls(raw: socket.socket, host: str, deadline: float) -> ssl.SSLSocket:
    """``raw`` after a TLS handshake offering h2, without verifying the certificate (this is a
    liveness probe of one's own listener, not a client)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    context.set_alpn_protocols(["h2"])
    raw.settimeout(max(0.001, deadline - time.monotonic()))
    return context.wrap_socket(raw, server_hostname=host.strip("[]"))


def _first_frame_type(conn: socket.socket, deadline: float) -> int | None:
    """The type of the first HTTP/2 frame the server sends (its header's fourth byte); None if the
    connection ends first."""
    header = b""
    while len(header) < 4:
        conn.settimeout(max(0.001, deadline - time.monotonic()))
        data = conn.recv(4 - len(header))
        if not data:
            return None
        header += data
    return header[3]
