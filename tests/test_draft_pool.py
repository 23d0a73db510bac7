"""The draft caches of a batched engine's tap drafters as slots of one pool
(specdec/drafters/draft_pool.py): the pooled attention means each request's own masked
attention, the shared draft forwards run over the pool, and every slot comes back."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from memra_dist.batching.calibrate import draft_points
from memra_dist.cache import KVLayer
from memra_dist.model.attention import cached_attention
from memra_dist.model.tap_pool import TapPool, gather_rows
from memra_dist.model.taps import TapSink
from memra_dist.batching.chain import Chain
from memra_dist.specdec.drafters.draft_pool import DraftPool, pooled_attention

from test_batching import CAP, _batched, _drafter_cls, _prompts, _solo, _tap_drafter, spy_proposals


def _alone(drafter: str, llama, tmp_path_factory, monkeypatch):
    """(its checkpoint, eight requests, their solo ids, the proposals list the spy fills, their
    solo proposals sorted) for a random tiny `drafter` over `llama`; the spy then starts empty."""
    ddir = _tap_drafter(drafter, llama, tmp_path_factory)
    seen = spy_proposals(monkeypatch, _drafter_cls(drafter))
    reqs = _prompts(8)
    solo = _solo(llama, drafter, reqs, draft_model=str(ddir))
    alone, seen[:] = sorted(seen), []
    return ddir, reqs, solo, seen, alone


def _chain_graphs(b):
    """EAGLE-3's round of chains over the backend's pools as graphs of an emulated capture (K 3,
    up to 4 requests: buckets 1, 2 and 4), installed as the engine's GPU path installs them."""
    from graph_emulator import EmulatedCapture

    from memra_dist.specdec.drafters.eagle3_pool_graph import PoolChainGraphs

    b.draft_pool.alloc(CAP)
    b.batcher.tap_pool.alloc(CAP)
    net = b.tap_net
    embed = net.embed_tokens if net.embed_tokens is not None else b.runner.stage.embed_tokens
    g = PoolChainGraphs(net, embed, b.draft_pool, b.batcher.tap_pool, 3, 4, graph_cls=EmulatedCapture)
    assert g.warm() == 3
    b.draft_pool.graphs = g
    return g


def _dflash_pool_graphs(b):
    """DFlash's shared block forward and maintenance over the backend's pools as graphs of an
    emulated capture (block 4, K 3, up to 4 requests: buckets 1, 2 and 4), installed as the
    engine's GPU path installs them -> (block graphs, ingest graphs)."""
    from graph_emulator import EmulatedCapture

    from memra_dist.specdec.drafters.dflash_pool_graph import PoolBlockGraphs, PoolIngestGraphs

    b.draft_pool.alloc(CAP + 4)
    b.batcher.tap_pool.alloc(CAP)
    g = PoolBlockGraphs(b.tap_net, b.runner.stage, b.draft_pool, 4, 3, 1, 4, graph_cls=EmulatedCapture)
    ing = PoolIngestGraphs(b.tap_net, b.draft_pool, b.batcher.tap_pool, 4, 4, graph_cls=EmulatedCapture)
    assert g.warm() == 3 and ing.warm() == 3
    b.draft_pool.graphs, b.draft_pool.ingest_graphs = g, ing
    return g, ing


def _mostly_k_0(monkeypatch, llama, drafter: str, reqs, ddir, on_open):
    """`reqs` batched four at a time under --spec-k auto whose choice is stood in for: each
    request's bound for two steps, then K 0 for six -> (ids, stats)."""
    import memra_dist.batching.loop_rounds as lr

    calls = [0]

    def choose(reqs_, cost, others=None):
        calls[0] += 1
        return [bound if calls[0] % 8 < 2 else 0 for _, bound in reqs_]

    monkeypatch.setattr(lr, "choose", choose)
    return _batched(llama, drafter, reqs, max_batch=4, draft_model=str(ddir), on_open=on_open, spec_k="auto")


def _proposals_as_alone(seen, alone) -> None:
    """Most batched proposals were made at a context the request also had alone (most are), and
    each of those equals its solo proposal there."""
    solo_at = dict(alone)
    both = [(c, d) for c, d in seen if c in solo_at]
    assert len(both) >= 0.5 * len(seen) > 0, (len(both), len(seen))
    assert all(solo_at[c] == d for c, d in both), [(len(c), d, solo_at[c]) for c, d in both if solo_at[c] != d]


@pytest.mark.parametrize("block", [False, True])
def test_pooled_attention_is_each_requests_own_masked_attention(block):
    """Three requests in slots 4, 0, 2 of a pool of capacity 24, GQA (4 query heads over 2 KV
    heads): each row's output equals cached_attention over that request's cache alone under
    its own mask, causal (EAGLE-3's rows) or whole-block (DFlash's: every row reads to the
    block's end)."""
    g = torch.Generator().manual_seed(0)
    S, C, nkv, nh, hd, T = 5, 24, 2, 4, 8, 3
    kp, vp = torch.randn(S, C, nkv, hd, generator=g), torch.randn(S, C, nkv, hd, generator=g)
    slots, starts = [4, 0, 2], [9, 2, 17]
    q = torch.randn(len(slots), T, nh, hd, generator=g)
    lim = torch.tensor([[s + T] * T if block else [s + t + 1 for t in range(T)] for s in starts])
    L = max(starts) + T
    got = pooled_attention(q, kp, vp, torch.tensor(slots), lim, L)
    for r, (s, lo) in enumerate(zip(slots, starts)):
        mask = torch.arange(C)[None, :] < lim[r][:, None]  # (T, C) over its whole cache
        want = cached_attention(q[r], kp[s], vp[s], mask, nkv)
        torch.testing.assert_close(got[r], want, rtol=1e-5, atol=1e-6)


def test_a_pool_slot_is_its_requests_until_given_back():
    """take gives a request's drafter views of one slot (writes land in the pool), again the
    same slot for the same request; another row count, or a full pool, keeps caches of its own
    (None); give frees the slot for the next request."""

    class D:  # a drafter over its request's BatchSlot
        def __init__(self, owner):
            self.target = owner

    pool = DraftPool(2, 3, 1, 4, torch.device("cpu"), torch.float32)
    a, b, c = D(object()), D(object()), D(object())
    st = pool.take(a, 10)
    assert len(st) == 3 and all(isinstance(s, KVLayer) for s in st) and a.pool_slot == 0
    st[1].k[3].fill_(7.0)
    assert pool.k[1, 0, 3].eq(7.0).all() and pool.k[1, 1].eq(0).all()
    assert pool.take(D(a.target), 10) is not None and pool.take(b, 10) is not None and b.pool_slot == 1
    assert pool.take(c, 10) is None  # both slots held
    assert pool.take(D(object()), 11) is None  # another capacity: its own caches
    pool.give(a.target)
    assert pool.take(c, 10) is not None and c.pool_slot == 0


