"""The event clock (phase/clock.py) on a simulated asynchronous stream: work launched on it
runs in stream order on the wall clock while the host goes on, as on a GPU. SpecSession's
rounds over a fake target and drafter whose phases are DEVICE work of known, distinct lengths:

- each bucket holds its own phase's device time, as the draining clock gives it;
- the host never waits at a boundary: it launched the verify before the draft had finished
  on the device and the next draft before the maintenance had (the draining clock cannot);
- the clock waits once a burst (its end) plus an anchor a stream, and nowhere else;
- a drafter on a stream of its own: the draft boundary is when the later stream reached it;
- level 0 records no event; MEMRA_PHASE_CLOCK=drain and the first-token profile drain;
- level 2's graphed stamps come back behind the verify and land in the round's sub-split.
"""

from __future__ import annotations

import time

import pytest
import torch

from memra_dist.env import environment, trace_settings
from memra_dist.phase.clock import PhaseClock
from memra_dist.phase.levels import TraceSettings, clock_from
from memra_dist.phase.records import PHASE_COUNT
from memra_dist.phase.subsplit import StampMarks, SubsplitTimer
from memra_dist.specdec.drafters.base import Drafter, Proposal
from memra_dist.specdec.sampling import SamplingParams
from memra_dist.specdec.session import SpecSession
from memra_dist.tracing.conventions import PHASES

V = 16
TOKEN = 3
# device seconds: draft, verify, rollback, maint (all distinct); the accept is host work
DRAFT, VERIFY, ROLL, MAINT = 0.030, 0.045, 0.012, 0.022
DEV = (DRAFT, VERIFY, 0.0, ROLL, MAINT)
# a bucket may run over its own work by a host hiccup (the GIL held by another thread of the test
# process, up to its 5 ms switch interval, at a wake-up or two), never by a neighbouring phase's
# work: every phase here takes more than this
SLACK_MS = 10


class SimEvent:
    __slots__ = ("t",)

    def __init__(self):
        self.t = None


class SimStream:
    """A stream that runs launched work in order on the wall clock (ns, perf_counter)."""

    def __init__(self):
        self.tail = 0  # when the work launched so far is done
        self.records = self.waits = self.busy_waits = 0

    def now(self) -> int:
        return time.perf_counter_ns()

    def launch(self, seconds: float) -> None:
        self.tail = max(self.tail, self.now()) + round(seconds * 1e9)

    def after(self, other: "SimStream") -> None:
        self.tail = max(self.tail, other.tail)  # a cross-stream dependency (the drafts' copy)

    def sync_until(self, t: int) -> None:
        while self.now() < t:
            time.sleep(max(0.0, (t - self.now()) / 1e9))

    def drain(self) -> None:
        self.sync_until(self.tail)

    # StreamMarks
    def bind(self) -> None:
        pass

    def event(self):
        return SimEvent()

    def record(self, ev) -> None:
        self.records += 1
        ev.t = max(self.tail, self.now())

    def wait(self, ev) -> None:
        self.waits += 1
        self.busy_waits += self.tail > ev.t  # work queued past the awaited event: the device stays busy
        self.sync_until(ev.t)

    def elapsed_ns(self, a, b) -> int:
        return b.t - a.t


class _OnStream:
    """An engine whose work runs on one SimStream."""

    stream: SimStream
    free = 1000
    has_marks = True

    def drain(self):
        self.stream.drain()

    def free_mb(self):
        return self.free

    def stream_marks(self):
        return self.stream if self.has_marks else None


class SimTarget(_OnStream):
    """Its verify is device work on its stream; the accept's readback (`greedy_rows`, as a
    batched step hands rows over) waits for it and predicts TOKEN on every row."""

    def __init__(self, stream: SimStream, marks: bool = True):
        self.stream, self.has_marks = stream, marks
        self.device = torch.device("cpu")
        self.label = "sim0"
        self.primed = False
        self.rows = 0
        self.launched: list[int] = []  # host ns of each verify launch
        self.laps_read: list[tuple[int, int]] = []

    def alloc(self, capacity):
        pass

    def forward(self, ids, start, timer=None, last=False):
        self.rows = int(ids.shape[0])
        if self.primed:
            self.stream.after(self.drafter_stream)
            self.launched.append(time.perf_counter_ns())
            self.stream.launch(VERIFY)
            if timer is not None:  # a graphed level-2 verify: its laps come back later
                i = len(self.launched) - 1

                def read(into, i=i):
                    self.laps_read.append((i, len(self.launched)))  # (its verify, verifies launched by then)
                    into.ns["attn"] += 7
                timer.later(read)
        self.primed = True
        logits = torch.zeros(ids.shape[0], V)
        logits[:, TOKEN] = 1.0
        return logits

    @property
    def greedy_rows(self):
        if not self.primed or not self.rows:
            return None
        self.stream.drain()  # the readback
        return [TOKEN] * self.rows, [1.0] * self.rows

    def rollback(self, new_len):
        if self.primed:
            self.stream.launch(ROLL)


