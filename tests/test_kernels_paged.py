"""The batched engine on the kernels (kernels/paged_attention.py, run by Triton's interpreter on
CPU): the paged split-sequence attention equals each request's reference attention over its own
keys, read through scattered block tables; and a batched engine switched onto the kernels (the
GPU's fast path: fused projections, rotary with the paged K/V write, one paged launch a step)
gives every request the ids the reference engine gives it alone (fp32)."""

from __future__ import annotations

import threading

import pytest
import torch

from triton_interp import triton  # noqa: E402,F401 (the interpreter on CPU; skips without Triton)

from memra_dist.app import open_engine  # noqa: E402
from memra_dist.config import RunConfig  # noqa: E402
from memra_dist.model.attention import cached_attention, causal_mask  # noqa: E402

from test_kernels import _on_kernels as _runner_on_kernels  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter tests run on CPU machines")


@pytest.mark.parametrize("nh,nkv", [(8, 2), (4, 4)])
def test_paged_attention_equals_each_requests_reference(nh, nkv):
    from memra_dist.kernels.paged_attention import paged_attention

    block, hd, nblocks = 8, 16, 40
    g = torch.Generator().manual_seed(nh)
    kp, vp = torch.randn(nblocks * block, nkv, hd, generator=g), torch.randn(nblocks * block, nkv, hd, generator=g)
    order = torch.randperm(nblocks, generator=g).tolist()  # blocks scattered over the pool
    # (rows, first position, capacity): a decode row, a verify of 5 at a block edge, one at position 0
    reqs = [(1, 70, 96), (5, 43, 64), (1, 0, 16), (3, 17, 40)]
    tables, lo, pos, q_rows, refs = [], [], [], [], []
    row = 0
    for rows, start, cap in reqs:
        need = -(-cap // block)
        table = [order.pop() for _ in range(need)]
        slots = torch.tensor([table[p // block] * block + p % block for p in range(start + rows)])
        tables.append(table)
        lo.append(row)
        row += rows
        p = torch.arange(start, start + rows)
        pos.append(p)
        q = torch.randn(rows, nh, hd, generator=g)
        q_rows.append(q)
        kc, vc = torch.zeros(cap, nkv, hd), torch.zeros(cap, nkv, hd)
        kc[:start + rows], vc[:start + rows] = kp[slots], vp[slots]
        refs.append(cached_attention(q, kc, vc, causal_mask(p, cap), nkv))
    width = max(map(len, tables))
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    out = paged_attention(torch.cat(q_rows), kp, vp, torch.cat(pos), torch.tensor(lo, dtype=torch.int32),
                          torch.tensor([r for r, _, _ in reqs], dtype=torch.int32), table, block, 5, 96, chunk=16)
    torch.testing.assert_close(out, torch.cat(refs), rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def wide_llama(ckpt_factory):
    """head_dim 16: the attention kernel's smallest tile."""
    return ckpt_factory("llama", seed=5, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                        num_key_value_heads=2, num_hidden_layers=2)[0]


def _cfg(model, drafter, n=12):
    return RunConfig(model=str(model), drafter=drafter, k=3, device="cpu", dtype="fp32", prefill_chunk=40,
                     max_new_tokens=n)


def _on_kernels(backend) -> None:
    """What a GPU's fast path does to the batched engine's stage, on CPU (test_kernels.py)."""
    assert _runner_on_kernels(backend.runner) > 0
    backend.batcher.kernels = True


def _all_at_once(eng, reqs, cfg) -> list:
    """The requests (prompt, new tokens) from concurrent threads on the open batched engine,
    each with its config `cfg(new tokens)` -> their ids in order (None: one did not finish)."""
    got: dict[int, list[int]] = {}

    def one(i, p, n):
        got[i] = eng.generate(p, cfg(n)).token_ids

    threads = [threading.Thread(target=one, args=(i, p, n)) for i, (p, n) in enumerate(reqs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    return [got.get(i) for i in range(len(reqs))]


@pytest.fixture(scope="module")
def wide_qwen3(ckpt_factory):
    """qwen3's q / k norms at head_dim 16 (they ride the rotary kernel: kernels/rope_kv.py)."""
    return ckpt_factory("qwen3", seed=6, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                        num_key_value_heads=2, num_hidden_layers=2)[0]


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    """glm4_moe: partial rotary with q / k norms (the rotary kernel), a MoE FFN."""
    from moe_ckpt import save_moe

    return save_moe(tmp_path_factory.mktemp("glm") / "m", "glm4_moe", use_qk_norm=True)[0]


@pytest.mark.slow  # the Triton interpreter: seconds to a minute on 2 cores; the full run (slow tier) keeps it
@pytest.mark.parametrize("model,drafter", [("wide_llama", "none"), ("wide_qwen3", "ngram"), ("glm", "none")])
def test_a_batched_engine_on_the_kernels_gives_every_request_its_solo_ids(model, drafter, request, monkeypatch):
    import memra_dist.kernels.paged_attention as pa

    path = request.getfixturevalue(model)
    reqs = [([5, 6, 7, 8, 5, 6, 7, 8, 5, 6], 12), ([9, 3, 9, 3, 9, 3, 9], 8), (list(range(4, 50)), 10),
            ([11, 12, 13, 11, 12, 13, 11], 12)]  # the third prefills beside the others' decode rows
    with open_engine(_cfg(path, drafter), capacity=96) as eng:
        solo = [eng.generate(p, _cfg(path, drafter, n)).token_ids for p, n in reqs]
    from memra_dist.model.attention import Attention

    launches, folded = [], []
    real = pa.paged_attention
    monkeypatch.setattr(pa, "paged_attention", lambda q, *a, **kw: launches.append(a[3].numel()) or real(q, *a, **kw))
    fused = Attention.fused_step  # a batched step's rows fold the norms and residuals (up to the row GEMM's 128)
    monkeypatch.setattr(Attention, "fused_step", lambda self, x, ctx, *a: folded.append(
        (ctx.batch is not None, x.shape[0])) or fused(self, x, ctx, *a))
    with open_engine(_cfg(path, drafter), capacity=96, max_batch=4) as eng:
        _on_kernels(eng._backend)
        got = _all_at_once(eng, reqs, lambda n: _cfg(path, drafter, n))
        stats = eng._backend.stats()
    assert got == solo
    assert max(launches) >= 2, launches  # one launch held several requests' rows
    assert any(b and rows >= 2 for b, rows in folded), folded  # several requests' rows in one folded step
    assert stats["max_requests"] >= 2, stats


@pytest.mark.slow  # the Triton interpreter: seconds to a minute on 2 cores; the full run (slow tier) keeps it
def test_a_wide_batched_step_folds_and_equals_the_unfolded_step(wide_llama, monkeypatch):
    """A step of 6 requests x 4 verify rows (24 rows, past a verify's 16) runs the folded blocks
    and the folded head on the row GEMM's wider column block (kernels/gemm_rows.py, BM 32), and
    its logits equal the same step through the unfolded layers and head (cuBLAS-style linears,
    separate norms and adds)."""
    from memra_dist.batching.job import Job
    from memra_dist.batching.step_forward import forward
    from memra_dist.model.transformer import Block

    torch.manual_seed(0)
    n, rows, plen, cap = 6, 4, 9, 32
    ids = [torch.randint(0, 100, (plen + rows,)) for _ in range(n)]
    out, folded = {}, []
    fwd = Block.forward
    monkeypatch.setattr(Block, "forward", lambda self, x, ctx, st: folded.append(
        (x.shape[0], ctx.batch is not None and x.shape[0] <= self.batch_rows)) or fwd(self, x, ctx, st))
    for fold in (True, False):
        with open_engine(_cfg(wide_llama, "none"), capacity=cap, max_batch=n) as eng:
            _on_kernels(eng._backend)
            b = eng._backend.batcher
            assert b.stage.fused_head >= n * rows  # the lm_head's final norm folded over the step's rows too
            if not fold:
                for blk in b.stage.layers.values():
                    monkeypatch.setattr(blk, "batch_rows", 0)
                monkeypatch.setattr(b.stage, "fused_head", 0)
            folded.clear()
            rids = [("wide", i) for i in range(n)]
            for r, t in zip(rids, ids):
                b.admit(r, cap)
                forward(b, [Job(r, t[:plen], 0, cap, True)])
            with torch.inference_mode():
                out[fold] = forward(b, [Job(r, t[plen:], plen, cap, False) for r, t in zip(rids, ids)]).clone()
            for r in rids:
                b.leave(r)
        assert (n * rows, fold) in folded, folded
    torch.testing.assert_close(out[True], out[False], rtol=1e-4, atol=1e-4)


class _Replayed:
    """A CUDA graph's contract on CPU: fn runs once at capture (its output is the static
    buffer), and every replay re-runs it into that buffer, reading the static inputs as they
    are then (so the packed inputs and the padding are what is tested). Not graph_emulator's
    op recorder: the interpreter's Triton launches are not aten ops it could replay."""

    def __init__(self, fn, pool):
        self.fn = fn
        logits, taps = fn()
        self.out = (logits.clone(), {t: r.clone() for t, r in taps.items()})

    def replay(self) -> None:
        logits, taps = self.fn()
        self.out[0].copy_(logits)
        for t, r in taps.items():
            self.out[1][t].copy_(r)


@pytest.mark.slow  # the Triton interpreter: ~15 s on 2 cores
@pytest.mark.parametrize("tail", [35, pytest.param(70, marks=pytest.mark.slow)])  # (70: 30 s of the interpreter)
def test_a_prefill_tail_rides_a_graphed_step_beside_decode_rows_and_equals_the_eager_step(wide_llama, tail):
    """A prompt's last 35 or 70 rows (what a prefix-cache hit leaves to prefill) beside another
    request's decode row: the step replays a graph of the tails' buckets (48 or 128 rows; the
    tail as three or five paged segments of at most 16 rows over one block table), hands back
    the decode row's logits and the tail's last row's only, as the eager step does, and writes
    the same K/V (the next step's logits agree too)."""
    from memra_dist.batching.graphs import StepGraphs
    from memra_dist.batching.job import Job
    from memra_dist.batching.step_forward import forward

    torch.manual_seed(0)
    cap, a, b_ = 128, torch.randint(0, 100, (41 + tail,)), torch.randint(0, 100, (12,))
    out = {}
    with open_engine(_cfg(wide_llama, "none"), capacity=cap, max_batch=4) as eng:
        _on_kernels(eng._backend)
        b = eng._backend.batcher
        graphs = StepGraphs(b, cap, graph_cls=_Replayed)  # (a row budget of the capacity: the step's 36 or 71 rows)
        graphs.tails, graphs.tail_top = True, 128  # (as warm(..., tails=True) leaves them; captured on first use here)
        for graphed in (False, True):
            ra, rb = ("tail", graphed), ("decode", graphed)
            b.graphs = None
            for r, ids, n in ((ra, a, 40), (rb, b_, 11)):
                b.admit(r, cap)
                forward(b, [Job(r, ids[:n], 0, cap, True)])  # eager: the cached prefix, the other's prompt
            b.graphs = graphs if graphed else None
            before = graphs.replays
            with torch.inference_mode():
                step = [Job(rb, b_[11:12], 11, cap, False), Job(ra, a[40:40 + tail], 40, cap, True)]
                assert graphs.eligible(step)
                first = forward(b, step).clone()
                second = forward(b, [Job(ra, a[40 + tail:], 40 + tail, cap, False),
                                     Job(rb, b_[11:12], 12, cap, False)]).clone()
            out[graphed] = first, second
            assert first.shape[0] == 2 and (graphs.replays - before == 2) == graphed
            assert not graphed or graphs._key(step)[0] == (48 if tail == 35 else 128)
            for r in (ra, rb):
                b.leave(r)
    for x, y in zip(out[True], out[False]):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)


@pytest.mark.slow  # the Triton interpreter: ~15 s on 2 cores
def test_an_eager_steps_prefill_tails_attend_in_the_paged_launch_and_equal_the_prefix_attention(wide_llama,
                                                                                              monkeypatch):
    """An eager step (no graphs) with two prompts' tails (35 rows over a 41-row cached prefix, 20
    over 13) beside a decode row: on the kernels every row attends in ONE paged launch a layer,
    each tail as segments of at most 16 rows over its own block table (3 + 2, and the decode
    row's), no gather and no prefix attention; the rows handed back (the decode row's logits,
    each tail's last row's) and the K/V written equal the reference step's (the gather and the
    prefix attention, kernels off)."""
    import memra_dist.kernels.paged_attention as pa
    from memra_dist.batching.job import Job
    from memra_dist.batching.step_forward import forward

    torch.manual_seed(0)
    cap = 128
    a, c, d = torch.randint(0, 100, (80,)), torch.randint(0, 100, (40,)), torch.randint(0, 100, (12,))
    segs, real = [], pa.paged_attention
    monkeypatch.setattr(pa, "paged_attention", lambda q, *x, **kw: segs.append(x[3].numel()) or real(q, *x, **kw))
    out = {}
    with open_engine(_cfg(wide_llama, "none"), capacity=cap, max_batch=4) as eng:
        _on_kernels(eng._backend)
        b = eng._backend.batcher
        for kernels in (False, True):
            ra, rc, rd = ("a", kernels), ("c", kernels), ("d", kernels)
            b.kernels = False
            for r, ids, n in ((ra, a, 41), (rc, c, 13), (rd, d, 11)):
                b.admit(r, cap)
                forward(b, [Job(r, ids[:n], 0, cap, True)])  # the prefixes, on the reference
            b.kernels = kernels
            segs.clear()
            with torch.inference_mode():
                first = forward(b, [Job(rd, d[11:12], 11, cap, False), Job(ra, a[41:76], 41, cap, True),
                                    Job(rc, c[13:33], 13, cap, True)]).clone()
                calls = list(segs)
                b.kernels = False  # the next step on the reference: it reads what the first wrote
                second = forward(b, [Job(ra, a[76:77], 76, cap, False), Job(rc, c[33:34], 33, cap, False),
                                     Job(rd, d[11:12], 12, cap, False)]).clone()
            out[kernels] = first, second
            assert first.shape[0] == 3
            assert calls == ([1 + 3 + 2] * 2 if kernels else []), calls  # one launch a layer (2 layers)
            for r in (ra, rc, rd):
                b.leave(r)
    for x, y in zip(out[True], out[False]):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)


class _Uncapturable:
    def __init__(self, fn, pool):
        raise RuntimeError("operation not permitted when stream is capturing")


@pytest.mark.parametrize("graph_cls,drafter", [  # the interpreter's replays take a minute each (the slow tier);
    pytest.param(_Uncapturable, "ngram", marks=pytest.mark.slow),  # (verify rows replayed: dflash's, K + 1 = 4)
    pytest.param(_Replayed, "dflash", marks=pytest.mark.slow),
    pytest.param(_Replayed, "none", marks=pytest.mark.slow)])
def test_batched_steps_replayed_as_graphs_give_every_request_its_solo_ids(wide_llama, graph_cls, drafter,
                                                                          tmp_path_factory, monkeypatch):
    """Steps of padded rows (ids 0 at the pool's scratch slot) and padded segments (no rows)
    replay one bucket's graph, every bucket captured before the first request (the warm-up's
    steps write only blocks it gives back); a bucket that cannot be captured runs eager. With a
    tap drafter the graph keeps the tapped layers' rows and each request's sink gets its own:
    every DFlash proposal equals the request's solo one. Plain greedy requests go one step
    ahead: a step launched behind the one before, its ids that step's argmax copied over the
    graph's packed input (batching/ahead.py)."""
    import memra_dist.batching.calibrate as calibrate
    from memra_dist.batching.graphs import PREFILL_TAIL_ROWS, StepGraphs, pieces

    monkeypatch.setattr(calibrate, "REPS", 1)  # one timed replay a bucket: in Triton's interpreter each takes seconds
    kw, seen = {}, []
    if drafter == "dflash":
        from memra_dist.demo.tiny_dflash import random_dflash
        from memra_dist.specdec.drafters.dflash import DFlashDrafter

        kw["draft_model"] = str(random_dflash(tmp_path_factory.mktemp("gdflash") / "d", wide_llama, seed=2, layers=1,
                                              block_size=4, taps=(0, 1), mask_token_id=1, heads=2, kv_heads=1,
                                              head_dim=16, intermediate_size=64))
        from test_batching import spy_proposals

        seen = spy_proposals(monkeypatch, DFlashDrafter)  # its own, and the step leader's shared forwards

    def cfg(n=12):
        return RunConfig(model=str(wide_llama), drafter=drafter, k=3, device="cpu", dtype="fp32", prefill_chunk=40,
                         max_new_tokens=n, spec_k="fixed", **kw)  # (every round's drafts against the solo run's)

    reqs = [([5, 6, 7, 8, 5, 6, 7, 8, 5, 6], 12), ([9, 3, 9, 3, 9, 3, 9], 8), (list(range(4, 50)), 10),
            ([11, 12, 13, 11, 12, 13, 11], 12), ([7, 7, 8], 9)]
    with open_engine(cfg(), capacity=96) as eng:
        solo = [eng.generate(p, cfg(n)).token_ids for p, n in reqs]
    alone, seen[:] = sorted(seen), []
    import memra_dist.kernels.paged_attention as pa

    slots, real_pa = [], pa.paged_attention  # each launch's (rows, request slots)
    monkeypatch.setattr(pa, "paged_attention", lambda q, *a, **k: slots.append((q.shape[0], k.get("segments")))
                        or real_pa(q, *a, **k))
    with open_engine(cfg(), capacity=96, max_batch=5) as eng:
        b = eng._backend.batcher
        _on_kernels(eng._backend)
        b.graphs = StepGraphs(b, b.max_tokens, graph_cls=graph_cls)
        b.ahead = True  # as on a GPU's graphed steps (plain chains only: drafter none)
        # decode rows, verify rows of K + 1 = 4, at capacity 96; each bucket's replay timed too
        # (--spec-k auto's calibration: the requests after it still get their solo ids)
        warmed, _ = b.graphs.warm(5, (1, 4), 96, timed=True)
        assert len(b.graphs.timings) == warmed and all(ns > 0 for _, ns in b.graphs.timings)
        if drafter == "none":  # and the buckets of prefill chunks of up to 64 rows (untimed: not a
            tails, _ = b.graphs.warm(5, (1, 4), 96, timed=True, tails=True)  # step's cost): the
            assert tails >= 3 and len(b.graphs.timings) == warmed  # prompts' chunks that fit replay too
            warmed += tails
        got = _all_at_once(eng, reqs, cfg)
        st = eng._backend.stats()
        g = st["graphs"]
    assert got == solo
    assert (st["ahead_steps"] > 0) == (drafter == "none" and graph_cls is _Replayed), st
    assert sorted(seen) == alone and (drafter != "dflash" or len(alone) > 10)
    if graph_cls is _Replayed:  # every step size the requests took was captured before them
        assert warmed >= 6 and g["captured"] == warmed and g["eager_buckets"] == 0, g
        assert g["replays"] > 0 and g["padded_rows"] > 0, g
        assert (g["prefill_replays"] > 0) == (drafter == "none"), g
        # a graph launches min(rows, 5) request slots; one with a prefill chunk, its segments more
        graphed = [(t, s) for t, s in slots if s is not None]
        assert graphed and all(s in (min(t, 5), min(t, 5 + pieces(PREFILL_TAIL_ROWS))) for t, s in graphed), graphed
        assert any(t > s for t, s in graphed), graphed  # steps of more rows than requests: not a slot a row
    else:
        assert g["replays"] == 0 and g["captured"] == 0 and g["eager_buckets"] >= 1, g


@pytest.mark.slow  # the Triton interpreter: every replay re-runs the step's kernels
def test_verifies_launched_ahead_on_graphed_steps_move_their_rows_on_the_device(wide_llama, tmp_path_factory,
                                                                                monkeypatch):
    """DFlash rounds drafted early over the pool's graphs, each next verify launched behind the
    verify before on the graphed steps (batching/verify_ahead.py): its rows packed from lo + 1
    and moved on the device by the acceptance found there (`Advance.apply`: the positions, the
    K/V slots through each block table, the bonus id; the drafts by DraftPatch), never read on
    the host first; every request gets its solo ids and every proposal is its solo proposal."""
    import memra_dist.batching.calibrate as calibrate
    from graph_emulator import EmulatedCapture
    from memra_dist.batching.graphs import StepGraphs
    from memra_dist.batching.verify_ahead import Advance
    from memra_dist.demo.tiny_dflash import random_dflash
    from memra_dist.specdec.drafters.dflash import DFlashDrafter
    from memra_dist.specdec.drafters.dflash_pool_graph import PoolBlockGraphs, PoolIngestGraphs
    from test_batching import spy_proposals

    monkeypatch.setattr(calibrate, "REPS", 1)
    ddir = random_dflash(tmp_path_factory.mktemp("adflash") / "d", wide_llama, seed=2, layers=1, block_size=4,
                         taps=(0, 1), mask_token_id=1, heads=2, kv_heads=1, head_dim=16, intermediate_size=64)
    seen = spy_proposals(monkeypatch, DFlashDrafter)
    moved, resolved = [0], [0]
    real_apply, real_resolve = Advance.apply, Advance.resolve
    monkeypatch.setattr(Advance, "apply", lambda self, *a: moved.__setitem__(0, moved[0] + 1) or real_apply(self, *a))
    monkeypatch.setattr(Advance, "resolve", lambda self: resolved.__setitem__(0, 1) or real_resolve(self))

    def cfg(n=12):
        return RunConfig(model=str(wide_llama), drafter="dflash", k=3, device="cpu", dtype="fp32", prefill_chunk=40,
                         max_new_tokens=n, spec_k="fixed", draft_model=str(ddir))

    reqs = [([5, 6, 7, 8, 5, 6, 7, 8, 5, 6], 14), ([9, 3, 9, 3, 9, 3, 9], 12), ([11, 12, 13, 11, 12, 13, 11], 13)]
    with open_engine(cfg(), capacity=96) as eng:
        solo = [eng.generate(p, cfg(n)).token_ids for p, n in reqs]
    alone, seen[:] = sorted(seen), []
    with open_engine(cfg(), capacity=96, max_batch=3) as eng:
        be = eng._backend
        b = be.batcher
        _on_kernels(be)
        b.graphs = StepGraphs(b, b.max_tokens, graph_cls=_Replayed)
        b.graphs.warm(3, (1, 4), 96)
        be.draft_pool.alloc(96 + 4)
        b.tap_pool.alloc(96)
        g = PoolBlockGraphs(be.tap_net, be.runner.stage, be.draft_pool, 4, 3, 1, 3, graph_cls=EmulatedCapture)
        ing = PoolIngestGraphs(be.tap_net, be.draft_pool, b.tap_pool, 4, 3, graph_cls=EmulatedCapture)
        g.warm(), ing.warm()
        be.draft_pool.graphs, be.draft_pool.ingest_graphs = g, ing
        b.verify_ahead = True  # (as on a GPU's graphed steps)
        got = _all_at_once(eng, reqs, cfg)
        assert b.wait_idle(60)
        st = be.stats()
    assert got == solo
    assert sorted(seen) == alone, (len(seen), len(alone))
    assert st["ahead_verify_steps"] > 0 and moved[0] == st["ahead_verify_steps"] and not resolved[0], (moved, st)
    assert st["kv_blocks_used"] == 0, st
