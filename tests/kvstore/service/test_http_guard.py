"""The HTTP port's guards against idle clients, on a real uvicorn server over real sockets."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest
from fastapi import FastAPI, Response

from kvstore.service import http_guard
from kvstore.service.http import HttpServer

DEADLINE_S = 0.5
BIG_BYTES = 1 << 20


@pytest.fixture
def server(monkeypatch):
    """A real ``HttpServer`` on a free port, answering ``GET /``, ``/slow`` and ``/big``; the
    server and its (host, port)."""
    monkeypatch.setattr(http_guard, "REQUEST_DEADLINE_S", DEADLINE_S)
    monkeypatch.setattr(http_guard, "MAX_CONNECTIONS", 4)
    app = FastAPI()
    app.get("/")(lambda: {"ok": True})

    @app.get("/slow")
    async def slow():  # answered after the deadline: a slow scrape, a large page
        await asyncio.sleep(3 * DEADLINE_S)
        return {"ok": "slow"}
    app.get("/big")(lambda: Response(b"x" * BIG_BYTES))
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server = HttpServer(app, "127.0.0.1:0")
    url = asyncio.run_coroutine_threadsafe(server.start(), loop).result(10)
    yield server, url.removeprefix("http://").rstrip("/").split(":")
    asyncio.run_coroutine_threadsafe(server.stop(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


@pytest.fixture
def served(server):
    """The (host, port) of ``server``."""
    return server[1]


def connect(address) -> socket.socket:
    return socket.create_connection((address[0], int(address[1])), timeout=5)


def closed_within(sock: socket.socket, seconds: float, trickle: bytes = b"") -> bool:
    """Whether the server closes ``sock`` within ``seconds``, sending ``trickle`` a byte every 0.1 s."""
    end = time.monotonic() + seconds
    sock.settimeout(0.1)
    while time.monotonic() < end:
        try:
            if sock.recv(65536) == b"":
                return True
        except socket.timeout:
            pass
        except ConnectionResetError:
            return True
        if trickle:
            try:
                sock.send(trickle[:1])
            except (BrokenPipeError, ConnectionResetError):
                return True
            trickle = trickle[1:] or b"x"
    return False


def answered(sock: socket.socket) -> bytes:
    """Send one request; its whole response (head and Content-Length body)."""
    sock.sendall(b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\n")
    sock.settimeout(5)
    response = b""
    while b"\r\n\r\n" not in response:
        response += sock.recv(65536)
    head, body = response.split(b"\r\n\r\n", 1)
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
    while len(body) < length:
        body += sock.recv(65536)
    return head + b"\r\n\r\n" + body


def test_a_connection_that_sends_nothing_is_closed_at_the_deadline(served):
    with connect(served) as idle:
        assert closed_within(idle, DEADLINE_S + 2)


def test_a_connection_trickling_its_headers_is_closed_at_the_deadline(served):
    with connect(served) as slow:
        slow.sendall(b"GET / HTTP/1.1\r\n")
        assert closed_within(slow, DEADLINE_S + 2, trickle=b"X-Slow: " + b"y" * 200)


def test_after_a_response_the_next_request_has_the_deadline_too(served):
    with connect(served) as client:
        assert answered(client).startswith(b"HTTP/1.1 200")
        client.sendall(b"GET / HTTP/1.1\r\n")  # the next request starts, and never ends
        assert closed_within(client, DEADLINE_S + 2, trickle=b"X-Slow: " + b"y" * 200)


def test_a_prompt_client_is_served_and_kept_alive_past_no_deadline_it_meets(served):
    with connect(served) as client:
        for _ in range(3):
            assert answered(client).startswith(b"HTTP/1.1 200")
            time.sleep(DEADLINE_S / 2)


def test_a_slow_response_and_one_pipelined_behind_a_fast_one_are_both_served(served):
    with connect(served) as client:
        client.sendall(b"GET /slow HTTP/1.1\r\nHost: localhost\r\n\r\n")
        assert b'"slow"' in received(client, 5, until=b'"slow"}')
        client.sendall(b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\nGET /slow HTTP/1.1\r\nHost: localhost\r\n\r\n")
        assert b'"slow"' in received(client, 5, until=b'"slow"}'), "the pipelined response was cut off"


def received(sock: socket.socket, seconds: float, until: bytes) -> bytes:
    """What arrives on ``sock`` within ``seconds``, stopping once it ends with ``until`` or closes."""
    data, end = b"", time.monotonic() + seconds
    sock.settimeout(0.1)
    while time.monotonic() < end and not data.endswith(until):
        try:
            chunk = sock.recv(65536)
        except socket.timeout:
            continue
        if not chunk:
            break
        data += chunk
    return data


def test_connections_beyond_the_cap_are_closed_at_once_and_served_again_once_others_go(served):
    held = [connect(served) for _ in range(4)]
    try:
        with connect(served) as extra:
            assert closed_within(extra, DEADLINE_S / 2), "the fifth connection is closed before any deadline"
    finally:
        for sock in held:
            sock.close()
    time.sleep(0.2)
    with connect(served) as client:
        assert answered(client).startswith(b"HTTP/1.1 200")


def test_a_client_that_stops_reading_its_responses_is_dropped(server):
    """Pipelined requests for large responses, never read: the server's writes pause once the
    socket buffers are full, and the connection is dropped at the next deadline instead of being
    held (and counted against the cap) for ever."""
    http, address = server
    connections = http._server.server_state.connections
    reader = socket.socket()
    reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    with reader:
        reader.connect((address[0], int(address[1])))
        reader.sendall(b"GET /big HTTP/1.1\r\nHost: localhost\r\n\r\n" * 40)
        end = time.monotonic() + DEADLINE_S + 5
        while connections and time.monotonic() < end:
            time.sleep(0.05)
        assert not connections, "a connection whose client reads nothing is still held"