class SimDrafter(_OnStream, Drafter):
    name = "sim"
    free = 2000

    def __init__(self, stream: SimStream, own_device: bool = False):
        self.stream = stream
        self.launched: list[int] = []  # host ns of each propose's launch
        if own_device:
            self.device = torch.device("meta")  # "another device": the session adds its stream
            self.runner = self

    label = "sim1"

    def propose(self, context, k, sp, gen):
        self.launched.append(time.perf_counter_ns())
        self.stream.launch(DRAFT)
        return Proposal(torch.tensor(([TOKEN, TOKEN] + [TOKEN + 1] * k)[:k], dtype=torch.long))

    def maintain(self, context):
        self.stream.launch(MAINT)


class Sink:
    def __init__(self):
        self.bursts = []

    def burst(self, rec):
        self.bursts.append(rec)

    def first_token(self, prof):
        pass

    def rounds(self, log, final):
        pass


def _started(level=1, clock="events", own_device=False, prof=False, marks=True, max_new=60):
    """A started session over simulated streams (one, or the drafter's own)."""
    a = SimStream()
    b = SimStream() if own_device else a
    tgt = SimTarget(a, marks)
    tgt.drafter_stream = b
    d = SimDrafter(b, own_device)
    sink = Sink()
    s = SpecSession(tgt, d, SamplingParams(), torch.Generator().manual_seed(0), 4,
                    TraceSettings(level=level, clock=clock, prof=prof), sink)
    s.start([1, 2, 3, 4], max_new=max_new, capacity=128)
    return s, sink, tgt, d, a, b


def _run(level=1, clock="events", own_device=False, rounds=4, prof=False, marks=True):
    s, sink, tgt, d, a, b = _started(level, clock, own_device, prof, marks)
    s.burst(rounds)
    s.burst(1)  # the event clock reads the burst before's events in this one's first verify
    return s, sink, tgt, d, a, b


def _ms(r, i):
    return r.phase_ns(i) / 1e6


def test_each_bucket_holds_its_own_device_time_without_a_drain():
    s, sink, tgt, d, a, _ = _run()
    assert s.clock.mode == "events"
    (rec,) = sink.bursts
    assert rec.n == 4
    for r in rec.live():
        assert (r.k, r.j) == (4, 2)
        got = [_ms(r, i) for i in range(PHASE_COUNT)]
        for i in (0, 1, 3, 4):  # device phases: their own work, no neighbour's
            assert DEV[i] * 1e3 - 0.5 <= got[i] < DEV[i] * 1e3 + SLACK_MS, (PHASES[i], got)
        assert 0 <= got[2] < SLACK_MS, got  # the accept: the readback found the verify done, then host logic
        assert r.t == sorted(r.t)
    # the host went on at every boundary: each verify was launched while its draft still ran,
    # and each next draft while the previous round's maintenance still ran
    live = rec.live()
    for n, r in enumerate(live):
        assert tgt.launched[n] < r.t[1], "the verify waited for the draft to finish"
        if n:
            assert d.launched[n] < live[n - 1].t[5], "the next draft waited for the maintenance"
    # two waits (the burst's last event, its anchor), both in the next burst's verify with the
    # device busy: nothing at any boundary, no wait with the device idle
    assert a.waits == 2 and a.busy_waits == 2
    # the first round's entry, four boundaries a round (a later round's entry is the round
    # before's end, or the host's arrival; the accept's end is the host's, its readback having
    # run the one stream dry), the anchor; the same for the one-round burst after
    assert a.records == (1 + 4 * rec.n + 1) + (1 + 4 + 1)


