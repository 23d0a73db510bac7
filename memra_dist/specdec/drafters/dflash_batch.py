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
once instead of n times; the per-request attention is n small launches a layer.
"""

from __future__ import annotations

import torch

from ...model.attention import cached_attention
from ..sampling import draw_drafts, probs
from .base import EMPTY, Proposal

__all__ = ["ingest_many", "propose_many"]


@torch.inference_mode()
def ingest_many(drafters, uptos: list[int]) -> None:
    """Each drafter's context rows [its n, upto) ingested, all in one forward."""
    todo = [(d, u) for d, u in zip(drafters, uptos) if u > d.n]
    if not todo:
        return
    if len(todo) == 1:
        todo[0][0]._ingest(todo[0][1])
        return
    net, dev = todo[0][0].net, todo[0][0].device
    lens = [u - d.n for d, u in todo]
    pos = torch.cat([torch.arange(d.n, u, device=dev) for d, u in todo])
    C = net.features(torch.cat([d._taps().rows(d.n, u) for d, u in todo]))
    for li, (k, v) in enumerate(net.context_kv(C, pos)):
        for (d, _), kr, vr, p in zip(todo, k.split(lens), v.split(lens), pos.split(lens)):
            d.states[li].k.index_copy_(0, p, kr)
            d.states[li].v.index_copy_(0, p, vr)
    for d, u in todo:
        d.n = u


@torch.inference_mode()
def propose_many(drafters, contexts, ks: list[int], sps, gens) -> list[Proposal]:
    """Each drafter's Proposal (min(k, B - 1) drafts, on the host; EMPTY where k <= 0) for its
    context: one block forward of every drafting request's block. Greedy: the argmax rows (one
    readback for all); sampled (`sps[i]` not greedy): drawn from its own rows' distribution
    with its generator `gens[i]`, as its solo proposal draws them (DFlashDrafter.propose)."""
    out: list[Proposal] = [EMPTY for _ in drafters]
    live = [(i, d, c, min(k, d.B - 1)) for i, (d, c, k) in enumerate(zip(drafters, contexts, ks)) if k > 0]
    if not live:
        return out
    d0 = live[0][1]
    net, B, dev, stage = d0.net, d0.B, d0.device, d0.target.stage
    starts = [len(c) - 1 for _, _, c, _ in live]
    ingest_many([d for _, d, _, _ in live], starts)  # normally a no-op: maintenance ingested every committed row
    n = len(live)
    ids = torch.full((n * B,), d0.dc.mask_token_id, dtype=torch.long)
    ids[::B] = torch.tensor([c[-1] for _, _, c, _ in live])
    base = torch.tensor(starts)
    pos = (torch.arange(B)[None, :] + base[:, None]).reshape(-1).to(dev)
    ids = ids.to(dev)
    blocks = [slice(r * B, (r + 1) * B) for r in range(n)]
    masks = [(d.slots < s + B)[None, :] for (_, d, _, _), s in zip(live, starts)]  # context rows and the block
    nkv = net.layers[0].self_attn.nkv

    def kv_of(li, kb, vb):  # each block's K/V into its own request's draft cache (dropped by the next ingest)
        for (_, d, _, _), sl in zip(live, blocks):
            d.states[li].k.index_copy_(0, pos[sl], kb[sl])
            d.states[li].v.index_copy_(0, pos[sl], vb[sl])
        return [d.states[li].k for _, d, _, _ in live], [d.states[li].v for _, d, _, _ in live]

    def attend(q, Ks, Vs):  # per request, over its own K/V and mask (as its solo block)
        return torch.cat([cached_attention(q[sl], K, V, m, nkv) for sl, K, V, m in zip(blocks, Ks, Vs, masks)])

    h = net.block(stage.embed_tokens(ids), pos, kv_of, None, attend=attend)  # (n * B, H)
    rows = [r * B + 1 + i for r, (_, _, _, kk) in enumerate(live) for i in range(kk)]
    logits = stage.lm_head(h[torch.tensor(rows, device=dev)]).float()  # (rows, V)
    toks = logits.argmax(-1).tolist()
    lo = 0
    for i, d, _, kk in live:
        sp = sps[i]
        if sp.greedy:
            out[i] = Proposal(torch.tensor(toks[lo:lo + kk], dtype=torch.long))
        else:  # its own rows' distribution, drawn with its own generator (as alone)
            q = probs(logits[lo:lo + kk], sp)
            out[i] = Proposal(draw_drafts(q, gens[i], d.name), q)
        lo += kk
    return out
