"""The bench's span sink: spans built as the CLI builds them, into memory (no network)."""

from __future__ import annotations

__all__ = ["span_sink"]


def span_sink(name: str = "memra.bench"):
    """(span sink, provider, exporter): spans built as the CLI builds them (a DeferredSink over a
    SpanSink, a BatchSpanProcessor) into an in-memory exporter: the SDK's real cost, no network."""
    from opentelemetry.sdk.trace import TracerProvider  # noqa: PLC0415
    from opentelemetry.sdk.trace.export import BatchSpanProcessor  # noqa: PLC0415
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: PLC0415

    from ..tracing.deferred import DeferredSink  # noqa: PLC0415
    from ..tracing.emit import SpanSink  # noqa: PLC0415
    from ..tracing.otel import quick_gil_handoff  # noqa: PLC0415

    quick_gil_handoff()  # as make_provider does for the CLI's provider
    tp = TracerProvider()
    exp = InMemorySpanExporter()
    tp.add_span_processor(BatchSpanProcessor(exp))
    return DeferredSink(SpanSink(tp.get_tracer(name), None)), tp, exp