def test_the_draining_clock_gives_the_same_buckets_and_waits_at_every_boundary():
    _, sink_e, *_ = _run()
    s, sink_d, tgt, d, a, _ = _run(clock="drain")
    assert s.clock.mode == "drain" and a.records == 0
    ev = [sum(_ms(r, i) for r in sink_e.bursts[0].live()) for i in range(PHASE_COUNT)]
    dr = [sum(_ms(r, i) for r in sink_d.bursts[0].live()) for i in range(PHASE_COUNT)]
    for i in (0, 1, 3, 4):
        assert abs(ev[i] - dr[i]) < 0.15 * dr[i] + 4, (PHASES[i], ev, dr)
    for n, r in enumerate(sink_d.bursts[0].live()):
        assert tgt.launched[n] >= r.t[1]  # drained: the verify only left after the draft was done


class HostDrafter(Drafter):
    """An ngram-like drafter: propose and maintain are host work only (known host times)."""

    name, host_only = "host", True
    PROPOSE, MAINTAIN = 0.015, 0.012  # each above SLACK_MS

    def propose(self, context, k, sp, gen):
        time.sleep(self.PROPOSE)
        return Proposal(torch.tensor(([TOKEN, TOKEN] + [TOKEN + 1] * k)[:k], dtype=torch.long))

    def maintain(self, context):
        time.sleep(self.MAINTAIN)


class HostRollbackTarget(SimTarget):
    rollback_on_host = True  # moves lengths only

    def rollback(self, new_len):
        pass


@pytest.mark.parametrize("clock", ["events", "drain"])
def test_a_host_only_drafters_round_records_one_event_and_keeps_its_buckets(clock):
    """ngram's case: draft, rollback and maintenance launch nothing on the device, and the
    accept ends on a readback: the only event of a round is the verify's (recorded after its
    launch, in its shadow); each bucket still holds its own phase's time, as drained."""
    a = SimStream()
    tgt = HostRollbackTarget(a)
    tgt.drafter_stream = a
    sink = Sink()
    s = SpecSession(tgt, HostDrafter(), SamplingParams(), torch.Generator().manual_seed(0), 4,
                    TraceSettings(level=1, clock=clock), sink)
    s.start([1, 2, 3, 4], max_new=60, capacity=128)
    s.burst(4)
    s.burst(1)
    rec = sink.bursts[0]
    if clock == "events":
        assert s.clock.quiet == (False, True, False, True, True, True)
        # the first round's entry and the anchor, then one event a round
        assert a.records == (1 + rec.n + 1) + (1 + 1 + 1)
    for r in rec.live():
        got = [_ms(r, i) for i in range(PHASE_COUNT)]
        assert HostDrafter.PROPOSE * 1e3 - 0.5 <= got[0] < HostDrafter.PROPOSE * 1e3 + SLACK_MS, got
        assert VERIFY * 1e3 - 0.5 <= got[1] < VERIFY * 1e3 + SLACK_MS, got
        assert 0 <= got[2] < SLACK_MS and 0 <= got[3] < SLACK_MS, got
        assert HostDrafter.MAINTAIN * 1e3 - 0.5 <= got[4] < HostDrafter.MAINTAIN * 1e3 + SLACK_MS, got
        assert r.t == sorted(r.t)


def test_quiet_boundaries_need_a_host_only_phase():
    from types import SimpleNamespace

    from memra_dist.phase.clock import quiet_boundaries

    host, dev = SimpleNamespace(host_only=True), SimpleNamespace()
    moves = SimpleNamespace(rollback_on_host=True)
    assert quiet_boundaries(host, moves, ["m"]) == {1, 3, 4, 5}
    assert quiet_boundaries(dev, SimpleNamespace(), ["m"]) == {3}
    assert quiet_boundaries(dev, moves, ["m", "m2"]) == {4}  # two streams: the readback ran only one dry
    assert quiet_boundaries(host, moves, None) == set()  # the draining clock
    with pytest.raises(ValueError):
        PhaseClock([], lambda: {}, [SimStream()], quiet={2})  # the verify always ends on an event


