"""A real OTLP/gRPC trace receiver for tests, built on opentelemetry-proto's service
definitions: start it, point OTEL_EXPORTER_OTLP_ENDPOINT at `receiver.endpoint`, read what
arrived over the wire.

    with OTLPReceiver(required_headers={"x-token": "s3cret"}) as rx:
        env = {**os.environ, **rx.env()}          # endpoint + protocol (+ the headers)
        subprocess.run([...], env=env)
        spans = rx.wait_for_spans(lambda s: any(x.name == "memra.request" for x in s))

Requests whose metadata lacks a required header (or has the wrong value) are refused with
UNAUTHENTICATED and counted in `rejected`; their spans are not stored.
"""

from __future__ import annotations

import threading
import time
from concurrent import futures
from dataclasses import dataclass, field

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

__all__ = ["OTLPReceiver", "ReceivedSpan", "any_value"]


def any_value(v: AnyValue):
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


@dataclass
class ReceivedSpan:
    name: str
    trace_id: str  # hex
    span_id: str  # hex
    parent_span_id: str  # hex, "" for a root
    start_ns: int
    end_ns: int
    attributes: dict = field(default_factory=dict)
    resource: dict = field(default_factory=dict)
    scope: str = ""
    status_code: int = 0  # OTLP Status.code: 0 unset, 1 ok, 2 error
    status_message: str = ""


class _Servicer(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, rx: "OTLPReceiver"):
        self.rx = rx

    def Export(self, request, context):
        md = {k.lower(): v for k, v in (context.invocation_metadata() or ())}
        with self.rx._lock:
            self.rx.metadata.append(md)
            for k, v in self.rx.required_headers.items():
                if md.get(k.lower()) != v:
                    self.rx.rejected += 1
                    context.abort(grpc.StatusCode.UNAUTHENTICATED, f"missing or wrong header {k}")
            self.rx.requests += 1
            for rs in request.resource_spans:
                res = {a.key: any_value(a.value) for a in rs.resource.attributes}
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        self.rx.spans.append(ReceivedSpan(
                            name=s.name, trace_id=s.trace_id.hex(), span_id=s.span_id.hex(),
                            parent_span_id=s.parent_span_id.hex(), start_ns=s.start_time_unix_nano,
                            end_ns=s.end_time_unix_nano,
                            attributes={a.key: any_value(a.value) for a in s.attributes},
                            resource=res, scope=ss.scope.name, status_code=s.status.code,
                            status_message=s.status.message))
        return trace_service_pb2.ExportTraceServiceResponse()


class OTLPReceiver:
    def __init__(self, required_headers: dict[str, str] | None = None, host: str = "127.0.0.1"):
        self.required_headers = dict(required_headers or {})
        self.host = host
        self.spans: list[ReceivedSpan] = []
        self.metadata: list[dict] = []
        self.requests = 0
        self.rejected = 0
        self._lock = threading.Lock()
        self._server = None
        self.port = 0

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    def env(self) -> dict[str, str]:
        """The standard OTEL_* variables that send a process's spans here over gRPC."""
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": self.endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}
        if self.required_headers:
            env["OTEL_EXPORTER_OTLP_HEADERS"] = ",".join(f"{k}={v}" for k, v in self.required_headers.items())
        return env

    def start(self) -> "OTLPReceiver":
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_Servicer(self), self._server)
        self.port = self._server.add_insecure_port(f"{self.host}:0")
        self._server.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(grace=0.5).wait()
            self._server = None

    def __enter__(self) -> "OTLPReceiver":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def snapshot(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self.spans)

    def wait_for_spans(self, done=lambda spans: bool(spans), timeout: float = 10.0) -> list[ReceivedSpan]:
        """Spans received so far once `done(spans)` holds (or the timeout passes)."""
        end = time.monotonic() + timeout
        while True:
            spans = self.snapshot()
            if done(spans) or time.monotonic() > end:
                return spans
            time.sleep(0.05)
