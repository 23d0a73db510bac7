"""EAGLE-3 for many requests at once: the step leader's chained rounds (batching/chain_drafts.py)
draft every greedy EAGLE-3 request of a step together, as batched chains.

A round's first forward runs every request's committed rows not yet in its cache (after a
verify that accepted a drafts: a + 1 rows each) stacked into ONE step of the head (its
projections, FFN and the lm_head over all rows at once); each following chain step runs one
row per request still drafting (requests ask for different k) in one step again. Each request's
rows write and read only its own draft K/V, under its own causal mask (or, for a long run of
rows, the prefix attention its solo step takes: Eagle3Drafter._run), so each request drafts
exactly what it drafts alone. The picks stay on the device until one readback of them all.
Eager: the head is one layer, so n requests' step launches each GEMM once instead of n times.
Where every request's draft cache is a slot of the engine's pool (draft_pool.py), a step's K/V
write is one launch and its attention one gather and two batched GEMMs for all requests (rows of
different counts padded to the longest, each under its own causal mask); otherwise n small
launches.
"""

from __future__ import annotations

import torch

from ...model.attention import cached_attention, causal_mask
from ...model.prefix_attention import PREFIX_MIN_ROWS, prefix_attention
from ...model.tap_pool import gather_rows
from ..chunks import pack_chunks
from .base import EMPTY, Proposal
from .chain_picks import ChainPicks
from ...device import to_device
from .draft_pool import pool_of, pooled_attention

__all__ = ["maintain_many", "propose_many", "prime_many", "draft_early_many"]


def maintain_many(drafters, contexts) -> None:
    for d, c in zip(drafters, contexts):
        d.maintain(c)


def prime_many(drafters, prompts: list[list[int]], chunks: list[list[tuple[int, int]] | None], rows: int = 0) -> None:
    """Each drafter primed on its prompt (Eagle3Drafter.prime: rows 0 .. P - 2, their K/V only),
    the requests' chunks packed into shared forwards of at most `rows` rows (the target's
    prefill chunk; the largest chunk's, if more), as the engine loop primes a step's new
    requests together (batching/primes.py)."""
    lists = []
    for d, p, cs in zip(drafters, prompts, chunks):
        d.n, n = 0, len(p) - 1
        lists.append([(lo, min(hi, n)) for lo, hi in cs or [(0, n)] if lo < min(hi, n)])
    if not any(lists):
        return
    for pack in pack_chunks(lists, max(rows, max(hi - lo for cs in lists for lo, hi in cs))):
        _prime_kv_many([drafters[i] for i, _, _ in pack], [prompts[i] for i, _, _ in pack],
                       [(lo, hi) for _, lo, hi in pack])


@torch.inference_mode()
def _prime_kv_many(ds, prompts, ranges: list[tuple[int, int]]) -> None:
    """Eagle3Drafter._prime_kv of several requests in one forward: committed rows [lo, hi) of
    each (token p + 1, hidden fc(taps of p)), only their K/V into each request's cache."""
    if len(ds) == 1:
        ds[0]._prime_kv(prompts[0], *ranges[0])
        return
    d0 = ds[0]
    net, dev = d0.net, d0.device
    pos = to_device([p for lo, hi in ranges for p in range(lo, hi)], dev)
    tokens = to_device([t for c, (lo, hi) in zip(prompts, ranges) for t in c[lo + 1:hi + 1]], dev)
    g = net.features(gather_rows([d._taps() for d in ds], ranges, dev))
    k, v = net.context_kv(d0.embed(tokens), g, pos)
    pool = pool_of(ds)
    if pool is not None:  # every request's rows into its own slot, one launch each
        at = (to_device([d.pool_slot for d, (lo, hi) in zip(ds, ranges) for _ in range(lo, hi)], dev), pos)
        pool.k[0].index_put_(at, k)
        pool.v[0].index_put_(at, v)
    else:
        lens = [hi - lo for lo, hi in ranges]
        for d, p, kr, vr in zip(ds, pos.split(lens), k.split(lens), v.split(lens)):
            d.state.k.index_copy_(0, p, kr)
            d.state.v.index_copy_(0, p, vr)
    for d, (lo, hi) in zip(ds, ranges):
        d.n = hi