def test_the_callers_sink_is_fed_while_a_verify_runs():
    """Request.feed_in_shadow: a burst's record reaches the caller's sink from the session's
    pump, right after a verify's launch with the device busy, not between bursts."""
    from memra_dist.specdec.request import _Collect

    a = SimStream()
    tgt = SimTarget(a)
    tgt.drafter_stream = a
    seen = []

    class Caller:
        def burst(self, rec):
            seen.append((rec.index, len(tgt.launched), a.tail > a.now()))
    c = _Collect(None)
    c.caller = Caller()
    s = SpecSession(tgt, SimDrafter(a), SamplingParams(), torch.Generator().manual_seed(0), 4,
                    TraceSettings(level=1), c)
    s.start([1, 2, 3, 4], max_new=60, capacity=128)
    s.burst(3)
    s.burst(2)
    assert seen == [(0, 4, True)]  # burst 0's record: in burst 1's first verify (the 4th), device busy
    assert c.take()[0] == ()  # nothing left for BurstOut
    s.burst(2)
    assert seen[1] == (1, 6, True)


def test_a_drafter_on_its_own_stream_bounds_the_draft():
    s, sink, tgt, d, a, b = _run(own_device=True)
    assert s.clock.mode == "events" and len(s.clock.marks) == 2
    (rec,) = sink.bursts
    for r in rec.live():
        got = [_ms(r, i) for i in range(PHASE_COUNT)]
        assert DRAFT * 1e3 - 0.5 <= got[0] < DRAFT * 1e3 + SLACK_MS, got  # the drafter's stream, not the idle target's
        assert VERIFY * 1e3 - 0.5 <= got[1] < VERIFY * 1e3 + SLACK_MS, got
    assert a.waits == 2 and b.waits == 2 and a.busy_waits == 2


def test_a_bursts_record_reaches_the_sink_one_burst_late_and_every_one_by_the_end():
    s, sink, _, _, a, _ = _started(max_new=24)
    s.burst(2)
    assert sink.bursts == []  # its events are read in the next burst's first verify
    s.burst(2)
    assert [r.index for r in sink.bursts[0].live()] == [0, 1]
    while not s.done:
        s.burst(2)
    assert sum(rec.n for rec in sink.bursts) == s.stats.rounds  # the last burst's at the request's end
    assert [r.index for rec in sink.bursts for r in rec.live()] == list(range(s.stats.rounds))
    for rec in sink.bursts:
        assert rec.t0 <= rec.rounds[0].t[0] and rec.rounds[rec.n - 1].t[5] <= rec.t1
        assert all(r.t == sorted(r.t) for r in rec.live())
    # every burst but the last was read with the device busy; only the last one's last event,
    # at the request's end, was waited for with nothing queued behind it
    assert a.waits == 2 * len(sink.bursts) and a.waits - a.busy_waits == 1


def test_a_host_pause_between_rounds_is_in_no_phase():
    """The caller's hook runs between rounds (streaming the tokens): with the device idle by
    then, the next round starts when the host comes back, not at the round before's end."""
    s, sink, *_ = _started()
    s.burst(3, lambda new: time.sleep(0.040))
    s.burst(1)
    rec = sink.bursts[0]
    live = rec.live()
    for prev, r in zip(live, live[1:]):
        # the hook's 40 ms began as the host launched the maintenance (h[4]); the device was done
        # before the host came back, so the next round starts at the host's return
        assert r.t[0] - prev.h[4] >= 0.039e9 and r.t[0] > prev.t[5] + 0.004e9, (prev.t, prev.h, r.t)
        assert DRAFT * 1e3 - 0.5 <= _ms(r, 0) < DRAFT * 1e3 + SLACK_MS


def test_level_zero_records_no_event_and_the_profile_drains():
    s, sink, *_, a, _ = _run(level=0)
    assert s.clock is None and not sink.bursts and a.records == 0 and a.waits == 0
    s, *_ = _run(prof=True)
    assert s.clock.mode == "drain"  # the first-token profile's depth laps drain
    s, *_ = _run(marks=False)
    assert s.clock.mode == "drain"  # an engine without timing events: drained


def test_level_two_laps_from_a_graphed_verify_land_in_their_round():
    s, sink, tgt, *_ = _run(level=2)
    (rec,) = sink.bursts
    assert all(r.sub_ns["attn"] == 7 for r in rec.live())
    assert s.timer._later == []
    # each verify's laps were added up only once the next verify was on its way (its shadow)
    assert [i for i, _ in tgt.laps_read] == list(range(rec.n))
    assert all(launched > i + 1 for i, launched in tgt.laps_read), tgt.laps_read


