"""DFlash for many requests at once: the step leader's chained rounds (batching/chain_drafts.py)
maintain and propose every greedy DFlash request of a step in one draft forward each.

`ingest_many`: every request's newly verified context rows (their taps, from each request's
own sink) in one feature GEMM and one k/v projection per layer, each request's rows then
written into its own draft K/V. `propose_many`: every request's block [last token, mask ...]
stacked into one forward of the draft network (each layer's projections, FFN and the lm_head
over all blocks' rows at once); the attention runs per request over its own draft K/V under
its own mask, exactly as its solo block does (DFlashDrafter.block_logits), so each request
drafts what it drafts alone. One readback of every request's drafts.

Eager: the draft's layers are few (one to five), so a step of n requests launches each GEMM
once instead of n times. Every request's draft cache is a slot of the engine's pool
(draft_pool.py: a batched engine's drafters), so each layer's K/V write is one launch for all of
them and the attention one gather and two batched GEMMs (`pooled_attention`), each request's
rows under its own mask. Drafters that found no slot (draft_pool.py `take`: not seen in any
engine path) ingest and propose one by one, as alone.
"""

from __future__ import annotations

import torch

from ...model.tap_pool import gather_rows
from ..chunks import pack_chunks
from .chain_picks import draw_requests
from .base import EMPTY, Proposal
from ...device import to_device
from .dflash_pool_graph import DeviceDrafts
from .draft_pool import pool_of, pooled_attention

__all__ = ["ingest_many", "pre_ingest_many", "draft_early_many", "propose_many", "prime_many"]


@torch.inference_mode()
def ingest_many(drafters, uptos: list[int]) -> None:
    """Each drafter's context rows [its n, upto) ingested, all in one forward (none for a drafter
    whose rows the step's `pre_ingest_many` already ingested)."""
    for d, u in zip(drafters, uptos):
        if d.pre is not None and d.pre[0] == d.n < u <= d.pre[1]:
            d.n = u
        d.pre = None
    todo = [(d, u) for d, u in zip(drafters, uptos) if u > d.n]
    if not todo:
        return
    pool = pool_of([d for d, _ in todo])
    g = pool.ingest_graphs if pool is not None else None
    if g is not None:  # replayed (dflash_pool_graph.py): one replay a step, a catch-up's few more
        segs = g.segments([d._taps() for d, _ in todo], [d.pool_slot for d, _ in todo], [(d.n, u) for d, u in todo])
        if segs is not None:
            g.ingest(segs)
            for d, u in todo:
                d.n = u
            return
    if len(todo) == 1 or pool is None:  # (a drafter that found no pool slot keeps caches of its own: alone)
        for d, u in todo:
            d._ingest(u)
        return
    net, dev = todo[0][0].net, todo[0][0].device
    pos = to_device([p for d, u in todo for p in range(d.n, u)], dev)
    C = net.features(gather_rows([d._taps() for d, _ in todo], [(d.n, u) for d, u in todo], dev))
    at = (to_device([d.pool_slot for d, u in todo for _ in range(d.n, u)], dev), pos)
    for li, (k, v) in enumerate(net.context_kv(C, pos)):  # every request's rows into its own slot, one launch a layer
        pool.k[li].index_put_(at, k)
        pool.v[li].index_put_(at, v)
    for d, u in todo:
        d.n = u


@torch.inference_mode()
def pre_ingest_many(drafters, rows: list[tuple[int, int]]) -> int:
    """Right behind a verify step, before its readback: each drafter's verify rows [lo, hi) (its
    pending token's and its drafts', `lo` its n) from the step's taps into its draft slot, in the
    ingest graphs' replays, whatever the acceptance. The maintenance after the accept then finds
    its rows done (`pre`: ingest_many) and the draft forward is the first launch after the
    readback; the device ingests while the loop reads the step back and accepts. The rows past
    the accepted ones are scratch: the next block forward writes its K/V at start .. start + B - 1
    (start: the committed rows, >= lo + 1; hi - lo <= K + 1 <= B) before its attention reads them,
    as it writes over a solo drafter's last block (dflash.py `block_logits`). Only drafters in the
    pool's ingest graphs, their rows one entry each; the others are maintained as usual. Returns
    how many were ingested."""
    todo = [(d, lo, hi) for d, (lo, hi) in zip(drafters, rows) if d.n == lo < hi]
    pool = pool_of([d for d, _, _ in todo]) if todo else None
    g = pool.ingest_graphs if pool is not None else None
    if g is None:
        return 0
    segs = g.segments([d._taps() for d, _, _ in todo], [d.pool_slot for d, _, _ in todo], [(lo, hi) for _, lo, hi in todo])
    if segs is None or len(segs) != len(todo):  # (a row range past the graphs' entry: the usual maintenance)
        return 0
    g.ingest(segs)
    for d, lo, hi in todo:
        d.pre = (lo, hi)
    return len(todo)


