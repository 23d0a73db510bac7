"""The OpenAI-compatible HTTP API (a FastAPI ASGI app) over one EngineHost:

    POST /v1/completions   text completion; "stream": true answers text/event-stream
    GET  /v1/models        the one model served
    GET  /health           200 while the engine is loaded
    GET  /metrics          Prometheus text (serve/api_metrics.py)

A request is validated (400 naming the field), tokenized and checked against the context
(400) before it queues; it then waits for one of the engine's sessions (429 at once when
--max-queue requests already wait). The engine runs on a worker thread; its tokens cross to
the event loop and go out as SSE chunks (or one JSON object). When the client goes away the
handler is cancelled, the stream callback raises at the engine's next round, the request is
aborted and its session freed for the next waiter. A `traceparent` header parents the
request's `memra.request` span.

Ray Serve runs this app in a replica (serve/deployment.py); `uvicorn` can run it directly
(tests do, over a fake engine)."""

from __future__ import annotations

import asyncio
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from .admission import Admission, QueueFull
from .api_metrics import CONTENT_TYPE, ApiMetrics
from .host import ClientGone
from .protocol import (SSE_DONE, ApiError, chunk, completion, finish_reason, models_list, parse_completion, sse,
                       usage)

__all__ = ["build_app"]

_END = object()


class _Run:
    """One admitted request: its generation on a worker thread, its tokens on an asyncio queue."""

    def __init__(self, api: "_Api", prep, traceparent: str | None):
        self.api, self.prep, self.traceparent = api, prep, traceparent
        self.loop = asyncio.get_running_loop()
        self.q: asyncio.Queue = asyncio.Queue()
        self.cancelled = False  # set from the loop; read by the worker thread (a plain bool is atomic)
        self.fut: asyncio.Future | None = None
        self.created = int(time.time())
        self.id = f"cmpl-{uuid.uuid4().hex}"
        self.include_usage = False  # stream_options.include_usage

    def start(self) -> None:
        """The session is this request's: run it. The session is released when the worker
        thread is done (an aborted request unwinds first), never when the handler ends."""
        self.fut = self.loop.run_in_executor(self.api.pool, self._work)
        self.fut.add_done_callback(self._done)

    def _work(self):
        return self.api.host.run(self.prep, self._on_tokens, self.traceparent)

    def _on_tokens(self, ids) -> None:  # worker thread, once per round (pp=1) or burst (pp>1)
        if self.cancelled:
            raise ClientGone("the client went away")
        ids = [int(t) for t in ids]
        self.api.metrics.tokens(len(ids))
        self.loop.call_soon_threadsafe(self.q.put_nowait, ids)

    def _done(self, fut: asyncio.Future) -> None:  # on the loop, after the thread's last tokens
        self.api.admission.release()
        exc = fut.exception() if not fut.cancelled() else None
        if exc is None:
            self.api.metrics.outcome("ok")
        else:
            self.api.metrics.outcome("aborted" if self.cancelled or isinstance(exc, ClientGone) else "error")
        self.q.put_nowait(_END)

    def abort(self) -> None:
        self.cancelled = True

    async def result(self):
        try:
            return await asyncio.shield(self.fut)
        finally:
            self.abort()  # cancelled (client gone): the engine stops at its next round

    async def events(self):
        """SSE chunks: text deltas, a last chunk with the finish_reason, [DONE]."""
        host, prep, model = self.api.host, self.prep, self.api.host.model_name
        out: list[int] = []
        sent = ""
        try:
            while True:
                ids = await self.q.get()
                if ids is _END:
                    break
                out.extend(ids)
                text = host.text(prep.ids, out)
                if text.endswith("\ufffd") or not text.startswith(sent) or len(text) == len(sent):
                    continue  # an incomplete character (or nothing new) waits for the next tokens
                yield sse(chunk(self.id, self.created, model, text[len(sent):]))
                sent = text
            try:
                res = self.fut.result()
            except Exception as e:  # noqa: BLE001 (the engine failed mid-stream: say so in the stream)
                yield sse(_server_error(e).body())
                return
            final = host.text(prep.ids, res.token_ids)
            rest = final[len(sent):] if final.startswith(sent) else ""
            yield sse(chunk(self.id, self.created, model, rest, finish_reason(res.token_ids, host.eos_ids)))
            if self.include_usage:
                yield sse(chunk(self.id, self.created, model, "", use=usage(len(prep.ids), len(res.token_ids))))
            yield SSE_DONE
        finally:
            self.abort()


