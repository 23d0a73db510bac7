"""The first-token profile's depth fields of the tap-drafter path (issue 16 part 5): the tap
sink's allocation inside cache_alloc, the drafter prime split (h2d / feature GEMM / k/v
ingest) inside draft_prime, rows / chunks / arm; with known sleeps each sub-bucket holds its
own time and they sum to at most their bucket; the real DFlash and MTP paths on CPU; the
[spec-prof] line and the memra.first_token span carry them; and nothing is stamped (no
drain) without the profile."""

from __future__ import annotations

import time

import pytest
import torch
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from memra_dist import device as device_mod
from memra_dist.model import taps as taps_mod
from memra_dist.model.config import load_config
from memra_dist.model.dflash import load_dflash_config
from memra_dist.demo.tiny_dflash import random_dflash
from memra_dist.phase.first_token import DepthTimer, DEPTH_FIELDS, FirstTokenProf
from memra_dist.phase.levels import TraceSettings
from memra_dist.runner import ModelRunner
from memra_dist.specdec.drafters.base import Drafter, Proposal
from memra_dist.specdec.drafters.dflash import DFlashDrafter
from memra_dist.specdec.drafters.mtp import MTPDrafter
from memra_dist.specdec.sampling import SamplingParams
from memra_dist.specdec.session import SpecSession
from memra_dist.tracing.conventions import ATTR, SPAN_FIRST_TOKEN
from memra_dist.tracing.emit import SpanSink

from moe_ckpt import save_moe

CPU, F32 = torch.device("cpu"), torch.float32
V, TOKEN = 16, 3
PROMPT = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7]
CAP = 64
# seconds: the tap sink alloc (inside the target alloc), the rest of the alloc; the prime's
# feature GEMM, its k/v ingest, and the prime's work outside both
SINK, ALLOC_REST, FEAT, KV, PRIME_REST = 0.020, 0.040, 0.015, 0.025, 0.040
SHAPE = dict(layers=2, block_size=4, taps=(0, 2), mask_token_id=1, heads=2, kv_heads=1, head_dim=16,
             intermediate_size=64)


class Sink:
    def __init__(self, inner=None):
        self.prof, self.inner = None, inner

    def burst(self, rec):
        pass

    def first_token(self, prof):
        self.prof = prof
        if self.inner is not None:
            self.inner.first_token(prof)

    def rounds(self, log, final):
        pass


def _session(target, drafter, prof: bool, sink=None, level: int = 0):
    return SpecSession(target, drafter, SamplingParams(), torch.Generator().manual_seed(0), 3,
                       TraceSettings(level=level, prof=prof), sink)


# ---- known sleeps through fake engines --------------------------------------------------------


class FakeRunner:
    """A target whose alloc "allocates a tap sink" (a known sleep) between depth stamps."""

    def __init__(self):
        self.label, self.device = "cpu", torch.device("cpu")
        self.ttft_depth = None
        self.drains = 0
        self.seen_depth = []

    def alloc(self, capacity):
        d = self.ttft_depth
        self.seen_depth.append(d)
        t = d.stamp() if d is not None else 0
        time.sleep(SINK)
        if d is not None:
            d.lap("tap_sink_alloc_ms", t)
            d.prof.tap_sink_mb = 2.5
        time.sleep(ALLOC_REST)

    def forward(self, ids, start, timer=None, last=False):
        logits = torch.zeros(ids.shape[0], V)
        logits[:, TOKEN] = 1.0
        return logits

    def rollback(self, n):
        pass

    def drain(self):
        self.drains += 1

    def free_mb(self):
        return 1000


class FakeTapDrafter(Drafter):
    """A tap drafter whose prime ingests in two chunks, each a feature GEMM and a k/v ingest
    of known sleeps, with more work outside the stamped parts."""

    name = "fake-tap"
    ttft_depth = None

    def __init__(self):
        self.seen_depth = []

    def prime(self, prompt, chunks=None):
        d = self.ttft_depth
        self.seen_depth.append(d)
        half = len(prompt) // 2
        for rows in (half, len(prompt) - half):
            t = d.stamp() if d is not None else 0
            time.sleep(FEAT / 2)
            if d is not None:
                t = d.lap("draft_prime_feat_ms", t)
            time.sleep(KV / 2)
            if d is not None:
                d.lap("draft_prime_kv_ms", t)
                d.chunk(rows)
        time.sleep(PRIME_REST)

    def propose(self, context, k, sp, gen):
        return Proposal(torch.full((k,), TOKEN, dtype=torch.long))


