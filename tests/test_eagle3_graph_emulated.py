"""The EAGLE-3 drafter's round graphs (specdec/drafters/eagle3_graph.py), checked on the CPU with an
emulated capture (graph_emulator.py), fp32, strict: every graph a run of K drafts replays (the
round's first forward per row count 1 .. K + 1, the chained step) is captured when the drafter
allocates, none inside a round, and a session drafting through them proposes exactly the eager
path's drafts at every round - with the acceptance driven through every count from none to all
(an oracle rewrites the drafts after the drafter proposed them), rounds near the end asking for
k < K, a two-token prompt - and ends with the same ids, counts and K/V; the sampled path
through the graphs equals the eager one under the same seed; a full `generate` with the graphed
drafter is token-identical to the eager one and to plain decoding. The warm-up leaves a fresh
allocation's state. Sabotaged graphs (a stale row, a chain that does not advance) are caught by
the same comparison: it can fail."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from graph_emulator import EmulatedCapture
from memra_dist.app import generate
from memra_dist.config import RunConfig
from memra_dist.demo.tiny_eagle3 import random_eagle3
from memra_dist.model.config import load_config
from memra_dist.model.eagle3 import load_eagle3_config
from memra_dist.runner import ModelRunner
from memra_dist.specdec.drafters import eagle3 as eagle3_mod
from memra_dist.specdec.drafters.base import Proposal
from memra_dist.specdec.drafters.eagle3 import Eagle3Drafter
from memra_dist.specdec.drafters.eagle3_graph import Eagle3Graphs
from memra_dist.specdec.sampling import SamplingParams
from memra_dist.specdec.session import SpecSession

CPU, F32, CAP = torch.device("cpu"), torch.float32, 112
SHAPE = dict(taps=(0, 1, 3), heads=2, kv_heads=1, head_dim=16, intermediate_size=64, draft_vocab=96)
PROMPT = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7]
N_NEW = 30


class _Emulated(EmulatedCapture):
    """The emulated capture, its replays counted too (class-wide; captures: EmulatedCapture's)."""

    replays = 0

    def replay(self) -> None:
        _Emulated.replays += 1
        super().replay()


def _counts() -> tuple[int, int]:
    return EmulatedCapture.captures, _Emulated.replays


@pytest.fixture(scope="module")
def eagle_dir(llama, tmp_path_factory):
    return random_eagle3(tmp_path_factory.mktemp("eagle3g") / "e", llama, seed=2, **SHAPE)


@pytest.fixture(scope="module")
def plain(llama):
    """The target's greedy tokens after PROMPT (the oracle of the right drafts)."""
    return generate(RunConfig(model=str(llama), drafter="none", max_new_tokens=90, device="cpu"),
                    PROMPT).token_ids


@dataclass
class Run:
    ids: list[int]
    drafted: int
    accepted: int
    rounds: list  # each round's (k asked, the drafter's own drafts)
    state: list  # the drafter's K/V at the end
    alloc_captures: int
    round_captures: int
    round_replays: int

    def same(self, other: "Run") -> bool:
        return ((self.ids, self.drafted, self.accepted, self.rounds)
                == (other.ids, other.drafted, other.accepted, other.rounds)
                and all(torch.equal(a, b) for a, b in zip(self.state, other.state)))


def _drafter(llama, eagle_dir, oracle: list[int] | None, prompt: list[int]):
    """A fresh target and EAGLE-3 drafter, its propose spied on: each round's own drafts are
    recorded, then (with `oracle`) rewritten so that round r accepts r % (k + 1) of them (0:
    the first draft made wrong; k: all right), so the next round's first forward runs every
    row count."""
    target = ModelRunner(llama, CPU, F32, max_pos=CAP)
    d = Eagle3Drafter.load(eagle_dir, load_eagle3_config(eagle_dir, load_config(llama)), target)
    d.rounds, d.alloc_captures = [], 0
    propose, alloc = d.propose, d.alloc
    V = target.cfg.vocab_size

    def spy_propose(context, kk, sp, gen):
        p = propose(context, kk, sp, gen)
        d.rounds.append((kk, p.tokens.tolist()))
        if oracle is None or not sp.greedy:
            return p
        n, want = len(context) - len(prompt), len(d.rounds) % (kk + 1)
        right = oracle[n:n + kk]
        toks = right[:want] + [(t + 1) % V for t in right[want:]]
        return Proposal(torch.tensor(toks, dtype=torch.long))

    def spy_alloc(capacity):
        c = EmulatedCapture.captures
        out = alloc(capacity)
        d.alloc_captures += EmulatedCapture.captures - c
        return out

    d.propose, d.alloc = spy_propose, spy_alloc
    return target, d


def _graphed(monkeypatch, target, d, k: int, graph_cls=_Emulated) -> None:
    """From the next alloc on, the drafter's graphs (emulated), warmed for a run of k drafts."""
    target.warm_rows = k + 1  # as config.runner_kwargs sets it (the CPU target captures nothing itself)
    monkeypatch.setattr(eagle3_mod, "eagle3_graphs", lambda dr: Eagle3Graphs(dr, graph_cls=graph_cls))
    d.capacity = 0  # a fresh alloc: the graphs are built (and warmed) there, as on CUDA


def _run(d, target, k, prompt=PROMPT, n_new=N_NEW, sp=SamplingParams()) -> Run:
    d.rounds.clear()
    d.alloc_captures = 0
    s = SpecSession(target, d, sp, torch.Generator().manual_seed(0), k)
    ids = [s.start(prompt, n_new, CAP)]
    c1, r1 = _counts()
    while not s.done:
        ids.extend(s.burst(3))
    c2, r2 = _counts()
    return Run(ids, s.stats.drafted, s.stats.accepted, list(d.rounds), [d.state.k.clone(), d.state.v.clone()],
               d.alloc_captures, c2 - c1, r2 - r1)


@pytest.mark.parametrize("k", [1, 2, 4, 7])
def test_graphed_rounds_propose_the_eager_drafts(llama, eagle_dir, plain, monkeypatch, k):
    # two cycles of rounds accepting 1 .. k, 0 drafts ((k + 1)(k + 2) / 2 tokens each), the last
    # rounds cut below K by the budget
    n_new = (k + 1) * (k + 2) + 3
    target, d = _drafter(llama, eagle_dir, plain, PROMPT)
    eager = _run(d, target, k, n_new=n_new)
    assert d.graph is None  # CPU: the eager steps, the reference
    assert eager.ids == plain[:n_new]  # lossless under every acceptance
    assert len(eager.rounds) >= 2 * (k + 1) and 0 < eager.accepted < eager.drafted
    assert k == 1 or any(kk < k for kk, _ in eager.rounds)  # a round near the end with k < K

    _graphed(monkeypatch, target, d, k)
    graphed = _run(d, target, k, n_new=n_new)
    g = d.graph
    assert isinstance(g, Eagle3Graphs) and g.k == k
    assert graphed.same(eager), (graphed.rounds, eager.rounds)
    # every capture landed in the alloc, none in a round; each drafted token is one replay
    assert graphed.alloc_captures == len(g.graphs) == len(g.keys()) == k + 1 + (k >= 2)
    assert graphed.round_captures == 0 and graphed.round_replays == graphed.drafted

    kept = dict(g.graphs)  # a second request on the same allocation: the same graphs, no capture
    again = _run(d, target, k, n_new=n_new)
    assert again.same(eager) and again.alloc_captures == again.round_captures == 0
    assert d.graph is g and all(g.graphs[key] is v for key, v in kept.items())


@pytest.mark.parametrize("prompt", [[5, 6], [3, 4, 5]])
def test_short_prompt_and_short_request(llama, eagle_dir, monkeypatch, prompt):
    """A prompt of two / three tokens (the prime ingests one / two rows), and a request whose
    budget cuts every round below K."""
    ref = generate(RunConfig(model=str(llama), drafter="none", max_new_tokens=N_NEW + 8, device="cpu"),
                   prompt).token_ids
    for n_new in (N_NEW, 4):
        target, d = _drafter(llama, eagle_dir, ref, prompt)
        eager = _run(d, target, 4, prompt=prompt, n_new=n_new)
        _graphed(monkeypatch, target, d, 4)
        graphed = _run(d, target, 4, prompt=prompt, n_new=n_new)
        assert graphed.same(eager) and eager.ids == ref[:len(eager.ids)]
        assert graphed.round_captures == 0 and graphed.round_replays == graphed.drafted > 0


def test_sampled_session_through_the_graphs_equals_eager(llama, eagle_dir, monkeypatch):
    """Sampled: each draft drawn on the host from the replayed step's logits and fed to the
    next chain replay; the same seed gives the same drafts, tokens and K/V."""
    target, d = _drafter(llama, eagle_dir, None, PROMPT)
    sp = SamplingParams(temperature=0.8)
    eager = _run(d, target, 4, sp=sp)
    _graphed(monkeypatch, target, d, 4)
    graphed = _run(d, target, 4, sp=sp)
    assert graphed.same(eager) and eager.drafted > 0
    assert graphed.round_captures == 0 and graphed.round_replays == graphed.drafted


def test_warm_leaves_a_fresh_allocation_and_a_new_sink_recaptures_at_alloc(llama, eagle_dir, monkeypatch):
    target, d = _drafter(llama, eagle_dir, None, PROMPT)
    target.alloc(CAP)
    d.alloc(CAP)
    fresh = [d.state.k.clone(), d.state.v.clone()]
    _graphed(monkeypatch, target, d, 3)
    d.alloc(CAP)
    g = d.graph
    assert set(g.graphs) == {("first", 1), ("first", 2), ("first", 3), ("first", 4), ("chain",)}
    assert d.alloc_captures == 5 and d.n == 0
    assert torch.equal(d.state.k, fresh[0]) and torch.equal(d.state.v, fresh[1])
    g.first([1, 2, 3, 4], 0)  # a replay does write the K/V (so the zeroing above is not vacuous)
    assert not torch.equal(d.state.k, fresh[0])

    target.cache = None
    target.alloc(CAP)  # a new cache, a new tap sink: the old graphs read the old buffers
    assert not g.replays(len(PROMPT), len(PROMPT) - 2, 3)
    d.alloc_captures = 0
    d.alloc(CAP)
    assert d.graph is g and g.sink is target.cache.taps and d.alloc_captures == 5
    assert g.replays(len(PROMPT), len(PROMPT) - 2, 3)
    assert torch.equal(d.state.k, fresh[0]) and torch.equal(d.state.v, fresh[1])


# ---- the comparison can fail: sabotaged graphs are caught ----


class _StaleRow(Eagle3Graphs):
    """The first forward's row (ids, start) loaded only once: later rounds replay stale inputs."""

    def first(self, context, lo):
        if getattr(self, "_loaded", False):
            self.graphs[("first", len(context) - 1 - lo)].replay()
            return
        self._loaded = True
        super().first(context, lo)


class _StuckChain(Eagle3Graphs):
    """A chain step that does not advance its position: each step rewrites the same row."""

    def _chain(self):
        h = self.d._rows(self.tok, self.hid, self.pos)
        t = self._pick(h)
        self.drafts.index_copy_(0, self.sidx, t)
        self.sidx.add_(1)
        return self.drafts


@pytest.mark.parametrize("broken", [_StaleRow, _StuckChain])
def test_sabotaged_graphs_differ_from_eager(llama, eagle_dir, plain, monkeypatch, broken):
    target, d = _drafter(llama, eagle_dir, plain, PROMPT)
    eager = _run(d, target, 4)
    _graphed(monkeypatch, target, d, 4, graph_cls=_Emulated)
    monkeypatch.setattr(eagle3_mod, "eagle3_graphs", lambda dr: broken(dr, graph_cls=_Emulated))
    bad = _run(d, target, 4)
    assert isinstance(d.graph, broken) and bad.round_replays > 0
    assert not bad.same(eager)
    assert [r[1] for r in bad.rounds] != [r[1] for r in eager.rounds]
