"""Spans of a real (tiny) run through an in-memory exporter: the exact tree, parents, phase
spans tiling their round, sane attributes; level 2's verify sub-spans; level 0 makes no
drains, no per-round clock reads and no spans; and (subprocess) the stderr lines appear
exactly when the flags and environment say, with the run directory's OTLP JSON."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time as _time
import types

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from memra_dist import device as device_mod
from memra_dist.config import RunConfig
from memra_dist.phase import clock as clock_mod
from memra_dist.phase.levels import TraceSettings
from memra_dist.phase.report import FanOut, LineSink
from memra_dist.app import generate
from memra_dist.specdec import session as session_mod
from memra_dist.tracing.conventions import PHASE_SPANS, PHASES
from memra_dist.tracing.emit import SpanSink
from memra_dist.tracing.otel import CountingExporter, TracingSession

PROMPT = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7]
BURST = 4


def ceil_div(a, b):
    return -(-a // b)


@pytest.fixture
def drains(monkeypatch):
    """Counts every stream drain of every engine (ModelRunner.drain is a device.Drainer)."""
    box = {"n": 0}
    orig = device_mod.Drainer.__call__

    def counted(self):
        box["n"] += 1
        return orig(self)

    monkeypatch.setattr(device_mod.Drainer, "__call__", counted)
    return box


def in_memory_session():
    exp = InMemorySpanExporter()
    ts = TracingSession(True, None, None)
    ts.provider = TracerProvider()
    ts.counting = CountingExporter(exp)
    ts.provider.add_span_processor(SimpleSpanProcessor(ts.counting))
    ts.tracer = ts.provider.get_tracer("memra_dist")
    return ts, exp


def traced_run(llama, draft_llama, level: int, prof: bool = False):
    settings = TraceSettings(level=level, prof=prof)
    cfg = RunConfig(model=str(llama), draft_model=str(draft_llama), k=3, max_new_tokens=24, device="cpu",
                    spec_k="fixed", burst_rounds=BURST, trace=settings)  # (k = 3 every round: the tree's counts)
    ts, exp = in_memory_session()
    lines = io.StringIO()
    with ts.request(cfg, "prompt", len(PROMPT)) as req:
        res = generate(cfg, PROMPT, None, FanOut(LineSink(settings, out=lines), ts.sink()))
        req.finish(res, "")
    ts.close()
    return res, exp.get_finished_spans(), lines.getvalue().splitlines()


def children(spans, parent):
    return sorted((s for s in spans if s.parent is not None and s.parent.span_id == parent.context.span_id),
                  key=lambda s: s.start_time)


def check_tree(res, spans):
    """The level-1 tree: one request > bursts > rounds > five phases, tiled; returns verifies."""
    rounds_n = res.stats["rounds"]
    roots = [s for s in spans if s.parent is None]
    assert [s.name for s in roots] == ["memra.request"]
    req = roots[0]
    assert len({s.context.trace_id for s in spans}) == 1
    bursts = children(spans, req)
    assert [s.name for s in bursts] == ["spec.burst"] * ceil_div(rounds_n, BURST)
    all_rounds, verifies = [], []
    for bi, b in enumerate(bursts):
        assert b.attributes["memra.burst"] == bi
        assert req.start_time <= b.start_time <= b.end_time <= req.end_time
        rounds = children(spans, b)
        assert [s.name for s in rounds] == ["spec.round"] * min(BURST, rounds_n - BURST * bi)
        assert b.attributes["memra.rounds"] == len(rounds)
        for r in rounds:
            assert b.start_time <= r.start_time <= r.end_time <= b.end_time
            phases = children(spans, r)
            assert [s.name for s in phases] == [PHASE_SPANS[p] for p in PHASES]
            assert phases[0].start_time == r.start_time and phases[-1].end_time == r.end_time
            for a, c in zip(phases, phases[1:]):
                assert a.end_time == c.start_time  # tiled: each boundary ends one phase, starts the next
            for p in phases:
                assert p.end_time >= p.start_time
                at = p.attributes
                for key in ("memra.round", "memra.k", "memra.accepted", "memra.ctx"):
                    assert at[key] == r.attributes[key]
                assert at["memra.free_mb.cpu"] > 0
            verifies.append(phases[1])
            all_rounds.append(r)
    # attributes: round indices in order, 3 >= k >= accepted >= 0, ctx grows by accepted + 1
    assert [r.attributes["memra.round"] for r in all_rounds] == list(range(rounds_n))
    assert all(3 >= r.attributes["memra.k"] >= r.attributes["memra.accepted"] >= 0 for r in all_rounds)
    ctx = [r.attributes["memra.ctx"] for r in all_rounds]
    assert ctx[0] == len(PROMPT)
    for r, nxt in zip(all_rounds, ctx[1:]):
        assert nxt == r.attributes["memra.ctx"] + r.attributes["memra.accepted"] + 1
    assert sum(r.attributes["memra.accepted"] for r in all_rounds) == res.stats["accepted"]
    assert sum(r.attributes["memra.k"] for r in all_rounds) == res.stats["drafted"]
    assert req.attributes["memra.tokens"] == res.stats["tokens"] == 24
    return verifies


@pytest.mark.parametrize("solo", [True, False])
def test_level1_exact_span_tree(llama, draft_llama, drains, monkeypatch, solo):
    """The same tree from the solo engine (the seed's session: its phase clock drains at every
    boundary) and from the engine loop (the draft model's rounds are the loop's: chained, timed
    by the loop's stamps, no drain at a boundary; off CUDA one where a round is read back)."""
    import memra_dist.app as app

    monkeypatch.setattr(app, "_alone_on_loop", lambda cfg, mcfg: not solo)
    res, spans, lines = traced_run(llama, draft_llama, level=1)
    rounds_n = res.stats["rounds"]
    assert 0 < res.stats["accepted"] < res.stats["drafted"]  # mixed rounds in this run
    verifies = check_tree(res, spans)
    assert len(spans) == 1 + ceil_div(rounds_n, BURST) + 6 * rounds_n
    assert not any(s.name.startswith("spec.verify.") or s.name.startswith("ttft.") for s in spans)
    assert len(verifies) == rounds_n
    # solo: one drain per boundary per round (pp=1: primary == head == one engine)
    assert drains["n"] == (5 if solo else 1) * rounds_n
    assert [ln.split()[0] for ln in lines] == ["[spec-phase]"] * ceil_div(rounds_n, BURST)


def test_level2_verify_sub_spans(llama, draft_llama, drains):
    res, spans, lines = traced_run(llama, draft_llama, level=2)
    rounds_n = res.stats["rounds"]
    verifies = check_tree(res, spans)
    for v in verifies:
        subs = children(spans, v)
        assert [s.name for s in subs] == ["spec.verify.attn", "spec.verify.ffn", "spec.verify.rest"]
        assert sum(s.end_time - s.start_time for s in subs) <= v.end_time - v.start_time
        assert subs[0].start_time == v.start_time and subs[-1].end_time <= v.end_time
        assert all(s.end_time - s.start_time > 0 for s in subs[:2])
        assert all(s.attributes["memra.free_mb.cpu"] > 0 for s in subs)
    assert drains["n"] > 5 * rounds_n  # level 2 adds the per-layer drains
    tags = [ln.split()[0] for ln in lines]
    n_b = ceil_div(rounds_n, BURST)
    assert tags == ["[spec-phase]", "[spec-phase-v]"] * n_b
    v_line = lines[1]
    assert "vkda=0.000 (scan=0.000) vmla=0.000 vattn=" in v_line and "(vffn=" in v_line


def test_prof_first_token_spans(llama, draft_llama):
    res, spans, lines = traced_run(llama, draft_llama, level=0, prof=True)
    ft = [s for s in spans if s.name == "memra.first_token"]
    assert len(ft) == 1
    kids = children(spans, ft[0])
    assert {s.name for s in kids} == {f"ttft.{b}" for b in (
        "cache_alloc", "prime", "capture", "anchor", "draft_alloc", "draft_prime",
        "first_draft", "first_verify", "first_accept", "first_roll", "first_maint")}
    assert not [s for s in spans if s.name.startswith("spec.")]  # level 0: no phase spans
    tags = [ln.split()[0] for ln in lines]
    assert tags.count("[spec-prof]") == 1 and tags.count("[spec-prof-summary]") == 1
    assert tags.count("[spec-prof-rounds]") == res.stats["rounds"]
    assert "[spec-phase]" not in tags


class CountingTime(types.SimpleNamespace):
    pass


def test_level0_no_drains_no_spans_no_clock_reads(llama, draft_llama, drains, monkeypatch):
    built = {"clock": 0, "reads": 0}
    orig_init = clock_mod.PhaseClock.__init__

    def init(self, *a, **k):
        built["clock"] += 1
        orig_init(self, *a, **k)

    monkeypatch.setattr(clock_mod.PhaseClock, "__init__", init)

    def counted(fn):
        def f():
            built["reads"] += 1
            return fn()
        return f

    fake_time = CountingTime(perf_counter_ns=counted(_time.perf_counter_ns), perf_counter=counted(_time.perf_counter))
    monkeypatch.setattr(session_mod, "time", fake_time)

    exp = InMemorySpanExporter()
    prov = TracerProvider()
    prov.add_span_processor(SimpleSpanProcessor(exp))
    span_sink = SpanSink(prov.get_tracer("t"), None)
    cfg = RunConfig(model=str(llama), draft_model=str(draft_llama), k=3, max_new_tokens=24, device="cpu",
                    burst_rounds=BURST, trace=TraceSettings(level=0))
    ts = TracingSession.open(cfg)  # level 0: disabled, no provider
    assert not ts.enabled and ts.provider is None
    lines = io.StringIO()
    streamed = []
    with ts.request(cfg, "prompt", len(PROMPT)) as req:
        res = generate(cfg, PROMPT, streamed.append, FanOut(LineSink(cfg.trace, out=lines), ts.sink(), span_sink))
        req.finish(res, "")
    ts.close()
    rounds_n = res.stats["rounds"]
    assert rounds_n >= 8 and len(streamed) == rounds_n + 1  # the hook ran every round
    assert drains["n"] == 0
    assert built["clock"] == 0
    assert span_sink.count == 0 and exp.get_finished_spans() == ()
    assert lines.getvalue() == ""
    # clock reads are per burst / per request, never per round or per phase
    n_b = ceil_div(rounds_n, BURST)
    assert built["reads"] <= 2 * n_b + 4, (built["reads"], rounds_n, n_b)


# ---- CLI level: stderr lines exactly when the flags and the environment say ----

def _env(**over):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MEMRA_SPEC", "MEMRA_GLM5", "OTEL_", "TRACEPARENT"))}
    env.update(over)
    return env


def cli(llama, tmp_path, *flags, env=None):
    run_dir = tmp_path / "run"
    res = subprocess.run(
        [sys.executable, "-m", "memra_dist.cli", "generate", "--model", str(llama), "--prompt",
         "the drafter proposes and the target verifies", "--max-new-tokens", "20", "-k", "3", "--drafter", "replay",
         "--burst-rounds", "4", "--device", "cpu", "--json", "--run-dir", str(run_dir), *flags],
        capture_output=True, text=True, timeout=120, env=env or _env())
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)  # exactly one JSON object on stdout
    tags = [ln.split()[0] for ln in res.stderr.splitlines() if ln.startswith("[spec-")]
    return out, tags, res.stderr, run_dir