def test_sub_buckets_hold_their_sleeps_and_sum_to_at_most_their_bucket():
    sink = Sink()
    target, drafter = FakeRunner(), FakeTapDrafter()
    s = _session(target, drafter, prof=True, sink=sink)
    s.start(PROMPT, max_new=8, capacity=CAP)
    s.burst(2)
    pf = sink.prof
    assert pf is not None
    ms = pf.ms
    # inside cache_alloc: the sink's own sleep, not the rest of the alloc
    assert SINK * 1e3 <= pf.tap_sink_alloc_ms < (SINK + ALLOC_REST) * 1e3
    assert pf.tap_sink_alloc_ms <= ms["cache_alloc"] and ms["cache_alloc"] >= (SINK + ALLOC_REST) * 1e3
    assert pf.tap_sink_mb == 2.5
    # inside draft_prime: each sub-bucket its own sleeps, all three at most the bucket
    assert FEAT * 1e3 <= pf.draft_prime_feat_ms < (FEAT + KV) * 1e3
    assert KV * 1e3 <= pf.draft_prime_kv_ms < (KV + PRIME_REST) * 1e3
    assert pf.draft_prime_h2d_ms == 0.0 and pf.prime_tap_dtoh_ms == 0.0
    split = pf.draft_prime_h2d_ms + pf.draft_prime_feat_ms + pf.draft_prime_kv_ms
    assert split <= ms["draft_prime"] and ms["draft_prime"] >= (FEAT + KV + PRIME_REST) * 1e3
    assert ms["draft_prime"] - split >= PRIME_REST * 1e3  # the unstamped work stays outside the split
    assert (pf.draft_prime_rows, pf.draft_prime_chunks, pf.draft_prime_arm) == (len(PROMPT), 2, "device")
    # the timer was lent for the one call only
    assert target.ttft_depth is None and drafter.ttft_depth is None
    assert target.seen_depth[0] is not None and drafter.seen_depth[0] is not None


def test_without_the_profile_nothing_is_lent_and_nothing_drains():
    target, drafter = FakeRunner(), FakeTapDrafter()
    s = _session(target, drafter, prof=False, level=0)
    s.start(PROMPT, max_new=8, capacity=CAP)
    while not s.done:
        s.burst(4)
    assert target.seen_depth == [None] and drafter.seen_depth == [None]
    assert target.drains == 0


def test_a_drafter_that_reads_no_taps_keeps_the_depth_fields_zero():
    class Plain(Drafter):
        def propose(self, context, k, sp, gen):
            return Proposal(torch.full((k,), TOKEN, dtype=torch.long))

    sink = Sink()
    s = _session(FakeRunner(), Plain(), prof=True, sink=sink)
    s.start(PROMPT, max_new=4, capacity=CAP)
    s.burst(1)
    pf = sink.prof
    assert (pf.draft_prime_feat_ms, pf.draft_prime_kv_ms, pf.draft_prime_rows, pf.draft_prime_chunks) == (0, 0, 0, 0)
    assert pf.draft_prime_arm == "-"
    assert "draft_prime_arm=-" in pf.line() and "device arm" not in pf.line()


# ---- the line and the span --------------------------------------------------------------------


