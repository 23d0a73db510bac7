"""The DFlash block forward's graph (specdec/drafters/dflash_graph.py), checked on the CPU with an
emulated capture (graph_emulator.py): captured once per row count at one block start, then
replayed at later starts with no Python in between, it gives the eager block_logits exactly
(fp32), as the context grows through ingests; and a greedy session drafting through the
replayed graph equals one drafting eagerly (ids, drafted and accepted counts).

The maintenance ingest's graphs likewise: captured once per row count (1 .. B) at one start,
replayed at later starts they write exactly the eager `_ingest`'s K/V (every layer, every
row); a session whose drafter builds its graphs at alloc (as on CUDA) keeps the prime eager,
ingests every round through the graphs and equals eager; a new tap sink drops the graphs."""

from __future__ import annotations

import torch

from graph_emulator import EmulatedCapture
from memra_dist.bench.tap_checkpoints import ensure_dflash
from memra_dist.model.dflash import load_dflash_config
from memra_dist.runner import ModelRunner
from memra_dist.specdec.drafters import dflash as dflash_mod
from memra_dist.specdec.drafters.dflash import DFlashDrafter
from memra_dist.specdec.drafters.dflash_graph import BlockGraphs
from memra_dist.specdec.sampling import SamplingParams
from memra_dist.specdec.session import SpecSession

CPU, CAP = torch.device("cpu"), 160


_Emulated = EmulatedCapture


def _setup(tmp_path):
    target_dir, draft_dir = ensure_dflash("tiny", tmp_path, CPU, lambda s: None)
    target = ModelRunner(target_dir, CPU, torch.float32, max_pos=CAP)
    d = DFlashDrafter.load(draft_dir, load_dflash_config(draft_dir), target)
    return target, d


def _primed(tmp_path, n: int, seed: int):
    """Target and drafter allocated, the first n of 40 random ids run and ingested."""
    target, d = _setup(tmp_path)
    target.alloc(CAP)
    d.alloc(CAP)
    ids = torch.randint(3, 500, (40,), generator=torch.Generator().manual_seed(seed))
    target.forward(ids[:n], 0)
    d.prime(ids[:n].tolist())
    return target, d, ids


def test_replayed_block_equals_eager_at_every_start(tmp_path):
    target, d = _setup(tmp_path)
    target.alloc(CAP)
    d.alloc(CAP)
    assert d.graph is None  # CPU: the eager forward, the reference
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 500, (80,), generator=g)
    P = 20
    target.forward(ids[:P], 0)
    d.prime(ids[:P].tolist())
    graphs = BlockGraphs(d, graph_cls=_Emulated)
    before = _Emulated.captures
    n = P
    for step, rows in enumerate((15, 15, 7, 15, 7, 15)):
        add = 1 + step % 3  # rows committed this round (as after a verify)
        target.forward(ids[n:n + add], n)
        n += add
        d._ingest(n - 1)
        last, start = int(ids[n - 1]), n - 1
        eager = d.block_logits(last, start, rows).clone()
        replayed = graphs.logits(last, start, rows).clone()
        assert torch.equal(eager, replayed), (step, (eager - replayed).abs().max())
        assert torch.equal(graphs.greedy(last, start, rows), eager.argmax(-1))  # the graph's own argmax
    assert _Emulated.captures - before == 2  # one per row count, replayed at every later start


def test_session_drafting_through_the_graph_equals_eager(tmp_path):
    target, d = _setup(tmp_path)
    prompt = torch.randint(3, 500, (24,), generator=torch.Generator().manual_seed(5)).tolist()

    def run(graphed: bool):
        s = SpecSession(target, d, SamplingParams(), torch.Generator().manual_seed(0), 15)
        out = [s.start(prompt, 40, CAP)]
        if graphed:
            d.graph = BlockGraphs(d, graph_cls=_Emulated)  # after alloc, as dflash.alloc builds it on CUDA
        while not s.done:
            out.extend(s.burst(4))
        d.graph = None
        return out, s.stats.drafted, s.stats.accepted

    eager = run(False)
    before = _Emulated.captures
    assert run(True) == eager
    assert _Emulated.captures > before and eager[1] > 0  # the graph drafted every round


def _states_equal(a, b, upto):
    return all(torch.equal(x.k[:upto], y.k[:upto]) and torch.equal(x.v[:upto], y.v[:upto])
               for x, y in zip(a.states, b.states))


def test_replayed_ingest_writes_the_eager_kv_at_every_start(tmp_path):
    target, eager = _setup(tmp_path)
    graphed = DFlashDrafter(eager.net, target)  # the same network, its own K/V
    target.alloc(CAP)
    eager.alloc(CAP)
    graphed.alloc(CAP)
    ids = torch.randint(3, 500, (CAP,), generator=torch.Generator().manual_seed(7))
    P = 20
    target.forward(ids[:P], 0)
    eager.prime(ids[:P].tolist())
    graphed.prime(ids[:P].tolist())
    graphs = BlockGraphs(graphed, graph_cls=_Emulated)
    before = _Emulated.captures
    n, B = P, eager.B
    adds = (1, 3, 16, 1, 5, 3, 16, 2, 1, 5, 2, 8, 8, 1)  # repeats: replays at later starts
    for step, add in enumerate(adds):
        target.forward(ids[n:n + add], n)  # the verify writes the taps of the committed rows
        n += add
        eager._ingest(n)
        assert graphs.ingests_rows(n - graphed.n)
        graphs.ingest(graphed.n, n)
        graphed.n = n
        assert _states_equal(eager, graphed, CAP), step  # the ingested rows, and nothing else touched
    assert _Emulated.captures - before == len(set(adds))  # one per row count
    assert set(graphs.ingests) == set(adds) and not graphs.ingests_rows(B + 1) and not graphs.ingests_rows(0)
    # the block forward over the graph-ingested context equals the eager one
    assert torch.equal(eager.block_logits(int(ids[n - 1]), n - 1, 15), graphed.block_logits(int(ids[n - 1]), n - 1, 15))


