"""The API under plain uvicorn, with what the app itself cannot enforce because it never sees
a request before its headers are whole:

  * a header read timeout: a connection that has not sent a whole request head within
    `header_timeout_s` of opening (or of its last answer) is closed (408 if it sent part);
  * a cap on request-head bytes (431 beyond `max_header_bytes`);
  * a cap on open connections: one over `max_connections` gets a 503 and is closed;
  * idle keep-alive connections closed after `keep_alive_s`.

The 503, 431 and 408 here are each a lingering close: the answer is written, the sending side
shut (the client reads the answer, then the end), and what the client still sends is read and
thrown away until it closes, for at most `LINGER_S` or `LINGER_BYTES`; only then is the
connection closed. Closed at once, a connection with the client's bytes unread is reset by the
kernel, and a client still sending (http.client, requests) would see the reset, not the answer.

    server = uvicorn.Server(uvicorn_config(build_app(host, max_queue), "127.0.0.1", 8000))

Ray Serve's proxy (what `memra-dist serve` runs) has none of these settings but the
keep-alive timeout (deployment.py sets it): a client that never finishes its headers holds
a socket there, though no replica slot and no event-loop time. Body limits, the open-request
cap and slow readers are the app's (serve/limits.py) and hold under both."""

from __future__ import annotations

import json

__all__ = ["uvicorn_config", "guarded_protocol", "HEADER_TIMEOUT_S", "MAX_HEADER_BYTES", "MAX_CONNECTIONS",
           "KEEP_ALIVE_S", "LINGER_S", "LINGER_BYTES"]

HEADER_TIMEOUT_S = 10.0
MAX_HEADER_BYTES = 64 * 1024
MAX_CONNECTIONS = 1024
KEEP_ALIVE_S = 5
LINGER_S = 2.0  # after a refusal here: the most time spent reading and dropping what the client sends,
LINGER_BYTES = 64 * 1024 * 1024  # and the most bytes

_REASONS = {408: "Request Timeout", 431: "Request Header Fields Too Large", 503: "Service Unavailable"}


def _canned(status: int, code: str, message: str) -> bytes:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error" if status < 500 else
                                 "server_error", "param": None, "code": code}}).encode()
    head = (f"HTTP/1.1 {status} {_REASONS[status]}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n")
    if status == 503:
        head += "retry-after: 1\r\n"
    return head.encode() + b"\r\n" + body


def guarded_protocol(header_timeout_s: float = HEADER_TIMEOUT_S, max_header_bytes: int = MAX_HEADER_BYTES,
                     max_connections: int = MAX_CONNECTIONS):
    """uvicorn's httptools protocol class with the header timeout and the two caps."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol  # noqa: PLC0415

    class GuardedHttpTools(HttpToolsProtocol):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self._timer = None  # the head timeout; after a refusal, the lingering close's end
            self._head_bytes, self._tail = 0, b""  # the head's bytes so far; the last 3 of them
            self._in_head = False  # waiting for (the rest of) a request head
            self._lingering = None  # bytes dropped since a refusal here (None: none)

        def connection_made(self, transport):
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                self._refuse(_canned(503, "too_many_connections", f"the server holds {max_connections} "
                                     "connections, the most it takes; retry later"))
                return
            self._await_head()

        def _refuse(self, answer: bytes) -> None:
            """A lingering close (see the module docstring): the answer, the sending side shut,
            then what comes dropped until the client closes or LINGER_S / LINGER_BYTES."""
            self._in_head = False
            self._stop_timer()
            self._unset_keepalive_if_required()
            self._lingering = 0
            self.transport.write(answer)
            if self.transport.can_write_eof():
                self.transport.write_eof()
            self._timer = self.loop.call_later(LINGER_S, self.transport.close)

        def _await_head(self) -> None:
            self._stop_timer()
            self._in_head, self._head_bytes, self._tail = True, 0, b""
            self._timer = self.loop.call_later(header_timeout_s, self._head_timeout)

        def _stop_timer(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _head_timeout(self) -> None:
            self._timer = None
            if not self._in_head or self.transport.is_closing():
                return
            if self._head_bytes:
                self._refuse(_canned(408, "request_timeout", f"the request head did not arrive within "
                                     f"{header_timeout_s:g} s"))
            else:  # nothing came: nothing to answer, nothing unread
                self.transport.close()

        def data_received(self, data: bytes) -> None:
            if self._lingering is not None:  # refused: dropped, never parsed
                self._lingering += len(data)
                if self._lingering > LINGER_BYTES:
                    self.transport.close()
                return
            if self._in_head:  # counted before the parser sees them: a head read whole is bounded too
                probe = self._tail + data  # (the blank line that ends the head may straddle two reads)
                end = probe.find(b"\r\n\r\n")
                self._head_bytes += len(data) if end < 0 else max(0, end + 4 - len(self._tail))
                self._tail = probe[-3:]
                if self._head_bytes > max_header_bytes:
                    self._refuse(_canned(431, "headers_too_large", f"the request head is over "
                                         f"{max_header_bytes} bytes"))
                    return
            super().data_received(data)

        def on_headers_complete(self) -> None:
            self._in_head = False
            self._stop_timer()
            super().on_headers_complete()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
                self._await_head()  # the next request's head (keep-alive) has the same bound

        def connection_lost(self, exc) -> None:
            self._in_head = False
            self._stop_timer()
            super().connection_lost(exc)

    return GuardedHttpTools


def uvicorn_config(app, host: str = "127.0.0.1", port: int = 8000, *, header_timeout_s: float = HEADER_TIMEOUT_S,
                   max_header_bytes: int = MAX_HEADER_BYTES, max_connections: int = MAX_CONNECTIONS,
                   keep_alive_s: int = KEEP_ALIVE_S, **kw):
    """A uvicorn.Config serving `app` with the guarded protocol (the rest: uvicorn's keywords)."""
    import uvicorn  # noqa: PLC0415

    kw.setdefault("log_level", "warning")
    kw.setdefault("lifespan", "on")
    return uvicorn.Config(app, host=host, port=port, timeout_keep_alive=keep_alive_s,
                          http=guarded_protocol(header_timeout_s, max_header_bytes, max_connections), **kw)