def _sample_prof() -> FirstTokenProf:
    pf = FirstTokenProf()
    pf.ms.update(cache_alloc=1.0, prime=5.0, draft_prime=4.0, first_draft=1.0, first_verify=2.0)
    pf.t0_ns, pf.round1_t0_ns = 1_000_000, 20_000_000
    pf.tap_sink_alloc_ms, pf.tap_sink_mb = 0.25, 3.0
    pf.draft_prime_feat_ms, pf.draft_prime_kv_ms = 1.5, 2.0
    pf.draft_prime_rows, pf.draft_prime_chunks, pf.draft_prime_arm = 13, 1, "device"
    pf.prime_chunk_rows, pf.prime_chunk_ms = [8, 5], [3.0, 2.0]  # the prime's two chunks
    pf.cache_kv_alloc_ms, pf.graph_captures, pf.graph_first_capture_ms, pf.graph_capture_ms = 0.125, 5, 40.0, 2.5
    pf.graph_warmup_ms, pf.graph_record_ms, pf.graph_row_ms = 30.0, 12.5, {2: 2.5, 1: 40.0}
    pf.kernel_tune_configs, pf.kernel_tune_ms, pf.kernel_tune_cached = 3, 25.0, 2
    return pf


def test_line_carries_the_seed_names_and_says_device_arm():
    line = _sample_prof().line()
    depth = line.split(" | ")[-1]
    for f in DEPTH_FIELDS:
        assert f" {f}=" in f" {depth}", f
    kv = dict(tok.split("=", 1) for tok in depth.split(" (")[0].split())
    assert kv == {"cache_kv_alloc_ms": "0.125", "graph_captures": "5", "graph_first_capture_ms": "40.000",
                  "graph_capture_ms": "2.500", "graph_warmup_ms": "30.000", "graph_record_ms": "12.500",
                  "graph_rows_ms": "1:40.0/2:2.5", "kernel_tune_configs": "3", "kernel_tune_ms": "25.000",
                  "kernel_tune_cached": "2", "tap_sink_alloc_ms": "0.250", "tap_sink_mb": "3.0", "prime_chunks": "2", "prime_rows": "13",
                  "prime_chunk_mean_ms": "2.500", "prime_chunk_max_ms": "3.000", "prime_tap_dtoh_ms": "0.000",
                  "draft_prime_h2d_ms": "0.000", "draft_prime_feat_ms": "1.500", "draft_prime_kv_ms": "2.000",
                  "draft_prime_rows": "13", "draft_prime_chunks": "1", "draft_prime_arm": "device"}
    assert "(device arm: the taps never leave the device" in depth and "no tap DtoH" in depth


def _span_attrs(pf):
    exp = InMemorySpanExporter()
    prov = TracerProvider()
    prov.add_span_processor(SimpleSpanProcessor(exp))
    SpanSink(prov.get_tracer("t"), None).first_token(pf)
    (ft,) = [s for s in exp.get_finished_spans() if s.name == SPAN_FIRST_TOKEN]
    return ft.attributes


def test_first_token_span_carries_the_depth_attributes():
    at = _span_attrs(_sample_prof())
    assert at["memra.tap_sink_alloc_ms"] == 0.25 and at["memra.tap_sink_mb"] == 3.0
    assert at["memra.prime_tap_dtoh_ms"] == 0.0 and at["memra.draft_prime_h2d_ms"] == 0.0
    assert at["memra.draft_prime_feat_ms"] == 1.5 and at["memra.draft_prime_kv_ms"] == 2.0
    assert at["memra.draft_prime_rows"] == 13 and at["memra.draft_prime_chunks"] == 1
    assert at["memra.draft_prime_arm"] == "device"
    assert {ATTR[f] for f in DEPTH_FIELDS} <= set(at)


# ---- the real DFlash path on CPU --------------------------------------------------------------


@pytest.fixture(scope="module")
def dflash_dir(llama, tmp_path_factory):
    return random_dflash(tmp_path_factory.mktemp("dflash_split") / "d", llama, seed=2, **SHAPE)


@pytest.fixture
def drains(monkeypatch):
    box = {"n": 0}
    orig = device_mod.Drainer.__call__

    def counted(self):
        box["n"] += 1
        return orig(self)

    monkeypatch.setattr(device_mod.Drainer, "__call__", counted)
    return box


def _dflash(llama, ddir):
    target = ModelRunner(llama, CPU, F32, max_pos=128)
    return target, DFlashDrafter.load(ddir, load_dflash_config(ddir), target)


