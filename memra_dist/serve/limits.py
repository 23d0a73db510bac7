"""What a client may hold and send, enforced in the app itself (an ASGI middleware), so the
limits hold behind Ray Serve's proxy and under plain uvicorn alike:

  * POST /v1/completions takes a JSON body only (`Content-Type: application/json`, UTF-8):
    anything else is a 415 before the body is read (a browser page cannot send JSON
    cross-origin without a CORS preflight, which this server never grants);
  * a body over `max_body_bytes` is a 413: at once when Content-Length says so, otherwise
    as soon as that many bytes came; a body that has not arrived `read_timeout_s` after the
    headers is a 408. Both answer `Connection: close` (the connection is dropped);
  * at most `max_open` requests are open at once (uploading, checked, queued, generating,
    streaming); one more is a 503 at once. GET /health, /metrics and /v1/models never count
    and never wait: they answer under any number of stalled clients;
  * a refusal of a request whose body is not all read (415, 413, 408, 503) is a lingering
    close: the answer is written at once (a client waiting for it, e.g. curl after `Expect:
    100-continue`, gets it without a 100 and sends no body), then the rest of the body is
    read and thrown away (never kept) before the response ends and the connection closes.
    Closed with a client's bytes unread, a connection is reset by the kernel, and a client
    still sending its body (Python's http.client) would see the reset, never the answer. The
    reading stops at the body's end, the client's disconnect, `LINGER_IDLE_S` without a byte,
    `LINGER_TIME_S` in all, or `max(LINGER_MIN_BYTES, LINGER_BODY_FACTOR * max_body_bytes)`
    bytes; past a bound the connection is closed as it stands. Behind Ray Serve this also
    lets the proxy read the client's bytes before it closes the connection;
  * a response the client does not read for `write_timeout_s` (a slow reader) is given up
    and its connection dropped;
  * a client gone at any stage ends its request quietly (no traceback), counted `aborted`.

Every refusal is a JSON error object with a code, and every completion request refused here
is counted in the metrics (`count(outcome)`). The app reads the body as usual
(`await request.body()`): it is replayed from here, then `receive` goes on as the server's
(so a disconnect still reaches the app). Header read timeouts and a cap on connections are
the HTTP server's: serve/uvicorn_guard.py for plain uvicorn; see deployment.py for Ray Serve."""

from __future__ import annotations

import asyncio
import json

from starlette.requests import ClientDisconnect

from .body_size import DEFAULT_MAX_BODY_BYTES, parse_size  # noqa: F401 (re-exported: the app takes them from here)

__all__ = ["Limits", "LimitState", "DEFAULT_MAX_BODY_BYTES", "READ_TIMEOUT_S", "WRITE_TIMEOUT_S", "OPEN_HEADROOM",
           "LIGHT_PATHS", "BODY_ROUTES", "LINGER_TIME_S", "LINGER_IDLE_S", "LINGER_MIN_BYTES",
           "LINGER_BODY_FACTOR", "parse_size"]

READ_TIMEOUT_S = 10.0  # headers-complete to body-complete
WRITE_TIMEOUT_S = 30.0  # one write blocked this long on a client that does not read: dropped
OPEN_HEADROOM = 256  # open requests beyond sessions + queue (uploading, being checked, being refused)
LIGHT_PATHS = frozenset({"/health", "/metrics", "/v1/models"})  # GETs that never count toward max_open
BODY_ROUTES = frozenset({("POST", "/v1/completions")})  # the requests whose body is read here
LINGER_TIME_S = 5.0  # a refused body is read and thrown away for at most this long in all,
LINGER_IDLE_S = 1.0  # stopping sooner once no byte came for this long (the client waits, or left),
LINGER_MIN_BYTES = 64 * 1024 * 1024  # or once max(this, LINGER_BODY_FACTOR * max_body_bytes) bytes
LINGER_BODY_FACTOR = 16  # were thrown away
try:
    _GROUP: tuple = (BaseExceptionGroup,)  # noqa: F821 (Python >= 3.11)
except NameError:  # pragma: no cover (Python 3.10: anyio's own groups are unwrapped by starlette)
    _GROUP = ()
_COUNTED = "/v1/completions"  # refusals of these go to the metrics (memra_api_requests_total)