class _SSEResponse(StreamingResponse):
    def __init__(self, run: _Run):
        super().__init__(run.events(), media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.run = run

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:  # the stream ended, failed, or its client went away (even before the first chunk)
            self.run.abort()


def _server_error(e: BaseException) -> ApiError:
    msg = " ".join(str(e).split())[:300] or type(e).__name__
    return ApiError(500, f"the engine failed: {msg}", None, "engine_error")


class _Api:
    def __init__(self, host, max_queue: int):
        self.host = host
        self.admission = Admission(host.sessions, max_queue)
        self.metrics = ApiMetrics(lambda: self.admission.active, lambda: self.admission.waiting)
        self.pool = ThreadPoolExecutor(max_workers=host.sessions, thread_name_prefix="memra-session")
        self.started = int(time.time())

    def close(self) -> None:
        self.pool.shutdown(wait=True)


def _error(e: ApiError):
    headers = {"Retry-After": "1"} if e.status == 429 else None
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


async def _admit(api: _Api, request) -> tuple[object, object]:
    """(parsed body, prepared request) with a session held; ApiError otherwise."""
    req = parse_completion(await request.body(), api.host.model_name)
    prep = api.host.prepare(req)
    try:
        ticket = api.admission.enter()
    except QueueFull as e:
        raise ApiError(429, str(e), None, "queue_full") from None
    try:
        await _queued(ticket, request)
    except (asyncio.CancelledError, ClientGone):  # the client went away while queued: it left the queue
        api.metrics.outcome("aborted")
        raise
    return req, prep


QUEUED_POLL_S = 0.1  # how often a queued request checks that its client is still there


async def _queued(ticket, request) -> None:
    """Wait for a session. The server does not cancel a handler whose client closed its
    connection, so a queued request asks every QUEUED_POLL_S; a client gone raises ClientGone,
    and the cancelled wait leaves the queue (or passes on a session handed to it just then)."""
    wait = asyncio.ensure_future(ticket.wait())
    try:
        while not wait.done():
            await asyncio.wait({wait}, timeout=QUEUED_POLL_S)
            if not wait.done() and await request.is_disconnected():
                raise ClientGone("the client went away while queued")
        wait.result()
    finally:
        if not wait.done():
            wait.cancel()
            try:
                await wait
            except asyncio.CancelledError:
                pass


def build_app(host, max_queue: int, close_host: bool = True):
    """The ASGI app. The app's shutdown (lifespan) closes the host: Ray Serve runs it when
    the replica stops, uvicorn when it exits."""
    api = _Api(host, max_queue)

    @asynccontextmanager
    async def lifespan(_app):
        try:
            yield
        finally:
            await asyncio.get_running_loop().run_in_executor(None, api.close)
            if close_host:
                await asyncio.get_running_loop().run_in_executor(None, host.close)

    app = FastAPI(title="memra-dist", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.api = api

    @app.post("/v1/completions")
    async def completions(request: Request):
        try:
            req, prep = await _admit(api, request)
        except ApiError as e:
            api.metrics.outcome(e.outcome)
            return _error(e)
        except ClientGone:  # counted as aborted; nobody reads this answer
            return _error(ApiError(499, "the client went away while queued", None, "client_closed"))
        run = _Run(api, prep, request.headers.get("traceparent"))
        try:
            run.start()
        except BaseException:
            api.admission.release()
            raise
        if req.stream:
            run.include_usage = req.include_usage
            return _SSEResponse(run)
        try:
            res = await run.result()
        except ClientGone:
            return _error(ApiError(499, "the client went away", None, "client_closed"))
        except Exception as e:  # noqa: BLE001
            return _error(_server_error(e))
        text = host.text(prep.ids, res.token_ids)
        return JSONResponse(completion(run.id, run.created, host.model_name, text,
                                       finish_reason(res.token_ids, host.eos_ids), len(prep.ids),
                                       len(res.token_ids)))

    @app.get("/v1/models")
    async def models():
        return JSONResponse(models_list(host.model_name, api.started))

    @app.get("/health")
    async def health():
        return JSONResponse({"status": "ok", "model": host.model_name, "sessions": host.sessions,
                             "in_flight": api.admission.active, "queued": api.admission.waiting})

    @app.get("/metrics")
    async def metrics():
        return Response(api.metrics.render(), media_type=CONTENT_TYPE)

    @app.exception_handler(404)
    async def not_found(request: Request, exc):
        return _error(ApiError(404, f"no route {request.method} {request.url.path} (try POST /v1/completions, "
                                    "GET /v1/models, /health, /metrics)", None, "not_found"))

    @app.exception_handler(405)
    async def not_allowed(request: Request, exc):
        return _error(ApiError(405, f"{request.method} is not allowed on {request.url.path}", None,
                               "method_not_allowed", "invalid_request_error"))

    return app
