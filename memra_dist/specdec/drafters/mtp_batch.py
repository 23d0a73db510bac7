"""MTP for many requests at once: the step leader's chained rounds (batching/chain_drafts.py)
draft every MTP request of a step together, as batched chains.

Step s of a round runs the same MTP layer (s % n) for every request still drafting (requests
ask for different k), so the step is ONE forward of that layer over all their rows: its input
projection, its FFN (the target's MoE kind) and the lm_head over every request's rows at once,
the attention per request over its own draft cache under its own mask (MTPDrafter._rows /
_rows_chain: the same step context its solo step builds), or, where every request's K/V is a
slot of the draft pool (one MTP layer), the whole layer as one batched step over it
(mtp_pool_graph.py `pooled_step`). Each request drafts exactly what it
drafts alone; the picks stay on the device until one readback of them all. Eager, except where
the engine captured the pool's graphs (one MTP layer, every request greedy and its round within
the graphs' rows: mtp_pool_graph.py): then the whole round is one replay.
"""

from __future__ import annotations

import torch

from .base import EMPTY, Proposal
from .chain_picks import ChainPicks
from ...device import to_device
from ...model.prefix_attention import PREFIX_MIN_ROWS
from .draft_pool import pool_of
from .mtp_pool_graph import pooled_step

__all__ = ["maintain_many", "propose_many"]


def maintain_many(drafters, contexts) -> None:
    for d, c in zip(drafters, contexts):
        d.maintain(c)


def _layer(head, j: int, ds, los: list[int], lens: list[int], tokens: torch.Tensor, hidden: torch.Tensor,
           chained: bool) -> torch.Tensor:
    """MTP layer j over several requests' rows (request r: lens[r] rows from position los[r]) ->
    normed outputs (rows, H). `chained`: one row each past the layers (no output kept). Where
    every request's K/V is a slot of one pool (one MTP layer) and no request runs a prefill's
    worth of rows, one batched step over the pool (mtp_pool_graph.py `pooled_step`)."""
    blk, dev = head.layer(j), hidden.device
    pool = pool_of(ds) if head.n == 1 else None
    if pool is not None and max(lens) <= PREFIX_MIN_ROWS:
        m, b = sum(lens), len(ds)  # positions, row slots, each request's slot, first row and rows: one copy
        ix = to_device([p for lo, n in zip(los, lens) for p in range(lo, lo + n)]
                       + [d.pool_slot for d, n in zip(ds, lens) for _ in range(n)] + [d.pool_slot for d in ds]
                       + [sum(lens[:r]) for r in range(b)] + list(lens), dev)
        return pooled_step(head, ds[0].target.stage.embed_tokens, pool, tokens, hidden, ix[:m], ix[m:2 * m],
                           ix[2 * m:2 * m + b], lens, getattr(pool.graphs, "paged", False), spans=ix[2 * m + b:])
    poss = [torch.arange(lo, lo + n, device=dev) for lo, n in zip(los, lens)]
    emb = ds[0].target.stage.embed_tokens(tokens)
    x = blk.eh_proj(torch.cat((blk.enorm(emb), blk.hnorm(hidden)), dim=-1))
    xn = blk.input_layernorm(x)
    att = []
    for d, p, lo, xr in zip(ds, poss, los, xn.split(lens)):
        ctx = head.step_ctx(p, d.capacity) if chained else head.step_ctx(p, d.capacity, lo)
        att.append(blk.self_attn(xr, ctx, d.states[j]))
    x = x + torch.cat(att)
    out = blk.shared_head["norm"](x + blk.mlp(blk.post_attention_layernorm(x)))
    if not chained and j < head.n - 1:  # the next layer's inputs, by row
        for d, p, o in zip(ds, poss, out.split(lens)):
            d.outs[j].index_copy_(0, p, o)
    return out