@pytest.mark.parametrize("drafter", ["dflash", "eagle3"])
def test_a_batched_engines_tap_drafters_draft_over_one_pool(llama, tmp_path_factory, drafter, monkeypatch):
    """Eight requests four at a time: every request's drafter holds a slot of the engine's pool,
    the step leader's shared draft forwards take the pooled path (one index of the requests'
    slots each), every proposal equals the request's solo one, and at the end every slot is
    free again."""
    ddir, reqs, solo, seen, alone = _alone(drafter, llama, tmp_path_factory, monkeypatch)
    pooled, pools = [], []
    index = DraftPool.index

    def counted(self, ds):
        pooled.append(len(ds))
        return index(self, ds)

    monkeypatch.setattr(DraftPool, "index", counted)
    taps = {"scatter": 0, "gather": 0}
    for name in taps:
        real = getattr(TapPool, name)

        def spy(self, *a, real=real, name=name):
            taps[name] += 1
            return real(self, *a)

        monkeypatch.setattr(TapPool, name, spy)
    batched, stats = _batched(llama, drafter, reqs, max_batch=4, draft_model=str(ddir),
                              on_open=lambda eng: pools.append(eng._backend))
    assert batched == solo and sorted(seen) == alone
    assert stats["draft_batches"] > 0 and pooled and max(pooled) >= 2, (stats, pooled)
    # every step's taps went into the tap pool in one scatter, the shared forwards gathered from it
    assert taps["scatter"] >= stats["steps"] - 1 and taps["gather"] > 0, (taps, stats)
    pool, tp = pools[0].draft_pool, pools[0].batcher.tap_pool
    assert pool.k is not None and pool.slots == 4 and pool.owners.held == 0  # every slot given back
    assert tp.bufs and tp.owners.held == 0


def test_the_shared_block_forward_replayed_drafts_what_each_request_drafts_alone(llama, tmp_path_factory,
                                                                               monkeypatch):
    """The step leader's DFlash block forward and maintenance as graphs over the draft and tap
    pools (dflash_pool_graph.py), replayed from an emulated capture (every aten op recorded
    once, re-run on the same tensors with no Python between): eight requests four at a time get
    every proposal they get alone, from replays of the bucket that holds each step's requests
    (pads in the spare slots), every shared maintenance replayed too."""
    from graph_emulator import EmulatedCapture

    from memra_dist.specdec.drafters.dflash_pool_graph import PoolBlockGraphs, PoolIngestGraphs, buckets

    from memra_dist.specdec.drafters.dflash import DFlashDrafter

    assert buckets(4) == [1, 2, 4] and buckets(6) == [1, 2, 4, 6] and buckets(2) == [1, 2] and buckets(1) == [1]
    # (each proposal's forward after its step's readback, one replay a shared forward, counted
    # below; drafted before the readback: test_a_dflash_rounds_verify_rows_are_ingested_behind_the_verify)
    monkeypatch.setattr(DFlashDrafter, "drafts_early", False)
    ddir, reqs, solo, seen, alone = _alone("dflash", llama, tmp_path_factory, monkeypatch)  # block 4, mask id 1
    made = []

    def on_open(eng):
        b = eng._backend
        b.draft_pool.alloc(CAP + 4)  # the drafters' rows: capacity + block
        g = PoolBlockGraphs(b.tap_net, b.runner.stage, b.draft_pool, 4, 3, 1, 4, graph_cls=EmulatedCapture)
        assert g.warm() == 3
        b.draft_pool.graphs = g
        b.batcher.tap_pool.alloc(CAP)
        ing = PoolIngestGraphs(b.tap_net, b.draft_pool, b.batcher.tap_pool, 4, 4, graph_cls=EmulatedCapture)
        assert ing.warm() == 3
        b.draft_pool.ingest_graphs = ing
        made.extend((g, ing))
        # --spec-k auto's calibration times each bucket (every request a pad: the requests
        # after it still draft what they draft alone, asserted below)
        pts = draft_points(b.draft_pool, 3, 4, b.device)
        assert [x for x, _ in pts] == [1 * 3, 2 * 3, 4 * 3] and all(ns > 0 for _, ns in pts), pts
        # the backend's record of it, from these drafting points and steps timed as graphs.py's warm
        # times them (on a GPU both happen as the engine opens, where --spec-k auto is on)
        steps, real = [(1, 5.04e6), (64, 7.56e6)], b.batcher.graphs
        b.batcher.graphs = SimpleNamespace(timings=steps, timing_s=0.25)
        try:
            b.calibration = b._calibrate(SimpleNamespace(cfg=SimpleNamespace(drafter="dflash", k=3),
                                                         draft=SimpleNamespace(block_size=4)))
        finally:
            b.batcher.graphs = real
        assert b.batcher.cost.line() == pytest.approx((5e6, 4e4))
        assert b.calibration["steps_timed"] == 2 and b.calibration["drafts_timed"] == 3
        assert b.calibration["step_ms"] == pytest.approx(5.0) and b.calibration["seconds"] >= 0.25

    batched, stats = _batched(llama, "dflash", reqs, max_batch=4, draft_model=str(ddir), on_open=on_open)
    assert batched == solo and sorted(seen) == alone
    assert stats["calibration"]["draft_ms"] > 0, stats.get("calibration")
    g, ing = made
    assert g.replays == stats["draft_batches"] > 0 and sorted(g.graphs) == [1, 2, 4], (g.replays, stats)
    assert ing.replays > 0, (ing.replays, g.replays)  # the shared maintenance of the chained rounds


