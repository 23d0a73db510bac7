"""Tracer provider and exporters, the ecosystem's way: the standard OTEL_* variables choose
OTLP (gRPC or HTTP/protobuf), endpoint, headers and service name; with no endpoint, a run
directory (tracing/files.py). Export runs on the BatchSpanProcessor's thread, never in the
round loop; shutdown is bounded and reports spans it could not deliver."""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlparse

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from ..env import environment
from ..errors import UserError
from .conventions import ATTR, RESOURCE, SERVICE_NAME_DEFAULT, SPAN_REQUEST
from ..phase.lines import fast_path_label
from .deferred import DeferredSink
from .emit import SpanSink
from .files import RunDirExporter

__all__ = ["TracingSession", "default_run_dir", "make_provider", "otlp_endpoint", "parse_traceparent",
           "flush_timeout_s", "flush_words"]
_PROP = TraceContextTextMapPropagator()


def flush_timeout_s() -> float:
    """Bound on each process's span flush at exit (MEMRA_FLUSH_TIMEOUT_S)."""
    return environment().flush_timeout_s


def default_run_dir() -> Path:
    """Where a traced run with no OTLP endpoint writes its spans: ./runs/<time>-<pid>."""
    return Path("runs") / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"


def check_writable(run_dir: Path) -> None:
    """Refuse a run directory that cannot take files, before any model is loaded: the
    directory is created (as the run would) and a probe file written and removed."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".probe-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise UserError(f"--run-dir {run_dir}: cannot write there ({e.strerror or e})") from None


def otlp_endpoint() -> str | None:
    """The traces endpoint from the standard variables, validated (a one-line error if malformed)."""
    ep = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if not ep:
        return None
    scheme_given = "://" in ep
    u = urlparse(ep if scheme_given else f"http://{ep}")
    try:
        port = u.port
    except ValueError:
        port = -1
    host = u.hostname or ""
    ok_host = bool(host) and all(c.isalnum() or c in ".-_:[]" for c in host)
    # without a scheme, only host:port reads as an address ("garbage" would fail later, at DNS)
    if u.scheme not in ("http", "https") or not ok_host or port == -1 or (not scheme_given and port is None):
        raise UserError(f"OTEL_EXPORTER_OTLP_ENDPOINT '{ep}' is malformed (expected a URL such as http://127.0.0.1:4317)")
    return ep


class CountingExporter(SpanExporter):
    """Wraps the real exporter and counts what it delivered (spans made - sent = dropped)."""

    def __init__(self, inner: SpanExporter):
        self.inner, self.sent = inner, 0
        self._abandoned = False
        self._shut = threading.Lock()
        self._inner_down = False

    def export(self, spans):
        if self._abandoned:  # past the flush bound: fail at once, never block the exit
            return SpanExportResult.FAILURE
        try:
            res = self.inner.export(spans)
        except Exception:  # an exporter must never take the app down
            res = SpanExportResult.FAILURE
        if res == SpanExportResult.SUCCESS:
            self.sent += len(spans)
        return res

    def shutdown(self):
        with self._shut:  # once: the bounded flush and the SDK's atexit hook may both get here
            if self._inner_down:
                return
            self._inner_down = True
        self.inner.shutdown()

    def abandon(self) -> None:
        """Give up delivering: later batches fail at once and an OTLP export stuck in its
        retry/backoff loop is aborted (the exporter's shutdown closes the channel and wakes
        the backoff wait). Without this the SDK's atexit shutdown joins the export thread,
        which retries every queued batch for up to OTEL_EXPORTER_OTLP_TIMEOUT each."""
        self._abandoned = True
        if not isinstance(self.inner, RunDirExporter):  # local files never wait on a network
            self.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)


def _otlp_exporter() -> SpanExporter:
    proto = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    if proto == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter  # noqa: PLC0415
    elif proto == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter  # noqa: PLC0415
    else:
        raise UserError(f"OTEL_EXPORTER_OTLP_PROTOCOL '{proto}' is not supported (grpc or http/protobuf)")
    return OTLPSpanExporter()  # endpoint, headers, TLS and timeout from the OTEL_* variables


ABANDON_WAIT_S = 1.0  # after the flush bound: the wait for an abandoned exporter's thread to end
GIL_SWITCH_S = 5e-4
OTLP_QUEUE = 1 << 16  # spans the batch processor holds before it drops (a long run's end builds many at once)


def quick_gil_handoff() -> float:
    """Bound how long the round loop can wait for the GIL behind the exporter thread.

    The batch processor encodes and exports spans on its own thread (Python work, under the
    GIL). A thread that wants the GIL asks the holder to drop it only after the switch
    interval, 5 ms by default: an 8B verify is ~5 ms, so a loop waking from its device wait
    during an export could lose a whole step. 0.5 ms bounds that loss; the cost is more GIL
    hand-offs while both threads are busy. Process-wide, set once by every process that
    traces (driver, stage and head actors); returns the interval before, which the driver's
    TracingSession puts back when it closes (a caller's process is left as it was)."""
    before = sys.getswitchinterval()
    if before > GIL_SWITCH_S:
        sys.setswitchinterval(GIL_SWITCH_S)
    return before


def make_provider(role: str, run_dir: Path | None, stem: str = ""):
    """(provider, counting exporter, run-dir exporter or None) for this process's role."""
    res = Resource.create({
        RESOURCE["service"]: os.environ.get("OTEL_SERVICE_NAME", SERVICE_NAME_DEFAULT),
        RESOURCE["role"]: role, RESOURCE["host"]: socket.gethostname(), RESOURCE["pid"]: os.getpid()})
    provider = TracerProvider(resource=res)
    files = None
    if otlp_endpoint():
        inner = _otlp_exporter()
    else:
        inner = files = RunDirExporter(run_dir, stem)
    counting = CountingExporter(inner)
    if files is not None:  # local memory until the write at shutdown: no queue to overflow, no thread
        provider.add_span_processor(SimpleSpanProcessor(counting))
    else:
        provider.add_span_processor(BatchSpanProcessor(counting, max_queue_size=OTLP_QUEUE, schedule_delay_millis=500))
    return provider, counting, files


def shutdown_bounded(provider: TracerProvider, counting: CountingExporter, ended: int, timeout_s: float) -> int:
    """Flush and shut down within `timeout_s`; returns spans not delivered.

    A network exporter that does not finish within the bound is abandoned. A run directory
    is local disk: its files are written here, after the flush, and waited for (the time
    is bounded by the spans' size), so a process never exits with a file half-written."""
    files = counting.inner if isinstance(counting.inner, RunDirExporter) else None
    if files is not None:
        files.write_on_shutdown = False  # written below, on this thread
    t = threading.Thread(target=lambda: (provider.force_flush(int(timeout_s * 1000)), provider.shutdown()), daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():  # collector down or stalling: stop trying, so the process can exit now
        counting.abandon()
        t.join(min(ABANDON_WAIT_S, timeout_s))
    if files is None:
        return max(0, ended - counting.sent)
    try:
        files.write()
    except OSError as e:
        print(f"memra-dist: warning: could not write spans to {files.dir}: {e.strerror or e}", file=sys.stderr)
        return ended
    return max(0, ended - files.n_spans)


def parse_traceparent(tp: str | None):
    """A W3C traceparent -> parent context; malformed = None with one warning line."""
    if not tp:
        return None
    ctx = _PROP.extract({"traceparent": tp})
    if not trace.get_current_span(ctx).get_span_context().is_valid:
        print(f"memra-dist: warning: ignoring malformed traceparent '{tp}'", file=sys.stderr)
        return None
    return ctx


class _Request:
    def __init__(self, span, trace_content: bool, sink=None):
        self.span, self.trace_content = span, trace_content
        self.sink = sink  # this request's span sink (DeferredSink), None when tracing is off

    def carrier(self) -> dict:
        """The W3C context of this request, to carry in every command to an actor."""
        c: dict = {}
        if self.span is not None:
            _PROP.inject(c, context=trace.set_span_in_context(self.span))
        return c

    def context(self):
        return trace.set_span_in_context(self.span) if self.span is not None else None

    def finish(self, result, text: str) -> None:
        if self.span is None:
            return
        st = result.stats
        self.span.set_attributes({ATTR["tokens"]: st["tokens"], ATTR["rounds"]: st["rounds"],
                                  ATTR["drafted"]: st["drafted"], ATTR["accepted_total"]: st["accepted"],
                                  ATTR["cached_tokens"]: st.get("cached_tokens", 0),
                                  ATTR["fast_path"]: fast_path_label(st.get("fast_path"))})
        if self.trace_content:
            self.span.set_attribute(ATTR["output"], text)


class TracingSession:
    """The driver's tracing for one CLI run. Disabled (no provider, no spans) at level 0
    without the profile."""

    def __init__(self, enabled: bool, run_dir: Path | None, parent):
        self.enabled, self.run_dir, self.parent = enabled, run_dir, parent
        self.provider = self.counting = self.files = None
        self._sink: SpanSink | None = None  # the latest request's (the CLI's one request)
        self._req: _Request | None = None
        self.ended = 0  # request spans made
        self.burst_spans = 0  # spans made by the requests' sinks, once each request has ended
        self._count = threading.Lock()  # requests may run on several threads (a batch job at pp > 1)
        self._switch_before = sys.getswitchinterval()  # put back at close (open() lowers it)

    @classmethod
    def open(cls, cfg, run_dir: str | None = None, traceparent: str | None = None) -> "TracingSession":
        parent = parse_traceparent(traceparent or os.environ.get("TRACEPARENT"))
        enabled = cfg.trace.clock_on
        ep = otlp_endpoint()  # validated even when tracing is off: a bad variable is bad input
        if not enabled:
            return cls(False, None, parent)
        rd = None if ep else Path(run_dir) if run_dir else default_run_dir()
        if rd is not None:
            check_writable(rd)
        self = cls(True, rd, parent)
        self._switch_before = quick_gil_handoff()
        self.provider, self.counting, self.files = make_provider("driver", rd)
        self.tracer = self.provider.get_tracer("memra_dist")
        return self

    @contextmanager
    def request(self, cfg, prompt: str, n_prompt: int):
        if not self.enabled:
            yield _Request(None, False)
            return
        attrs = {ATTR["model"]: Path(cfg.model).name, ATTR["drafter"]: cfg.drafter, ATTR["k"]: cfg.k,
                 ATTR["pp"]: cfg.pp, ATTR["trace_level"]: cfg.trace.level, ATTR["prompt_tokens"]: n_prompt}
        if cfg.trace_content:
            attrs[ATTR["prompt"]] = prompt
        span = self.tracer.start_span(SPAN_REQUEST, context=self.parent, attributes=attrs)
        with self._count:
            self.ended += 1
        req = _Request(span, cfg.trace_content)
        req.sink = sink = DeferredSink(SpanSink(self.tracer, req.context()))
        self._req, self._sink = req, sink
        try:
            yield req
        except BaseException as e:
            span.set_status(trace.Status(trace.StatusCode.ERROR, type(e).__name__))
            raise
        finally:
            sink.close()  # every burst's spans built before the request span ends
            span.end()
            with self._count:
                self.burst_spans += sink.count

    def sink(self):
        return _LazySink(self)

    def close(self, metrics_follow: bool | None = None) -> int:
        """Flush within the bound; returns the driver's spans not delivered (said on stderr, with
        what the flushes at exit cost: `metrics_follow`, whether a metrics flush over OTLP comes
        next; None: wherever an OTLP endpoint is set, as the CLI's MetricsSession does)."""
        if not self.enabled:
            return 0
        made = self.ended + self.burst_spans
        bound = flush_timeout_s()
        t0 = time.monotonic()
        dropped = shutdown_bounded(self.provider, self.counting, made, bound)
        took = time.monotonic() - t0
        sys.setswitchinterval(self._switch_before)
        if dropped:
            print(f"memra-dist: warning: {dropped} of {made} spans were not delivered (exporter unreachable or slow): "
                  f"{flush_words(bound, took, metrics_flush_follows() if metrics_follow is None else metrics_follow)}",
                  file=sys.stderr)
        return dropped


def metrics_flush_follows() -> bool:
    """Whether a driver's metrics flush over OTLP follows its span flush at exit (the CLI's
    MetricsSession exports over OTLP wherever an endpoint is set)."""
    return bool(os.environ.get("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT") or otlp_endpoint())


def flush_words(bound: float, took: float, metrics: bool) -> str:
    """What the exit's flushes cost, truly: the span flush waits up to the bound
    (MEMRA_FLUSH_TIMEOUT_S) and then up to ABANDON_WAIT_S more for an abandoned exporter to
    stop (shutdown_bounded); the metrics flush that follows waits up to the bound again."""
    extra = min(ABANDON_WAIT_S, bound)
    s = (f"the span flush took {took:.1f} s (bounded by MEMRA_FLUSH_TIMEOUT_S={bound:g} s, plus up to {extra:g} s "
         "to stop a stalled exporter)")
    if metrics:
        s += f"; the metrics flush that follows waits up to {bound:g} s more"
    return s


class _LazySink:
    """Forwards to the request's SpanSink once the request span exists."""

    def __init__(self, ts: TracingSession):
        self.ts = ts

    def __getattr__(self, name):
        sink = self.ts._sink
        if sink is None:
            return lambda *a, **k: None
        return getattr(sink, name)
