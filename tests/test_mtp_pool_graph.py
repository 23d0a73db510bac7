"""The engine loop's MTP rounds as one graph a step over the draft and tap pools
(specdec/drafters/mtp_pool_graph.py): a glm4_moe target with one MTP layer, its requests
batched four at a time, get every proposal and every id they get alone (CPU, fp32), the graphs
replayed from an emulated capture (or re-run, where they launch Triton kernels)."""

from __future__ import annotations

import pytest

from test_batching import CAP, _batched, _prompts, _solo, spy_proposals
from test_draft_pool import _Rerun, _mostly_k_0, _proposals_as_alone


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    from moe_ckpt import save_moe

    path, _ = save_moe(tmp_path_factory.mktemp("mtpg") / "glm4_moe", "glm4_moe", layers=2, n_mtp=1, seed=2)
    return path


def _graphs(eng, graph_cls=None, paged=False):
    """The pool's MTP graphs (K 3, up to 4 requests: buckets 1, 2, 4), installed as the engine's
    GPU path installs them."""
    from graph_emulator import EmulatedCapture

    from memra_dist.specdec.drafters.mtp_pool_graph import MTPPoolGraphs

    b = eng._backend
    b.draft_pool.alloc(CAP)
    b.batcher.tap_pool.alloc(CAP)
    g = MTPPoolGraphs(b.tap_net, b.runner.stage, b.draft_pool, b.batcher.tap_pool, 3, 4,
                      graph_cls=graph_cls or EmulatedCapture, paged=paged)
    assert g.warm() == 3
    b.draft_pool.graphs = g
    return g


def _alone(glm, monkeypatch, n: int = 8):
    """(requests, their solo ids, the spy's proposals list (then empty), their solo proposals
    sorted); the MoE FFNs in their grouped form (what a graph captures: bf16 on CUDA), solo and
    batched alike."""
    from memra_dist.model.moe import MoE
    from memra_dist.specdec.drafters.mtp import MTPDrafter

    monkeypatch.setattr(MoE, "use_grouped", lambda self, on: setattr(self.experts, "grouped", True))

    seen = spy_proposals(monkeypatch, MTPDrafter)
    reqs = [(p[:14], m) for p, m in _prompts(n)]
    solo = _solo(glm, "mtp", reqs)
    alone, seen[:] = sorted(seen), []
    return reqs, solo, seen, alone


def test_a_one_layer_mtp_target_keeps_its_draft_caches_in_one_pool(glm):
    """The backend pools a single grouped-attention MTP layer's K/V (one pool layer, the
    attention's KV heads and head size); the pool's slots all come back after the requests."""
    from memra_dist.app import open_engine

    from test_batching import _cfg

    with open_engine(_cfg(glm, "mtp"), capacity=CAP, max_batch=3) as eng:
        b = eng._backend
        a = b.tap_net.layer(0).self_attn
        p = b.draft_pool
        assert (p.layers, p.n_kv, p.head_dim, p.slots) == (1, a.nkv, a.hd, 3)
        took = []
        real = p.take
        p.take = lambda d, rows: took.append(rows) or real(d, rows)
        for prompt, n in [(q[:14], 6) for q, _ in _prompts(2)]:
            eng.generate(prompt, _cfg(glm, "mtp", max_new_tokens=n))
        assert took == [CAP, CAP] and p.owners.held == 0 and p.graphs is None  # (no graphs on the CPU)


def test_the_mtp_rounds_replayed_from_the_pool_graphs_draft_what_each_request_drafts_alone(glm, monkeypatch):
    """Eight requests four at a time: every round of up to four greedy requests is one replay
    (the first forward over each request's new rows padded to K + 1, then K - 1 chained rows,
    the target's lm_head picking), and every proposal equals the request's solo proposal at the
    same context; near its end a request whose chain would pass its cache drafts on the eager
    chains."""
    reqs, solo, seen, alone = _alone(glm, monkeypatch)
    made = []
    batched, stats = _batched(glm, "mtp", reqs, max_batch=4, on_open=lambda eng: made.append(_graphs(eng)))
    assert batched == solo and sorted(seen) == alone
    assert stats["draft_batches"] > 0 and made[0].replays > stats["draft_batches"] // 2, (made[0].replays, stats)