def test_sampled_requests_draw_from_the_replayed_block_forwards_rows(llama, tmp_path_factory, monkeypatch):
    """Sampled DFlash requests take the shared block forward's graph too (dflash_pool_graph.py:
    it leaves every kept row's logits beside the argmax): each request's drafts are drawn from its
    own rows with its own generator after the replay, so every proposal (drafts and the
    distribution they were drawn from) is its solo one and the ids its solo ids; no eager shared
    forward runs."""
    import memra_dist.specdec.drafters.dflash_batch as db
    from memra_dist.specdec.sampling import SamplingParams

    reqs = _prompts(6)
    kw = dict(sampling=SamplingParams(temperature=0.8, top_k=20), seed=11,
              draft_model=str(_tap_drafter("dflash", llama, tmp_path_factory)))
    seen = spy_proposals(monkeypatch, _drafter_cls("dflash"))
    solo = _solo(llama, "dflash", reqs, **kw)
    alone, seen[:] = sorted(seen), []
    eager = [0]
    real_pooled = db._pooled

    def pooled(*a, **k):  # the eager shared forward's attention: never built where the graph replays
        eager[0] += 1
        return real_pooled(*a, **k)

    monkeypatch.setattr(db, "_pooled", pooled)
    made = []
    batched, stats = _batched(llama, "dflash", reqs, max_batch=3, on_open=lambda eng: made.append(
        _dflash_pool_graphs(eng._backend)[0]), **kw)
    assert batched == solo and sorted(seen) == alone
    assert len(alone) > 20 and made[0].replays >= stats["draft_batches"] > 0 and eager[0] == 0, (stats, eager)


@pytest.mark.parametrize("broken", [pytest.param(False, marks=pytest.mark.slow, id="compiled"),  # (inductor on CPU: ~16 s)
                                    pytest.param(True, id="compile-fails")])
def test_the_shared_dflash_block_graphs_capture_the_compiled_pieces(llama, tmp_path_factory, monkeypatch, capsys,
                                                                     broken):
    """Where --compile compiles the dflash path, the loop's shared block forward is captured with
    the network's compiled pieces (one compile, its rows dynamic, for every bucket): each request
    still gets every proposal it gets alone, and its solo ids. A piece that fails to compile
    leaves those graphs on the eager forward with one warning line, proposals unchanged."""
    from contextlib import contextmanager

    from graph_emulator import EmulatedCapture

    import memra_dist.specdec.drafters.dflash_pool_graph as dpg

    if not broken:
        pytest.importorskip("torch._inductor")
    ddir, reqs, solo, seen, alone = _alone("dflash", llama, tmp_path_factory, monkeypatch)
    used, real = [], dpg.compiled_pieces

    @contextmanager
    def pieces(net, on=True, dynamic=False):
        used.append(dynamic)
        if broken:
            raise RuntimeError("inductor: no C++ compiler\nmore lines")
        with real(net, on, dynamic):
            yield

    monkeypatch.setattr(dpg, "compiled_pieces", pieces)
    made = []

    def on_open(eng):
        b = eng._backend
        b.draft_pool.alloc(CAP + 4)
        g = dpg.PoolBlockGraphs(b.tap_net, b.runner.stage, b.draft_pool, 4, 3, 1, 4, graph_cls=EmulatedCapture,
                                compiled=True)
        assert g.warm() == 3
        b.draft_pool.graphs = g
        made.append(g)

    batched, _ = _batched(llama, "dflash", reqs, max_batch=4, draft_model=str(ddir), on_open=on_open)
    assert batched == solo and sorted(seen) == alone
    g = made[0]
    assert g.replays > 0 and used and all(used)  # every bucket's capture, its pieces compiled for any rows
    assert g.compiled is (not broken) and len(used) == (1 if broken else 3)
    err = [x for x in capsys.readouterr().err.splitlines() if "compiled pieces" in x]
    assert err == (["memra-dist: warning: the DFlash drafter's compiled pieces failed to build (inductor: no C++ "
                    "compiler); its graphs capture the eager forward"] if broken else [])


@pytest.mark.parametrize("level", [0, 1])
def test_untraced_dflash_drafts_reach_the_verify_on_the_device(llama, tmp_path_factory, monkeypatch, level):
    """The shared block forward's greedy drafts stay on the device (graphed over the pool): the
    next verify's ids take them there (step_forward.py DraftPatch) and the rounds read them back
    at their accept, so the loop packs and launches the verify while the draft runs. Each
    request gets every proposal it gets alone and its solo ids. Traced (level 1), a round's
    drafts are read back before its verify is queued (its draft phase ends with them on the
    host): nothing is patched."""
    from graph_emulator import EmulatedCapture

    import memra_dist.batching.step_forward as sf
    from memra_dist.phase.levels import TraceSettings
    from memra_dist.specdec.drafters.dflash_pool_graph import PoolBlockGraphs

    ddir, reqs, solo, seen, alone = _alone("dflash", llama, tmp_path_factory, monkeypatch)
    patched, real = [], sf.DraftPatch.apply
    monkeypatch.setattr(sf.DraftPatch, "apply", lambda self, ids: patched.append(len(self.parts)) or real(self, ids))

    def on_open(eng):
        b = eng._backend
        b.draft_pool.alloc(CAP + 4)
        g = PoolBlockGraphs(b.tap_net, b.runner.stage, b.draft_pool, 4, 3, 1, 4, graph_cls=EmulatedCapture)
        g.warm()
        b.draft_pool.graphs = g

    batched, stats = _batched(llama, "dflash", reqs, max_batch=4, draft_model=str(ddir), on_open=on_open,
                              trace=TraceSettings(level=level))
    assert batched == solo and sorted(seen) == alone
    if level == 0:
        assert stats["draft_batches"] > 0 and len(patched) >= stats["draft_batches"] // 2, (patched, stats)
    else:
        assert patched == []


