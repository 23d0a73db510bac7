"""The model drafter's greedy chain as one graph (specdec/drafters/chain_graph.py), checked on the
CPU with an emulated capture (graph_emulator.py): captured once at the drafter's allocation
for the run's K, then replayed every round at that round's start with no Python in between, it
drafts exactly what the per-step chain drafts (draft_model.py's eager path, the reference):
every round's proposal, the session's ids, drafted and accepted counts and the draft cache's
K/V, for K = 2, 4, 8 with partial acceptances. A round of another k (the end of a request)
steps through the runner instead; the catch-up forward of 1 or 2 pending tokens replays inside
the chain's graph, a longer one steps; a second session on the same cache reuses the graph, a new
capacity captures a new one; a recurrent (KDA) mixer, a CPU runner or k < 2 gets no graph."""

from __future__ import annotations

import pytest
import torch

from graph_emulator import EmulatedCapture
from memra_dist.runner import ModelRunner
from memra_dist.specdec.drafters import draft_model as dm
from memra_dist.specdec.drafters.chain_graph import FEEDS, ChainGraph, chain_eligible, chain_graph
from memra_dist.specdec.drafters.draft_model import ModelDrafter
from memra_dist.specdec.sampling import SamplingParams
from memra_dist.specdec.session import SpecSession

CPU, F32, CAP = torch.device("cpu"), torch.float32, 96
PROMPT = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7]
N_NEW = 40


def _draft_runner(path: str, noise: float) -> ModelRunner:
    """The draft's runner; `noise`: the lm_head perturbed (relative std) so that a draft made of
    the target's own checkpoint agrees with it only in part."""
    r = ModelRunner(path, CPU, F32, max_pos=128)
    if noise:
        w = r.stage.lm_head.weight
        with torch.no_grad():
            w.add_(torch.randn(w.shape, generator=torch.Generator().manual_seed(1)) * noise * w.std())
    return r


@pytest.fixture
def emulated(monkeypatch):
    """The drafter's chain graphs captured with the emulator (as chain_graph does on CUDA);
    counts the replays."""
    runs = []
    monkeypatch.setattr(dm, "chain_graph",
                        lambda r, k: ChainGraph(r, k, graph_cls=EmulatedCapture) if chain_eligible(r, k) else None)
    real, real_feed = ChainGraph.run, ChainGraph.run_feed

    def run(self, tok, start):
        runs.append(("run", start))
        return real(self, tok, start)

    def run_feed(self, feed, start):
        runs.append((f"feed{len(feed)}", start))
        return real_feed(self, feed, start)

    monkeypatch.setattr(ChainGraph, "run", run)
    monkeypatch.setattr(ChainGraph, "run_feed", run_feed)
    return runs


CAPTURES = 1 + len(FEEDS)  # a chain graph's captures: the chain fed a token, and one per catch-up feed


def _session(target, d, k, n_new=N_NEW, captures=None):
    """A greedy session -> (ids, drafted, accepted, every round's (k, drafts), the draft cache's
    K/V). `captures`: a list the capture counts go to (after alloc, after the rounds)."""
    props = []
    real_propose, real_alloc = d.propose, d.alloc

    def propose(context, kk, sp, gen):
        p = real_propose(context, kk, sp, gen)
        props.append((kk, p.tokens.tolist()))
        return p

    def alloc(capacity):
        mb = real_alloc(capacity)
        if captures is not None:
            captures.append(EmulatedCapture.captures)
        return mb

    d.propose, d.alloc = propose, alloc
    try:
        s = SpecSession(target, d, SamplingParams(), torch.Generator().manual_seed(0), k)
        ids = [s.start(PROMPT, n_new, CAP)]
        while not s.done:
            ids.extend(s.burst(4))
    finally:
        del d.propose, d.alloc
    if captures is not None:
        captures.append(EmulatedCapture.captures)
    kv = [t.clone() for st in d.runner.cache.layers.values() for t in (st.k, st.v)]
    return ids, s.stats.drafted, s.stats.accepted, props, kv


def _same(a, b):
    assert a[:4] == b[:4]
    assert all(torch.equal(x, y) for x, y in zip(a[4], b[4]))


@pytest.mark.parametrize("k", [2, 4, 8])
@pytest.mark.parametrize("draft", ["noisy_target", "draft_llama"])
def test_chain_graph_drafts_exactly_the_per_step_chain(llama, draft_llama, emulated, k, draft):
    path, noise = (str(llama), 0.3) if draft == "noisy_target" else (str(draft_llama), 0.0)
    target = ModelRunner(str(llama), CPU, F32, max_pos=128)
    ref_d = ModelDrafter(_draft_runner(path, noise), k=0)  # the reference: k = 0, no graph, the per-step chain
    want = _session(target, ref_d, k)
    assert not emulated  # the reference never replayed a chain
    d = ModelDrafter(_draft_runner(path, noise), k=k)
    caps = []
    before = EmulatedCapture.captures
    got = _session(target, d, k, captures=caps)
    _same(got, want)
    assert isinstance(d.chain, ChainGraph) and d.chain.k == k
    assert caps == [before + CAPTURES, before + CAPTURES]  # captured at alloc, none during the rounds
    full = [p for p in want[3] if p[0] == k]
    assert len(emulated) == len(full) > 3  # every round of the run's K replayed a graph
    assert emulated[0][0] == "feed2"  # the first round feeds the prompt's last token and the first one generated
    assert {kind for kind, _ in emulated} <= {"feed1", "feed2"}  # a steady state: the catch-up inside the graph
    assert want[1] > 0
    if draft == "noisy_target":
        assert 0 < want[2] < want[1]  # partial acceptances: rollbacks between replays


