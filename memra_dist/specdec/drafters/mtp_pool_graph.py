"""CUDA graphs of the engine loop's batched MTP chains over the draft and tap pools
(mtp_batch.py `propose_many`), one per bucket of requests, for a target with one MTP layer of
grouped attention (GLM-4.5's: partial rotary, q / k norms, its MoE FFN).

Eager (before the pool: attention request by request), a round of b requests' chains was K
forwards of the layer and its lm_head, each a few dozen launches: on an H100 a tiny glm4_moe's MTP decoded 87 tok/s
on the loop against 1,108 on the solo engine's graphs, the device idle after 399 of 400 steps
(BENCHMARKS.md). With one layer an MTP round is an EAGLE-3 round with another step: row p pairs
the token at p + 1 with a hidden of position p (the target's final-normed hidden, the FINAL tap
in the tap pool, for the round's first forward; the previous step's normed output for a chained
step), so eagle3_pool_graph.py's inputs, buckets, pads and `fits` hold as they are. Two things
differ: the step is the MTP layer, run as a batched step of the target's own kind over the pool
(`ctx.batch`: each request's draft slot is the one block of its table, so its attention takes
the arm the target's batched steps take: the paged kernel on a GPU's kernels, else each
request's masked attention over its slot), and the picks are the argmax of the target's lm_head.
"""

from __future__ import annotations

import torch

from ...cache import KVLayer
from ...device import to_device
from ...graphs import CapturedGraph
from ...model.transformer import StepCtx
from .eagle3_pool_graph import PoolChainGraphs

__all__ = ["MTPPoolGraphs", "poolable", "pooled_step"]


def poolable(head) -> bool:
    """Whether the loop's MTP drafters keep their K/V as slots of one draft pool, which the
    pool's graphs read: one MTP layer, of grouped attention (MLA's latents and two or more
    layers keep caches of their own and draft on the eager chains)."""
    from ...model.attention import Attention  # noqa: PLC0415

    return head.n == 1 and type(head.layer(0).self_attn) is Attention


def pooled_step(head, embed, pool, tokens, hidden, pos, row_slots, idx, lens, paged: bool, spans=None) -> torch.Tensor:
    """The (one) MTP layer over several requests' rows as one batched step of the target's kind
    over the draft pool: request r's rows (consecutive, in request order; `lens[r]` of them, or
    `lens` = T for every request: a graph's static layout) at positions `pos`, their K/V written
    into pool slots `row_slots`, each attending over its own slot idx[r] up to its position ->
    the normed outputs (rows, H). `paged`: on the paged kernel (the layer's QKV fused); with
    ragged `lens`, `spans` are each request's first row then its row count on the device (the
    caller's copy; else copied here)."""
    from ...batching.paged import BatchView, PagedRows, Segment  # noqa: PLC0415

    b, rows, dev, blk = idx.shape[0], pool.rows, pos.device, head.layer(0)
    rows_of = [(r * lens, lens) for r in range(b)] if isinstance(lens, int) else \
        [(sum(lens[:r]), n) for r, n in enumerate(lens)]
    state = KVLayer(*(x[0].view(-1, *x.shape[3:]) for x in (pool.k, pool.v)))  # (slots + 1) rows, flat
    slots = row_slots * rows + pos
    if paged:  # each request's slot the one block of its table, read below each row's position
        if isinstance(lens, int):  # made on the device (a graph captures no host copy)
            lo = torch.arange(0, b * lens, lens, device=dev, dtype=torch.int32)
            n = torch.full((b,), lens, device=dev, dtype=torch.int32)
        else:
            sd = (spans if spans is not None else to_device([o for o, _ in rows_of] + list(lens), dev)).to(torch.int32)
            lo, n = sd[:b], sd[b:]
        view = BatchView(slots, paged=PagedRows(lo, n, idx.to(torch.int32).view(b, 1), rows, max(m for _, m in rows_of),
                                                rows))
    else:
        span = torch.arange(rows, device=dev)
        keys = idx[:, None] * rows + span  # (b, rows): each request's slot, in position order
        masks = span[None, :] <= pos[:, None]  # (rows in the step, slot rows)
        view = BatchView(slots, [Segment(o, o + m, 0, rows, keys[r], masks[o:o + m]) for r, (o, m) in enumerate(rows_of)])
    ctx = StepCtx(pos=pos, mask=None, rope=head.rope(pos), batch=view)
    x = blk.eh_proj(torch.cat((blk.enorm(embed(tokens)), blk.hnorm(hidden)), dim=-1))
    return blk.shared_head["norm"](blk(x, ctx, state))


class MTPPoolGraphs(PoolChainGraphs):
    def __init__(self, head, stage, pool, taps, K: int, max_n: int, graph_cls=CapturedGraph, paged: bool = False):
        """`head`: the MTP layers (one); `stage`: the target's (its embedding and lm_head);
        `pool` the draft pool (one layer, the MTP attention's K/V), `taps` the tap pool (FINAL)."""
        super().__init__(head, stage.embed_tokens, pool, taps, K, max_n, graph_cls, paged)
        self.head, self.blk, self.lm_head = head, head.layer(0), stage.lm_head

    def _step(self, tokens, hidden, pos, row_slots, lim, idx, T: int):
        """The MTP layer over b requests' T rows each (pos == lim - 1 for every row, pads too)."""
        return pooled_step(self.head, self.embed, self.pool, tokens, hidden, pos, row_slots, idx, T, self.paged)

    def _first(self, v) -> torch.Tensor:
        tok, pos, tslot, slot, lim, last_row, idx, _ = v
        hidden = self.taps.gather(tslot, pos, self.taps.layers)  # (b R, H): the FINAL tap's rows
        return self._step(tok, hidden, pos, slot, lim, idx, self.R)[last_row]  # (b, H)

    def _pick(self, last):
        """The target's lm_head over the step's outputs: its argmax, and its logits for a sampled row."""
        logits = self.lm_head(last).float()  # (b, V)
        return logits.argmax(-1), lambda: logits