def test_a_dflash_request_back_from_k_0_rounds_catches_up_in_the_replayed_ingest(llama, tmp_path_factory,
                                                                                 monkeypatch):
    """--spec-k auto at K 0 for six steps in eight: a DFlash request skips those rounds'
    maintenance, so when it drafts again it brings more rows than an entry of the ingest graph
    takes (K + 1). Its rows go in as several entries (`PoolIngestGraphs.segments`), replayed
    like a round's, never as an eager ingest; every proposal equals the request's solo one at
    that context, and the ids are the solo ids."""
    import memra_dist.batching.loop_rounds as lr
    import memra_dist.specdec.drafters.dflash_batch as db
    from memra_dist.specdec.drafters.dflash import DFlashDrafter
    from memra_dist.specdec.drafters.dflash_pool_graph import PoolIngestGraphs

    ddir, reqs, solo, seen, alone = _alone("dflash", llama, tmp_path_factory, monkeypatch)  # block 4, mask id 1
    made, longest, eager, in_loop = [], [0], [], []
    real_segments, real_ingest, real_gather = PoolIngestGraphs.segments, DFlashDrafter._ingest, db.gather_rows
    real_rounds = lr.maintain_rounds

    def segments(self, sinks, slots, ranges):
        longest[0] = max([longest[0], *(hi - lo for lo, hi in ranges)])
        return real_segments(self, sinks, slots, ranges)

    def ingest(self, upto, depth=None):  # a drafter's own eager ingest, in the loop's maintenance
        if in_loop:
            eager.append(upto - self.n)
        real_ingest(self, upto, depth)

    def gather(sinks, ranges, dev):  # the shared eager ingest
        if in_loop:
            eager.append(max(hi - lo for lo, hi in ranges))
        return real_gather(sinks, ranges, dev)

    def maintain_rounds(chains):  # (not a prime: the rounds' maintenance and its catch-ups)
        in_loop.append(1)
        try:
            return real_rounds(chains)
        finally:
            in_loop.pop()

    def on_open(eng):
        eng._backend.batcher.auto_k = True
        made.extend(_dflash_pool_graphs(eng._backend))

    monkeypatch.setattr(PoolIngestGraphs, "segments", segments)
    monkeypatch.setattr(DFlashDrafter, "_ingest", ingest)
    monkeypatch.setattr(db, "gather_rows", gather)
    monkeypatch.setattr(lr, "maintain_rounds", maintain_rounds)
    batched, stats = _mostly_k_0(monkeypatch, llama, "dflash", reqs, ddir, on_open)
    assert batched == solo
    g, ing = made
    assert longest[0] > 4 and ing.replays > 0 and g.replays > 0, (longest, ing.replays, g.replays)
    assert not eager, eager
    assert stats["pre_maintained_rounds"] > 0, stats  # (their rows ingested behind the verify, then K 0 rounds skipping)
    _proposals_as_alone(seen, alone)


@pytest.mark.parametrize("pre,early", [(True, True), (True, False), (False, False)])
def test_a_dflash_rounds_verify_rows_are_ingested_behind_the_verify(llama, tmp_path_factory, monkeypatch, pre, early):
    """Untraced DFlash rounds over the pool's graphs: right behind each verify, before its
    readback, every verify row's taps go into the request's draft slot, the rejected drafts'
    too (dflash_batch.py pre_ingest_many); the maintenance after the accept then ingests
    nothing, since the rows past the accepted ones are written again by the next block forward
    before it reads them. `early`: the next round's drafts are made there too, the acceptance
    found on the device (draft_early_many), and the proposal after the accept takes them: the
    block graphs replay after the readback only for the rounds not drafted early. Every
    proposal equals the request's solo proposal and the ids are the solo ids, with each of
    these on and off (`DFlashDrafter.pre_maintains`, `drafts_early`)."""
    import memra_dist.batching.loop_rounds as lr
    from memra_dist.specdec.drafters.dflash import DFlashDrafter
    from memra_dist.specdec.drafters.dflash_pool_graph import PoolBlockGraphs, PoolIngestGraphs

    monkeypatch.setattr(DFlashDrafter, "pre_maintains", pre)
    monkeypatch.setattr(DFlashDrafter, "drafts_early", early)
    late = [0]  # block forwards replayed after a readback (the proposals' own)
    real_greedy = PoolBlockGraphs.greedy

    def greedy(self, *a, **k):
        late[0] += 1
        return real_greedy(self, *a, **k)

    monkeypatch.setattr(PoolBlockGraphs, "greedy", greedy)
    ddir, reqs, solo, seen, alone = _alone("dflash", llama, tmp_path_factory, monkeypatch)
    made, in_maint, maint_replays = [], [], [0]
    real_rounds, real_ingest = lr.maintain_rounds, PoolIngestGraphs.ingest

    def maintain_rounds(chains):
        in_maint.append(1)
        try:
            return real_rounds(chains)
        finally:
            in_maint.pop()

    def ingest(self, segs):
        maint_replays[0] += bool(in_maint)
        return real_ingest(self, segs)

    def on_open(eng):
        made.extend(_dflash_pool_graphs(eng._backend))

    monkeypatch.setattr(lr, "maintain_rounds", maintain_rounds)
    monkeypatch.setattr(PoolIngestGraphs, "ingest", ingest)
    batched, stats = _batched(llama, "dflash", reqs, max_batch=4, draft_model=str(ddir), on_open=on_open)
    assert batched == solo and sorted(seen) == alone
    if pre:
        assert stats["pre_maintained_rounds"] > 0.5 * stats["chained_rounds"], stats
        # the maintenance replays only for rounds not pre-maintained (on the CPU: 142 of 149
        # rounds were, and the maintenance replayed nothing; 48 times with it off)
        assert maint_replays[0] < 0.2 * stats["draft_batches"], (maint_replays, stats)
    else:
        assert stats["pre_maintained_rounds"] == 0 and maint_replays[0] > 0.5 * stats["draft_batches"], (maint_replays, stats)
    if early:  # most proposals were drafted before the readback; those after it are new requests' and the odd rest
        assert stats["early_drafted_rounds"] > 0.5 * stats["chained_rounds"], stats
        assert late[0] < 0.5 * stats["draft_batches"], (late, stats)
    else:
        assert stats["early_drafted_rounds"] == 0 and late[0] >= stats["draft_batches"] > 0, (late, stats)


def test_pooled_tap_sinks_scatter_and_gather_as_their_own_sinks():
    """Three requests' sinks in a pool of 3 (+ the spare): one scatter of a step's rows (a
    request without taps among them goes to the spare slot) writes what each request's own
    sink's `write` would, and one gather returns what `cat(sink.rows(lo, hi))` returns."""
    g = torch.Generator().manual_seed(1)
    layers, C, H = (2, 0), 12, 5
    pool = TapPool(layers, 3, H, torch.device("cpu"), torch.float32)
    owners = [object() for _ in range(3)]
    sinks = [pool.sink(o, C) for o in owners]
    own = [TapSink.alloc(layers, C, H, "cpu", torch.float32) for _ in owners]
    assert [s.pool_slot for s in sinks] == [0, 1, 2] and pool.sink(object(), C) is None  # full
    assert pool.sink(owners[1], C).pool_slot == 1 and pool.sink(owners[1], C + 1) is None  # its slot; another capacity
    # a step: request 1 rows 3..6, a request without taps 2 rows, request 0 rows 0..2, request 2 row 7
    starts, ns, who = [3, 0, 0, 7], [4, 2, 3, 1], [1, None, 0, 2]
    rows = sum(ns)
    tapped = {t: torch.randn(rows, H, generator=g) for t in layers}
    slots = [sinks[w].pool_slot if w is not None else pool.scratch for w, n in zip(who, ns) for _ in range(n)]
    at = [p if w is not None else 0 for w, s, n in zip(who, starts, ns) for p in range(s, s + n)]
    pool.scatter(torch.tensor(slots), torch.tensor(at), tapped)
    lo = 0
    for w, s, n in zip(who, starts, ns):
        if w is not None:
            for t in layers:
                own[w].write(t, torch.arange(s, s + n), tapped[t][lo:lo + n])
        lo += n
    for s, o in zip(sinks, own):
        for t in layers:
            assert torch.equal(s.bufs[t], o.bufs[t])
    ranges = [(0, 3), (3, 7), (7, 8)]
    got = gather_rows(sinks, ranges, torch.device("cpu"))
    assert torch.equal(got, torch.cat([o.rows(lo, hi) for o, (lo, hi) in zip(own, ranges)]))
    pool.give(owners[0])
    assert pool.sink(object(), C).pool_slot == 0