def test_a_shortened_k_steps_through_the_runner(llama, emulated):
    """The end of a request asks for fewer drafts: those rounds run the per-step chain, the
    full rounds replay the graph; the session equals the per-step one."""
    k, n_new = 8, 23  # 22 tokens after the first in rounds of <= 8 drafts: the last rounds are short
    target = ModelRunner(str(llama), CPU, F32, max_pos=128)
    ref_d = ModelDrafter(_draft_runner(str(llama), 0.3), k=0)
    want = _session(target, ref_d, k, n_new)
    d = ModelDrafter(_draft_runner(str(llama), 0.3), k=k)
    got = _session(target, d, k, n_new)
    _same(got, want)
    short = [p for p in want[3] if p[0] < k]
    assert short, "no shortened round: the test would not test the fallback"
    assert len(emulated) == len(want[3]) - len(short)


def test_propose_of_a_shorter_k_equals_the_per_step_path(llama, emulated):
    """Directly: after the same prime, proposals of k = 1 .. K from the graphed drafter equal
    the per-step drafter's, and only k = K replays."""
    K = 4
    a = ModelDrafter(_draft_runner(str(llama), 0.3), k=K)
    b = ModelDrafter(_draft_runner(str(llama), 0.3), k=0)  # k = 0: no graph
    for d in (a, b):
        d.alloc(CAP)
        d.prime(PROMPT)
    assert a.chain is not None and b.chain is None
    ctx = list(PROMPT)
    for kk in (1, 3, K, 2, K):
        pa = a.propose(ctx, kk, SamplingParams(), None)
        pb = b.propose(ctx, kk, SamplingParams(), None)
        assert pa.tokens.tolist() == pb.tokens.tolist() and len(pa.tokens) == kk
        assert a.cached == b.cached and a.runner.length == b.runner.length
        ctx = ctx + pa.tokens.tolist()[:1]  # one draft accepted, the rest rolled back
        for d in (a, b):
            d.maintain(ctx)
    assert len(emulated) == 2


def test_catch_up_feeds_replay_with_the_chain_and_a_longer_one_steps(llama, emulated):
    """The catch-up of 1 pending token (a rejection) and of 2 (all K accepted, then the bonus)
    replays inside the chain's graph; 3 (tokens the drafter never saw) takes the catch-up step
    and the chain fed its argmax. Every proposal, the cached ids and the draft cache's K/V
    equal the per-step drafter's."""
    K = 4
    a = ModelDrafter(_draft_runner(str(llama), 0.3), k=K)
    b = ModelDrafter(_draft_runner(str(llama), 0.3), k=0)
    for d in (a, b):
        d.alloc(CAP)
        d.prime(PROMPT)
    ctx = list(PROMPT)
    for step in range(3):
        pa = a.propose(ctx, K, SamplingParams(), None)
        pb = b.propose(ctx, K, SamplingParams(), None)
        assert pa.tokens.tolist() == pb.tokens.tolist() and a.cached == b.cached
        n = a.runner.length
        assert n == b.runner.length
        for la, lb in zip(a.runner.cache.layers.values(), b.runner.cache.layers.values()):
            assert torch.equal(la.k[:n], lb.k[:n]) and torch.equal(la.v[:n], lb.v[:n])
        if step == 0:  # all K accepted, then the bonus: 2 pending tokens
            ctx = ctx + pa.tokens.tolist() + [11]
        else:  # three committed tokens the drafter never saw
            ctx = ctx + [t + 1 for t in pa.tokens.tolist()[:3]]
        for d in (a, b):
            d.maintain(ctx)
    assert [kind for kind, _ in emulated] == ["feed1", "feed2", "run"]


def test_the_graph_is_kept_per_cache(llama, emulated):
    """A second session on the same capacity reuses the graph; another capacity captures anew."""
    d = ModelDrafter(_draft_runner(str(llama), 0.3), k=4)
    before = EmulatedCapture.captures
    d.alloc(CAP)
    g = d.chain
    d.alloc(CAP)
    assert d.chain is g and EmulatedCapture.captures == before + CAPTURES
    d.alloc(CAP + 8)
    assert d.chain is not g and d.chain.over(d.runner.cache) and EmulatedCapture.captures == before + 2 * CAPTURES


def test_eligibility(llama, monkeypatch):
    r = _draft_runner(str(llama), 0.0)
    r.alloc(CAP)
    assert chain_eligible(r, 4) and not chain_eligible(r, 1)
    assert chain_graph(r, 4) is None  # a CPU runner captures no steps: the per-step path
    assert ModelDrafter(r, k=4).chain is None
    blk = next(iter(r.stage.layers.values()))
    monkeypatch.setattr(blk.self_attn, "mixer_class", "kda", raising=False)
    assert not chain_eligible(r, 4)  # a recurrent state's begin is per forward
