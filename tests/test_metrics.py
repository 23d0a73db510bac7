"""MetricsSink on hand-made records, read back through an InMemoryMetricReader; the meter
provider's readers; the Prometheus names the dashboards rely on."""

from __future__ import annotations

import dataclasses
import urllib.request

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from memra_dist.phase.first_token import FirstTokenProf
from memra_dist.phase.records import BurstRecord, RoundRecord
from memra_dist.tracing.conventions import METRIC_ATTR, METRIC_META, METRICS, PHASES, TTFT_BUCKETS
from memra_dist.tracing.metrics import MetricsSink, make_meter_provider, prometheus_name, slow_count

MS = 1_000_000


def _round(i, phase_ms, k=4, j=2, free=None, sub=None):
    t = [0]
    for ms in phase_ms:
        t.append(t[-1] + int(ms * MS))
    base = 10_000 * MS * (i + 1)
    r = RoundRecord(index=i, t=[base + x for x in t], k=k, j=j, ctx=20 + i)
    if free:
        r.free_mb = [dict(free) for _ in PHASES]
    if sub:
        r.sub_ns = {b: int(ms * MS) for b, ms in sub.items()}
    return r


def _burst(rounds):
    b = BurstRecord(index=0, k=4, rounds=rounds, n=len(rounds), tokens=sum(r.j + 1 for r in rounds))
    return b


@pytest.fixture
def sink():
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    yield MetricsSink(provider.get_meter("test")), reader
    provider.shutdown()


def _points(reader):
    out = {}
    data = reader.get_metrics_data()
    for rm in data.resource_metrics if data else ():
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                out[m.name] = list(m.data.data_points)
    return out


def _by(points, attr):
    return {dict(p.attributes)[attr]: p for p in points}