@pytest.mark.parametrize("early", [False, True])
def test_the_batched_eagle3_chains_replayed_draft_what_each_request_drafts_alone(llama, tmp_path_factory,
                                                                               monkeypatch, early):
    """A step's EAGLE-3 chains as one graph over the draft and tap pools (eagle3_pool_graph.py),
    replayed from an emulated capture: the first forward over every request's new rows (padded
    to K + 1) and K chained steps; eight requests four at a time get every proposal they get
    alone, most rounds from a replay (near its end a request asks for fewer drafts than its
    chain would run past its cache: those rounds run the eager chains). `early`
    (`Eagle3Drafter.drafts_early`): most rounds are drafted right behind their verify, before its
    readback, the acceptance found on the device (eagle3_batch.py draft_early_many), and the
    proposal after the accept takes them: few replays are left after the readback."""
    from memra_dist.specdec.drafters.eagle3 import Eagle3Drafter
    from memra_dist.specdec.drafters.eagle3_pool_graph import PoolChainGraphs

    monkeypatch.setattr(Eagle3Drafter, "drafts_early", early)
    late, real_greedy = [0], PoolChainGraphs.greedy

    def greedy(self, reqs_):
        late[0] += 1
        return real_greedy(self, reqs_)

    monkeypatch.setattr(PoolChainGraphs, "greedy", greedy)
    ddir, reqs, solo, seen, alone = _alone("eagle3", llama, tmp_path_factory, monkeypatch)
    made = []

    def on_open(eng):
        b = eng._backend
        made.append(_chain_graphs(b))
        pts = draft_points(b.draft_pool, 3, None, b.device)  # (timed: calibrate.py)
        assert [x for x, _ in pts] == [1 * 3, 2 * 3, 4 * 3] and all(ns > 0 for _, ns in pts), pts

    late[0] = 0
    batched, stats = _batched(llama, "eagle3", reqs, max_batch=4, draft_model=str(ddir), on_open=on_open)
    assert batched == solo and sorted(seen) == alone
    if not early:
        assert stats["early_drafted_rounds"] == 0, stats
        assert stats["draft_batches"] >= made[0].replays == late[0] > stats["draft_batches"] // 2, (made[0].replays, stats)
    else:
        assert stats["early_drafted_rounds"] > 0.5 * stats["chained_rounds"], stats
        assert late[0] < 0.5 * stats["draft_batches"] and made[0].replays > late[0], (late, made[0].replays, stats)


def test_a_lone_eagle3_request_replays_the_chains_bucket_of_one(llama, tmp_path_factory, monkeypatch):
    """A request alone is a batch of one (`generate`'s engine: the loop at --max-batch 1): its
    EAGLE-3 rounds replay the pool's chain graphs (an emulated capture of the one bucket), and
    its ids are plain decoding's."""
    from graph_emulator import EmulatedCapture

    from memra_dist.specdec.drafters.eagle3_pool_graph import PoolChainGraphs

    ddir = _tap_drafter("eagle3", llama, tmp_path_factory)
    reqs = _prompts(3)
    plain = _solo(llama, "none", reqs)
    made = []

    def on_open(eng):
        b = eng._backend
        b.draft_pool.alloc(CAP)
        b.batcher.tap_pool.alloc(CAP)
        net = b.tap_net
        embed = net.embed_tokens if net.embed_tokens is not None else b.runner.stage.embed_tokens
        g = PoolChainGraphs(net, embed, b.draft_pool, b.batcher.tap_pool, 3, 1, graph_cls=EmulatedCapture)
        assert g.warm() == 1  # the one bucket: one request
        b.draft_pool.graphs = g
        made.append(g)

    got, stats = _batched(llama, "eagle3", reqs, max_batch=1, draft_model=str(ddir), on_open=on_open)
    assert got == plain
    assert stats["chained_rounds"] > 0 and made[0].replays > stats["draft_batches"] // 2 > 0, (made[0].replays, stats)


def test_an_eagle3_request_back_from_k_0_rounds_catches_up_and_still_replays_the_round(llama, tmp_path_factory,
                                                                                      monkeypatch):
    """--spec-k auto at K 0 for six steps in eight: an EAGLE-3 request skips those rounds' drafts,
    so when it drafts again it brings more committed rows than the round's graph takes (K + 1).
    Those rows' K/V go in first (`_prime_kv`, no output read; the step's requests that do so
    together in one forward) and the round still replays the graph, instead of every request of
    the step running the eager chains (24 ms a step at 16 requests on an H200); every proposal
    equals the request's solo one at that context."""
    import memra_dist.specdec.drafters.eagle3_batch as eb
    from memra_dist.specdec.drafters.eagle3 import Eagle3Drafter

    ddir, reqs, solo, seen, alone = _alone("eagle3", llama, tmp_path_factory, monkeypatch)
    made, caught, together = [], [], []
    real_prime_kv = Eagle3Drafter._prime_kv

    def prime_kv(self, context, lo, hi):
        if len(context) > 0 and getattr(self, "_primed", False):  # (a catch-up, not the prime)
            caught.append(hi - lo)
        real_prime_kv(self, context, lo, hi)

    real_prime = Eagle3Drafter.prime

    def prime(self, prompt, chunks=None):
        real_prime(self, prompt, chunks)
        self._primed = True

    def on_open(eng):
        eng._backend.batcher.auto_k = True
        made.append(_chain_graphs(eng._backend))

    real_many = eb._prime_kv_many

    def prime_kv_many(ds, contexts, ranges):  # several requests' catch-ups at once: one forward
        if len(ds) > 1 and all(getattr(d, "_primed", False) for d in ds):
            together.append(len(ds))
            caught.extend(hi - lo for lo, hi in ranges)
        real_many(ds, contexts, ranges)

    monkeypatch.setattr(Eagle3Drafter, "_prime_kv", prime_kv)
    monkeypatch.setattr(Eagle3Drafter, "prime", prime)
    monkeypatch.setattr(eb, "_prime_kv_many", prime_kv_many)
    batched, stats = _mostly_k_0(monkeypatch, llama, "eagle3", reqs, ddir, on_open)
    assert batched == solo
    assert caught and made[0].replays >= stats["draft_batches"] // 2 > 0, (caught, made[0].replays, stats)
    assert together, caught  # requests back from K 0 in one step caught up in one forward
    _proposals_as_alone(seen, alone)


