"""Pure parts of the phase instruments: the round log's summary (hand-computed,
field by field), the stderr line shapes, and record -> span conversion."""

from __future__ import annotations

import re

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from memra_dist.phase.first_token import FirstTokenProf
from memra_dist.phase.lines import phase_line, phase_v_line
from memra_dist.phase.records import BurstRecord
from memra_dist.phase.rounds_log import SPEC_PROF_ROUNDS, RoundProf, RoundsLog
from memra_dist.tracing.conventions import PHASE_SPANS, PHASES, TTFT_BUCKETS
from memra_dist.tracing.emit import SpanSink


def rp(wall, draft, verify, k, j, ctx, seq=0):
    return RoundProf(wall_ms=wall, draft_ms=draft, verify_ms=verify, accept_ms=0.1, rest_ms=0.2, k=k, j=j,
                     ctx=ctx, seq_rows=seq)


def test_summary_hand_computed():
    log = RoundsLog()
    for r in [rp(2.0, 0.2, 1.5, 4, 4, 10), rp(1.0, 0.1, 0.6, 4, 0, 15), rp(3.2, 0.3, 2.5, 4, 2, 16, seq=3),
              rp(1.5, 0.1, 1.0, 2, 1, 19), rp(9.0, 0.4, 8.0, 4, 3, 21, seq=1)]:
        log.push(r)
    # walls sorted [1.0, 1.5, 2.0, 3.2, 9.0]: median walls[5 // 2] = 2.0, slow = {3.2, 9.0} (> 3.0);
    # mean 16.7 / 5 = 3.34; k 18 / 5 = 3.6, j 10 / 5 = 2, accept 10 / 18, (j + n) / n = 3;
    # draft 1.1 / 5 = 0.22, verify 13.6 / 5 = 2.72, seq rows 4
    assert log.summary() == (
        "rounds=5 k_mean=3.60 j_mean=2.00 accept=0.556 tok_per_round=3.00 wall_ms mean=3.3 min=1.0 "
        "med=2.0 max=9.0 slow_rounds(>1.5x med)=2 draft_mean=0.2 verify_mean=2.7 seq_rows_total=4 "
        "ctx_first=10 ctx_last=21")


@pytest.mark.parametrize("walls, med, slow", [
    ([1.0, 2.0, 3.0, 10.0], 3.0, 1),  # even n: the upper median walls[n // 2]; 10 > 4.5
    ([2.0, 2.0, 3.0, 2.0], 2.0, 0),  # 3.0 == 1.5 x median is not past it (strict)
    ([2.0, 2.0, 3.01, 2.0], 2.0, 1),
    ([5.0], 5.0, 0),
    ([1.0, 1.0, 1.0, 1.6, 1.6, 1.7], 1.6, 0),  # median at index 3 of the sorted walls
])
def test_summary_median_and_slow_round_count(walls, med, slow):
    log = RoundsLog()
    for i, w in enumerate(walls):
        log.push(rp(w, 0.0, 0.0, 0, 0, i))
    s = log.summary()
    assert f" med={med:.1f} " in s
    assert f"slow_rounds(>1.5x med)={slow} " in s
    assert "accept=0.000" in s  # k == 0: no division by zero
    assert f"ctx_first=0 ctx_last={len(walls) - 1}" in s


def test_summary_empty_and_log_cap():
    log = RoundsLog()
    assert log.summary() == "rounds=0"
    for i in range(SPEC_PROF_ROUNDS + 10):
        log.push(rp(1.0, 0.0, 0.0, 1, 1, i))
    assert len(log.rounds) == SPEC_PROF_ROUNDS == 64 and not log.wants_more()
    assert log.summary().startswith("rounds=64 ")
    # the line sink prints each row once and one summary, whether the log comes back as the
    # same object (pp=1) or as a fresh copy each burst (pp>1, unpickled from the head)
    import copy
    import io

    from memra_dist.phase.levels import TraceSettings
    from memra_dist.phase.report import LineSink

    out = io.StringIO()
    sink = LineSink(TraceSettings(prof=True), out=out)
    sink.rounds(copy.deepcopy(log), False)
    sink.rounds(copy.deepcopy(log), False)
    sink.rounds(log, True)
    sink.rounds(log, True)
    lines = out.getvalue().splitlines()
    assert [ln.split()[1] for ln in lines if ln.startswith("[spec-prof-rounds]")] == [f"r={i}" for i in range(64)]
    assert sum(ln.startswith("[spec-prof-summary]") for ln in lines) == 1


