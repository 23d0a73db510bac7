"""The OpenAI-compatible HTTP API (a FastAPI ASGI app) over one EngineHost:

    POST /v1/completions   text completion; "stream": true answers text/event-stream
    GET  /v1/models        the one model served
    GET  /health           200 while the engine is loaded; 503 {"status": "draining"} while it drains
    GET  /metrics          Prometheus text (serve/api_metrics.py)

The body arrives through serve/limits.py (JSON only, size and time bounded, at most so many
requests open). It is parsed, tokenized and checked against the context (400 naming the
field) on a worker thread, never on the event loop; the request then waits for one of the
engine's sessions (429 at once when --max-queue requests already wait). The engine runs on a
worker thread; its tokens cross to the event loop and go out as SSE chunks (or one JSON
object), decoded on a worker thread. The client is watched from its body on: when it goes
away (queued, generating or streaming) the stream callback raises at the engine's next
round, the request is aborted, counted `aborted`, and its session freed for the next waiter.
A request that fails in the engine fails alone: a 500 (a stream: an error event, then
[DONE]), counted `error`. A `traceparent` header parents the request's `memra.request` span
(a malformed one is ignored, with a short warning a minute at most). While the server drains
(serve/drain.py: SIGTERM to `memra-dist serve`) a new completion is a 503 "draining" and the
open ones go on; a cut ends a begun stream with an error event, then [DONE], and answers a
queued (or unstreamed) request 503 "shutting_down".

Ray Serve runs this app in a replica (serve/deployment.py); `uvicorn` can run it directly
(serve/uvicorn_guard.py; tests do, over a fake engine)."""

from __future__ import annotations

import asyncio
import logging
import re
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from .admission import Admission, QueueFull
from .api_metrics import CONTENT_TYPE, ApiMetrics
from .drain import Drain, DrainGate, cut_error, draining_error, refused
from .host import ClientGone
from .limits import DEFAULT_MAX_BODY_BYTES, OPEN_HEADROOM, READ_TIMEOUT_S, WRITE_TIMEOUT_S, Limits, LimitState
from .protocol import (SSE_DONE, ApiError, chunk, completion, finish_reason, models_list, parse_completion, sse,
                       usage)

__all__ = ["build_app", "CPU_THREADS"]

_END = object()
_CUT = object()  # the server stops now: the stream ends with an error event
CPU_THREADS = 2  # parsing and tokenizing (detokenizing has a thread of its own): never on the event loop
_log = logging.getLogger("memra_dist.serve")


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
            if getattr(self.api.host, "prefix_cache", False):
                self.api.metrics.prefix(len(self.prep.ids), fut.result().stats.get("cached_tokens", 0))
        elif self.cancelled or isinstance(exc, ClientGone):
            self.api.metrics.outcome("aborted")
        else:
            self.api.metrics.outcome("error")
            _log.error("request %s failed in the engine (the server goes on): %s: %s", self.id,
                       type(exc).__name__, " ".join(str(exc).split())[:300], exc_info=exc)
        self.q.put_nowait(_END)

    def abort(self) -> None:
        self.cancelled = True

    def cut(self) -> None:  # on the loop: the server stops now (serve/drain.py)
        self.cancelled = True
        self.q.put_nowait(_CUT)

    async def text(self, out: list[int]) -> str:
        """The completion's text so far, decoded on a worker thread."""
        prep = self.prep
        return await self.loop.run_in_executor(self.api.texts, self.api.host.text, prep.ids, tuple(out), prep.base)

    async def events(self):
        """SSE chunks: text deltas, a last chunk with the finish_reason, [DONE]. An engine
        failure ends the stream with an error event, then [DONE]."""
        host, prep, model = self.api.host, self.prep, self.api.host.model_name
        out: list[int] = []
        sent = ""
        try:
            ended = cut = False
            while not (ended or cut):
                got = [await self.q.get()]
                while not self.q.empty():  # all that came meanwhile: one decode for them
                    got.append(self.q.get_nowait())
                before = len(out)
                for ids in got:
                    if ids is _END:
                        ended = True
                    elif ids is _CUT:
                        cut = True
                    else:
                        out.extend(ids)
                if len(out) == before:
                    continue
                text = await self.text(out)
                if text.endswith("\ufffd") or not text.startswith(sent) or len(text) == len(sent):
                    continue  # an incomplete character (or nothing new) waits for the next tokens
                yield sse(chunk(self.id, self.created, model, text[len(sent):]))
                sent = text
            if cut and not (self.fut.done() and not self.fut.cancelled() and self.fut.exception() is None):
                yield sse(cut_error().body())  # the server stops before this completion ended
                yield SSE_DONE
                return
            try:
                res = self.fut.result()
            except Exception as e:  # noqa: BLE001 (the engine failed mid-stream: say so in the stream)
                yield sse(_server_error(e).body())
                yield SSE_DONE
                return
            final = await self.text(res.token_ids)
            rest = final[len(sent):] if final.startswith(sent) else ""
            yield sse(chunk(self.id, self.created, model, rest, finish_reason(res.token_ids, host.eos_ids)))
            if self.include_usage:
                yield sse(chunk(self.id, self.created, model, "", use=usage(len(prep.ids), len(res.token_ids),
                                                                   res.stats.get("cached_tokens", 0))))
            yield SSE_DONE
        finally:
            self.abort()
            self.api.drain.off_cut(self.cut)


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
            self.run.api.drain.off_cut(self.run.cut)


