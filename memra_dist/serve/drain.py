"""The replica's side of `serve`'s graceful stop (SIGTERM; serve_cli.py drives it through the
deployment, deployment.py):

    drain = Drain()
    app = DrainGate(app, drain)   # the outermost ASGI layer: counts completions, marks new ones
    drain.start()                 # POST /v1/completions: 503 "draining"; GET /health: 503
    drain.open                    # completion requests open now, from their head to their last byte
    drain.cut()                   # what is still open ends now (thread-safe)

On a cut, each listener (`on_cut`) runs on the app's event loop: a stream that already began
ends with an error event (code "shutting_down"), then `data: [DONE]`; a request still queued,
or generating without a stream, is answered 503 "shutting_down" (serve/api.py)."""

from __future__ import annotations

import asyncio

from .protocol import ApiError

__all__ = ["Drain", "DrainGate", "DRAINING", "SHUTTING_DOWN", "cut_error", "draining_error", "refused"]

DRAINING = "draining"  # the error code of a completion refused while the server drains
SHUTTING_DOWN = "shutting_down"  # the error code of one cut short by the stop
_PATH = "/v1/completions"
_MARK = "memra.drain.refuse"  # in the scope of a completion that came while the server drains


def draining_error() -> ApiError:
    return ApiError(503, "the server is draining before it stops and takes no new requests; retry on another",
                    None, DRAINING)


def refused(scope) -> bool:
    """Whether this completion came while the server drains (DrainGate marked it)."""
    return bool(scope.get(_MARK))


def cut_error() -> ApiError:
    return ApiError(503, "the server is shutting down: this completion was stopped before it finished; retry it", None,
                    SHUTTING_DOWN)


class Drain:
    """Whether the server drains, how many completions are open, and the cut."""

    def __init__(self):
        self.draining = False
        self.cutting = False
        self.open = 0  # changed on the app's loop only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._cut_fut: asyncio.Future | None = None
        self._listeners: set = set()

    def bind(self) -> None:
        """The app's event loop (the one serving requests): cuts are run there."""
        if self._loop is None:
            self._loop = asyncio.get_running_loop()

    def start(self) -> None:
        self.draining = True

    def cut(self) -> None:
        """End what is open now; from any thread (or the app's loop itself)."""
        self.draining = True
        loop = self._loop
        if loop is None:  # no request ever came: nothing to cut
            self.cutting = True
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            self._cut()
        else:
            loop.call_soon_threadsafe(self._cut)

    def _cut(self) -> None:
        self.cutting = True
        if self._cut_fut is not None and not self._cut_fut.done():
            self._cut_fut.set_result(None)
        for fn in list(self._listeners):
            fn()

    def cut_future(self) -> asyncio.Future:
        """Done once a cut came (on the app's loop): a queued or waiting request awaits it too."""
        if self._cut_fut is None:
            self._cut_fut = asyncio.get_running_loop().create_future()
            if self.cutting:
                self._cut_fut.set_result(None)
        return self._cut_fut

    def on_cut(self, fn) -> None:
        self._listeners.add(fn)

    def off_cut(self, fn) -> None:
        self._listeners.discard(fn)

    def state(self) -> dict:
        return {"draining": self.draining, "cut": self.cutting, "open": self.open}


class DrainGate:
    """ASGI: counts every POST /v1/completions from its head to its last byte (`drain.open`).
    One that comes while draining is not counted but marked (`refused(scope)`): the app reads
    its body as any other (within serve/limits.py's bounds, so the client reads the answer
    rather than a reset) and answers 503 "draining"."""

    def __init__(self, app, drain: Drain):
        self.app, self.drain = app, drain

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("path") != _PATH or scope.get("method") != "POST":
            return await self.app(scope, receive, send)
        d = self.drain
        d.bind()
        if d.draining:
            return await self.app({**scope, _MARK: True}, receive, send)
        d.open += 1
        try:
            await self.app(scope, receive, send)
        finally:
            d.open -= 1