def test_requests_back_from_k_0_catch_up_and_replay(glm, monkeypatch):
    """--spec-k auto leaving requests at K 0 for rounds: a request back from them has more new
    rows than the graph takes; those are run first (their K/V only) and the round replays:
    every id as alone, most rounds' proposals as alone, most rounds replayed."""
    import memra_dist.specdec.drafters.mtp_batch as mb

    reqs, solo, seen, alone = _alone(glm, monkeypatch)
    made, caught, inside = [], [], [False]
    real_layer, real_replayed = mb._layer, mb._replayed

    def replayed(g, live, *a):
        inside[0] = True
        try:
            return real_replayed(g, live, *a)
        finally:
            inside[0] = False

    def layer(head, j, ds, los, lens, *a):  # the catch-up rows run before a replay
        if inside[0]:
            caught.extend(lens)
        return real_layer(head, j, ds, los, lens, *a)

    monkeypatch.setattr(mb, "_replayed", replayed)
    monkeypatch.setattr(mb, "_layer", layer)
    batched, stats = _mostly_k_0(monkeypatch, glm, "mtp", reqs, "", lambda eng: (
        setattr(eng._backend.batcher, "auto_k", True), made.append(_graphs(eng))))
    assert batched == solo
    assert caught and min(caught) > 0, caught
    assert made[0].replays >= stats["draft_batches"] // 2 > 0, (made[0].replays, stats)
    _proposals_as_alone(seen, alone)


@pytest.mark.slow  # the Triton interpreter: ~10-20 s on 2 cores
def test_the_mtp_pool_graphs_on_the_paged_kernel_draft_what_each_request_drafts_alone(glm, monkeypatch):
    """`paged=True` (a GPU's fast path): the layer's rotary and K/V write in one kernel and its
    attention one paged launch reading each request's slot through its one-block table."""
    import memra_dist.kernels.paged_attention as pa

    reqs, solo, seen, alone = _alone(glm, monkeypatch, n=5)
    made, launches, real = [], [], pa.paged_attention
    monkeypatch.setattr(pa, "paged_attention", lambda q, kp, *a, **kw: launches.append(a[4].shape) or real(q, kp, *a, **kw))

    def on_open(eng):
        eng._backend.tap_net.layer(0).self_attn.fuse()  # (the engine fuses it where the target runs our kernels)
        made.append(_graphs(eng, _Rerun, paged=True))

    batched, stats = _batched(glm, "mtp", reqs, max_batch=4, on_open=on_open)
    assert batched == solo and sorted(seen) == alone
    assert made[0].replays > 0 and launches and all(t[1] == 1 for t in launches), (made[0].replays, launches[:3])


@pytest.mark.slow  # the Triton interpreter (~5 s)
def test_a_pooled_step_on_the_paged_kernel_equals_the_masked_one_for_ragged_rows(glm):
    """`pooled_step` over requests of 3, 1 and 2 rows (the eager chains' ragged layout, as a
    sampled round on a GPU's kernels runs it): the paged kernel's arm and the masked per-request
    arm write the same K/V and give the same outputs."""
    import torch

    from memra_dist.model.config import load_config
    from memra_dist.model.mtp import load_mtp
    from memra_dist.specdec.drafters.draft_pool import DraftPool
    from memra_dist.specdec.drafters.mtp_pool_graph import pooled_step

    cpu = torch.device("cpu")
    head = load_mtp(glm, load_config(glm), 1, cpu, torch.float32)
    head.layer(0).self_attn.fuse()
    a = head.layer(0).self_attn
    g = torch.Generator().manual_seed(0)
    H = head.cfg.hidden_size
    embed = torch.nn.Embedding(head.cfg.vocab_size, H)
    lens, starts, idx = [3, 1, 2], [10, 5, 20], [2, 0, 1]
    pos = torch.tensor([s + t for s, n in zip(starts, lens) for t in range(n)])
    slots = torch.tensor([i for i, n in zip(idx, lens) for _ in range(n)])
    tokens = torch.randint(0, head.cfg.vocab_size, (sum(lens),), generator=g)
    hidden = torch.randn(sum(lens), H, generator=g)
    outs, pools = [], []
    for paged in (False, True):
        pool = DraftPool(3, 1, a.nkv, a.hd, cpu, torch.float32)
        pool.alloc(32)
        gk = torch.Generator().manual_seed(1)  # the same earlier rows in both pools
        pool.k.normal_(generator=gk)
        pool.v.normal_(generator=gk)
        with torch.inference_mode():
            outs.append(pooled_step(head, embed, pool, tokens, hidden, pos, slots, torch.tensor(idx), lens, paged))
        pools.append((pool.k.clone(), pool.v.clone()))
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(pools[1][0], pools[0][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pools[1][1], pools[0][1], rtol=1e-5, atol=1e-5)
