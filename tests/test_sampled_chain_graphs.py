"""Sampled requests on the chain drafters' graphed path (issue 45 item 1): a step's EAGLE-3 and
MTP chains draw every sampled request's drafts on the device (specdec/sampling.py `probs_rows`,
`draw_rows`) at uniforms its generator gave before the round, so a round of greedy and sampled
requests together is one replay of the pool's sampled graph, and each request gets the drafts
(and the distributions they were drawn from) it gets alone, its ids its solo ids (CPU, fp32,
the graphs replayed from an emulated capture)."""

from __future__ import annotations

import pytest
import torch

from memra_dist.specdec.sampling import SamplingParams, draw_drafts, draw_rows, probs, probs_rows, uniforms

from test_batching import _batched, _prompts, _solo, _tap_drafter

SAMPLED = [dict(sampling=SamplingParams(temperature=0.8, top_k=20), seed=11),
           dict(sampling=SamplingParams(temperature=1.3, top_p=0.9), seed=5)]


# ---- the device-side sampler --------------------------------------------------------------


def test_probs_rows_gives_each_row_what_probs_gives_it_alone():
    """Rows of different temperature / top-k / top-p in one call: each row bit for bit the
    distribution `probs` gives it with its own parameters (ties, -inf logits, k past V)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 50, generator=g) * 3
    x[1, ::4] = float("-inf")
    x[2] = x[2].round()  # ties
    sps = [SamplingParams(temperature=0.7), SamplingParams(temperature=1.0, top_k=5),
           SamplingParams(temperature=1.5, top_p=0.6), SamplingParams(temperature=0.4, top_k=60, top_p=0.95),
           SamplingParams(temperature=2.0, top_k=1), SamplingParams(temperature=1.0, top_p=1e-45)]
    rows = probs_rows(x, torch.tensor([s.temperature for s in sps]), torch.tensor([s.top_k for s in sps]),
                      torch.tensor([s.top_p for s in sps]))
    for r, sp in enumerate(sps):
        assert torch.equal(rows[r], probs(x[r:r + 1], sp)[0]), (r, sp)
    assert (rows[4] > 0).sum() == 1 and (rows[5] > 0).sum() == 1  # top-k 1 and a top-p of 0 in fp32: greedy
    # top-k alone (no row with a top-p): one topk of the largest k instead of a sort, the same rows
    ko, ks = [0, 1, 2, 4], [0, 5, 60, 1]  # no filter, k 5, k 60 (past V: no filter), k 1
    sub = probs_rows(x[ko], torch.tensor([sps[r].temperature for r in ko]), torch.tensor(ks), torch.ones(4), filters=60)
    for i, (r, k) in enumerate(zip(ko, ks)):
        assert torch.equal(sub[i], probs(x[r:r + 1], SamplingParams(temperature=sps[r].temperature, top_k=k))[0]), r


def test_draw_rows_follows_the_distribution_and_never_draws_a_zero():
    """The inverse CDF at a uniform: every draw has mass, and 20k draws over a 6-token
    distribution match it (chi-square, 5 dof, p ~ 1e-4 bound)."""
    q = torch.tensor([[0.0, 0.1, 0.4, 0.0, 0.3, 0.2]])
    gen = torch.Generator().manual_seed(3)
    n = 20000
    toks = draw_rows(q.expand(n, -1), uniforms(gen, n))
    counts = torch.bincount(toks, minlength=6).double()
    assert counts[0] == counts[3] == 0
    exp = q[0].double() * n
    keep = exp > 0
    chi2 = float((((counts - exp) ** 2)[keep] / exp[keep]).sum())
    assert chi2 < 25.7, (counts, chi2)
    assert int(draw_rows(q, torch.tensor([0.0]))) == 1 and int(draw_rows(q, torch.tensor([1 - 1e-12]))) == 5


def test_a_requests_uniforms_drawn_at_once_are_those_drawn_a_draft_at_a_time():
    """What lets a graph draw a round's K drafts from uniforms taken before it: the generator's
    stream is the same taken at once or one draft at a time (`draw_drafts`, a solo proposal)."""
    q = torch.softmax(torch.randn(5, 30, generator=torch.Generator().manual_seed(1)), -1)
    one = torch.Generator().manual_seed(9)
    alone = [int(draw_drafts(q[i:i + 1], one, "test")[0]) for i in range(5)]
    at_once = draw_rows(q, uniforms(torch.Generator().manual_seed(9), 5)).tolist()
    assert alone == at_once
    assert torch.equal(one.get_state(), _after(torch.Generator().manual_seed(9), 5).get_state())


def _after(gen, n):
    uniforms(gen, n)
    return gen


# ---- the pool's graphs --------------------------------------------------------------------


def _mixed(reqs, model, drafter, **kw):
    """Request i's own fields (`each`): even ones greedy, odd ones sampled, two ways in turn;
    and their solo ids, each group through one engine."""
    each = [{} if i % 2 == 0 else SAMPLED[(i // 2) % 2] for i in range(len(reqs))]
    solo: dict[int, list[int]] = {}
    for own in [{}, *SAMPLED]:
        idx = [i for i, e in enumerate(each) if e == own]
        for i, ids in zip(idx, _solo(model, drafter, [reqs[i] for i in idx], **own, **kw)):
            solo[i] = ids
    return each, [solo[i] for i in range(len(reqs))]


def _spy(monkeypatch, cls):
    """Every proposal (context, drafts, q) drafter class `cls` makes alone or batched."""
    seen = []
    real, many = cls.propose, cls.propose_many

    def keep(c, p, k):
        seen.append((tuple(c), tuple(p.tokens[:k].tolist()), None if p.q is None else p.q[:k].clone()))

    def spy(self, context, k, sp, gen):
        p = real(self, context, k, sp, gen)
        keep(context, p, k)
        return p

    def spy_many(drafters, contexts, ks, sps, gens, **kw):
        out = many(drafters, contexts, ks, sps, gens, **kw)
        for c, k, p in zip(contexts, ks, out):
            if k > 0 and not p.on_device:
                keep(c, p, k)
        return out

    monkeypatch.setattr(cls, "propose", spy)
    monkeypatch.setattr(cls, "propose_many", staticmethod(spy_many))
    return seen


def _as_alone(seen, alone):
    """Every batched proposal made at a context the request also had alone (most) equals it:
    drafts exactly, the distribution to fp32 rounding (a batched step's sums in another order)."""
    solo = {(c, d is None): (t, q) for c, t, q in alone for d in [q]}
    both = [(c, t, q) for c, t, q in seen if (c, q is None) in solo]
    assert len(both) >= 0.5 * len(seen) > 0, (len(both), len(seen))
    for c, t, q in both:
        st, sq = solo[(c, q is None)]
        assert t == st, (len(c), t, st)
        assert (q is None) == (sq is None) and (q is None or torch.allclose(q, sq, atol=1e-6)), len(c)
    assert sum(q is not None for _, _, q in both) > 10


def _count_sampled(monkeypatch, cls):
    n = [0]
    real = cls.sampled

    def sampled(self, *a, **k):
        out = real(self, *a, **k)
        n[0] += out is not None
        return out

    monkeypatch.setattr(cls, "sampled", sampled)
    return n


def test_sampled_eagle3_requests_draw_from_the_replayed_chains(llama, tmp_path_factory, monkeypatch):
    """Eight EAGLE-3 requests four at a time, half of them sampled (top-k, top-p): the rounds
    replay the chain graphs (the sampled graph where a sampled request rides), no eager chain
    step runs, and every proposal and id is the request's solo one."""
    import memra_dist.specdec.drafters.eagle3_batch as eb
    from memra_dist.specdec.drafters.eagle3_pool_graph import PoolChainGraphs

    from test_draft_pool import _chain_graphs

    ddir = str(_tap_drafter("eagle3", llama, tmp_path_factory))
    reqs = _prompts(8)
    from memra_dist.specdec.drafters.eagle3 import Eagle3Drafter

    seen = _spy(monkeypatch, Eagle3Drafter)
    each, solo = _mixed(reqs, llama, "eagle3", draft_model=ddir)
    alone, seen[:] = list(seen), []
    replays = _count_sampled(monkeypatch, PoolChainGraphs)
    eager, real_step = [0], eb._step
    monkeypatch.setattr(eb, "_step", lambda *a: eager.__setitem__(0, eager[0] + 1) or real_step(*a))
    batched, stats = _batched(llama, "eagle3", reqs, max_batch=4, draft_model=ddir, each=each,
                              on_open=lambda eng: _chain_graphs(eng._backend))
    assert batched == solo
    _as_alone(seen, alone)
    assert replays[0] > stats["draft_batches"] // 3 > 0, (replays, stats)
    # near its end a request's chain would pass its cache: only those rounds run eager
    assert eager[0] < stats["draft_batches"] // 3, (eager, stats)


def test_sampled_mtp_requests_draw_from_the_replayed_pool_graphs(monkeypatch, tmp_path_factory):
    """The same for a glm4_moe target's one MTP layer (mtp_pool_graph.py): sampled and greedy
    requests four at a time, their rounds replayed, every proposal and id as alone."""
    from moe_ckpt import save_moe

    from memra_dist.model.moe import MoE
    from memra_dist.specdec.drafters.eagle3_pool_graph import PoolChainGraphs

    from test_mtp_pool_graph import _graphs

    glm, _ = save_moe(tmp_path_factory.mktemp("smtp") / "glm4_moe", "glm4_moe", layers=2, n_mtp=1, seed=2)
    monkeypatch.setattr(MoE, "use_grouped", lambda self, on: setattr(self.experts, "grouped", True))
    reqs = [(p[:14], m) for p, m in _prompts(8)]
    from memra_dist.specdec.drafters.mtp import MTPDrafter

    seen = _spy(monkeypatch, MTPDrafter)
    each, solo = _mixed(reqs, glm, "mtp")
    alone, seen[:] = list(seen), []
    replays = _count_sampled(monkeypatch, PoolChainGraphs)
    batched, stats = _batched(glm, "mtp", reqs, max_batch=4, each=each, on_open=lambda eng: _graphs(eng))
    assert batched == solo
    _as_alone(seen, alone)
    assert replays[0] > stats["draft_batches"] // 3 > 0, (replays, stats)


@pytest.mark.parametrize("drafter", ["eagle3", "mtp"])
def test_a_sampled_graph_that_cannot_be_captured_leaves_the_eager_chains(drafter, llama, tmp_path_factory,
                                                                         monkeypatch, capfd):
    """A capture failure of the sampled graph (one warning line) leaves those rounds to the eager
    chains, whose draws are the same: every id as alone, greedy rounds still replayed."""
    from memra_dist.specdec.drafters.eagle3_pool_graph import PoolChainGraphs

    real = PoolChainGraphs._body

    def body(self, b, sampled=False):  # the sampled graph's capture (its eager warm-up) fails
        if sampled:
            raise RuntimeError("capture failed: out of memory")
        return real(self, b, sampled)

    monkeypatch.setattr(PoolChainGraphs, "_body", body)
    if drafter == "eagle3":
        from test_draft_pool import _chain_graphs

        model, kw, reqs = llama, {"draft_model": str(_tap_drafter("eagle3", llama, tmp_path_factory))}, _prompts(4)
        install = lambda eng: _chain_graphs(eng._backend)  # noqa: E731
    else:
        from moe_ckpt import save_moe

        from memra_dist.model.moe import MoE

        from test_mtp_pool_graph import _graphs

        model, _ = save_moe(tmp_path_factory.mktemp("smtpf") / "g", "glm4_moe", layers=2, n_mtp=1, seed=2)
        monkeypatch.setattr(MoE, "use_grouped", lambda self, on: setattr(self.experts, "grouped", True))
        kw, reqs, install = {}, [(p[:14], m) for p, m in _prompts(4)], _graphs
    each, solo = _mixed(reqs, model, drafter, **kw)
    made = []
    batched, _ = _batched(model, drafter, reqs, max_batch=4, each=each, **kw,
                          on_open=lambda eng: made.append(install(eng)))
    assert batched == solo
    err = capfd.readouterr().err
    assert err.count("sampled draft chains stay eager") == 1, err
    assert made[0].replays > 0 and not made[0]._sampled_ok


def test_sampled_plain_decoding_draws_at_launch_and_goes_ahead(llama, monkeypatch):
    """Sampled requests with no drafter: each step's rows drawn on the device as the step is
    launched (step_forward.py `draw_at_launch`, read back as greedy rows are), so the loop launches
    the next step behind it as for greedy plain decoding: six at a time, each its solo ids, several
    rows drawn a step, steps launched ahead."""
    import memra_dist.batching.step_forward as sf

    sizes, real = [], sf.draw_at_launch

    def draw(jobs, *a):
        sizes.append(sum(1 for j in jobs if j.chain is not None and j.chain.drawn))
        return real(jobs, *a)

    reqs = _prompts(6)
    solo = _solo(llama, "none", reqs, **SAMPLED[1])
    monkeypatch.setattr(sf, "draw_at_launch", draw)
    batched, stats = _batched(llama, "none", reqs, max_batch=6, **SAMPLED[1],
                              on_open=lambda eng: setattr(eng._backend.batcher, "ahead", True))  # (as on a GPU's graphs)
    assert batched == solo
    assert max(sizes) >= 4 and stats["ahead_steps"] > stats["steps"] // 3, (max(sizes), stats)
    assert stats["void_rows"] <= len(reqs), stats  # (a row launched past a request's EOS at most once each)


@pytest.mark.parametrize("drafter", ["ngram"])
def test_a_steps_sampled_rounds_are_accepted_together(drafter, llama, monkeypatch):
    """The loop accepts a step's sampled rounds at once (chain.py `accept_sampled_rounds`: one
    readback for all, not each round's logit rows copied to the host): n-gram's one-hot drafts,
    six requests at a time, each its solo ids, steps of several rounds."""
    import memra_dist.batching.chain as chain_mod

    sizes, real = [], chain_mod.accept_sampled_many

    def many(ps, *a):
        sizes.append(len(ps))
        return real(ps, *a)

    reqs = _prompts(6)
    kw = SAMPLED[1]
    solo = _solo(llama, drafter, reqs, **kw)
    monkeypatch.setattr(chain_mod, "accept_sampled_many", many)
    batched, _ = _batched(llama, drafter, reqs, max_batch=6, **kw)
    assert batched == solo
    assert max(sizes) >= 4 and sum(sizes) > 3 * len(sizes) // 2, sizes


def test_a_non_finite_draft_distribution_on_the_sampled_graph_is_one_line(llama, tmp_path_factory):
    """A broken EAGLE-3 head (NaN in its lm_head) under sampled requests on the replayed sampled
    graph: the request ends with the drafter's one-line error (the graph's non-finite flag,
    read back with its drafts), as the solo path's `draw_drafts` refuses it."""
    from memra_dist.app import open_engine
    from memra_dist.errors import UserError

    from test_batching import CAP, _cfg
    from test_draft_pool import _chain_graphs

    ddir = str(_tap_drafter("eagle3", llama, tmp_path_factory))
    kw = dict(draft_model=ddir, **SAMPLED[0])
    with open_engine(_cfg(llama, "eagle3", **kw), capacity=CAP, max_batch=4) as eng:
        g = _chain_graphs(eng._backend)
        eng._backend.tap_net.lm_head.weight.data[3] = float("nan")
        with pytest.raises(UserError, match=r"non-finite logits \(NaN/inf\) from the eagle3 drafter"):
            eng.generate(_prompts(1)[0][0], _cfg(llama, "eagle3", max_new_tokens=8, **kw))
        assert g.sampled_replays > 0