def _step(net, ds, los: list[int], lens: list[int], tokens: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Rows of several requests in one step of the head: request r's `lens[r]` rows at positions
    los[r] .. (tokens / hiddens stacked in request order) -> pre-norm outputs (rows, H)."""
    dev = g.device
    pool = pool_of(ds)
    if pool is not None and max(lens) <= PREFIX_MIN_ROWS:
        return _step_pooled(net, pool, ds, los, lens, tokens, g)
    poss = [torch.arange(lo, lo + n, device=dev) for lo, n in zip(los, lens)]
    nkv, scale = net.midlayer.self_attn.nkv, ds[0].ec.base.head_dim ** -0.5

    def kv_of(k, v):  # each request's rows into its own draft cache
        for d, p, kr, vr in zip(ds, poss, k.split(lens), v.split(lens)):
            d.state.k.index_copy_(0, p, kr)
            d.state.v.index_copy_(0, p, vr)
        return None, None

    def attend(q, _K, _V):  # per request, over its own cache, as its solo step attends
        outs = []
        for d, p, lo, qr in zip(ds, poss, los, q.split(lens)):
            T = qr.shape[0]
            if T > PREFIX_MIN_ROWS:
                outs.append(prefix_attention(qr, d.state.k[:lo + T], d.state.v[:lo + T], lo, scale).reshape(T, -1))
            else:
                outs.append(cached_attention(qr, d.state.k, d.state.v, causal_mask(p, d.capacity), nkv))
        return torch.cat(outs)

    return net.step(ds[0].embed(tokens), g, torch.cat(poss), kv_of, None, attend)


def _step_pooled(net, pool, ds, los: list[int], lens: list[int], tokens: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """`_step` over the pool: every request's rows written into its slot in one launch, then its
    rows (padded to the longest request's, the pads repeating its last row) each reading slots
    <= its own position of its own cache."""
    n, T, dev = len(ds), max(lens), g.device
    pos = to_device([lo + t for lo, m in zip(los, lens) for t in range(m)], dev)
    at = (to_device([d.pool_slot for d, m in zip(ds, lens) for _ in range(m)], dev), pos)
    idx = pool.index(ds)
    lim = to_device([[lo + min(t, m - 1) + 1 for t in range(T)] for lo, m in zip(los, lens)], dev)
    L = max(lo + m for lo, m in zip(los, lens))
    kp, vp = pool.k[0], pool.v[0]
    pad = None
    if any(m != T for m in lens):  # ragged: gather into (n, T) rows and back
        offs = [sum(lens[:r]) for r in range(n)]
        src = to_device([o + min(t, m - 1) for o, m in zip(offs, lens) for t in range(T)], dev)
        dst = to_device([r * T + t for r, m in enumerate(lens) for t in range(m)], dev)
        pad = (src, dst)

    def kv_of(k, v):
        kp.index_put_(at, k)
        vp.index_put_(at, v)
        return kp, vp

    def attend(q, K, V):
        qs = q if pad is None else q.index_select(0, pad[0])
        o = pooled_attention(qs.view(n, T, *q.shape[1:]), K, V, idx, lim, L).view(n * T, -1)
        return o if pad is None else o.index_select(0, pad[1])

    return net.step(ds[0].embed(tokens), g, pos, kv_of, None, attend)


@torch.inference_mode()
@torch.inference_mode()
def draft_early_many(drafters, verify: list[tuple[int, int, int, int]], pred: torch.Tensor, ids: torch.Tensor) -> int:
    """Before the step's readback (batching/chain_drafts.py draft_early): the next round of each
    drafter whose cache ends where its verify began (`verify[i]`: (lo, its first argmax row in
    `pred`, its first row in `ids`, its drafts)), in one replay of the pool's chain graphs with
    the acceptance found on the device (PoolChainGraphs.greedy_after). Each keeps them
    (`early`) for its next proposal, which takes them where its context is the one the device
    accepted. Returns how many drafted."""
    todo = [(d, v) for d, v in zip(drafters, verify) if d.n == v[0]]
    pool = pool_of([d for d, _ in todo]) if todo else None
    g = pool.graphs if pool is not None else None
    if g is None or len(todo) > g.max_n or any(v[3] > g.K or v[0] + v[3] + g.K >= g.pool.rows for _, v in todo):
        return 0
    sinks = [d._taps() for d, _ in todo]
    if not all(getattr(s, "pool", None) is g.taps for s in sinks):
        return 0
    dd = g.greedy_after([(v[0], s.pool_slot, d.pool_slot) for (d, v), s in zip(todo, sinks)], [v for _, v in todo],
                        pred, ids)
    for r, (d, v) in enumerate(todo):
        d.early = (dd, r, v[0], v[3])
    return len(todo)


def _early(d, N: int, k: int):
    """Drafter d's drafts from `draft_early_many` where its context (N tokens) ends where the
    device's acceptance ended it and its cache is as it was then: (DeviceDrafts, row), its
    committed rows then N - 1 (the replay wrote their K/V); else None."""
    e, d.early = d.early, None
    if e is None:
        return None
    dd, row, lo, kv = e
    if not (0 <= N - 2 - lo <= kv and k <= dd.k and d.n == lo):
        return None
    d.n = N - 1
    return dd, row


def _replay(graphs, reqs, live, sps, gens, name: str) -> list[Proposal] | None:
    """The live requests' round as one replay: the greedy graph where every request is greedy,
    else the sampled one (None where it could not be captured: the eager chains run it)."""
    ks = [k for *_, k in live]
    if all(sps[i].greedy for i, *_ in live):
        return [Proposal(ids=t[:k]) for t, k in zip(graphs.greedy(reqs), ks)]
    return graphs.sampled(reqs, [sps[i] for i, *_ in live], [gens[i] for i, *_ in live], ks, name)


def propose_many(drafters, contexts, ks: list[int], sps, gens, defer: bool = False) -> list[Proposal]:
    """Each drafter's Proposal (k drafts, on the host; EMPTY where k <= 0) after its context:
    the round's first forward and each chain step shared by every request still drafting.
    Greedy: each step's argmax mapped to target ids (one readback at the end); sampled: each
    step's draft drawn from its target-vocabulary distribution with the request's generator
    and fed to the next step, as its solo proposal draws it (Eagle3Drafter.propose). A round
    drafted before the readback (`draft_early_many`) is taken as it is; `defer`: its drafts
    stay on the device (`Proposal.dev`)."""
    out: list[Proposal] = [EMPTY for _ in drafters]
    live = []
    for i, (d, c, k) in enumerate(zip(drafters, contexts, ks)):
        e = _early(d, len(c), k) if k > 0 and d.early is not None else None
        if e is not None:
            out[i] = Proposal(dev=(*e, k)) if defer else Proposal(ids=e[0].rows()[e[1]][:k])
        elif k > 0:
            live.append((i, d, c, k))
    if not live:
        return out
    d0 = live[0][1]
    net, dev = d0.net, d0.device
    ds = [d for _, d, _, _ in live]
    Ns = [len(c) for _, _, c, _ in live]
    los = [min(d.n, N - 2) for d, N in zip(ds, Ns)]  # at least the last committed row: its output gives d_1
    lens = [N - 1 - lo for N, lo in zip(Ns, los)]
    pool = pool_of(ds)
    graphs = pool.graphs if pool is not None else None
    if graphs is not None:  # one replay (eagle3_pool_graph.py)
        behind = [r for r, N in enumerate(Ns) if N - 1 - los[r] > graphs.R]
        if behind:  # they skipped rounds at K 0 (--spec-k auto): the rows the graph cannot take,
            _prime_kv_many([ds[r] for r in behind], [live[r][2] for r in behind],  # their K/V
                           [(los[r], Ns[r] - 1 - graphs.R) for r in behind])  # only, in one forward
            for r in behind:  # (no output of theirs is read), then the replay
                los[r], lens[r] = ds[r].n, graphs.R
        sinks = [d._taps() for d in ds]
        if graphs.fits(ds, sinks, los, Ns, [k for *_, k in live]):
            reqs = [(c, lo, s.pool_slot, d.pool_slot) for (_, d, c, _), lo, s in zip(live, los, sinks)]
            props = _replay(graphs, reqs, live, sps, gens, d0.name)
            if props is not None:
                for (i, d, _, _), N, p in zip(live, Ns, props):
                    d.n = N - 1
                    out[i] = p
                return out
    tokens = to_device([t for (_, _, c, _), lo, N in zip(live, los, Ns) for t in c[lo + 1:N]], dev)
    g = net.features(gather_rows([d._taps() for d in ds], [(lo, N - 1) for lo, N in zip(los, Ns)], dev))
    h = _step(net, ds, los, lens, tokens, g)
    ends = torch.tensor(lens).cumsum(0) - 1
    last = h[to_device(ends, dev)]  # (n, H): each request's last committed row
    for d, N in zip(ds, Ns):
        d.n = N - 1
    active = list(range(len(live)))
    picks = ChainPicks(live, sps, gens, dev)
    for s in range(max(k for *_, k in live)):
        logits = net.logits(last)  # (len(active), Vd): greedy, the argmax as target ids; sampled, over the target's
        tok = picks.take(active, net.hot[logits.argmax(-1)], lambda sel: net.target_logits(logits[sel]))
        keep = [a for a, r in enumerate(active) if s + 1 < live[r][3]]
        if not keep:
            break
        sel = to_device(keep, dev) if len(keep) < len(active) else None  # (all still drafting: no gather)
        active = [active[a] for a in keep]
        last = _step(net, [ds[r] for r in active], [Ns[r] - 1 + s for r in active], [1] * len(active),
                     tok if sel is None else tok[sel], last if sel is None else last[sel])
    return picks.proposals(len(drafters))