# ---- records ----

def make_burst(sub: bool = False) -> BurstRecord:
    """Two rounds at hand-set perf_counter-ns stamps."""
    b = BurstRecord()
    b.reset(index=3, k=4, capacity=8)
    b.t0 = 1_000_000
    stamps = [[1_000_100, 1_000_300, 1_002_300, 1_002_500, 1_002_600, 1_002_700],
              [1_002_800, 1_003_000, 1_006_000, 1_006_100, 1_006_200, 1_006_400]]
    for i, t in enumerate(stamps):
        r = b.next_round()
        r.index, r.t, r.k, r.j, r.ctx = 7 + i, list(t), 4, 2 * i, 20 + 3 * i
        r.free_mb = [{"cpu": 1000 + 10 * p} for p in range(5)]
        if sub:
            r.sub_ns = {"kda": 0, "mla": 0, "attn": 900, "ffn": 500, "scan": 0}
    b.t1, b.tokens = 1_006_500, 5
    return b


def test_phase_lines_shape():
    b = make_burst(sub=True)
    # totals: draft 200+200, verify 2000+3000, accept 200+100, roll 100+100, maint 100+200
    assert phase_line(b) == (
        "[spec-phase] rounds=2 k=4 total=0.01ms | draft=0.00 verify=0.01 accept=0.00 roll=0.00 maint=0.00 | "
        "per-round ms: draft=0.000 verify=0.003 accept=0.000 roll=0.000 maint=0.000 total=0.003")
    assert phase_v_line(b) == (
        "[spec-phase-v] rounds=2 k=4 | per-round ms: vkda=0.000 (scan=0.000) vmla=0.000 vattn=0.001 "
        "vrest=0.002 (vffn=0.001)")
    empty = BurstRecord()
    empty.reset(0, 4, 2)
    assert phase_line(empty) is None and phase_v_line(empty) is None


def test_phase_line_numbers_in_ms():
    b = BurstRecord()
    b.reset(0, 2, 1)
    r = b.next_round()
    r.t = [0, 1_000_000, 5_000_000, 5_500_000, 5_750_000, 6_000_000]  # 1, 4, 0.5, 0.25, 0.25 ms
    assert phase_line(b) == (
        "[spec-phase] rounds=1 k=2 total=6.00ms | draft=1.00 verify=4.00 accept=0.50 roll=0.25 maint=0.25 | "
        "per-round ms: draft=1.000 verify=4.000 accept=0.500 roll=0.250 maint=0.250 total=6.000")


@pytest.fixture
def mem():
    exp = InMemorySpanExporter()
    prov = TracerProvider()
    prov.add_span_processor(SimpleSpanProcessor(exp))
    return prov.get_tracer("test"), exp


def test_burst_record_to_spans(mem):
    tracer, exp = mem
    sink = SpanSink(tracer, None)
    b = make_burst()
    sink.burst(b)
    spans = exp.get_finished_spans()
    off = sink.offset
    by_name = {}
    for s in spans:
        by_name.setdefault(s.name, []).append(s)
    assert len(by_name["spec.burst"]) == 1 and len(by_name["spec.round"]) == 2
    assert sink.count == len(spans) == 1 + 2 + 2 * 5
    burst = by_name["spec.burst"][0]
    assert (burst.start_time, burst.end_time) == (b.t0 + off, b.t1 + off)
    assert burst.attributes["memra.burst"] == 3 and burst.attributes["memra.tokens"] == 5
    for rs, rr in zip(by_name["spec.round"], b.live()):
        assert rs.parent.span_id == burst.context.span_id
        assert (rs.start_time, rs.end_time) == (rr.t[0] + off, rr.t[5] + off)
        phases = sorted((s for s in spans if s.parent and s.parent.span_id == rs.context.span_id),
                        key=lambda s: s.start_time)
        assert [s.name for s in phases] == [PHASE_SPANS[p] for p in PHASES]
        for i, ps in enumerate(phases):
            assert (ps.start_time, ps.end_time) == (rr.t[i] + off, rr.t[i + 1] + off)
            a = ps.attributes
            assert (a["memra.round"], a["memra.k"], a["memra.accepted"], a["memra.ctx"]) == (rr.index, 4, rr.j, rr.ctx)
            assert a["memra.free_mb.cpu"] == 1000 + 10 * i
    assert not any(s.name.startswith("spec.verify.") for s in spans)  # level 1: no sub-spans


