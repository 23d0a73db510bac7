"""Plain greedy decoding one step ahead of the host (specdec/ahead.py), on the CPU with an
emulated one-row step graph (graph_emulator.py): the device-side argmax feeds the next
replay, the host reads tokens one step behind. Token-identical to the round loop (fp32),
across bursts, at a stop token and at the token budget; the step launched past the end is
rolled back, so the cache is left as the round loop leaves it. Where the host is needed
between steps (sampling, drafts, a traced run) the round loop runs."""

from __future__ import annotations

import pytest
import torch

from graph_emulator import EmulatedGraph
from memra_dist.graphs import _Graph
from memra_dist.phase.subsplit import EventMarks, StampMarks
from memra_dist.phase.levels import TraceSettings
from memra_dist.runner import ModelRunner
from memra_dist.specdec.drafters.none import NoDrafter
from memra_dist.specdec.drafters.replay import ReplayDrafter
from memra_dist.specdec.sampling import SamplingParams
from memra_dist.specdec.session import SpecSession

CPU, CAP = torch.device("cpu"), 96
PROMPT = [5, 9, 17, 5, 9, 23, 40, 5, 9, 17, 5, 9]


class _NoEvent:
    def record(self):
        pass

    def synchronize(self):
        pass


def _step(r: ModelRunner, stamped: bool = False) -> _Graph:
    """graphs._Graph (the step graphs' own record: its `load` included) over an emulated
    capture of the one-row step, with a host staging row as on CUDA (not pinned here).
    `stamped`: the level-2 twin, its sub-split boundaries StampMarks whose emulated clock
    advances by position + 1 per boundary (so each replay's laps say which step they are)."""
    x, base = torch.zeros(1, dtype=torch.long), torch.arange(1)
    pos = base.clone()
    st = r.stage
    marks = None
    if stamped:
        clock = torch.zeros(1, dtype=torch.int64)

        def stamp(buf, i):
            clock.add_(pos[:1] + 1)
            buf[i:i + 1].copy_(clock)

        marks = StampMarks(torch.zeros(64, dtype=torch.int64), stamp)
    fn = lambda: st.logits(st(x, pos, r.cache, marks))  # noqa: E731
    with torch.inference_mode():
        for _ in range(2):
            if marks is not None:
                marks.reset()
            fn()
        if marks is not None:
            marks.reset()
        graph = EmulatedGraph()
        out = graph.capture(fn)
    return _Graph(graph, x, base, pos, out, host=torch.zeros(1, dtype=torch.long), copied=_NoEvent(), marks=marks)


class _Graphs:
    """StepGraphs' face: the one-row graph (replayed by the round loop's forwards too);
    longer forwards (the prime) run eager."""

    def __init__(self, r: ModelRunner):
        self.r = r
        self.graphs = {1: _step(r)}
        self.timed = {1: _step(r, stamped=True)}
        self.replays = 0

    def warm(self, rows_list, timed=False, depth=None):
        pass  # its one graph and twin exist; other row counts run eager

    def run(self, x, start, timer=None):
        if x.shape[0] != 1:
            st = self.r.stage
            return st.logits(st(x, torch.arange(start, start + x.shape[0]), self.r.cache, timer))
        g = (self.graphs if timer is None else self.timed)[1]
        g.load(x)
        g.replay_at(start)
        if timer is not None and isinstance(g.marks, StampMarks):
            g.marks.add_to(timer)
        self.replays += 1
        return g.out.clone()


def _graphed(model_dir) -> ModelRunner:
    r = ModelRunner(model_dir, CPU, torch.float32)
    r.alloc(CAP)
    r.graphs = _Graphs(r)
    return r


def _run(target, n, burst=3, eos=(), sp=SamplingParams(), drafter=None, k=1, trace=TraceSettings(), sink=None):
    s = SpecSession(target, drafter or NoDrafter(), sp, torch.Generator().manual_seed(0), k, trace, sink, eos_ids=eos)
    ids = [s.start(PROMPT, n, CAP)]
    streamed: list[list[int]] = []
    while not s.done:
        ids.extend(s.burst(burst, streamed.append))
    assert [t for new in streamed for t in new] == ids[1:]  # the caller's hook sees every token, in order
    if s._ahead is not None:
        assert all(len(new) == 1 for new in streamed)  # as they are read: one per step
    return ids, s


@pytest.fixture(scope="module")
def eager_ids(llama):
    r = ModelRunner(str(llama), CPU, torch.float32)
    ids, s = _run(r, 40)
    return ids, r.cache.length


@pytest.mark.parametrize("burst", [1, 3, 8])
def test_one_ahead_gives_the_round_loops_ids(llama, eager_ids, burst):
    want, want_len = eager_ids
    r = _graphed(str(llama))
    got, s = _run(r, 40, burst=burst)
    assert got == want
    assert s._ahead is not None and s._ahead.launched >= 30  # the steps ran ahead, not the round loop
    assert s.ran_ahead  # what the request's stats report (fast_path.ahead)
    assert r.cache.length == want_len  # the step launched past the budget was rolled back
    assert s.stats.rounds == len(want) - 1 and s.stats.tokens == len(want)


