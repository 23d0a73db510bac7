"""The embedded default exporter: with no OTLP endpoint, spans go to a run directory as
OTLP JSON (`spans.otlp.json`) and a Chrome/Perfetto trace (`trace.perfetto.json`, opens in
ui.perfetto.dev). Both are written atomically at shutdown (temp file + rename): a crash
leaves complete files or none, never a truncated JSON."""

from __future__ import annotations

import json
import os
import tempfile
import threading
from pathlib import Path
from typing import Sequence

from google.protobuf.json_format import MessageToDict
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

__all__ = ["RunDirExporter", "write_atomic", "perfetto_events"]


def write_atomic(path: Path, data: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _hex_ids(d):
    """OTLP/JSON wants hex trace and span ids; protobuf's JSON mapping gives base64."""
    import base64  # noqa: PLC0415

    if isinstance(d, dict):
        for k, v in list(d.items()):
            if k in ("traceId", "spanId", "parentSpanId") and isinstance(v, str):
                d[k] = base64.b64decode(v).hex()
            else:
                _hex_ids(v)
    elif isinstance(d, list):
        for x in d:
            _hex_ids(x)
    return d


def perfetto_events(spans: Sequence[ReadableSpan]) -> list[dict]:
    """Complete ('X') events, one track per process role; nesting follows time containment."""
    out = []
    for s in spans:
        role = str(s.resource.attributes.get("memra.role", "driver"))
        pid = int(s.resource.attributes.get("process.pid", 0))
        args = {k: v for k, v in (s.attributes or {}).items() if isinstance(v, (int, float, str, bool))}
        out.append({"name": s.name, "ph": "X", "ts": s.start_time / 1e3, "dur": (s.end_time - s.start_time) / 1e3,
                    "pid": pid, "tid": role, "args": args})
        out.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": f"memra {role} {pid}"}})
    return out


class RunDirExporter(SpanExporter):
    def __init__(self, run_dir: Path, stem: str = ""):
        self.dir = Path(run_dir)
        self.stem = stem  # actors write <stem>spans.otlp.json beside the driver's
        self._spans: list[ReadableSpan] = []
        self._lock = threading.Lock()
        self._written = False

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        with self._lock:
            self._spans.extend(spans)
        return SpanExportResult.SUCCESS

    def write(self) -> None:
        with self._lock:
            spans = list(self._spans)
        otlp = _hex_ids(MessageToDict(encode_spans(spans)))
        write_atomic(self.dir / f"{self.stem}spans.otlp.json", json.dumps(otlp))
        write_atomic(self.dir / f"{self.stem}trace.perfetto.json",
                     json.dumps({"traceEvents": perfetto_events(spans), "displayTimeUnit": "ms"}))
        self._written = True

    def shutdown(self) -> None:
        if not self._written:
            self.write()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True