@pytest.mark.parametrize("block", [False, True])
def test_the_paged_pool_attention_means_the_pooled_attention(block):
    """The pool graphs' attention on the paged kernel (each slot one block of the flattened
    pool, each row a query at its limit - 1) equals `pooled_attention` for the same requests:
    DFlash's whole-block limits and EAGLE-3's causal ones, GQA, a slot's rows past the limits
    holding garbage it must not read."""
    from memra_dist.specdec.drafters.draft_pool import paged_pool_attention

    g = torch.Generator().manual_seed(1)
    S, C, nkv, nh, hd, T = 5, 40, 2, 4, 16, 4
    kp, vp = torch.randn(S, C, nkv, hd, generator=g), torch.randn(S, C, nkv, hd, generator=g)
    idx, starts = torch.tensor([4, 0, 2]), [9, 2, 30]
    q = torch.randn(3, T, nh, hd, generator=g)
    if block:  # every row reads to its block's end
        lim = torch.tensor([[s + T] * T for s in starts])
    else:  # causal
        lim = torch.tensor([[s + t + 1 for t in range(T)] for s in starts])
    ref = pooled_attention(q, kp, vp, idx, lim, C)
    torch.testing.assert_close(paged_pool_attention(q, kp, vp, idx, lim, C), ref, rtol=1e-5, atol=1e-5)


class _Rerun:
    """A CUDA graph's contract on CPU for graphs that launch Triton kernels (the interpreter's
    launches are not aten ops graph_emulator could record): fn runs at capture (its output the
    static buffer) and again at every replay, into that buffer."""

    def __init__(self, fn, pool):
        self.fn = fn
        out = fn()
        self.out = tuple(t.clone() for t in out) if isinstance(out, tuple) else out.clone()

    def replay(self) -> None:
        out = self.fn()
        for dst, src in zip(*((self.out, out) if isinstance(out, tuple) else ((self.out,), (out,)))):
            dst.copy_(src)


@pytest.mark.slow  # the Triton interpreter: ~10-20 s on 2 cores
# (DFlash on a GPU's kernels is always fused, so its unfolded paged arm never runs; EAGLE-3's is
# where its kernels' probe refuses the head)
@pytest.mark.parametrize("drafter,folded", [("dflash", True), ("eagle3", False), ("eagle3", True)])
def test_the_pool_graphs_on_the_paged_kernel_draft_what_each_request_drafts_alone(llama, tmp_path_factory,
                                                                               monkeypatch, drafter, folded):
    """The shared draft forwards' graphs with their attention on the paged kernel (`paged=True`:
    what a GPU's fast path builds, at any capacity): eight requests four at a time get every
    proposal they get alone, the attention of every replay one paged launch a layer reading each
    request's slot through its one-block table. `folded`: the network fused / installed as the
    engine's GPU path does (a bucket of up to 64 rows then runs its norms, projections and FFN on
    our row GEMMs, the K/V written by the rotary kernel: `DFlashNet.block(folded=True)`,
    `Eagle3Net.step_folded`), every replay through them."""
    import memra_dist.kernels.paged_attention as pa
    from memra_dist.kernels.ops import install_eagle3
    from memra_dist.model.dflash import DFlashNet
    from memra_dist.model.eagle3 import Eagle3Net

    from memra_dist.specdec.drafters.dflash_pool_graph import PoolBlockGraphs
    from memra_dist.specdec.drafters.eagle3_pool_graph import PoolChainGraphs

    ddir, reqs, solo, seen, alone = _alone(drafter, llama, tmp_path_factory, monkeypatch)  # dflash: block 4, mask 1
    made, launches, real = [], [], pa.paged_attention
    monkeypatch.setattr(pa, "paged_attention", lambda q, kp, *a, **kw: launches.append(a[4].shape) or real(q, kp, *a, **kw))

    folds = []
    if folded:  # count the forwards that ran folded (the pools' whole buckets: every one of them)
        if drafter == "dflash":
            blk = DFlashNet.block
            monkeypatch.setattr(DFlashNet, "block", lambda self, *a, **kw: folds.append(kw.get("folded")) or blk(self, *a, **kw))
        else:
            st = Eagle3Net.step_folded
            monkeypatch.setattr(Eagle3Net, "step_folded", lambda self, *a, **kw: folds.append(True) or st(self, *a, **kw))

    def on_open(eng):
        b = eng._backend
        if folded:
            assert b.tap_net.fuse() is None if drafter == "dflash" else install_eagle3(b.tap_net)
        if drafter == "dflash":
            b.draft_pool.alloc(CAP + 4)
            g = PoolBlockGraphs(b.tap_net, b.runner.stage, b.draft_pool, 4, 3, 1, 4, graph_cls=_Rerun, paged=True)
        else:
            b.draft_pool.alloc(CAP)
            b.batcher.tap_pool.alloc(CAP)
            net = b.tap_net
            embed = net.embed_tokens if net.embed_tokens is not None else b.runner.stage.embed_tokens
            g = PoolChainGraphs(net, embed, b.draft_pool, b.batcher.tap_pool, 3, 4, graph_cls=_Rerun, paged=True)
        assert g.warm() == 3
        b.draft_pool.graphs = g
        made.append(g)

    batched, stats = _batched(llama, drafter, reqs, max_batch=4, draft_model=str(ddir), on_open=on_open)
    assert batched == solo and sorted(seen) == alone
    assert made[0].replays > 0 and launches and all(t[1] == 1 for t in launches), (made[0].replays, launches[:3])
    assert made[0].fold_rows == (64 if folded else 0)
    if folded:  # every graph forward folded (the solo drafter's eager rounds never fold on CPU)
        assert folds and all(folds), folds[:8]


