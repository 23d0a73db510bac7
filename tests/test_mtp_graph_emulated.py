"""The MTP drafter's step graphs (specdec/drafters/mtp_graph.py), checked on the CPU with an
emulated capture (graph_emulator.py): every step a run of K drafts can ask for (a layer's first
forward per row count, a chained step per layer) is captured when the drafter allocates, none
inside a round (also not in a round near the end of a request that asks for fewer drafts), and
each is replayed at later rounds' positions with no Python in between; a greedy session
drafting through them equals one drafting eagerly - ids, drafted and accepted counts, every
round's drafts, and the layers' K/V and kept outputs - for deepseek_v3 with two MTP layers and
glm4_moe with one, K below, at and above the layer count; a second request on the same
allocation replays the same graphs and captures nothing. The warm-up leaves the state as a
fresh allocation has it. The MoE runs its grouped form (the capturable one, as on CUDA bf16)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from graph_emulator import EmulatedCapture
from memra_dist.model.config import load_config
from memra_dist.model.moe import MoE
from memra_dist.runner import ModelRunner
from memra_dist.specdec.drafters import mtp as mtp_mod
from memra_dist.specdec.drafters.mtp import MTPDrafter
from memra_dist.specdec.drafters.mtp_graph import MTPGraphs
from memra_dist.specdec.sampling import SamplingParams
from memra_dist.specdec.session import SpecSession

pytest.importorskip("transformers")
from moe_ckpt import save_moe  # noqa: E402

CPU, F32, CAP = torch.device("cpu"), torch.float32, 96
PROMPT = [5, 6, 7, 8, 9, 10, 11, 5, 6, 7]


class _Emulated(EmulatedCapture):
    """The emulated capture, its replays counted too (class-wide; captures: EmulatedCapture's)."""

    replays = 0

    def replay(self) -> None:
        _Emulated.replays += 1
        super().replay()


def _counts() -> tuple[int, int]:
    return EmulatedCapture.captures, _Emulated.replays


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtpg")
    return {"deepseek_v3": save_moe(root / "ds", "deepseek_v3", layers=2, n_mtp=2, seed=1)[0],
            "glm4_moe": save_moe(root / "glm", "glm4_moe", layers=2, n_mtp=1, seed=2)[0]}


@dataclass
class Run:
    ids: list[int]
    drafted: int
    accepted: int
    rounds: list  # each round's (k asked, drafts)
    state: list  # the layers' K/V tensors, then their kept outputs, at the end
    alloc_captures: int  # captures inside the drafter's alloc
    start_captures: int  # captures during the session's start (its alloc included)
    round_captures: int  # captures during the rounds
    round_replays: int  # graph replays during the rounds

    def same(self, other: "Run") -> bool:
        return ((self.ids, self.drafted, self.accepted, self.rounds) == (other.ids, other.drafted, other.accepted,
                                                                          other.rounds)
                and len(self.state) == len(other.state)
                and all(torch.equal(a, b) for a, b in zip(self.state, other.state)))


def _state(d) -> list[torch.Tensor]:
    return ([t.clone() for st in d.states for t in vars(st).values() if isinstance(t, torch.Tensor)]
            + [o.clone() for o in d.outs])


def _drafter(ckpts, name, monkeypatch):
    """A fresh target and MTP drafter; its propose and alloc spied on (rounds, captures in alloc)."""
    monkeypatch.setattr(MoE, "use_grouped", lambda self, on: setattr(self.experts, "grouped", True))
    d_dir = ckpts[name]
    target = ModelRunner(d_dir, CPU, F32, max_pos=128)
    d = MTPDrafter.load(d_dir, load_config(d_dir), target)
    assert all(d.head.layer(j).mlp.graph_safe for j in range(d.n))
    d.rounds, d.alloc_captures = [], 0
    propose, alloc = d.propose, d.alloc

    def spy_propose(context, kk, sp, gen):
        p = propose(context, kk, sp, gen)
        d.rounds.append((kk, p.tokens.tolist()))
        return p

    def spy_alloc(capacity):
        c = EmulatedCapture.captures
        out = alloc(capacity)
        d.alloc_captures += EmulatedCapture.captures - c
        return out

    d.propose, d.alloc = spy_propose, spy_alloc
    return target, d


def _graphed(monkeypatch, target, d, k: int | None) -> None:
    """From the next alloc on, the drafter's graphs (emulated), warmed for a run of k drafts (the
    target's warm rows, as config.runner_kwargs sets them; None: none, captured on first use)."""
    target.warm_rows = k + 1 if k is not None else 0  # the CPU target captures nothing itself
    monkeypatch.setattr(mtp_mod, "mtp_graphs", lambda dr: MTPGraphs(dr, graph_cls=_Emulated))
    d.capacity = 0  # a fresh alloc: the graphs are built (and warmed) there, as on CUDA


def _run(d, target, k, n_new=24, sp=SamplingParams()) -> Run:
    d.rounds.clear()
    d.alloc_captures = 0
    s = SpecSession(target, d, sp, torch.Generator().manual_seed(0), k)
    c0, _ = _counts()
    ids = [s.start(PROMPT, n_new, CAP)]
    c1, r1 = _counts()
    while not s.done:
        ids.extend(s.burst(4))
    c2, r2 = _counts()
    return Run(ids, s.stats.drafted, s.stats.accepted, list(d.rounds), _state(d), d.alloc_captures, c1 - c0,
               c2 - c1, r2 - r1)


@pytest.mark.parametrize("name,k", [("deepseek_v3", 1), ("deepseek_v3", 2), ("deepseek_v3", 3), ("deepseek_v3", 5),
                                    ("glm4_moe", 1), ("glm4_moe", 2), ("glm4_moe", 3)])
def test_session_through_graphs_captured_at_alloc_equals_eager(ckpts, monkeypatch, name, k):
    target, d = _drafter(ckpts, name, monkeypatch)
    eager = _run(d, target, k)
    assert d.graph is None  # CPU: the eager steps, the reference
    assert len(eager.rounds) > 3 and eager.drafted > 0
    if k > 1:  # the request's last rounds ask for fewer drafts than K
        assert any(kk < k for kk, _ in eager.rounds)

    _graphed(monkeypatch, target, d, k)
    graphed = _run(d, target, k)
    g = d.graph
    assert isinstance(g, MTPGraphs) and g.k == k
    assert graphed.same(eager)
    # every capture landed in the drafter's alloc, none in a round; every drafted step replayed one
    assert graphed.alloc_captures == graphed.start_captures == len(g.graphs) == len(g.keys()) > 0
    assert graphed.round_captures == 0
    assert graphed.round_replays == graphed.drafted
    assert (k > d.n) == any(key[0] == "chain" for key in g.graphs)

    # a second request on the same allocation reuses every graph: no capture at all
    kept = dict(g.graphs)
    again = _run(d, target, k)
    assert again.same(eager)
    assert again.start_captures == again.alloc_captures == again.round_captures == 0
    assert again.round_replays == again.drafted
    assert d.graph is g and g.graphs == kept and all(g.graphs[key] is v for key, v in kept.items())


def test_shortened_round_replays_a_graph_captured_at_alloc(ckpts, monkeypatch):
    """A request whose budget cuts rounds short (k = 1, 2 below K = 3, layers skipped): the
    shorter rounds' steps are among those captured at alloc."""
    target, d = _drafter(ckpts, "deepseek_v3", monkeypatch)
    eager = _run(d, target, 3, n_new=4)
    assert sorted({kk for kk, _ in eager.rounds}) == [1, 2]  # every round shortened
    _graphed(monkeypatch, target, d, 3)
    graphed = _run(d, target, 3, n_new=4)
    assert graphed.same(eager)
    assert graphed.alloc_captures == graphed.start_captures > 0 and graphed.round_captures == 0
    assert graphed.round_replays == graphed.drafted


def test_warm_leaves_a_fresh_allocation(ckpts, monkeypatch):
    """The captures' warm-ups write the layers' K/V and kept outputs at rows 0 ..; alloc leaves
    them as a fresh allocation has them. A new FINAL tap (the target reallocated) is recaptured
    in the next alloc, not in a round."""
    target, d = _drafter(ckpts, "deepseek_v3", monkeypatch)
    target.alloc(CAP)
    d.alloc(CAP)
    fresh = _state(d)
    _graphed(monkeypatch, target, d, 3)
    d.alloc(CAP)
    g = d.graph
    assert d.alloc_captures == len(g.graphs) > 0 and d.done == [0] * d.n
    # two layers, K = 3: layer j's first forward over 1 + j .. K + 1 + j rows (a round that
    # committed 0 .. K drafts and the bonus), layer 0 chained once (step 2)
    assert set(g.graphs) == ({("first", 0, r) for r in range(1, 5)} | {("first", 1, r) for r in range(1, 6)}
                             | {("chain", 0)})
    assert all(torch.equal(a, b) for a, b in zip(_state(d), fresh)) and len(_state(d)) == len(fresh)
    g.first(0, 0, [1, 2, 3], [])  # a replay does write the state (so the reset above is not vacuous)
    assert not all(torch.equal(a, b) for a, b in zip(_state(d), fresh))

    target.cache = None
    target.alloc(CAP)  # a new cache, a new FINAL tap buffer
    assert not g.replays(("first", 0, 1))  # the old graphs read the old buffer: eager until recaptured
    d.alloc_captures = 0
    d.alloc(CAP)
    assert d.graph is g and g.sink is d._final() and d.alloc_captures == len(g.graphs) > 0
    assert all(g.replays(key) for key in g.keys())
    assert all(torch.equal(a, b) for a, b in zip(_state(d), fresh))


def test_unwarmed_target_captures_on_first_use(ckpts, monkeypatch):
    """A target that warms no rows (captures its own steps on first use) leaves the drafter's
    graphs on first use too; they still equal the eager steps."""
    target, d = _drafter(ckpts, "deepseek_v3", monkeypatch)
    eager = _run(d, target, 3)
    _graphed(monkeypatch, target, d, None)
    graphed = _run(d, target, 3)
    assert d.graph.k is None and graphed.same(eager)
    assert graphed.alloc_captures == 0 and graphed.round_captures == len(d.graph.graphs) > 0


def test_sampled_session_through_the_step_graphs_equals_eager(ckpts, monkeypatch):
    """Sampled: each draft is drawn on the host from the replayed step's logits and fed back on
    the device; the same seed gives the same tokens and K/V."""
    target, d = _drafter(ckpts, "deepseek_v3", monkeypatch)
    sp = SamplingParams(temperature=0.8)
    eager = _run(d, target, 3, sp=sp)
    _graphed(monkeypatch, target, d, 3)
    graphed = _run(d, target, 3, sp=sp)
    assert isinstance(d.graph, MTPGraphs) and d.graph.graphs
    assert graphed.same(eager) and eager.drafted > 0
    assert graphed.round_captures == 0 and graphed.round_replays == graphed.drafted
