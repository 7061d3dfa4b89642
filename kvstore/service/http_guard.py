"""uvicorn's h11 protocol with the two guards a sidecar's HTTP port needs against idle clients.

uvicorn gives a connection no deadline until it has answered a request, and then only while the
connection sends nothing: one that never completes its request headers (idle, or trickling a
byte at a time) is held forever, open to anyone, since the token is checked per request. Such
connections used up the process's file descriptors, which gRPC needs too: its health check
failed and new clients timed out. So:

- a connection must complete a request's headers within ``REQUEST_DEADLINE_S`` of connecting,
  and each next one within that long of the previous response (sending bytes does not extend
  it); past it, the connection is closed;
- a client that stops reading its responses is cut off: while a response is being written, the
  connection is checked every ``REQUEST_DEADLINE_S``, and dropped at once (``abort``: a polite
  close would wait for the unread bytes to drain) when its writes are paused, that is when
  megabytes sent already sit unread in the socket's buffers. Such clients (pipelining requests
  and never reading) otherwise held a connection for ever, and 256 of them shut the port;
- beyond ``MAX_CONNECTIONS`` open at once, a new connection is closed as soon as it is made.
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.h11_impl import H11Protocol

REQUEST_DEADLINE_S = 10.0
MAX_CONNECTIONS = 256


class GuardedH11Protocol(H11Protocol):
    _request_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > MAX_CONNECTIONS:
            transport.close()
            return
        self._await_request()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._await_request()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._request_deadline is not None:
            self._request_deadline.cancel()
        super().connection_lost(exc)

    def _await_request(self) -> None:
        """Close the connection unless a request beyond the current one starts in time."""
        if self._request_deadline is not None:
            self._request_deadline.cancel()
        self._request_deadline = self.loop.call_later(REQUEST_DEADLINE_S, self._close_if_idle, self.cycle)

    def _close_if_idle(self, cycle_then) -> None:
        """Close unless a request began since; while one is answered, drop the connection if the
        client is not reading it, else look again later (a slow handler is not the client's fault)."""
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            if self.flow.write_paused:
                self.transport.abort()
            else:
                self._request_deadline = self.loop.call_later(REQUEST_DEADLINE_S, self._close_if_idle, self.cycle)
        elif self.cycle is cycle_then:
            self.transport.close()
