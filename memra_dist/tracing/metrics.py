"""Records -> OpenTelemetry metrics, from each settled burst record (in a verify's shadow).

`MetricsSink` has the session-sink interface (`burst`, `first_token`, `rounds`) and turns the
same numbers the spans carry into instruments named in `conventions.METRICS`. Exporters follow
the traces' settings: an OTLP metric exporter when `OTEL_EXPORTER_OTLP_ENDPOINT` (or the
`..._METRICS_ENDPOINT`) is set, gRPC or HTTP/protobuf per `OTEL_EXPORTER_OTLP_PROTOCOL`; plus,
on request, a Prometheus scrape endpoint bound to 127.0.0.1.

Slow rounds: a round is slow when its wall time is past 1.5x the median round wall time of ITS
BURST (the median as the [spec-prof-summary] line takes it: the sorted middle element). The sink sees
one burst at a time, so the burst is the window; the request-wide figure stays on the
`[spec-prof-summary]` line.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from dataclasses import dataclass, field

from opentelemetry.context import Context
from opentelemetry.metrics import Meter
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource

from ..errors import UserError
from ..phase.first_token import FirstTokenProf
from ..phase.records import BurstRecord
from .conventions import METRIC_ATTR, METRIC_META, METRICS, PHASES, RESOURCE, SERVICE_NAME_DEFAULT
from .emit import verify_sub_layout
from .otel import flush_timeout_s, otlp_endpoint

__all__ = ["MetricsSink", "MetricsSession", "make_meter_provider", "prometheus_name",
           "SLOW_FACTOR", "MS_BUCKETS", "TOKEN_BUCKETS", "RATIO_BUCKETS"]

SLOW_FACTOR = 1.5
# phases on a CPU demo run tens of microseconds, a verify on a big model tens of milliseconds
MS_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000)
TOKEN_BUCKETS = tuple(float(i) for i in range(1, 17)) + (24.0, 32.0)
RATIO_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)
DRAFT_BUCKETS = (0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0, 12.0, 16.0, 24.0, 32.0)
REQUEST_BUCKETS = (1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 24.0, 32.0, 48.0, 64.0, 128.0, 256.0)
_PROM_UNIT = {"ms": "milliseconds", "MBy": "megabytes", "s": "seconds", "By": "bytes"}


def prometheus_name(key: str) -> str:
    """The series base name an OTel -> Prometheus exporter makes of METRICS[key] (the SDK's
    PrometheusMetricReader and the Collector's prometheus exporter agree): dots -> '_', the
    unit's word appended ('{...}' units add nothing, '1' adds '_ratio' on gauges only),
    '_total' on counters. Histograms add '_bucket' / '_sum' / '_count' to this base."""
    kind, unit, _ = METRIC_META[key]
    name = METRICS[key].replace(".", "_")
    word = _PROM_UNIT.get(unit) or ("ratio" if unit == "1" and kind == "gauge" else "")
    if word and not name.endswith("_" + word):
        name += "_" + word
    return name + "_total" if kind == "counter" else name


def _instruments(meter: Meter) -> dict:
    out = {}
    bounds = {"ms": MS_BUCKETS, "{token}": TOKEN_BUCKETS, "1": RATIO_BUCKETS, "{request}": REQUEST_BUCKETS,
              "{draft}": DRAFT_BUCKETS}
    for key, (kind, unit, desc) in METRIC_META.items():
        name = METRICS[key]
        if kind == "histogram":
            out[key] = meter.create_histogram(name, unit=unit, description=desc,
                                              explicit_bucket_boundaries_advisory=list(bounds[unit]))
        elif kind == "counter":
            out[key] = meter.create_counter(name, unit=unit, description=desc)
        else:
            out[key] = meter.create_gauge(name, unit=unit, description=desc)
    return out


def slow_count(walls_ns: list[int], factor: float = SLOW_FACTOR) -> int:
    """Rounds past `factor` x the median (sorted middle element, as the [spec-prof-summary] line)."""
    if not walls_ns:
        return 0
    med = sorted(walls_ns)[len(walls_ns) // 2]
    return sum(1 for w in walls_ns if w > factor * med)


class MetricsSink:
    """Session sink recording metrics. `context` (optional callable -> Context | None) gives
    the request's span context so histogram exemplars carry its trace id (Grafana links a
    point on a panel to the trace in Tempo)."""

    def __init__(self, meter: Meter, context=None):
        self.m = _instruments(meter)
        self.context = context or (lambda: None)
        self.a_phase = [{METRIC_ATTR["phase"]: p} for p in PHASES]  # attribute dicts built once
        self.a_kv = {st: {METRIC_ATTR["kv_state"]: st} for st in ("used", "free", "cached")}
        self.a_part = {pt: {METRIC_ATTR["part"]: pt} for pt in ("rounds", "held", "other")}
        self.a_pos: list[dict] = []  # position i's attributes (memra.draft_position = i + 1), made as reached

    def _ctx(self) -> Context | None:
        try:
            return self.context()
        except Exception:  # a metrics sink must never take the run down
            return None

    def burst(self, rec: BurstRecord) -> None:
        rounds = rec.live()
        if not rounds:
            return
        ctx, m = self._ctx(), self.m
        drafted = accepted = 0
        auto_exp, auto_acc = 0.0, 0
        reached, took = [], []  # per draft position: drafts that reached it, drafts accepted there
        for r in rounds:
            for i in range(min(r.k, r.j + 1)):
                if i == len(reached):
                    reached.append(0)
                    took.append(0)
                reached[i] += 1
                took[i] += i < r.j
            for i, attrs in enumerate(self.a_phase):
                m["phase_duration"].record(r.phase_ns(i) / 1e6, attrs, context=ctx)
                if r.h[i]:
                    m["phase_host_duration"].record(r.host_ns(i) / 1e6, attrs, context=ctx)
            if r.sub_ns:
                for bucket, ns, _ in verify_sub_layout(r):
                    m["verify_sub_duration"].record(ns / 1e6, {METRIC_ATTR["bucket"]: bucket}, context=ctx)
            m["round_duration"].record(r.wall_ns / 1e6, context=ctx)
            m["tokens_per_round"].record(r.j + 1, context=ctx)
            if r.batch is not None:
                m["batch_requests"].record(r.batch.requests, context=ctx)
                m["batch_wait"].record(r.batch.wait_ns / 1e6, context=ctx)
                m["batch_step"].record(r.batch.forward_ns / 1e6, context=ctx)
                if r.batch.predicted_ns:
                    m["batch_step_predicted"].record(r.batch.predicted_ns / 1e6, context=ctx)
                self._idle(r.batch, ctx)
            if r.draft_requests:
                m["batch_draft_requests"].record(r.draft_requests, context=ctx)
            if r.expected >= 0:  # --spec-k auto chose its K
                m["spec_k_chosen"].record(r.k, context=ctx)
                auto_exp, auto_acc = auto_exp + r.expected, auto_acc + r.j
            drafted, accepted = drafted + r.k, accepted + r.j
        m["drafted"].add(drafted)
        m["accepted"].add(accepted)
        while len(self.a_pos) < len(reached):
            self.a_pos.append({METRIC_ATTR["position"]: len(self.a_pos) + 1})
        for i, (n, a) in enumerate(zip(reached, took)):
            m["position_reached"].add(n, self.a_pos[i])
            m["position_accepted"].add(a, self.a_pos[i])
        if any(r.expected >= 0 for r in rounds):
            m["spec_k_expected"].add(auto_exp)
            m["spec_k_accepted"].add(auto_acc)
        if drafted:
            m["acceptance"].record(accepted / drafted, context=ctx)
        slow = slow_count([r.wall_ns for r in rounds])
        if slow:
            m["slow_rounds"].add(slow)
        self._memory(next((d for r in reversed(rounds) for d in reversed(r.free_mb) if d), {}))
        last = rounds[-1].batch
        if last is not None:
            m["kv_blocks"].set(last.kv_used, self.a_kv["used"])
            m["kv_blocks"].set(last.kv_free, self.a_kv["free"])
            if last.kv_cached or last.evictions:  # an engine with its prefix cache on, once it holds a block
                m["kv_blocks"].set(last.kv_cached, self.a_kv["cached"])
                m["prefix_evictions"].set(last.evictions)
            m["batch_preemptions"].set(last.preempted)

    def _idle(self, b, ctx) -> None:
        """The device's idle before step `b`, in its parts (their sum is the step's gap)."""
        rounds, held = min(b.rounds_ns, b.gap_ns), min(b.held_ns, max(b.gap_ns - b.rounds_ns, 0))
        for part, ns in (("rounds", rounds), ("held", held), ("other", b.gap_ns - rounds - held)):
            self.m["batch_idle"].record(ns / 1e6, self.a_part[part], context=ctx)

    def _memory(self, free_mb: dict[str, int]) -> None:
        for dev, mb in free_mb.items():
            self.m["free_memory"].set(mb, {METRIC_ATTR["device"]: dev})

    def first_token(self, prof: FirstTokenProf) -> None:
        ctx = self._ctx()
        for bucket, ms in prof.ms.items():
            self.m["first_token"].record(ms, {METRIC_ATTR["bucket"]: bucket}, context=ctx)
        self._memory(prof.free_mb_after or prof.free_mb_before)

    def rounds(self, log, final: bool) -> None:
        pass  # the depth log's rows are the same rounds burst() already recorded


def _resource(role: str) -> Resource:
    return Resource.create({
        RESOURCE["service"]: os.environ.get("OTEL_SERVICE_NAME", SERVICE_NAME_DEFAULT),
        RESOURCE["role"]: role, RESOURCE["host"]: socket.gethostname(), RESOURCE["pid"]: os.getpid()})


def _otlp_reader() -> MetricReader | None:
    if not (os.environ.get("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT") or otlp_endpoint()):
        return None
    proto = os.environ.get("OTEL_EXPORTER_OTLP_METRICS_PROTOCOL") or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    if proto == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter  # noqa: PLC0415
    elif proto == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter  # noqa: PLC0415
    else:
        raise UserError(f"OTEL_EXPORTER_OTLP_PROTOCOL '{proto}' is not supported (grpc or http/protobuf)")
    # endpoint, headers, TLS, timeout and OTEL_METRIC_EXPORT_INTERVAL from the OTEL_* variables
    return PeriodicExportingMetricReader(OTLPMetricExporter())


def _prometheus(port: int):
    """(reader, server) serving /metrics on 127.0.0.1:port (0 = any free port)."""
    try:
        from opentelemetry.exporter.prometheus import PrometheusMetricReader  # noqa: PLC0415
        from prometheus_client import start_http_server  # noqa: PLC0415
    except ImportError:
        raise UserError("--metrics-port needs opentelemetry-exporter-prometheus "
                        "(pip install opentelemetry-exporter-prometheus)") from None
    reader = PrometheusMetricReader()
    try:
        server, _ = start_http_server(port, addr="127.0.0.1")
    except OSError as e:
        reader.shutdown()
        raise UserError(f"--metrics-port {port}: cannot listen on 127.0.0.1:{port} ({e.strerror})") from None
    return reader, server


def make_meter_provider(role: str, prometheus_port: int | None):
    """(MeterProvider, Prometheus HTTP server or None). Readers: OTLP when the OTEL_* variables
    name an endpoint; Prometheus on 127.0.0.1 when `prometheus_port` is not None."""
    readers, server = [], None
    otlp = _otlp_reader()
    if otlp is not None:
        readers.append(otlp)
    if prometheus_port is not None:
        reader, server = _prometheus(prometheus_port)
        readers.append(reader)
    return MeterProvider(metric_readers=readers, resource=_resource(role), shutdown_on_exit=False), server


@dataclass
class MetricsSession:
    """The driver's metrics for one CLI run: off (sink None) unless tracing level >= 1, a
    metrics port or an OTLP endpoint asks for them."""

    provider: MeterProvider | None = None
    server: object | None = None
    sink: MetricsSink | None = None
    hold_s: float = 0.0
    _tracing: object | None = field(default=None, repr=False)

    @classmethod
    def open(cls, cfg, tracing=None, port: int | None = None, hold_s: float = 0.0) -> "MetricsSession":
        if not (cfg.trace.level >= 1 or port is not None or otlp_endpoint()):
            return cls()
        if not cfg.trace.clock_on:
            print("memra-dist: note: phase metrics need --trace-level >= 1 (the phase clock is off at level 0)",
                  file=sys.stderr)
        provider, server = make_meter_provider("driver", port)
        if server is not None:
            print(f"[memra] metrics at http://127.0.0.1:{server.server_port}/metrics", file=sys.stderr, flush=True)
        self = cls(provider, server, None, hold_s, tracing)
        self.sink = MetricsSink(provider.get_meter("memra_dist"), context=lambda: self._context())
        return self

    def _context(self):
        req = getattr(self._tracing, "_req", None)  # the request span, once TracingSession opened it
        return req.context() if req is not None else None

    def close(self, timeout_s: float | None = None) -> None:
        """Hold the scrape endpoint open `hold_s` seconds (so a scraper sees the final values),
        then flush OTLP and stop, bounded by `timeout_s` (default: the traces' flush bound)."""
        if self.provider is None:
            return
        timeout_s = flush_timeout_s() if timeout_s is None else timeout_s
        if self.server is not None and self.hold_s > 0:
            time.sleep(self.hold_s)
        t = threading.Thread(target=lambda: self.provider.shutdown(timeout_millis=timeout_s * 1000), daemon=True)
        t.start()
        t.join(timeout_s)
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