def test_stamp_marks_copy_back_later():
    """StampMarks with a host copy: add_to queues the copy; the laps arrive at take()."""

    class Ev:
        def __init__(self):
            self.recorded = self.synced = 0

        def record(self):
            self.recorded += 1

        def synchronize(self):
            self.synced += 1

    buf = torch.zeros(8, dtype=torch.int64)
    ev = Ev()
    m = StampMarks(buf, lambda b, i: b.__setitem__(i, 100 * (i + 1)), host=[torch.zeros(8, dtype=torch.int64)],
                   copied=[ev])
    m.begin()
    m.lap("attn")
    m.lap("ffn")
    timer = SubsplitTimer(lambda: None)
    m.add_to(timer)
    assert ev.recorded == 1 and ev.synced == 0 and timer.ns["attn"] == 0
    ns, _ = timer.take()
    assert ev.synced == 1 and ns["attn"] == 100 and ns["ffn"] == 100


def test_clock_resolve_without_rounds_waits_for_nothing():
    st = SimStream()
    c = PhaseClock([st.drain], lambda: {}, [st])
    c.begin(2)
    c.resolve([])
    assert st.waits == 0 and st.records == 0


def test_clock_flag(monkeypatch):
    said = []
    assert clock_from(None) == "events" and clock_from("DRAIN") == "drain"
    assert clock_from("sync", said.append) == "events" and "MEMRA_PHASE_CLOCK" in said[0]
    monkeypatch.setenv("MEMRA_PHASE_CLOCK", "drain")
    environment.cache_clear()
    try:
        assert trace_settings(1).clock == "drain"
    finally:
        environment.cache_clear()


@pytest.mark.parametrize("clock", ["events", "drain"])
def test_tokens_do_not_depend_on_the_clock(clock):
    s, *_ = _run(clock=clock, rounds=6)
    s0, *_ = _run(level=0, rounds=6)
    assert s.tokens == s0.tokens and len(s.tokens) == 4 + 1 + 7 * 3


def test_level_two_twins_are_captured_in_the_start_not_in_a_round():
    """An engine built without level 2's twins (another level at open): the session's start
    asks the target for them (k + 1 rows), before its first round; levels 0 / 1 never do."""
    from types import SimpleNamespace

    from memra_dist.runner import ModelRunner

    asked = []
    SimTarget.warm_timed_rows = lambda self, rows: asked.append((rows, self.primed))
    try:
        _run(level=2)
        assert asked == [(5, False)]  # before the prefill (a fresh cache), k + 1 rows
        _run(level=1)
        _run(level=0)
        assert asked == [(5, False)]
    finally:
        del SimTarget.warm_timed_rows
    warmed = []
    graphs = SimpleNamespace(timed={1: 0, 2: 0}, warm=lambda rows, timed, depth: warmed.append((list(rows), timed)))
    fake = SimpleNamespace(graphs=graphs, cache=object(), graph_rows=4, ttft_depth=None)
    ModelRunner.warm_timed_rows(fake, 5)
    assert warmed == [([1, 2, 3, 4], True)]  # bounded by the graphs' row limit
    graphs.timed.update({3: 0, 4: 0})
    ModelRunner.warm_timed_rows(fake, 5)
    assert len(warmed) == 1  # all there: nothing captured again


def test_an_abandoned_request_hands_its_held_record_over():
    """The caller leaves mid-request: flush_trace gives the sink the burst the clock still held;
    a request's collector hands every record a burst delivered to the caller's sinks."""
    from memra_dist.specdec.request import _Collect

    s, sink, *_ = _run(rounds=2)
    assert len(sink.bursts) == 1 and s._held.unsettled is not None
    s.flush_trace()
    assert len(sink.bursts) == 2 and s._held.unsettled is None
    assert [r.index for rec in sink.bursts for r in rec.live()] == list(range(s.stats.rounds))
    c = _Collect(None)
    c.burst(sink.bursts[0])
    c.burst(sink.bursts[1])
    assert c.take()[0] == tuple(sink.bursts) and c.take()[0] == ()


def test_a_pipeline_head_shared_by_sessions_drains():
    """Sessions in flight on one head stream: the event clock's anchor (the stream running dry
    after this session's readback) does not hold, so the head offers no marks (drained)."""
    from types import SimpleNamespace

    from memra_dist.pipeline.head_target import PipelineTarget

    runner = SimpleNamespace(stream_marks=lambda: "marks")
    alone = SimpleNamespace(runner=runner, shared=False)
    shared = SimpleNamespace(runner=runner, shared=True)
    assert PipelineTarget.stream_marks(alone) == "marks" and PipelineTarget.stream_marks(shared) is None