def _run(target, drafter, prof: bool, n_new=12):
    exp = InMemorySpanExporter()
    prov = TracerProvider()
    prov.add_span_processor(SimpleSpanProcessor(exp))
    sink = Sink(SpanSink(prov.get_tracer("t"), None))
    s = _session(target, drafter, prof=prof, sink=sink)
    s.start(PROMPT, max_new=n_new, capacity=CAP)
    while not s.done:
        s.burst(4)
    return s.tokens, sink.prof, [sp for sp in exp.get_finished_spans() if sp.name == SPAN_FIRST_TOKEN]


def test_dflash_prime_split_for_real(llama, dflash_dir):
    target, drafter = _dflash(llama, dflash_dir)
    toks, pf, spans = _run(target, drafter, prof=True)
    H = load_config(llama).hidden_size
    sink_mb = len(SHAPE["taps"]) * CAP * H * 4 / 2**20
    assert pf.tap_sink_mb == pytest.approx(sink_mb)
    assert 0 < pf.tap_sink_alloc_ms <= pf.ms["cache_alloc"]
    assert pf.prime_tap_dtoh_ms == 0.0 and pf.draft_prime_h2d_ms == 0.0
    assert pf.draft_prime_feat_ms > 0 and pf.draft_prime_kv_ms > 0
    assert pf.draft_prime_h2d_ms + pf.draft_prime_feat_ms + pf.draft_prime_kv_ms <= pf.ms["draft_prime"]
    assert (pf.draft_prime_rows, pf.draft_prime_chunks, pf.draft_prime_arm) == (len(PROMPT), 1, "device")
    assert pf.draft_kv_mb > 0  # kept
    (ft,) = spans
    assert ft.attributes["memra.draft_prime_rows"] == len(PROMPT)
    assert ft.attributes["memra.draft_prime_arm"] == "device"
    assert ft.attributes["memra.tap_sink_mb"] == pytest.approx(sink_mb)
    assert f"draft_prime_rows={len(PROMPT)} draft_prime_chunks=1 draft_prime_arm=device" in pf.line()
    # the maintain ingests after the prime are not the prime's: the counts did not move
    assert drafter.n > len(PROMPT) and pf.draft_prime_chunks == 1
    assert drafter.ttft_depth is None and target.ttft_depth is None

    # a second session at the same capacity reuses the sink: its size, ~no allocation time
    toks2, pf2, _ = _run(target, drafter, prof=True)
    assert pf2.tap_sink_mb == pytest.approx(sink_mb) and pf2.tap_sink_alloc_ms == 0.0
    assert (pf2.draft_prime_rows, pf2.draft_prime_chunks) == (len(PROMPT), 1)
    assert toks2 == toks


def test_dflash_without_the_profile_drains_nothing_and_drafts_the_same(llama, dflash_dir, drains):
    target, drafter = _dflash(llama, dflash_dir)
    toks_off, pf, spans = _run(target, drafter, prof=False)
    assert drains["n"] == 0 and pf is None and spans == []
    target2, drafter2 = _dflash(llama, dflash_dir)
    toks_on, _, _ = _run(target2, drafter2, prof=True)
    assert drains["n"] > 0
    assert toks_on == toks_off


def test_tap_sink_alloc_holds_its_own_time(llama, dflash_dir, monkeypatch):
    """A slow sink allocation lands in tap_sink_alloc_ms, inside cache_alloc."""
    real = taps_mod.TapSink.alloc.__func__

    def slow(cls, *a, **k):
        time.sleep(SINK)
        return real(cls, *a, **k)

    import memra_dist.runner as runner_mod
    monkeypatch.setattr(runner_mod.TapSink, "alloc", classmethod(slow))
    target, drafter = _dflash(llama, dflash_dir)
    _, pf, _ = _run(target, drafter, prof=True, n_new=2)
    assert SINK * 1e3 <= pf.tap_sink_alloc_ms <= pf.ms["cache_alloc"]


# ---- MTP: no feature GEMM, one k/v chunk per layer ---------------------------------------------