def test_burst_records_every_instrument(sink):
    s, reader = sink
    # 4 rounds: phases (draft, verify, accept, rollback, maint) ms; the last round is slow
    rounds = [_round(0, [1, 4, 0.5, 0.2, 0.3], k=4, j=4, free={"cpu": 900}),
              _round(1, [1, 4, 0.5, 0.2, 0.3], k=4, j=1, free={"cpu": 800}),
              _round(2, [1, 5, 0.5, 0.2, 0.3], k=4, j=0, free={"cpu": 700}),
              _round(3, [2, 9, 0.5, 0.2, 0.3], k=3, j=3, free={"cpu": 600, "cuda0": 5000})]
    rounds[1].h = [rounds[1].t[i + 1] - MS // 2 for i in range(len(PHASES))]  # each phase's last 0.5 ms drained
    s.burst(_burst(rounds))
    pts = _points(reader)
    batch_only = {METRICS[k] for k in ("batch_requests", "batch_wait", "kv_blocks", "batch_preemptions",
                                       "batch_draft_requests", "prefix_evictions", "spec_k_chosen",
                                       "spec_k_expected", "spec_k_accepted", "batch_idle", "batch_step",
                                       "batch_step_predicted")}  # a batched engine's rounds
    assert set(pts) == set(METRICS.values()) - {METRICS["verify_sub_duration"], METRICS["first_token"]} - batch_only
    host = _by(pts[METRICS["phase_host_duration"]], METRIC_ATTR["phase"])
    assert host["verify"].count == 1 and host["verify"].sum == pytest.approx(3.5)  # only the round that has it
    assert host["rollback"].sum == pytest.approx(0.0)  # 0.2 ms, all of it drained: clamped at zero

    phase = _by(pts[METRICS["phase_duration"]], METRIC_ATTR["phase"])
    assert set(phase) == set(PHASES)
    assert phase["verify"].count == 4 and phase["verify"].sum == pytest.approx(22.0)
    assert phase["draft"].sum == pytest.approx(5.0) and phase["draft"].max == pytest.approx(2.0)

    (rd,) = pts[METRICS["round_duration"]]
    assert rd.count == 4 and rd.sum == pytest.approx(6 + 6 + 7 + 12)
    (drafted,) = pts[METRICS["drafted"]]
    (accepted,) = pts[METRICS["accepted"]]
    assert (drafted.value, accepted.value) == (15, 8)
    (acc,) = pts[METRICS["acceptance"]]
    assert acc.count == 1 and acc.sum == pytest.approx(8 / 15)
    # per draft position (k, j = 4/4, 4/1, 4/0, 3/3): the drafts that reached it, and accepted there
    reached = _by(pts[METRICS["position_reached"]], METRIC_ATTR["position"])
    took = _by(pts[METRICS["position_accepted"]], METRIC_ATTR["position"])
    assert {p: x.value for p, x in reached.items()} == {1: 4, 2: 3, 3: 2, 4: 1}
    assert {p: x.value for p, x in took.items()} == {1: 3, 2: 2, 3: 2, 4: 1}
    (tpr,) = pts[METRICS["tokens_per_round"]]
    assert tpr.count == 4 and tpr.sum == 8 + 4  # j + 1 per round
    (slow,) = pts[METRICS["slow_rounds"]]
    assert slow.value == 1  # 12 ms > 1.5 x median 7 ms
    mem = _by(pts[METRICS["free_memory"]], METRIC_ATTR["device"])
    assert {d: p.value for d, p in mem.items()} == {"cpu": 600, "cuda0": 5000}  # last round's


def test_counters_accumulate_across_bursts(sink):
    s, reader = sink
    for _ in range(3):
        s.burst(_burst([_round(0, [1, 1, 1, 1, 1], k=2, j=1)]))
    pts = _points(reader)
    assert pts[METRICS["drafted"]][0].value == 6
    assert pts[METRICS["accepted"]][0].value == 3
    assert METRICS["slow_rounds"] not in pts  # nothing slow, nothing added


def test_verify_sub_buckets_share_the_verify(sink):
    s, reader = sink
    r = _round(0, [1, 10, 1, 1, 1], sub={"kda": 3, "attn": 2, "ffn": 4, "scan": 1})
    s.burst(_burst([r]))
    sub = _by(_points(reader)[METRICS["verify_sub_duration"]], METRIC_ATTR["bucket"])
    assert {b: p.sum for b, p in sub.items()} == pytest.approx({"kda": 3, "attn": 2, "ffn": 4, "rest": 1})


def test_empty_burst_records_nothing(sink):
    s, reader = sink
    s.burst(BurstRecord())
    assert _points(reader) == {}


def test_first_token_buckets(sink):
    s, reader = sink
    pf = FirstTokenProf()
    pf.ms.update(cache_alloc=0.5, prime=3.0, first_verify=2.0)
    pf.free_mb_after = {"cpu": 1234}
    s.first_token(pf)
    pts = _points(reader)
    ft = _by(pts[METRICS["first_token"]], METRIC_ATTR["bucket"])
    assert set(ft) == set(TTFT_BUCKETS)
    assert ft["prime"].sum == pytest.approx(3.0) and ft["capture"].sum == 0.0
    assert _by(pts[METRICS["free_memory"]], METRIC_ATTR["device"])["cpu"].value == 1234


def test_exemplars_carry_the_request_trace():
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider

    tracer = TracerProvider().get_tracer("t")
    span = tracer.start_span("memra.request")
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    s = MetricsSink(provider.get_meter("t"), context=lambda: trace.set_span_in_context(span))
    s.burst(_burst([_round(0, [1, 2, 3, 4, 5])]))
    (rd,) = _points(reader)[METRICS["round_duration"]]
    assert rd.exemplars and rd.exemplars[0].trace_id == span.get_span_context().trace_id
    span.end()


def test_slow_count_uses_the_sorted_middle():
    assert slow_count([]) == 0
    assert slow_count([10]) == 0
    assert slow_count([10, 10, 16]) == 1
    assert slow_count([10, 10, 15]) == 0  # not past 1.5x


def test_prometheus_names_follow_the_registry():
    for key, name in METRICS.items():
        kind, unit, _ = METRIC_META[key]
        prom = prometheus_name(key)
        assert prom.startswith(name.replace(".", "_"))
        assert prom.endswith("_total") == (kind == "counter")
    assert prometheus_name("phase_duration") == "memra_spec_phase_duration_milliseconds"
    assert prometheus_name("free_memory") == "memra_device_free_memory_megabytes"


def test_provider_without_endpoint_or_port_has_no_server(monkeypatch):
    for v in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT"):
        monkeypatch.delenv(v, raising=False)
    provider, server = make_meter_provider("driver", None)
    assert server is None
    provider.shutdown()


@pytest.mark.parametrize("proto", ["grpc", "http/protobuf"])
def test_otlp_reader_follows_the_traces_settings(monkeypatch, proto):
    from memra_dist.tracing.metrics import _otlp_reader

    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    assert _otlp_reader() is None
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", proto)
    reader = _otlp_reader()
    mod = "grpc" if proto == "grpc" else "http"
    assert type(reader._exporter).__module__.startswith(f"opentelemetry.exporter.otlp.proto.{mod}")
    reader.shutdown(timeout_millis=500)


def test_otlp_reader_refuses_unknown_protocol(monkeypatch):
    from memra_dist.errors import UserError
    from memra_dist.tracing.metrics import _otlp_reader

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "carrier-pigeon")
    with pytest.raises(UserError):
        _otlp_reader()