def test_verify_sub_spans_sum_within_verify(mem):
    tracer, exp = mem
    sink = SpanSink(tracer, None)
    b = make_burst(sub=True)
    sink.burst(b)
    spans = exp.get_finished_spans()
    verifies = [s for s in spans if s.name == "spec.verify"]
    assert len(verifies) == 2
    for v, rr in zip(verifies, b.live()):
        subs = sorted((s for s in spans if s.parent and s.parent.span_id == v.context.span_id),
                      key=lambda s: s.start_time)
        assert [s.name for s in subs] == ["spec.verify.attn", "spec.verify.ffn", "spec.verify.rest"]
        durs = [s.end_time - s.start_time for s in subs]
        assert durs[:2] == [900, 500]
        assert durs[2] == rr.phase_ns(1) - 1400  # rest = verify - attn - ffn
        assert sum(durs) <= v.end_time - v.start_time
        assert subs[0].start_time == v.start_time and subs[-1].end_time <= v.end_time
        for a, c in zip(subs, subs[1:]):
            assert a.end_time == c.start_time  # laid end to end


def test_kda_sub_span_carries_scan_ms(mem):
    tracer, exp = mem
    sink = SpanSink(tracer, None)
    b = make_burst()
    for r in b.live():
        r.sub_ns = {"kda": 800, "scan": 300, "mla": 400, "attn": 0, "ffn": 200}
    sink.burst(b)
    kda = [s for s in exp.get_finished_spans() if s.name == "spec.verify.kda"]
    assert len(kda) == 2 and all(s.attributes["memra.scan_ms"] == pytest.approx(300 / 1e6) for s in kda)
    assert not [s for s in exp.get_finished_spans() if s.name == "spec.verify.attn"]


def test_first_token_record_to_spans(mem):
    tracer, exp = mem
    sink = SpanSink(tracer, None)
    pf = FirstTokenProf()
    pf.t0_ns, pf.round1_t0_ns = 5_000_000, 9_000_000
    for i, b in enumerate(TTFT_BUCKETS):
        pf.ms[b] = 0.0 if b == "capture" else 0.1 * (i + 1)
    pf.free_mb_before, pf.free_mb_after = {"cpu": 900}, {"cpu": 850}
    pf.first_burst_tokens, pf.first_burst_rounds = 9, 8
    sink.first_token(pf)
    spans = exp.get_finished_spans()
    root = [s for s in spans if s.name == "memra.first_token"]
    assert len(root) == 1
    kids = {s.name: s for s in spans if s.parent and s.parent.span_id == root[0].context.span_id}
    assert set(kids) == {f"ttft.{b}" for b in TTFT_BUCKETS}
    off = sink.offset
    t = pf.t0_ns
    for b in TTFT_BUCKETS[:6]:
        s = kids[f"ttft.{b}"]
        assert s.start_time == t + off and s.end_time - s.start_time == int(pf.ms[b] * 1e6)
        t = s.end_time - off
    t = pf.round1_t0_ns
    for b in TTFT_BUCKETS[6:]:
        s = kids[f"ttft.{b}"]
        assert s.start_time == t + off
        t = s.end_time - off
    assert kids["ttft.cache_alloc"].attributes["memra.free_mb.cpu"] == 900
    assert kids["ttft.draft_alloc"].attributes["memra.free_mb.cpu"] == 850
    assert root[0].start_time == pf.t0_ns + off and root[0].end_time >= t + off
    assert re.match(r"cache_alloc=0\.100 prime=0\.200 capture=0\.000 ", pf.line())