def test_a_draft_patch_writes_each_jobs_device_drafts_over_its_rows():
    """DraftPatch (step_forward.py): a step's jobs whose drafts are still on the device, from two
    shared draft forwards, beside jobs with host ids: each such job's rows 1 .. n - 1 take its
    own drafts, the others' rows are left as packed; `host_ids` reads them back the same."""
    from memra_dist.batching.job import Job
    from memra_dist.batching.step_forward import DraftPatch
    from memra_dist.specdec.drafters.base import Proposal
    from memra_dist.specdec.drafters.dflash_pool_graph import DeviceDrafts

    a = DeviceDrafts(torch.tensor([[11, 12, 13], [21, 22, 23], [31, 32, 33]]))
    b = DeviceDrafts(torch.tensor([[41, 42, 43]]))
    jobs = [Job(0, [7, 0, 0, 0], 5, 64, False, drafts=Proposal(dev=(a, 1, 3))), Job(1, [8, 9], 3, 64, False),
            Job(2, [6, 0, 0], 2, 64, False, drafts=Proposal(dev=(b, 0, 2))),
            Job(3, [5, 0], 9, 64, False, drafts=Proposal(dev=(a, 2, 1))),
            Job(4, list(range(40, 45)), 0, 64, True)]
    ids = torch.tensor([x for j in jobs for x in j.ids])
    DraftPatch.of(jobs).apply(ids)
    assert ids.tolist() == [7, 21, 22, 23, 8, 9, 6, 41, 42, 5, 31, 40, 41, 42, 43, 44]
    assert [j.host_ids() for j in jobs][:4] == [[7, 21, 22, 23], [8, 9], [6, 41, 42], [5, 31]]
    assert all(j.drafts is None for j in jobs) and DraftPatch.of(jobs) is None


def test_a_dflash_drafter_without_a_pool_slot_drafts_alone_beside_the_pooled_ones(llama, tmp_path_factory,
                                                                                     monkeypatch):
    """A batched engine's DFlash drafter that finds no slot in the draft pool (draft_pool.py
    `take`: None) keeps caches of its own; the step leader's shared forwards then ingest and
    propose for its group one by one (dflash_batch.py), and every request still gets every
    proposal it gets alone and its solo ids."""
    ddir, reqs, solo, seen, alone = _alone("dflash", llama, tmp_path_factory, monkeypatch)
    real, calls = DraftPool.take, [0]

    def take(self, drafter, rows):
        calls[0] += 1
        return None if calls[0] % 3 == 2 else real(self, drafter, rows)  # every third drafter: no slot

    monkeypatch.setattr(DraftPool, "take", take)
    batched, stats = _batched(llama, "dflash", reqs, max_batch=4, draft_model=str(ddir))
    assert batched == solo
    assert set(seen) == set(alone)  # (a proposal made alone inside a shared one is seen twice: once each)
    assert calls[0] >= 3 and stats["draft_batches"] > 0, (calls, stats)


def test_a_failing_early_draft_leaves_the_rounds_to_their_usual_proposal(llama, tmp_path_factory, monkeypatch, capfd):
    """The next drafts made before the readback are an optimisation: where that shared forward
    raises, its drafters forget what was made ahead, each round is proposed after its accept as
    before (the ids still solo's), and one warning line says so, once."""
    import memra_dist.batching.chain_drafts as cd
    from memra_dist.specdec.drafters.dflash import DFlashDrafter

    def broken(drafters, verify, pred, ids):
        raise RuntimeError("no early drafts today")

    monkeypatch.setattr(cd, "_WARNED", set())
    monkeypatch.setattr(DFlashDrafter, "draft_early_many", staticmethod(broken))
    ddir, reqs, solo, seen, alone = _alone("dflash", llama, tmp_path_factory, monkeypatch)
    batched, stats = _batched(llama, "dflash", reqs, max_batch=4, draft_model=str(ddir),
                              on_open=lambda eng: _dflash_pool_graphs(eng._backend))
    assert batched == solo and sorted(seen) == alone
    assert stats["early_drafted_rounds"] == 0 and stats["pre_maintained_rounds"] > 0, stats
    err = capfd.readouterr().err
    assert err.count("[memra] early drafting failed (RuntimeError: no early drafts today); rounds drafted after "
                     "their accept") == 1, err


def test_a_replayed_tap_drafters_verify_launched_ahead_runs_the_replays_drafts(llama, tmp_path_factory, monkeypatch):
    """The bench's TapReplay (the real DFlash drafter paid in full, its drafts replaced by a
    recorded continuation corrupted at 0.3) with each next verify launched ahead: the replay's
    drafts for the round after the device's acceptance are gathered on the device from each
    position's draw (ReplayDrafter.drafted), so every request gets its solo ids, each round's
    drafts are the replay's at its context (some accepted, some not), and most steps went ahead."""
    from memra_dist.bench.batching import _tap_replay
    from memra_dist.specdec.drafters.replay import ReplayDrafter

    ddir, reqs, solo, seen, alone = _alone("dflash", llama, tmp_path_factory, monkeypatch)
    prompts = [p for p, _ in reqs]
    recorded = solo  # (each request's generated ids)
    replays = {tuple(p): ReplayDrafter(r, len(p), 128, 0.3, seed=1) for p, r in zip(prompts, recorded)}
    ran = []
    real_settle = Chain.settle

    def settle(self, job):  # each round's drafts are the replay's at its context
        if job.n > 1:
            ran.append((tuple(self.tokens), job.host_ids()[1:]))
        return real_settle(self, job)

    monkeypatch.setattr(Chain, "settle", settle)

    def on_open(eng):
        _dflash_pool_graphs(eng._backend)
        eng._backend.batcher.verify_ahead = True
        _tap_replay(eng, prompts, recorded, 128, 0.3)

    batched, stats = _batched(llama, "dflash", reqs, max_batch=4, draft_model=str(ddir), on_open=on_open)
    assert batched == solo
    same = 0
    for context, drafts in ran:
        rp = next(r for p, r in replays.items() if context[:len(p)] == p)
        want = rp.drafted[len(context) - rp.prompt_len:][:len(drafts)]
        assert drafts[:len(want)] == want, (len(context), drafts, want)
        same += sum(a == b for a, b in zip(want, rp.recorded[len(context) - rp.prompt_len:]))
    assert 0 < same < sum(len(d) for _, d in ran)  # drafts the target accepts, and corrupted ones
    assert len(ran) > 0.8 * stats["chained_rounds"], (len(ran), stats)
    assert stats["ahead_verify_steps"] > 0.3 * stats["steps"], stats


