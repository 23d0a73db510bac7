"""The MTP drafter's step graphs (specdec/drafters/mtp_graph.py), checked on the CPU with an
emulated capture (graph_emulator.py): each step kind (a layer's first forward per row count, a
chained step per layer) captured once, then replayed at later rounds' positions with no Python
in between; a greedy session drafting through them equals one drafting eagerly - ids, drafted
and accepted counts, every round's drafts, and the layers' K/V and kept outputs - for
deepseek_v3 with two MTP layers and glm4_moe with one, k below, at and above the layer count.
The MoE runs its grouped form (the capturable one, as on CUDA bf16) in both."""

from __future__ import annotations

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


_Emulated = EmulatedCapture


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtpg")
    return {"deepseek_v3": save_moe(root / "ds", "deepseek_v3", layers=2, n_mtp=2, seed=1)[0],
            "glm4_moe": save_moe(root / "glm", "glm4_moe", layers=2, n_mtp=1, seed=2)[0]}


def _run(target, d, k, drafts, n_new=24, sp=SamplingParams()):
    drafts.clear()
    s = SpecSession(target, d, sp, torch.Generator().manual_seed(0), k)
    ids = [s.start(PROMPT, n_new, CAP)]
    while not s.done:
        ids.extend(s.burst(4))
    state = [t.clone() for st in d.states for t in vars(st).values() if isinstance(t, torch.Tensor)]
    return ids, s.stats.drafted, s.stats.accepted, list(drafts), state, [o.clone() for o in d.outs]


@pytest.mark.parametrize("name,k", [("deepseek_v3", 1), ("deepseek_v3", 2), ("deepseek_v3", 5), ("glm4_moe", 1),
                                    ("glm4_moe", 3)])
def test_session_through_the_step_graphs_equals_eager(ckpts, monkeypatch, name, k):
    monkeypatch.setattr(MoE, "use_grouped", lambda self, on: setattr(self.experts, "grouped", True))
    d_dir = ckpts[name]
    target = ModelRunner(d_dir, CPU, F32, max_pos=128)
    d = MTPDrafter.load(d_dir, load_config(d_dir), target)
    assert all(d.head.layer(j).mlp.graph_safe for j in range(d.n))
    drafts = []
    real = d.propose

    def spy(context, kk, sp, gen):
        p = real(context, kk, sp, gen)
        drafts.append(p.tokens.tolist())
        return p

    d.propose = spy
    eager = _run(target, d, k, drafts)
    assert d.graph is None  # CPU: the eager steps, the reference
    monkeypatch.setattr(mtp_mod, "mtp_graphs", lambda dr: MTPGraphs(dr, graph_cls=_Emulated))
    d.capacity = 0  # a fresh alloc: the graphs are built there, as on CUDA
    before = _Emulated.captures
    graphed = _run(target, d, k, drafts)
    g = d.graph
    assert isinstance(g, MTPGraphs)
    assert graphed[:4] == eager[:4]
    for a, b in zip(graphed[4] + graphed[5], eager[4] + eager[5]):
        assert torch.equal(a, b)
    rounds = len(eager[3])
    assert rounds > 3 and eager[1] > 0
    kinds = set(g.graphs)
    assert _Emulated.captures - before == len(kinds) < rounds * min(k, d.n)  # replayed, not recaptured
    assert any(key[0] == "first" for key in kinds)
    assert (k > d.n) == any(key[0] == "chain" for key in kinds)
    # a second session on the same cache reuses every graph
    kept = dict(g.graphs)
    again = _run(target, d, k, drafts)
    assert again[:4] == eager[:4] and all(g.graphs[key] is v for key, v in kept.items())


def test_sampled_session_through_the_step_graphs_equals_eager(ckpts, monkeypatch):
    """Sampled: each draft is drawn on the host from the replayed step's logits and fed back on
    the device; the same seed gives the same tokens and K/V."""
    monkeypatch.setattr(MoE, "use_grouped", lambda self, on: setattr(self.experts, "grouped", True))
    d_dir = ckpts["deepseek_v3"]
    target = ModelRunner(d_dir, CPU, F32, max_pos=128)
    d = MTPDrafter.load(d_dir, load_config(d_dir), target)
    sp = SamplingParams(temperature=0.8)
    eager = _run(target, d, 3, [], sp=sp)
    monkeypatch.setattr(mtp_mod, "mtp_graphs", lambda dr: MTPGraphs(dr, graph_cls=_Emulated))
    d.capacity = 0
    graphed = _run(target, d, 3, [], sp=sp)
    assert isinstance(d.graph, MTPGraphs) and d.graph.graphs
    assert graphed[:3] == eager[:3] and eager[1] > 0
    assert all(torch.equal(a, b) for a, b in zip(graphed[4] + graphed[5], eager[4] + eager[5]))
