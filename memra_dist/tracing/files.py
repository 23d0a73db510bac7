"""The embedded default exporter: with no OTLP endpoint, spans go to a run directory.

Each process writes its spans as OTLP JSON: the driver `spans.otlp.json`, a pipeline actor
`<role><rank>-spans.otlp.json`. The driver, which closes last, then writes ONE Chrome /
Perfetto trace, `trace.perfetto.json` (opens in ui.perfetto.dev), from every OTLP file in the
directory: driver, head and stages as separate tracks (tracing/perfetto.py). Files are written
atomically (temp file + rename): a crash leaves complete files or none, never a truncated
JSON; `remove_partial` clears the temp files of a writer that was killed. A Ctrl-C or
SIGTERM that arrives while the end-of-run files are written is held until they are, then
delivered (the run still ends as interrupted, with its trace on disk)."""

from __future__ import annotations

import json
import os
import signal
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Sequence

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from .otlp_json import otlp_document, read_spans
from .perfetto import perfetto_trace

__all__ = ["RunDirExporter", "signals_held", "write_atomic", "write_merged_perfetto", "remove_partial", "OTLP_NAME", "PERFETTO_NAME"]

OTLP_NAME = "spans.otlp.json"
PERFETTO_NAME = "trace.perfetto.json"


def write_merged_perfetto(run_dir: Path) -> int:
    """trace.perfetto.json from every *spans.otlp.json in the directory; returns the spans."""
    run_dir = Path(run_dir)
    items = read_spans(sorted(run_dir.glob(f"*{OTLP_NAME}")))
    write_atomic(run_dir / PERFETTO_NAME, json.dumps(perfetto_trace(items), separators=(",", ":")))
    return len(items)


def remove_partial(run_dir: Path) -> list[str]:
    """Delete the temp files a killed writer left (`.<name>.<random>`); returns their names."""
    gone = []
    for p in Path(run_dir).glob(".*.json.*"):
        try:
            p.unlink()
            gone.append(p.name)
        except OSError:
            pass
    return gone


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


@contextmanager
def signals_held(signums=(signal.SIGINT, signal.SIGTERM)):
    """SIGINT / SIGTERM arriving inside the block are held and delivered again on its exit
    (their handlers then run as usual). Only the main thread can swap handlers: elsewhere
    the block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[int] = []
    prev = {n: signal.signal(n, lambda num, _frame: got.append(num)) for n in signums}
    try:
        yield
    finally:
        for n, h in prev.items():
            signal.signal(n, h)
        for n in dict.fromkeys(got):
            signal.raise_signal(n)


class RunDirExporter(SpanExporter):
    def __init__(self, run_dir: Path, stem: str = ""):
        self.dir = Path(run_dir)
        self.stem = stem  # actors write <stem>spans.otlp.json beside the driver's
        self._spans: list[ReadableSpan] = []
        self._lock = threading.Lock()
        self._written = False
        self.write_on_shutdown = True  # tracing.otel.shutdown_bounded writes itself instead

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        with self._lock:
            self._spans.extend(spans)
        return SpanExportResult.SUCCESS

    @property
    def n_spans(self) -> int:
        return len(self._spans)

    def write(self) -> None:
        with self._lock:
            spans = list(self._spans)
        with signals_held():
            write_atomic(self.dir / f"{self.stem}{OTLP_NAME}", json.dumps(otlp_document(spans), separators=(",", ":")))
            if not self.stem:  # the driver's: closes after every actor has written its file
                write_merged_perfetto(self.dir)
        self._written = True

    def shutdown(self) -> None:
        if not self._written and self.write_on_shutdown:
            self.write()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True