@pytest.mark.parametrize("drafter,auto", [("dflash", False), ("eagle3", False), ("dflash", True), ("eagle3", True)])
def test_verifies_launched_before_the_round_before_is_read_back_get_solo_proposals_and_ids(
        llama, tmp_path_factory, monkeypatch, drafter, auto):
    """Untraced greedy rounds drafted early over the pool's graphs, each next verify launched
    right behind the verify before, before its readback (batching/verify_ahead.py: its rows
    packed from lo + 1, moved by the acceptance found on the device; on the CPU read on the
    host, the eager step's path): eight requests four at a time get every id they get alone and
    every proposal (fixed K: all of them; `auto`: --spec-k auto's choice stood in for, K 0 for
    some requests in most steps, whose plain rows ride the steps launched ahead beside the
    verifies: those made at a context the request also had alone); most steps went ahead, and
    the pool gets every block back."""
    import memra_dist.batching.loop_rounds as lr
    import memra_dist.batching.verify_ahead as va

    adopted, plain = [], [0]
    real_plan = va.plan_verify_ahead

    def plan(b, take):
        nxt = real_plan(b, take)
        if nxt is not None:
            adopted.append(len(nxt))
            plain[0] += sum(j.ahead is None for j in nxt)
        return nxt

    monkeypatch.setattr("memra_dist.batching.batcher.plan_verify_ahead", plan)
    if auto:
        calls = [0]

        def choose(reqs_, cost, others=None):  # K 0 for one request in three, in turn
            calls[0] += 1
            return [0 if (calls[0] + i) % 3 == 0 else bound for i, (_, bound) in enumerate(reqs_)]

        monkeypatch.setattr(lr, "choose", choose)
    ddir, reqs, solo, seen, alone = _alone(drafter, llama, tmp_path_factory, monkeypatch)

    def on_open(eng):
        b = eng._backend
        if drafter == "dflash":
            _dflash_pool_graphs(b)
        else:
            _chain_graphs(b)
        b.batcher.verify_ahead = True

    batched, stats = _batched(llama, drafter, reqs, max_batch=4, draft_model=str(ddir), on_open=on_open,
                              **({"spec_k": "auto"} if auto else {}))
    assert batched == solo
    if auto:
        _proposals_as_alone(seen, alone)
        assert plain[0] > 0 and stats["k_chosen"].get("0", 0) > 0, (plain, stats)
    else:
        assert sorted(seen) == alone
    assert stats["ahead_verify_steps"] == len(adopted) > 0.3 * stats["steps"], (len(adopted), stats)
    assert stats["kv_blocks_used"] == 0, stats


def test_a_request_ending_at_an_eos_drops_its_verify_launched_ahead(llama, tmp_path_factory, monkeypatch):
    """A checkpoint whose EOS is a token the requests produce mid-way: DFlash requests end at it
    while their next verify already runs, launched ahead (batching/verify_ahead.py); those rows
    are dropped (counted), and every request gets its solo ids, ending at the EOS as alone, and
    gives its blocks back."""
    import json
    import shutil

    ddir = _tap_drafter("dflash", llama, tmp_path_factory)
    reqs = _prompts(8)
    plain = _solo(llama, "dflash", reqs, draft_model=str(ddir))
    eos = next(t for out in plain for t in out[3:-2])  # a token some request makes mid-way
    ck = tmp_path_factory.mktemp("eos") / "m"
    shutil.copytree(llama, ck)
    cfg = json.loads((ck / "config.json").read_text())
    cfg["eos_token_id"] = int(eos)
    (ck / "config.json").write_text(json.dumps(cfg))
    solo = _solo(ck, "dflash", reqs, draft_model=str(ddir))
    assert any(len(s) < n + 1 and s[-1] == eos for s, (_, n) in zip(solo, reqs))  # some end at the EOS

    def on_open(eng):
        _dflash_pool_graphs(eng._backend)
        eng._backend.batcher.verify_ahead = True

    got, stats = _batched(ck, "dflash", reqs, max_batch=4, draft_model=str(ddir), on_open=on_open)
    assert got == solo
    assert stats["ahead_verify_steps"] > 0 and stats["void_rows"] >= 1, stats
    assert stats["kv_blocks_used"] == 0, stats


def test_a_verify_launched_ahead_where_the_host_accepted_otherwise_fails_its_request(llama, tmp_path_factory,
                                                                                    monkeypatch):
    """Were the host ever to accept a round otherwise than the device did (here: the host's
    acceptance made to drop one accepted draft, once; the bench's replay of each request's own
    continuation, so the device accepts every draft), the verify launched ahead for the round
    after it ran at positions the host did not accept: that request fails with one error naming
    it rather than commit what those rows gave; the others keep their solo ids, and every block
    comes back."""
    import threading

    import memra_dist.batching.chain as chain_mod
    from memra_dist.app import open_engine
    from memra_dist.bench.batching import _tap_replay
    from test_batching import _cfg

    ddir = _tap_drafter("dflash", llama, tmp_path_factory)
    reqs = _prompts(6)
    solo = _solo(llama, "dflash", reqs, draft_model=str(ddir))
    real, hit, armed = chain_mod.commit_rows, [], [False]
    real_settle = Chain.settle

    def settle(self, job):  # a round whose next verify already runs, launched ahead
        armed[0] = self.inflight is not None and self.inflight.ahead is not None
        return real_settle(self, job)

    def commit_rows(pred, drafts, val):
        new = real(pred, drafts, val)
        if armed[0] and not hit and len(new) > 2:
            hit.append(1)
            return new[:-1]  # (one accepted draft fewer than the device found)
        return new

    monkeypatch.setattr(Chain, "settle", settle)
    monkeypatch.setattr(chain_mod, "commit_rows", commit_rows)
    got, errors = {}, {}
    with open_engine(_cfg(llama, "dflash", draft_model=str(ddir)), capacity=CAP, max_batch=4) as eng:
        _dflash_pool_graphs(eng._backend)
        eng._backend.batcher.verify_ahead = True
        _tap_replay(eng, [p for p, _ in reqs], solo, 128, 0.0)

        def one(i, p, n):
            try:
                got[i] = eng.generate(p, _cfg(llama, "dflash", max_new_tokens=n, draft_model=str(ddir))).token_ids
            except RuntimeError as e:
                errors[i] = e

        threads = [threading.Thread(target=one, args=(i, p, n)) for i, (p, n) in enumerate(reqs)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert eng._backend.batcher.wait_idle(60)
        stats = eng._backend.stats()
    assert hit and len(errors) == 1, (hit, errors)
    assert "ran where the device accepted the round before, not the host" in str(next(iter(errors.values())))
    assert all(got[i] == solo[i] for i in got) and len(got) == len(reqs) - 1
    assert stats["ahead_verify_steps"] > 0 and stats["kv_blocks_used"] == 0, stats