@torch.inference_mode()
def draft_early_many(drafters, verify: list[tuple[int, int, int, int]], pred: torch.Tensor, ids: torch.Tensor) -> int:
    """Right behind `pre_ingest_many`, still before the step's readback: the next round's drafts
    of each drafter whose verify rows it ingested, in one replay of the pool's block graphs
    (PoolBlockGraphs.greedy_after: the acceptance found on the device). `verify[i]`: drafter i's
    (lo, its first argmax row in `pred`, its first row in the step's `ids`, its drafts). Each
    drafter keeps them (`early`) for its next proposal, which takes them where its context is
    the one the device accepted (propose_many); so the device drafts while the loop reads the
    step back and accepts, and the next verify is launched with those drafts still on the
    device. Returns how many drafted."""
    todo = [(d, v) for d, v in zip(drafters, verify) if d.pre == (v[0], v[0] + v[3] + 1)]
    pool = pool_of([d for d, _ in todo]) if todo else None
    g = pool.graphs if pool is not None else None
    if g is None or len(todo) > g.max_n:
        return 0
    dd = g.greedy_after([d.pool_slot for d, _ in todo], [v for _, v in todo], pred, ids)
    for r, (d, v) in enumerate(todo):
        d.early = (dd, r, v[0], v[3])
    return len(todo)


def _early(d, start: int, k: int):
    """Drafter d's drafts from `draft_early_many`, where its context now ends where the device's
    acceptance ended it (its last token at `start`, k drafts at most): (DeviceDrafts, row), else None."""
    e, d.early = d.early, None
    if e is None:
        return None
    dd, row, lo, kv = e
    return (dd, row) if 0 <= start - lo - 1 <= kv and k <= dd.k and d.n == start else None


def prime_many(drafters, prompts: list[list[int]], chunks: list[list[tuple[int, int]] | None], rows: int = 0) -> None:
    """Each drafter primed on its prompt (DFlashDrafter.prime: every prompt row ingested), the
    requests' chunks packed into shared ingests of at most `rows` rows (the target's prefill
    chunk: the working memory one request's prime takes; the largest chunk's, if more), as the
    engine loop primes a step's new requests together (batching/primes.py)."""
    lists = [cs or [(0, len(p))] for p, cs in zip(prompts, chunks)]
    for d in drafters:
        d.n, d.pre = 0, None
    for pack in pack_chunks(lists, max(rows, max(hi - lo for cs in lists for lo, hi in cs))):
        ingest_many([drafters[i] for i, _, _ in pack], [hi for _, _, hi in pack])