def _span_names(run_dir):
    d = json.loads((run_dir / "spans.otlp.json").read_text())
    return [s for rs in d["resourceSpans"] for ss in rs["scopeSpans"] for s in ss["spans"]]


@pytest.mark.slow  # a CLI subprocess run
def test_cli_level0_prints_nothing_and_writes_nothing(llama, tmp_path):
    out, tags, err, run_dir = cli(llama, tmp_path)
    assert tags == [] and "[memra]" not in err
    assert not run_dir.exists()


@pytest.mark.slow  # a CLI subprocess run
def test_cli_env_alias_conflict_loud_once_general_wins(llama, tmp_path):
    out, tags, err, run_dir = cli(llama, tmp_path, env=_env(MEMRA_SPEC_TRACE="1", MEMRA_GLM5_SPEC_TRACE="2"))
    n_b = ceil_div(out["stats"]["rounds"], 4)
    assert tags == ["[spec-trace]"] + ["[spec-phase]"] * n_b  # level 1 won: no [spec-phase-v]
    loud = [ln for ln in err.splitlines() if ln.startswith("[spec-trace]")][0]
    assert "MEMRA_SPEC_TRACE=1" in loud and "MEMRA_GLM5_SPEC_TRACE=2" in loud
    spans = _span_names(run_dir)
    names = [s["name"] for s in spans]
    assert names.count("memra.request") == 1 and names.count("spec.burst") == n_b
    assert names.count("spec.round") == out["stats"]["rounds"]
    for p in PHASES:
        assert names.count(PHASE_SPANS[p]) == out["stats"]["rounds"]
    assert (run_dir / "trace.perfetto.json").exists()
    assert json.loads((run_dir / "trace.perfetto.json").read_text())["traceEvents"]


