"""SpecSession with fake engines whose phases sleep known times: each phase bucket of the
BurstRecord holds its own phase's time and no neighbour's; the per-device free-memory dict
names every device of the process (the drafter's too) and reaches the phase spans; and k < 1
is refused through the Python API."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from memra_dist.errors import UserError
from memra_dist.phase.levels import TraceSettings
from memra_dist.phase.records import PHASE_COUNT
from memra_dist.specdec import session as session_mod
from memra_dist.specdec.drafters.base import Drafter, Proposal
from memra_dist.specdec.sampling import SamplingParams
from memra_dist.specdec.session import SpecSession
from memra_dist.tracing.conventions import PHASE_SPANS, PHASES
from memra_dist.tracing.emit import SpanSink

V = 16
TOKEN = 3  # the fake target's argmax on every row
# seconds each phase sleeps: draft, verify, accept, rollback, maint (all distinct)
SLEEP = (0.020, 0.030, 0.015, 0.010, 0.025)


class FakeTarget:
    """forward sleeps SLEEP[1] (after the prime) and predicts TOKEN on every row;
    rollback sleeps SLEEP[3] and records the committed lengths it was given."""

    def __init__(self, label: str = "cpu", free: int = 5000, sleeps: bool = True):
        self.label, self._free, self.sleeps = label, free, sleeps
        self.device = torch.device("cpu")
        self.primed = False
        self.rollbacks: list[int] = []

    def alloc(self, capacity: int) -> None:
        pass

    def forward(self, ids, start, timer=None, last=False):
        if self.primed and self.sleeps:
            time.sleep(SLEEP[1])
        self.primed = True
        logits = torch.zeros(ids.shape[0], V)
        logits[:, TOKEN] = 1.0
        return logits

    def rollback(self, new_len: int) -> None:
        if self.sleeps:
            time.sleep(SLEEP[3])
        self.rollbacks.append(new_len)

    def drain(self) -> None:
        pass

    def free_mb(self) -> int:
        return self._free


class FakeDrafter(Drafter):
    """Proposes TOKEN, TOKEN, then other tokens (two drafts accepted per round at k >= 3);
    propose sleeps SLEEP[0], maintain SLEEP[4]."""

    name = "fake"

    def __init__(self, runner=None, sleeps: bool = True):
        self.sleeps = sleeps
        if runner is not None:
            self.runner = runner
            self.device = runner.device

    def propose(self, context, k, sp, gen):
        if self.sleeps:
            time.sleep(SLEEP[0])
        toks = [TOKEN, TOKEN] + [TOKEN + 1] * max(0, k - 2)
        return Proposal(torch.tensor(toks[:k], dtype=torch.long))

    def maintain(self, context) -> None:
        if self.sleeps:
            time.sleep(SLEEP[4])


class RecordSink:
    def __init__(self, inner=None):
        self.bursts, self.inner = [], inner

    def burst(self, rec):
        self.bursts.append(rec)
        if self.inner is not None:
            self.inner.burst(rec)

    def first_token(self, prof):
        pass

    def rounds(self, log, final):
        pass


def _session(target, drafter, k=4, level=1, sink=None):
    return SpecSession(target, drafter, SamplingParams(), torch.Generator().manual_seed(0), k,
                       TraceSettings(level=level), sink)


def test_each_phase_bucket_holds_its_own_time(monkeypatch):
    real_accept = session_mod.greedy_commit

    def slow_accept(logits, drafts, rows=None):
        time.sleep(SLEEP[2])
        return real_accept(logits, drafts, rows)

    monkeypatch.setattr(session_mod, "greedy_commit", slow_accept)
    sink = RecordSink()
    s = _session(FakeTarget(), FakeDrafter(), k=4, sink=sink)
    s.start([1, 2, 3, 4], max_new=40, capacity=64)
    s.burst(3)
    (rec,) = sink.bursts
    assert rec.n == 3
    total = sum(SLEEP)
    for r in rec.live():
        assert (r.k, r.j) == (4, 2)
        for i in range(PHASE_COUNT):
            ms = r.phase_ns(i) / 1e6
            own = SLEEP[i] * 1e3
            # a phase holds at least its own sleep, and less than its sleep plus all the others':
            # a boundary stamped on the wrong side of a neighbour's work fails one or the other
            assert own <= ms < total * 1e3, (PHASES[i], ms, [r.phase_ns(x) / 1e6 for x in range(PHASE_COUNT)])
        assert r.wall_ns == r.t[PHASE_COUNT] - r.t[0] >= total * 1e9
    tot = rec.totals_ns()
    for i in range(PHASE_COUNT):
        assert tot[i] >= 3 * SLEEP[i] * 1e9, (PHASES[i], tot)


def test_committed_length_handed_to_the_target_every_round():
    """The target is rolled back to the pending token's position: len(tokens) - 1 after the
    round's commit (the pending token is the next round's first verify row)."""
    t = FakeTarget(sleeps=False)
    s = _session(t, FakeDrafter(sleeps=False), k=4, level=0)
    s.start([1, 2, 3, 4], max_new=30, capacity=64)
    while not s.done:
        before = len(t.rollbacks)
        s.burst(1)
        assert len(t.rollbacks) == before + 1
        assert t.rollbacks[-1] == len(s.tokens) - 1
    assert len(t.rollbacks) > 1


# ---- free memory per device -------------------------------------------------------------


def _drafter_runner(label="cuda1", free=1234):
    return SimpleNamespace(label=label, free_mb=lambda: free, device=torch.device("meta"), drain=lambda: None)


def test_free_mb_names_the_drafter_device_when_apart():
    s = _session(FakeTarget(label="cuda0", free=5678), FakeDrafter(_drafter_runner()), level=1)
    assert s._free_mb() == {"cuda0": 5678, "cuda1": 1234}


def test_free_mb_one_entry_when_the_drafter_shares_the_device():
    s = _session(FakeTarget(label="cuda0", free=5678), FakeDrafter(_drafter_runner("cuda0", 1)), level=1)
    assert s._free_mb() == {"cuda0": 5678}


def test_phase_spans_carry_every_device_free_mb():
    exp = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exp))
    sink = RecordSink(SpanSink(provider.get_tracer("memra_dist"), None))
    s = _session(FakeTarget(label="cuda0", free=5678, sleeps=False),
                 FakeDrafter(_drafter_runner(), sleeps=False), k=3, sink=sink)
    s.start([1, 2, 3], max_new=12, capacity=32)
    s.burst(2)
    rec = sink.bursts[0]
    for r in rec.live():
        assert r.free_mb == [{"cuda0": 5678, "cuda1": 1234}] * PHASE_COUNT
    spans = exp.get_finished_spans()
    phase_spans = [sp for sp in spans if sp.name in set(PHASE_SPANS[p] for p in PHASES)]
    assert len(phase_spans) == PHASE_COUNT * rec.n > 0
    for sp in phase_spans:
        assert sp.attributes["memra.free_mb.cuda0"] == 5678, sp.name
        assert sp.attributes["memra.free_mb.cuda1"] == 1234, sp.name


# ---- k through the Python API -----------------------------------------------------------


@pytest.mark.parametrize("k", [0, -1])
def test_k_below_one_is_refused(k):
    with pytest.raises(UserError, match="must be >= 1"):
        _session(FakeTarget(), FakeDrafter(), k=k, level=0)


def test_k_one_is_accepted():
    s = _session(FakeTarget(sleeps=False), FakeDrafter(sleeps=False), k=1, level=0)
    s.start([1, 2], max_new=6, capacity=16)
    while not s.done:
        s.burst(4)
    assert s.stats.drafted > 0 and s.stats.drafted <= s.stats.rounds


# ---- the host part of a phase ---------------------------------------------------------------

HOST_S, DEVICE_S = 0.010, 0.040  # the fake verify: host launch work, then device work until its drain


class AsyncTarget(FakeTarget):
    """A verify that launches work running on a fake device: forward spends HOST_S on the host
    and returns, the device is busy until DEVICE_S after the launch began; drain() waits for it."""

    def __init__(self):
        super().__init__(sleeps=False)
        self.busy_until = 0.0

    def forward(self, ids, start, timer=None, last=False):
        if self.primed:
            self.busy_until = time.perf_counter() + DEVICE_S
            time.sleep(HOST_S)
        return super().forward(ids, start, timer)

    def drain(self) -> None:
        time.sleep(max(0.0, self.busy_until - time.perf_counter()))


def test_a_phase_span_says_how_much_of_it_the_host_took():
    """memra.host_ms: the verify's host part is its launch work, not the device tail the drain
    waited for; a host-only phase (the fake draft sleeping on the host) is host nearly whole;
    the share table carries the same split."""
    from memra_dist.phase.share import ShareTable

    exp = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exp))
    sink = RecordSink(SpanSink(provider.get_tracer("memra_dist"), None))
    s = _session(AsyncTarget(), FakeDrafter(), k=4, sink=sink)
    s.start([1, 2, 3, 4], max_new=40, capacity=64)
    s.burst(3)
    (rec,) = sink.bursts
    for r in rec.live():
        verify, host = r.phase_ns(1) / 1e9, r.host_ns(1) / 1e9
        assert verify >= DEVICE_S and HOST_S <= host < DEVICE_S * 0.75, (verify, host)
        assert r.host_ns(0) >= SLEEP[0] * 1e9 and r.host_ns(0) <= r.phase_ns(0)
    spans = {sp.name: sp for sp in exp.get_finished_spans()}
    v, d = spans[PHASE_SPANS["verify"]], spans[PHASE_SPANS["draft"]]
    assert HOST_S * 1e3 <= v.attributes["memra.host_ms"] < (v.end_time - v.start_time) / 1e6 * 0.75
    assert d.attributes["memra.host_ms"] >= SLEEP[0] * 1e3
    table = ShareTable()
    table.burst(rec)
    row = next(ln for ln in table.table().splitlines() if ln.startswith("  verify "))
    ms_round, host = (float(x) for x in row.split()[2:4])
    assert HOST_S * 1e3 <= host < ms_round * 0.75, row