def _server_error(e: BaseException) -> ApiError:
    return ApiError(500, f"the engine failed on this request ({type(e).__name__}); the server goes on", None,
                    "engine_error")


class _Api:
    def __init__(self, host, max_queue: int, drain: Drain | None = None):
        self.host = host
        self.admission = Admission(host.sessions, max_queue)
        self.metrics = ApiMetrics(lambda: self.admission.active, lambda: self.admission.waiting)
        self.drain = drain or Drain()
        self.pool = ThreadPoolExecutor(max_workers=host.sessions, thread_name_prefix="memra-session")
        self.cpu = ThreadPoolExecutor(max_workers=CPU_THREADS, thread_name_prefix="memra-cpu")  # parse, tokenize
        self.texts = ThreadPoolExecutor(max_workers=1, thread_name_prefix="memra-text")  # streams never wait on them
        self.started = int(time.time())
        self.traceparents = _Traceparents()
        self.limits = LimitState()

    def prepare(self, raw: bytes):
        """(parsed body, prepared request); ApiError when refused. Blocking: a cpu-pool thread."""
        req = parse_completion(raw, self.host.model_name)
        return req, self.host.prepare(req)

    def close(self) -> None:
        self.cpu.shutdown(wait=True)
        self.texts.shutdown(wait=True)
        self.pool.shutdown(wait=True)


_TRACEPARENT = re.compile(r"[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}(-[!-~]*)?")
WARN_EVERY_S = 60.0


class _Traceparents:
    """A malformed `traceparent` header is ignored (the request gets a trace of its own), with
    one short warning line a minute at most, counting those ignored since the last one."""

    def __init__(self):
        self.ignored = self._unsaid = 0
        self._said = -WARN_EVERY_S

    def check(self, tp: str | None) -> str | None:
        if tp is None or (len(tp) <= 256 and _TRACEPARENT.fullmatch(tp) and not tp.startswith("ff")
                          and tp[3:35] != "0" * 32 and tp[36:52] != "0" * 16):
            return tp
        self.ignored += 1
        self._unsaid += 1
        now = time.monotonic()
        if now - self._said >= WARN_EVERY_S:
            shown = repr(tp[:60]) + ("..." if len(tp) > 60 else "")
            print(f"memra-dist: warning: ignoring a malformed traceparent header {shown} ({self._unsaid} ignored "
                  f"since the last warning)", file=sys.stderr, flush=True)
            self._said, self._unsaid = now, 0
        return None


def _error(e: ApiError, close: bool = False):
    headers = {"Retry-After": "1"} if e.status in (429, 503) else {}
    if close:  # a draining server: the client's next request goes elsewhere
        headers["Connection"] = "close"
    return JSONResponse(e.body(), status_code=e.status, headers=headers or None)


class _Watch:
    """Ends when the client closes its connection (reads `receive` after the body: the
    server's http.disconnect). The server does not cancel a handler whose client left."""

    def __init__(self, receive):
        self.task = asyncio.ensure_future(self._run(receive))

    @staticmethod
    async def _run(receive) -> None:
        try:
            while (await receive())["type"] != "http.disconnect":
                pass
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 (a receive that broke: the client is gone all the same)
            return

    @property
    def gone(self) -> bool:
        return self.task.done() and not self.task.cancelled()

    async def close(self) -> None:
        if not self.task.done():
            self.task.cancel()
            try:
                await self.task
            except asyncio.CancelledError:
                pass


async def _queued(ticket, watch: _Watch, cut: asyncio.Future, release) -> None:
    """Wait for a session, or for the client to go away (ClientGone), or for the server's cut
    (ApiError 503); the cancelled wait leaves the queue (or passes on a session handed to it
    just then). A session handed to it just before its handler was cancelled (Serve cancels
    the handler of a client that went away) is passed on too (`release`): no run holds it."""
    wait = asyncio.ensure_future(ticket.wait())
    got = False
    try:
        await asyncio.wait({wait, watch.task, cut}, return_when=asyncio.FIRST_COMPLETED)
        if not wait.done():
            if cut.done() and not watch.gone:
                raise cut_error()
            raise ClientGone("the client went away while queued")
        wait.result()
        got = True
    finally:
        if wait.done() and not got and not wait.cancelled() and wait.exception() is None:
            release()
        if not wait.done():
            wait.cancel()
            try:
                await wait
            except asyncio.CancelledError:
                pass