@pytest.mark.slow  # a CLI subprocess run
def test_cli_level2_prof_flags(llama, tmp_path):
    out, tags, err, run_dir = cli(llama, tmp_path, "--trace-level", "2", "--prof")
    rounds_n = out["stats"]["rounds"]
    n_b = ceil_div(rounds_n, 4)
    assert tags.count("[spec-phase]") == n_b and tags.count("[spec-phase-v]") == n_b
    assert tags.count("[spec-prof]") == 1 and tags.count("[spec-prof-summary]") == 1
    assert tags.count("[spec-prof-rounds]") == rounds_n
    assert "[spec-trace]" not in tags
    summary = [ln for ln in err.splitlines() if ln.startswith("[spec-prof-summary]")][0]
    assert f"rounds={rounds_n} " in summary
    names = [s["name"] for s in _span_names(run_dir)]
    assert names.count("memra.first_token") == 1 and names.count("spec.verify.attn") == rounds_n


@pytest.mark.slow  # a CLI subprocess run
def test_cli_flag_beats_env(llama, tmp_path):
    """MEMRA_SPEC_TRACE=2 but --trace-level 0: no phase lines; MEMRA_SPEC_PROF=1 (no --prof
    flag) still turns the profile on."""
    out, tags, err, run_dir = cli(llama, tmp_path, "--trace-level", "0",
                                  env=_env(MEMRA_SPEC_TRACE="2", MEMRA_SPEC_PROF="1"))
    assert "[spec-phase]" not in tags and "[spec-phase-v]" not in tags
    assert tags.count("[spec-prof]") == 1 and tags.count("[spec-prof-summary]") == 1
    assert tags.count("[spec-prof-rounds]") == out["stats"]["rounds"]


def test_traceparent_env_and_flag_precedence(monkeypatch, tmp_path, llama):
    from opentelemetry import trace as otel_trace

    env_tp = "00-11111111111111111111111111111111-2222222222222222-01"
    flag_tp = "00-33333333333333333333333333333333-4444444444444444-01"
    monkeypatch.setenv("TRACEPARENT", env_tp)
    cfg = RunConfig(model=str(llama), trace=TraceSettings(level=1))

    def parent_ids(ts):
        sc = otel_trace.get_current_span(ts.parent).get_span_context()
        ts.close()
        return f"{sc.trace_id:032x}", f"{sc.span_id:016x}"

    assert parent_ids(TracingSession.open(cfg, run_dir=str(tmp_path / "a"))) == ("1" * 32, "2" * 16)
    assert parent_ids(TracingSession.open(cfg, run_dir=str(tmp_path / "b"), traceparent=flag_tp)) == ("3" * 32, "4" * 16)