def test_prometheus_endpoint_serves_loopback_only(monkeypatch):
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    provider, server = make_meter_provider("driver", 0)
    try:
        assert server.server_address[0] == "127.0.0.1"
        s = MetricsSink(provider.get_meter("t"))
        s.burst(_burst([_round(0, [1, 2, 3, 4, 5])]))
        body = urllib.request.urlopen(f"http://127.0.0.1:{server.server_port}/metrics", timeout=5).read().decode()
        for key in ("phase_duration", "round_duration", "tokens_per_round"):
            assert prometheus_name(key) + "_bucket{" in body
        for key in ("drafted", "accepted"):
            assert prometheus_name(key) + "{" in body
        assert 'memra_phase="verify"' in body
    finally:
        provider.shutdown()
        server.shutdown()
        server.server_close()


def test_batched_rounds_record_the_step_size_the_wait_and_the_kv_blocks(sink):
    from memra_dist.batching.batcher import BatchStep

    s, reader = sink
    rounds = [_round(i, [1, 4, 0.5, 0.2, 0.3], k=4, j=2, free={"cpu": 900}) for i in range(3)]
    # the device's idle before each step (ms): gap, of it the loop's rounds and its hold
    idle = [(3.0, 1.0, 0.5), (0.0, 0.0, 0.0), (2.0, 2.0, 0.0)]  # the second launched behind a running step
    for r, (n, wait_ms, used), (gap, rnd, held) in zip(rounds, [(4, 0.5, 10), (6, 2.0, 12), (2, 0.0, 7)], idle):
        r.batch = BatchStep(id=r.index, requests=n, rows=5 * n, wait_ns=int(wait_ms * MS), forward_ns=3 * MS,
                            kv_used=used, kv_free=40 - used, preempted=used // 6,
                            gap_ns=int(gap * MS), rounds_ns=int(rnd * MS), held_ns=int(held * MS))
    rounds[0].draft_requests, rounds[1].draft_requests = 4, 3  # drafted in shared forwards; the last alone
    rounds[0].batch = dataclasses.replace(rounds[0].batch, predicted_ns=int(2.5 * MS))  # --spec-k auto's forecast
    s.burst(_burst(rounds))
    pts = _points(reader)
    (size,) = pts[METRICS["batch_requests"]]
    assert size.count == 3 and size.sum == 12
    (shared,) = pts[METRICS["batch_draft_requests"]]
    assert shared.count == 2 and shared.sum == 7  # one value per round drafted in a shared forward
    (wait,) = pts[METRICS["batch_wait"]]
    assert wait.count == 3 and wait.sum == pytest.approx(2.5)
    (step,) = pts[METRICS["batch_step"]]
    (forecast,) = pts[METRICS["batch_step_predicted"]]
    assert (step.count, step.sum) == (3, pytest.approx(9.0)) and (forecast.count, forecast.sum) == (1, pytest.approx(2.5))
    parts = _by(pts[METRICS["batch_idle"]], METRIC_ATTR["part"])
    assert {p: (x.count, x.sum) for p, x in parts.items()} == {
        "rounds": (3, pytest.approx(3.0)), "held": (3, pytest.approx(0.5)), "other": (3, pytest.approx(1.5))}
    kv = _by(pts[METRICS["kv_blocks"]], METRIC_ATTR["kv_state"])
    assert kv["used"].value == 7 and kv["free"].value == 33  # the burst's last step
    (pre,) = pts[METRICS["batch_preemptions"]]
    assert pre.value == 1  # the engine's count as of that step
    assert "cached" not in kv and METRICS["prefix_evictions"] not in pts  # no prefix cache: no such series
    rounds[2].batch = dataclasses.replace(rounds[2].batch, kv_cached=9, evictions=2)
    s.burst(_burst(rounds))
    pts = _points(reader)
    kv = _by(pts[METRICS["kv_blocks"]], METRIC_ATTR["kv_state"])
    (ev,) = pts[METRICS["prefix_evictions"]]
    assert kv["cached"].value == 9 and ev.value == 2


def test_auto_k_rounds_record_the_k_chosen_and_expected_against_accepted(sink):
    """--spec-k auto rounds (their record's `expected` set): the K chosen as a histogram (0
    included), and the accepted drafts expected and brought as two counters; a round whose K
    was fixed adds to neither."""
    s, reader = sink
    rounds = [_round(i, [1, 4, 0.5, 0.2, 0.3], k=k, j=j) for i, (k, j) in enumerate([(0, 0), (3, 2), (4, 4), (2, 1)])]
    for r, e in zip(rounds, (0.0, 2.5, 3.1, -1.0)):
        r.expected = e
    s.burst(_burst(rounds))
    pts = _points(reader)
    (chosen,) = pts[METRICS["spec_k_chosen"]]
    assert chosen.count == 3 and chosen.sum == 7  # K 0, 3, 4: the fixed round left out
    (exp,), (acc,) = pts[METRICS["spec_k_expected"]], pts[METRICS["spec_k_accepted"]]
    assert exp.value == pytest.approx(5.6) and acc.value == 6