async def _completion(api: _Api, request: Request):
    """POST /v1/completions, with the client watched from the body on. Each request is
    counted once: refused here, gone before its run started (here), or by its run."""
    host, loop = api.host, asyncio.get_running_loop()
    raw = await request.body()  # whole and within its limits (serve/limits.py)
    if refused(request.scope):  # it came while the server drains (serve/drain.py)
        api.metrics.outcome("rejected")
        return _error(draining_error(), close=True)
    watch = _Watch(request.receive)
    cut = api.drain.cut_future()
    run = None
    try:
        try:
            req, prep = await loop.run_in_executor(api.cpu, api.prepare, raw)
            if api.drain.cutting:
                raise cut_error()
            try:
                ticket = api.admission.enter()
            except QueueFull as e:
                raise ApiError(429, str(e), None, "queue_full") from None
            # the client gone (or the server's cut) while queued: it left the queue
            await _queued(ticket, watch, cut, api.admission.release)
        except ApiError as e:
            api.metrics.outcome(e.outcome)
            return _error(e)
        run = _Run(api, prep, api.traceparents.check(request.headers.get("traceparent")))
        try:
            run.start()
        except BaseException:
            api.admission.release()
            raise
        if req.stream:
            api.drain.on_cut(run.cut)  # the stream ends with an error event when the server stops now
            if api.drain.cutting:
                run.cut()
            run.include_usage = req.include_usage
            await watch.close()  # the streaming response watches the client itself
            return _SSEResponse(run)
        try:
            await asyncio.wait({run.fut, watch.task, cut}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not run.fut.done():  # the client went away, the server's cut (or the handler was cancelled)
                run.abort()
        if not run.fut.done():
            if cut.done() and not watch.gone:
                return _error(cut_error())  # the run counts itself (aborted)
            raise ClientGone("the client went away")
        try:
            res = run.fut.result()
        except ClientGone:
            raise
        except Exception as e:  # noqa: BLE001 (this request failed in the engine; the server goes on)
            return _error(_server_error(e))
        text = await run.text(res.token_ids)
        return JSONResponse(completion(run.id, run.created, host.model_name, text,
                                       finish_reason(res.token_ids, host.eos_ids), len(prep.ids),
                                       len(res.token_ids), res.stats.get("cached_tokens", 0)))
    except (asyncio.CancelledError, ClientGone) as e:  # the client went away (Serve cancels the handler)
        if run is None:
            api.metrics.outcome("aborted")  # before its run started (a run counts itself)
        else:
            run.abort()  # cancelled before its stream began: the run ends at its next round
        if isinstance(e, ClientGone):  # nobody reads this answer
            return _error(ApiError(499, "the client went away", None, "client_closed"))
        raise
    finally:
        await watch.close()


def build_app(host, max_queue: int, close_host: bool = True, *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
              read_timeout_s: float = READ_TIMEOUT_S, write_timeout_s: float = WRITE_TIMEOUT_S,
              max_open: int | None = None, drain: Drain | None = None):
    """The ASGI app. The app's shutdown (lifespan) closes the host: Ray Serve runs it when
    the replica stops, uvicorn when it exits. The limits (serve/limits.py): bodies of at most
    `max_body_bytes`, whole within `read_timeout_s`; a write blocked `write_timeout_s` drops
    its client; at most `max_open` requests open (default sessions + queue + OPEN_HEADROOM).
    `drain` (serve/drain.py): the graceful stop's state, started and cut from outside."""
    api = _Api(host, max_queue, drain)

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
    app.add_middleware(Limits, max_body_bytes=max_body_bytes, read_timeout_s=read_timeout_s,
                       write_timeout_s=write_timeout_s, count=api.metrics.outcome, state=api.limits,
                       max_open=max_open or host.sessions + max_queue + OPEN_HEADROOM)
    app.add_middleware(DrainGate, drain=api.drain)  # outermost: a completion counts from its head to its last byte

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _completion(api, request)

    @app.get("/v1/models")
    async def models():
        return JSONResponse(models_list(host.model_name, api.started))

    @app.get("/health")
    async def health():  # draining: a 503, so a load balancer's probe sends no new requests here
        draining = api.drain.draining
        return JSONResponse({"status": "draining" if draining else "ok", "model": host.model_name,
                             "sessions": host.sessions, "in_flight": api.admission.active,
                             "queued": api.admission.waiting, "open_requests": api.limits.open},
                            status_code=503 if draining else 200)

    @app.get("/metrics")
    async def metrics():
        return Response(api.metrics.render(), media_type=CONTENT_TYPE)

    @app.exception_handler(404)
    async def not_found(request: Request, exc):
        path = request.url.path if len(request.url.path) <= 80 else request.url.path[:77] + "..."
        return _error(ApiError(404, f"no route {request.method} {path} (try POST /v1/completions, "
                                    "GET /v1/models, /health, /metrics)", None, "not_found"))

    @app.exception_handler(405)
    async def not_allowed(request: Request, exc):
        return _error(ApiError(405, f"{request.method[:16]} is not allowed on {request.url.path[:80]}", None,
                               "method_not_allowed", "invalid_request_error"))

    @app.exception_handler(Exception)
    async def internal(request: Request, exc):  # a bug: the server logs its traceback, the client gets JSON
        return _error(ApiError(500, f"internal error ({type(exc).__name__})", None, "internal_error"))

    return app