class _Refused(Exception):
    """A refusal; `unread`: the request's body may not be all read yet (set where that is known)."""

    def __init__(self, status: int, message: str, code: str, outcome: str, extra: dict | None = None,
                 unread: bool | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.outcome, self.extra = status, message, code, outcome, extra
        self.unread = unread


class _Gone(Exception):
    """The client closed its connection before its request was whole."""


_TYPES = {408: "invalid_request_error", 413: "invalid_request_error", 415: "invalid_request_error",
          503: "server_error"}


async def _answer(send, receive, e: _Refused, linger_bytes: int) -> None:
    """The refusal, whole, at once; then, `e.unread`, a lingering close: the response is held
    open (all its bytes sent) while the rest of the body is read and thrown away."""
    body = json.dumps({"error": {"message": e.message, "type": _TYPES.get(e.status, "server_error"), "param": None,
                                 "code": e.code}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               (b"connection", b"close")]
    if e.status == 503:
        headers.append((b"retry-after", b"1"))
    await send({"type": "http.response.start", "status": e.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": bool(e.unread)})
    if e.unread:
        await _linger(receive, linger_bytes)
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _linger(receive, max_bytes: int) -> None:
    """Reads and drops the request's body until its end, the client's disconnect, or a bound
    (LINGER_IDLE_S without a byte, LINGER_TIME_S in all, `max_bytes`); O(1) memory."""
    loop = asyncio.get_running_loop()
    end, got = loop.time() + LINGER_TIME_S, 0
    while got <= max_bytes:
        left = min(end - loop.time(), LINGER_IDLE_S)
        if left <= 0:
            return
        try:
            msg = await asyncio.wait_for(receive(), left)
        except Exception:  # noqa: BLE001 (a bound reached, or a receive that broke: the client or the proxy is gone)
            return
        if msg["type"] != "http.request" or not msg.get("more_body", False):
            return
        got += len(msg.get("body", b""))


def _has_body(scope) -> bool:
    return _header(scope, b"content-length") not in (None, b"0") or _header(scope, b"transfer-encoding") is not None


def _header(scope, name: bytes) -> bytes | None:
    for k, v in scope.get("headers") or ():
        if k.lower() == name:
            return v
    return None


def _json_type(ctype: bytes | None) -> bool:
    if not ctype:
        return False
    parts = [p.strip() for p in ctype.decode("latin-1").lower().split(";")]
    if parts[0] != "application/json":
        return False
    for p in parts[1:]:
        k, _, v = p.partition("=")
        if k.strip() == "charset" and v.strip().strip('"') not in ("utf-8", "utf8"):
            return False
    return True


class LimitState:
    """What the middleware holds now (read by /health)."""

    def __init__(self):
        self.open = 0  # requests open now (light GETs left out)
        self.dropped_writers = 0  # responses given up on a client that did not read them


class Limits:
    """The middleware (see the module docstring). `count(outcome)`: a completion request
    refused or abandoned here ('bad_request', 'rejected', 'aborted')."""

    def __init__(self, app, *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, read_timeout_s: float = READ_TIMEOUT_S,
                 write_timeout_s: float = WRITE_TIMEOUT_S, max_open: int = 512, count=lambda outcome: None,
                 state: LimitState | None = None):
        if max_body_bytes < 1 or read_timeout_s <= 0 or write_timeout_s <= 0 or max_open < 1:
            raise ValueError("max_body_bytes, read_timeout_s, write_timeout_s and max_open must be positive")
        self.app, self.max_body_bytes, self.read_timeout_s = app, max_body_bytes, read_timeout_s
        self.write_timeout_s, self.max_open, self.count = write_timeout_s, max_open, count
        self.state = state or LimitState()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        method, path = scope.get("method", ""), scope.get("path", "")
        if method in ("GET", "HEAD") and path in LIGHT_PATHS:
            return await self.app(scope, receive, send)
        counted = path == _COUNTED
        started = [False]
        try:
            st = self.state
            if st.open >= self.max_open:
                raise _Refused(503, f"the server holds {st.open} open requests, the most it takes at once; retry "
                                    "later", "overloaded", "rejected")
            st.open += 1
            try:
                if (method, path) in BODY_ROUTES:
                    try:
                        body = await self._read_body(scope, receive)
                    except asyncio.CancelledError:  # Serve cancels a request whose client went away
                        if counted:
                            self.count("aborted")
                        raise
                    receive = _replay(body, receive)
                    await self.app(scope, receive, self._guarded(send, started, close=False))
                else:  # the app answers (404, 405) without reading a body it may have: do not keep the connection
                    await self.app(scope, receive, self._guarded(send, started, close=_has_body(scope)))
            finally:
                st.open -= 1
        except _Refused as e:
            if counted:
                self.count(e.outcome)
            if not started[0]:
                if e.unread is None:  # refused before its body was touched
                    e.unread = _has_body(scope)
                try:
                    await _answer(send, receive, e, max(LINGER_MIN_BYTES, LINGER_BODY_FACTOR * self.max_body_bytes))
                except (OSError, ClientDisconnect):
                    pass  # nobody left to tell
        except _Gone:  # before the body was whole; later, the app counts its own request
            if counted:
                self.count("aborted")
        except BaseException as e:  # noqa: BLE001 (a client gone or stalled mid-answer: end quietly)
            quiet = _quiet(e)
            if quiet is None:
                raise
            if isinstance(quiet, _Stalled):  # returning without ending the response: the server drops it
                self.state.dropped_writers += 1

    async def _read_body(self, scope, receive) -> bytes:
        if not _json_type(_header(scope, b"content-type")):
            got = (_header(scope, b"content-type") or b"none").decode("latin-1")[:60]
            raise _Refused(415, f"the body must be JSON: send 'Content-Type: application/json' (got {got!r})",
                           "unsupported_media_type", "bad_request")
        limit = self.max_body_bytes
        declared = _header(scope, b"content-length")
        if declared is not None:
            try:
                n = int(declared)
            except ValueError:
                raise _Refused(400, "the Content-Length header is not a number", "invalid_request",
                               "bad_request") from None
            if n > limit:
                raise _Refused(413, f"the body ({n} bytes) is over this server's limit of {limit} bytes "
                                    "(--max-body-bytes)", "body_too_large", "bad_request")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.read_timeout_s
        chunks, got = [], 0
        while True:
            left = deadline - loop.time()
            try:
                if left <= 0:
                    raise asyncio.TimeoutError
                msg = await asyncio.wait_for(receive(), left)
            except asyncio.TimeoutError:
                raise _Refused(408, f"the body did not arrive within {self.read_timeout_s:g} s ({got} bytes came)",
                               "request_timeout", "aborted", unread=True) from None
            except Exception:  # noqa: BLE001 (a receive that broke, e.g. Serve's proxy gone: the client is gone too)
                raise _Gone() from None
            if msg["type"] == "http.disconnect":
                raise _Gone()
            part = msg.get("body", b"")
            got += len(part)
            if got > limit:
                raise _Refused(413, f"the body is over this server's limit of {limit} bytes (--max-body-bytes)",
                               "body_too_large", "bad_request", unread=msg.get("more_body", False))
            if part:
                chunks.append(part)
            if not msg.get("more_body", False):
                return b"".join(chunks)

    def _guarded(self, send, started: list, close: bool):
        """`send`, with each write bounded by write_timeout_s (a client that does not read is
        dropped) and, `close`, the connection not kept after the answer."""
        timeout = self.write_timeout_s

        async def guarded(msg):
            if msg["type"] == "http.response.start":
                started[0] = True
                if close:
                    msg = {**msg, "headers": [*msg.get("headers", ()), (b"connection", b"close")]}
            try:
                await asyncio.wait_for(send(msg), timeout)
            except asyncio.TimeoutError:
                raise _Stalled() from None
            except OSError:  # ASGI 2.4 servers raise on a write to a closed connection
                raise ClientDisconnect() from None

        return guarded


class _Stalled(Exception):
    """A write blocked for write_timeout_s: the client does not read its answer."""


def _quiet(e: BaseException) -> BaseException | None:
    """The client-side end (gone, stalled) inside `e`, unwrapping exception groups; None when
    `e` is something else (a bug: the server logs it)."""
    if isinstance(e, (_Stalled, ClientDisconnect)):
        return e
    if _GROUP and isinstance(e, _GROUP) and e.exceptions:
        found = [_quiet(x) for x in e.exceptions]
        if all(f is not None for f in found):
            return found[0]
    return None


def _replay(body: bytes, receive):
    """The server's `receive`, with the body (already read) handed out first; a receive that
    breaks reads as the client's disconnect (it is one, or the proxy in front is gone)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replay():
        if pending:
            return pending.pop()
        try:
            return await receive()
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 (e.g. Serve's TaskCancelledError once the proxy dropped the client)
            return {"type": "http.disconnect"}

    return replay