@torch.inference_mode()
def propose_many(drafters, contexts, ks: list[int], sps, gens) -> list[Proposal]:
    """Each drafter's Proposal (k drafts, on the host; EMPTY where k <= 0) after its context:
    each step of the round shared by every request still drafting. Greedy: each step's argmax
    (one readback at the end); sampled: drawn with the request's generator and fed to the next
    step, as its solo proposal draws it (MTPDrafter.propose)."""
    out: list[Proposal] = [EMPTY for _ in drafters]
    live = [(i, d, c, k) for i, (d, c, k) in enumerate(zip(drafters, contexts, ks)) if k > 0]
    if not live:
        return out
    pool = pool_of([d for _, d, _, _ in live])
    if pool is not None and pool.graphs is not None:
        props = _replayed(pool.graphs, live, sps, gens)
        if props is not None:
            for (i, *_), p in zip(live, props):
                out[i] = p
            return out
    d0 = live[0][1]
    head, dev, lm_head = d0.head, d0.device, d0.target.stage.lm_head
    Ns = [len(c) for _, _, c, _ in live]
    drafts: list[list[torch.Tensor]] = [[] for _ in live]  # each request's picks so far, (1,) on the device
    picks = ChainPicks(live, sps, gens, dev)
    active = list(range(len(live)))
    prev = None  # the active requests' previous outputs (n_active, H)
    for s in range(max(k for *_, k in live)):
        j, r = s % head.n, s // head.n
        ds = [live[a][1] for a in active]
        if r == 0:  # layer j's first forward this round: committed rows, then the j draft rows
            los = [d.done[j] for d in ds]
            lens = [Ns[a] - 1 - lo for a, lo in zip(active, los)]
            ids = [to_device(live[a][2][lo + j + 1:Ns[a]], dev) for a, lo in zip(active, los)]
            tokens = torch.cat([t for a, real in zip(active, ids) for t in (real, *drafts[a][:j])])
            src = [d._final() if j == 0 else d.outs[j - 1] for d in ds]
            hidden = torch.cat([h[lo:Ns[a] - 1] for h, a, lo in zip(src, active, los)])
            h = _layer(head, j, ds, los, lens, tokens, hidden, False)
            last = h[to_device(torch.tensor(lens).cumsum(0) - 1, dev)]
            for d, a in zip(ds, active):
                d.done[j] = Ns[a] - 1 - j
        else:  # chained past the layers: one row further on, fed the previous step
            tokens = torch.cat([drafts[a][-1] for a in active])
            last = _layer(head, j, ds, [Ns[a] - 2 + r for a in active], [1] * len(active), tokens, prev, True)
        logits = lm_head(last).float()  # (n_active, V)
        tok = picks.take(active, logits.argmax(-1), lambda sel: logits[sel])
        for i, a in enumerate(active):
            drafts[a].append(tok[i:i + 1])
        keep = [i for i, a in enumerate(active) if s + 1 < live[a][3]]
        if not keep:
            break
        prev = last[to_device(keep, dev)]
        active = [active[i] for i in keep]
    return picks.proposals(len(drafters))


def _replayed(g, live, sps, gens) -> list[Proposal] | None:
    """The round of every live request (one MTP layer) as one replay of the pool's graphs
    (mtp_pool_graph.py: the greedy graph, or the sampled one where a request samples), each
    request's Proposal; None where the round does not fit them (the eager chains run it). Rows the graph cannot take (a request that skipped rounds
    at K 0 under --spec-k auto has more than K + 1 new rows) are run first, their K/V only, in one
    eager forward."""
    ds = [d for _, d, _, _ in live]
    Ns = [len(c) for _, _, c, _ in live]
    los = [max(d.done[0], N - 1 - g.R) for d, N in zip(ds, Ns)]
    sinks = [d.target.cache.taps for d in ds]
    if not g.fits(ds, sinks, los, Ns, [k for *_, k in live]):
        return None
    behind = [r for r, d in enumerate(ds) if d.done[0] < los[r]]
    if behind:
        head, dev = ds[0].head, ds[0].device
        b = [ds[r] for r in behind]
        lo0 = [b_.done[0] for b_ in b]
        ids = torch.cat([to_device(live[r][2][lo + 1:los[r] + 1], dev) for r, lo in zip(behind, lo0)])
        hidden = torch.cat([d._final()[lo:los[r]] for d, r, lo in zip(b, behind, lo0)])
        _layer(head, 0, b, lo0, [los[r] - lo for r, lo in zip(behind, lo0)], ids, hidden, False)
    reqs = [(c, lo, s.pool_slot, d.pool_slot) for (_, d, c, _), lo, s in zip(live, los, sinks)]
    ks = [k for *_, k in live]
    if all(sps[i].greedy for i, *_ in live):
        props = [Proposal(ids=t[:k]) for t, k in zip(g.greedy(reqs), ks)]
    else:
        props = g.sampled(reqs, [sps[i] for i, *_ in live], [gens[i] for i, *_ in live], ks, ds[0].name)
        if props is None:
            return None
    for d, N in zip(ds, Ns):
        d.done[0] = N - 1
    return props
