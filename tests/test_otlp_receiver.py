"""Spans over the wire: a real OTLP/gRPC TraceService receiver inside the test receives the
spans of a `memra-dist generate --trace-level 2` subprocess, all in one trace; an incoming
`--traceparent` parents memra.request; a required header is honoured."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from memra_dist.tracing.conventions import PHASE_SPANS, PHASES

from otlp_receiver import OTLPReceiver

BURST = 4


def _env(extra: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MEMRA_SPEC", "MEMRA_GLM5", "OTEL_", "TRACEPARENT"))}
    env.update(extra)
    return env


def generate(llama, tmp_path, env_extra: dict, *flags):
    res = subprocess.run(
        [sys.executable, "-m", "memra_dist.cli", "generate", "--model", str(llama), "--prompt",
         "the drafter proposes and the target verifies", "--max-new-tokens", "16", "-k", "3",
         "--drafter", "replay", "--burst-rounds", str(BURST), "--device", "cpu", "--json", *flags],
        capture_output=True, text=True, timeout=120, env=_env(env_extra), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "not delivered" not in res.stderr, res.stderr
    return json.loads(res.stdout)


def _has_request(spans):
    return any(s.name == "memra.request" for s in spans)


@pytest.mark.slow  # a CLI subprocess run
def test_level2_run_arrives_over_otlp_grpc_in_one_trace(llama, tmp_path):
    with OTLPReceiver() as rx:
        out = generate(llama, tmp_path, {**rx.env(), "OTEL_SERVICE_NAME": "memra-otlp-test"}, "--trace-level", "2")
        spans = rx.wait_for_spans(_has_request)
    rounds = out["stats"]["rounds"]
    assert rx.requests >= 1 and rx.rejected == 0
    assert len({s.trace_id for s in spans}) == 1
    names = [s.name for s in spans]
    assert names.count("memra.request") == 1
    assert names.count("spec.burst") == -(-rounds // BURST)
    assert names.count("spec.round") == rounds
    for p in PHASES:
        assert names.count(PHASE_SPANS[p]) == rounds
    for sub in ("spec.verify.attn", "spec.verify.ffn", "spec.verify.rest"):
        assert names.count(sub) == rounds
    ids = {s.span_id for s in spans}
    root = [s for s in spans if s.name == "memra.request"][0]
    assert root.parent_span_id == ""
    assert all(s.parent_span_id in ids for s in spans if s is not root)  # a closed tree
    assert all(s.resource.get("service.name") == "memra-otlp-test" for s in spans)
    assert all(s.resource.get("memra.role") == "driver" for s in spans)
    assert root.attributes["memra.trace_level"] == 2
    assert not (tmp_path / "runs").exists()  # with an endpoint, no run directory


@pytest.mark.slow  # a CLI subprocess run
def test_traceparent_parents_the_request_and_headers_are_sent(llama, tmp_path):
    trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    with OTLPReceiver(required_headers={"x-memra-token": "s3cret"}) as rx:
        generate(llama, tmp_path, rx.env(), "--trace-level", "1", "--traceparent", f"00-{trace_id}-{parent_id}-01")
        spans = rx.wait_for_spans(_has_request)
    assert rx.rejected == 0 and rx.requests >= 1
    assert all(md.get("x-memra-token") == "s3cret" for md in rx.metadata)
    root = [s for s in spans if s.name == "memra.request"]
    assert len(root) == 1
    assert root[0].trace_id == trace_id and root[0].parent_span_id == parent_id
    assert {s.trace_id for s in spans} == {trace_id}


def test_receiver_refuses_a_missing_header():
    """The helper's header check itself (what pipeline tests will rely on)."""
    with OTLPReceiver(required_headers={"x-memra-token": "s3cret"}) as rx:
        mem = InMemorySpanExporter()
        prov = TracerProvider()
        prov.add_span_processor(SimpleSpanProcessor(mem))
        with prov.get_tracer("t").start_as_current_span("probe"):
            pass
        spans = mem.get_finished_spans()
        bad = OTLPSpanExporter(endpoint=rx.endpoint, insecure=True, headers={"x-memra-token": "nope"}, timeout=5)
        assert bad.export(spans) == SpanExportResult.FAILURE
        good = OTLPSpanExporter(endpoint=rx.endpoint, insecure=True, headers={"x-memra-token": "s3cret"}, timeout=5)
        assert good.export(spans) == SpanExportResult.SUCCESS
        bad.shutdown()
        good.shutdown()
    assert rx.rejected >= 1 and rx.requests == 1
    assert [s.name for s in rx.spans] == ["probe"]