def test_a_stop_token_ends_it_where_the_round_loop_does(llama, eager_ids):
    want, _ = eager_ids
    eos = want[20]  # first occurs at or before index 20: the round loop stops at its first occurrence
    stop = want.index(eos)
    assert stop > 4, "the test's stop token should come after the first burst"
    ref = ModelRunner(str(llama), CPU, torch.float32)
    ref_ids, _ = _run(ref, 40, eos=(eos,))
    r = _graphed(str(llama))
    got, s = _run(r, 40, eos=(eos,))
    assert got == ref_ids == want[:stop + 1]
    assert s._ahead is not None and s._ahead.pending == 0
    assert r.cache.length == ref.cache.length  # the row written past the stop is rolled back


def test_a_second_request_on_the_same_runner(llama, eager_ids):
    r = _graphed(str(llama))
    _run(r, 17)
    got, _ = _run(r, 40)
    assert got == eager_ids[0]


@pytest.mark.parametrize("case", ["sampled", "profiled", "drafts"])
def test_the_round_loop_runs_where_the_host_is_needed_between_steps(llama, eager_ids, case):
    r = _graphed(str(llama))
    kw = {"sampled": dict(sp=SamplingParams(temperature=1.0)),
          "profiled": dict(trace=TraceSettings(prof=True), sink=_Bursts()),
          "drafts": dict(drafter=ReplayDrafter(eager_ids[0], len(PROMPT), r.cfg.vocab_size, 0.3, seed=3), k=3)}[case]
    got, s = _run(r, 40, **kw)
    assert s._ahead is None and not s.ran_ahead
    if case != "sampled":
        assert got == eager_ids[0]


def test_a_graph_loads_one_host_id_as_a_fill_and_more_through_its_staging_row():
    ev = _NoEvent()
    g = _Graph(None, torch.zeros(3, dtype=torch.long), torch.arange(3), torch.arange(3), None,
               host=torch.zeros(3, dtype=torch.long), copied=ev)
    g.load(torch.tensor([7, 8, 9]))
    assert g.x.tolist() == [7, 8, 9] and g.host.tolist() == [7, 8, 9]  # staged
    one = _Graph(None, torch.zeros(1, dtype=torch.long), torch.arange(1), torch.arange(1), None,
                 host=torch.zeros(1, dtype=torch.long), copied=ev)
    one.load(torch.tensor([123456]))
    assert one.x.tolist() == [123456] and one.host.tolist() == [0]  # a fill: the staging row untouched


class _Bursts:
    """A session sink that keeps every burst record (a fresh one per burst)."""

    def __init__(self):
        self.recs = []

    def burst(self, rec):
        self.recs.append(rec)

    def first_token(self, prof):
        pass

    def rounds(self, log, final):
        pass


@pytest.mark.parametrize("level", [1, 2])
def test_traced_decoding_runs_ahead_with_each_rounds_own_device_times(llama, eager_ids, level):
    """Levels 1 and 2 keep the one-ahead path (the trace describes the path users run): the
    ids are the round loop's, every round is recorded, its verify is its step's own replay
    (> 0, within the round), no draft or maint, free memory on every phase; at level 2 each
    round's sub-split is the laps of ITS step (the emulated clock advances by position + 1
    a boundary, so a lap read one step off would be off by one a layer)."""
    want, want_len = eager_ids
    r = _graphed(str(llama))
    sink = _Bursts()
    got, s = _run(r, 40, trace=TraceSettings(level=level), sink=sink)
    assert got == want and r.cache.length == want_len
    assert s._ahead is not None and s._ahead.timed and s.ran_ahead
    assert (s._ahead.step is r.graphs.timed[1]) == (level == 2)
    assert sink.recs and all(rec.ahead for rec in sink.recs)  # the share table says how they were timed
    rounds = [x for rec in sink.recs for x in rec.live()]
    assert len(rounds) == s.stats.rounds == len(want) - 1
    layers = r.cfg.num_layers
    for i, x in enumerate(rounds):
        assert x.index == i and x.ctx == len(PROMPT) + i and x.k == x.j == 0
        assert x.t == sorted(x.t) and x.wall_ns > 0
        assert x.phase_ns(0) == 0 and x.phase_ns(4) == 0  # no draft, no maint
        assert 0 < x.phase_ns(1) <= x.wall_ns  # the replay's own time
        assert all("cpu" in fm for fm in x.free_mb)
        if level == 2:
            assert x.sub_ns["attn"] == x.sub_ns["ffn"] == layers * (x.ctx + 1)
        else:
            assert not x.sub_ns


def test_level_two_without_device_stamps_keeps_the_round_loop(llama, eager_ids):
    """A twin of CUDA events (no Triton) is re-recorded by the next replay: it cannot run
    ahead, so level 2 runs the round loop there."""
    r = _graphed(str(llama))
    r.graphs.timed[1].marks = EventMarks(lambda: None)  # the fallback's kind of marks (never recorded here)
    got, s = _run(r, 40, trace=TraceSettings(level=2), sink=_Bursts())
    assert got == eager_ids[0] and s._ahead is None