def test_session_through_the_alloc_built_graphs_equals_eager(tmp_path, monkeypatch):
    """As on CUDA: alloc builds the graphs, the prime stays eager (its laps intact), every
    round's ingest and block forward replay a graph."""
    target, d = _setup(tmp_path)
    prompt = torch.randint(3, 500, (24,), generator=torch.Generator().manual_seed(11)).tolist()
    eager_ingests = []
    real_ingest = d._ingest

    def spy(upto, depth=None):
        eager_ingests.append(upto - d.n)
        real_ingest(upto, depth)

    d._ingest = spy
    drafts = []
    real_propose = d.propose

    def spy_propose(context, k, sp, gen):
        p = real_propose(context, k, sp, gen)
        drafts.append(p.tokens.tolist())
        return p

    d.propose = spy_propose

    def run():
        eager_ingests.clear()
        drafts.clear()
        s = SpecSession(target, d, SamplingParams(), torch.Generator().manual_seed(0), 15)
        out = [s.start(prompt, 48, CAP)]
        while not s.done:
            out.extend(s.burst(4))
        kv = [(st.k[:d.n].clone(), st.v[:d.n].clone()) for st in d.states]  # every ingested row
        # the drafts read every ingested row (a random drafter accepts ~nothing: they are the witness)
        return out, s.stats.drafted, s.stats.accepted, list(drafts), kv

    eager = run()
    assert eager[1] > 0 and eager_ingests[0] == len(prompt)
    monkeypatch.setattr(dflash_mod, "block_graphs", lambda dr: BlockGraphs(dr, graph_cls=_Emulated))
    d.states = []  # a fresh alloc: the graphs are built there, as on CUDA
    graphed = run()
    assert isinstance(d.graph, BlockGraphs)
    assert graphed[:4] == eager[:4] and len(graphed[3]) > 3
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(graphed[4], eager[4]))
    assert [r for r in eager_ingests if r > 0] == [len(prompt)]  # the prime only: the rounds replayed
    assert d.graph.ingests and d.graph.graphs
    # captured at allocation, every round row count: the rounds captured nothing more
    assert set(d.graph.ingests) == set(range(1, d.B + 1)) and set(d.graph.graphs) == set(range(1, d.B))
    # a second session on the same cache reuses the graphs (same sink, same K/V buffers)
    kept = dict(d.graph.ingests)
    assert run()[:4] == eager[:4] and all(d.graph.ingests[r] is g for r, g in kept.items())


def test_a_new_tap_sink_drops_the_graphs(tmp_path):
    target, d, ids = _primed(tmp_path, 10, seed=2)
    graphs = BlockGraphs(d, graph_cls=_Emulated)
    target.forward(ids[10:13], 10)
    graphs.ingest(10, 13)
    d.n = 13
    assert set(graphs.ingests) == {3}
    old = target.cache.taps
    target.alloc(CAP - 8)  # another capacity: a new cache, a new sink
    assert target.cache.taps is not old
    target.forward(ids[:13], 0)
    graphs.ingest(10, 13)  # recaptured over the new sink
    assert graphs.sink is target.cache.taps and set(graphs.ingests) == {3} and not graphs.graphs
    ref = DFlashDrafter(d.net, target)
    ref.alloc(CAP)
    ref._ingest(10)
    ref._ingest(13)  # the same 3-row ingest, eager, over the new sink
    assert all(torch.equal(x.k[10:13], y.k[10:13]) and torch.equal(x.v[10:13], y.v[10:13])
               for x, y in zip(ref.states, d.states))


def test_fused_projections_give_the_reference_block_and_ingest(tmp_path):
    """The fast path's fused [q; k; v] and [gate; up] GEMMs (DFlashNet.fuse, on CUDA graphs):
    the same K/V from the prime's ingest and from a block, and the same block logits."""
    target, d, ids = _primed(tmp_path, 30, seed=5)
    ref = d.block_logits(int(ids[29]), 29, 15).clone()
    kv_ref = [(s.k.clone(), s.v.clone()) for s in d.states]
    d.net.fuse()
    at = d.net.layers[0].self_attn
    assert not hasattr(at, "q_proj") and hasattr(at, "qkv_w") and hasattr(d.net.layers[0].mlp, "gate_up_proj")
    for s in d.states:
        s.k.zero_()
        s.v.zero_()
    d.prime(ids[:30].tolist())  # the context's k / v now from the fused weight's [k; v] rows
    fused = d.block_logits(int(ids[29]), 29, 15)
    torch.testing.assert_close(fused, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(fused.argmax(-1), ref.argmax(-1))
    for s, (k, v) in zip(d.states, kv_ref):
        torch.testing.assert_close(s.k, k, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(s.v, v, rtol=1e-5, atol=1e-5)