def test_mtp_prime_split(tmp_path):
    d, _hf = save_moe(tmp_path / "ds", "deepseek_v3", layers=2, n_mtp=2, seed=1)
    target = ModelRunner(d, CPU, F32, max_pos=128)
    drafter = MTPDrafter.load(d, load_config(d), target)
    sink = Sink()
    s = _session(target, drafter, prof=True, sink=sink)
    s.start(PROMPT, max_new=4, capacity=CAP)
    s.burst(2)
    pf = sink.prof
    P = len(PROMPT)
    assert pf.draft_prime_feat_ms == 0.0 and pf.draft_prime_kv_ms > 0
    assert pf.draft_prime_kv_ms <= pf.ms["draft_prime"]
    assert (pf.draft_prime_rows, pf.draft_prime_chunks, pf.draft_prime_arm) == ((P - 1) + (P - 2), 2, "device")
    H = load_config(d).hidden_size
    assert pf.tap_sink_mb == pytest.approx(CAP * H * 4 / 2**20)  # the FINAL tap only
    assert 0 < pf.tap_sink_alloc_ms <= pf.ms["cache_alloc"]


def test_graph_captures_are_laps_of_cache_alloc():
    """StepGraphs.warm with the profile's timer: one drained lap per capture, the first
    (compile, kernel JIT) apart from the rest, and the count."""
    from types import SimpleNamespace

    from memra_dist.graphs import StepGraphs

    runner = SimpleNamespace(stage=SimpleNamespace(has_embed=True), device=torch.device("cpu"))
    g = StepGraphs.__new__(StepGraphs)
    g.runner, g.graphs, g.timed = runner, {}, {}
    g._capture = lambda x, start, timed=False, depth=None: ("graph", x.shape[0], timed)
    clock = iter(range(0, 10**9, 1_000_000))  # each stamp 1 ms after the last
    pf = FirstTokenProf()
    g.warm(range(1, 4), timed=True, depth=DepthTimer(pf, lambda: next(clock)))
    assert sorted(g.graphs) == sorted(g.timed) == [1, 2, 3]
    assert pf.graph_captures == 6
    assert pf.graph_first_capture_ms == 1.0 and pf.graph_capture_ms == 5.0
    assert pf.graph_rows_ms == "1:2.0/2:2.0/3:2.0"  # each row count: its graph and its level-2 twin
    g.warm(range(1, 4), timed=True, depth=DepthTimer(pf, lambda: next(clock)))  # all captured: nothing more
    assert pf.graph_captures == 6


def test_a_profiled_cpu_alloc_times_the_cache(llama):
    """The real runner on CPU: the cache states are a lap of cache_alloc; no graph, no capture."""
    from memra_dist.runner import ModelRunner

    r = ModelRunner(llama, torch.device("cpu"), torch.float32, max_pos=256)
    pf = FirstTokenProf()
    clock = iter(range(0, 10**9, 1_000_000))
    r.ttft_depth = DepthTimer(pf, lambda: next(clock))
    r.alloc(256)
    assert pf.cache_kv_alloc_ms == 1.0 and pf.graph_captures == 0 and pf.graph_first_capture_ms == 0.0


def test_a_warm_up_collects_once_and_holds_the_collector_over_every_capture(monkeypatch):
    """StepGraphs.warm: one gc.collect for all its captures (each cost ~0.1 s in a process
    holding torch and Ray), the collector off during each capture, back on after."""
    import gc
    from types import SimpleNamespace

    from memra_dist import graphs as G

    collects = []
    monkeypatch.setattr(G.gc, "collect", lambda *a: collects.append(1) or 0)
    runner = SimpleNamespace(stage=SimpleNamespace(has_embed=True), device=torch.device("cpu"))
    g = G.StepGraphs.__new__(G.StepGraphs)
    g.runner, g.graphs, g.timed = runner, {}, {}
    seen = []

    def capture(x, start, timed=False, depth=None):
        with G.hold_collector():  # as the real capture does around its recording
            seen.append(gc.isenabled())
        return ("graph", x.shape[0], timed)

    g._capture = capture
    assert gc.isenabled()
    g.warm(range(1, 6), timed=True)
    assert len(seen) == 10 and not any(seen), "a capture ran with the collector on"
    assert len(collects) == 1, f"{len(collects)} collections for one warm-up"
    assert gc.isenabled()
    with G.hold_collector():  # a lone capture (first use) still collects first
        pass
    assert len(collects) == 2 and gc.isenabled()