@torch.inference_mode()
def propose_many(drafters, contexts, ks: list[int], sps, gens, defer: bool = False) -> list[Proposal]:
    """Each drafter's Proposal (min(k, B - 1) drafts, on the host; EMPTY where k <= 0) for its
    context: one block forward of every drafting request's block. Greedy: the argmax rows (one
    readback for all); sampled (`sps[i]` not greedy): drawn from its own rows' distribution
    with its generator `gens[i]`, as its solo proposal draws them (DFlashDrafter.propose).
    `defer`: where the forward replays the pool's graph, its greedy drafts stay on the device
    (`Proposal.dev`; read back when a caller asks for them)."""
    out: list[Proposal] = [EMPTY for _ in drafters]
    live = [(i, d, c, min(k, d.B - 1)) for i, (d, c, k) in enumerate(zip(drafters, contexts, ks)) if k > 0]
    if not live:
        return out
    d0 = live[0][1]
    net, B, dev, stage = d0.net, d0.B, d0.device, d0.target.stage
    starts = [len(c) - 1 for _, _, c, _ in live]
    ingest_many([d for _, d, _, _ in live], starts)  # normally a no-op: maintenance ingested every committed row
    n = len(live)
    pool = pool_of([d for _, d, _, _ in live])
    if pool is None:  # a drafter that found no pool slot (draft_pool.py take) drafts alone, as it would solo
        for i, d, c, _ in live:
            out[i] = d.propose(c, ks[i], sps[i], gens[i])
        return out
    g = pool.graphs
    if g is not None and n <= g.max_n and max(kk for *_, kk in live) <= g.K:  # one replay (dflash_pool_graph.py)
        sampled = any(not sps[i].greedy for i, *_ in live)
        early = [_early(d, s, kk) for (_, d, _, kk), s in zip(live, starts)]
        rest = [r for r, e in enumerate(early) if e is None]  # (drafted early: already on the device)
        rows = None
        if rest:
            toks = g.greedy([live[r][1].pool_slot for r in rest], [starts[r] for r in rest],
                            [live[r][2][-1] for r in rest], defer, logits=sampled)
            toks, rows = toks if sampled else (toks, None)
            for at, r in enumerate(rest):
                early[r] = (toks, at)
        samp = [r for r, (i, *_) in enumerate(live) if not sps[i].greedy]
        if samp:  # every sampled request's drafts drawn at once, one readback (chain_picks.py)
            drawn = draw_requests([rows[early[r][1]][:live[r][3]] for r in samp], [sps[live[r][0]] for r in samp],
                                  [gens[live[r][0]] for r in samp], d0.name, dev)
            for r, p in zip(samp, drawn):
                out[live[r][0]] = p
        for (i, d, _, kk), (toks, at) in zip(live, early):
            if not sps[i].greedy:
                continue
            if defer:
                out[i] = Proposal(dev=(toks, at, kk))
            else:
                out[i] = Proposal(ids=(toks.rows() if isinstance(toks, DeviceDrafts) else toks)[at][:kk])
        return out
    kmax = max(kk for *_, kk in live)
    keep = (B, 1, 1 + kmax)  # rows 1 .. kmax of each block past the last layer's K/V (DFlashNet.block)
    ids = torch.full((n * B,), d0.dc.mask_token_id, dtype=torch.long)
    ids[::B] = torch.tensor([c[-1] for _, _, c, _ in live])
    base = torch.tensor(starts)
    pos = to_device((torch.arange(B)[None, :] + base[:, None]).reshape(-1), dev)
    ids = to_device(ids, dev)
    kv_of, attend = _pooled(pool, [d for _, d, _, _ in live], pos, starts, B)
    h = net.block(stage.embed_tokens(ids), pos, kv_of, None, attend=attend, keep=keep)  # (n * kmax, H)
    return _picks(out, live, h, kmax, stage, sps, gens, dev)


def _pooled(pool, ds, pos: torch.Tensor, starts: list[int], B: int):
    """The block forward's K/V writer and attention over the pool: each request's B block rows
    written into its slot, then every block row of request r reading slots < starts[r] + B of
    its own cache (the context rows and its whole block, as its solo block reads them)."""
    n, dev = len(ds), pos.device
    idx = pool.index(ds)
    at = (idx.repeat_interleave(B), pos)
    lim = to_device((torch.tensor(starts) + B)[:, None].expand(n, B).contiguous(), dev)
    L = max(starts) + B

    def kv_of(li, kb, vb):
        pool.k[li].index_put_(at, kb)
        pool.v[li].index_put_(at, vb)
        return pool.k[li], pool.v[li]

    def attend(q, kp, vp):  # B rows a request, or in the last layer its kept ones (every row: one limit)
        R = q.shape[0] // n
        return pooled_attention(q.view(n, R, *q.shape[1:]), kp, vp, idx, lim[:, :R], L).view(n * R, -1)

    return kv_of, attend


def _picks(out, live, h, per: int, stage, sps, gens, dev) -> list[Proposal]:
    """Each live request's drafts from the kept block outputs h (n * per, H: rows 1 .. per of
    each block): its first k through the lm_head at once; greedy the argmax (one readback),
    sampled drawn with its generator (all at once: `draw_requests`)."""
    rows = [r * per + i for r, (_, _, _, kk) in enumerate(live) for i in range(kk)]
    logits = stage.lm_head(h if len(rows) == h.shape[0] else h[to_device(rows, dev)]).float()  # (rows, V)
    los = torch.tensor([0] + [kk for *_, kk in live]).cumsum(0).tolist()
    samp = [r for r, (i, *_) in enumerate(live) if not sps[i].greedy]
    if samp:
        drawn = draw_requests([logits[los[r]:los[r + 1]] for r in samp], [sps[live[r][0]] for r in samp],
                              [gens[live[r][0]] for r in samp], live[0][1].name, dev)
        for r, p in zip(samp, drawn):
            out[live[r][0]] = p
    if len(samp) < len(live):
        toks = logits.argmax(-1).tolist()
        for r, (i, *_) in enumerate(live):
            if sps[i].greedy:
                out[i] = Proposal(ids=toks[los[r]:los[r + 1]])
    return out
