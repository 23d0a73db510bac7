"""The picks of a batched draft chain (eagle3_batch.py, mtp_batch.py): each chain step's draft
for every request still drafting, on the device with no host sync: greedy the argmax; sampled
drawn from the step's distribution (`probs_rows`, each request's own temperature / top-k /
top-p) at a uniform its generator gave before the chain (`draw_rows`: one a step, as its solo
proposal draws them one at a time), the distribution kept for the acceptance. At the end one
readback of them all (and of a flag for a non-finite draft distribution), unpacked into each
request's Proposal."""

from __future__ import annotations

import torch

from ...device import to_device
from ..sampling import draw_rows, non_finite_drafts, probs_rows, row_filters, uniforms
from .base import EMPTY, Proposal

__all__ = ["ChainPicks", "sampled_rows", "draw_requests"]


def sampled_rows(sps, gens, ks: list[int], dev):
    """For sampled requests (sampling params, generators, drafts each): ((n, 3) fp64 rows of
    temperature, top-k, top-p; (n, max k) fp64 uniforms, each request's k drawn from its
    generator now, the rest 0) on `dev` in one copy, and their `probs_rows` filters (`row_filters`)."""
    K = max(ks)
    rows = torch.zeros(len(sps), 3 + K, dtype=torch.float64)
    for r, (sp, gen, k) in enumerate(zip(sps, gens, ks)):
        rows[r, :3] = torch.tensor([sp.temperature, sp.top_k, sp.top_p], dtype=torch.float64)
        rows[r, 3:3 + k] = uniforms(gen, k)
    rows = to_device(rows, dev)
    return rows[:, :3], rows[:, 3:], row_filters(sps)


def draw_requests(logits: list[torch.Tensor], sps, gens, name: str, dev) -> list[Proposal]:
    """Sampled requests' drafts from their rows' logits (request r's (k_r, V)) at once: every
    row's distribution (`probs_rows`, its request's parameters) and its draw at the request's
    next uniform, then one readback for all of them (and of a flag: a distribution that is not
    finite, refused in one line) -> each request's Proposal (drafts, the distributions), as
    `draw_drafts` draws them request by request."""
    ks = [x.shape[0] for x in logits]
    params, u, filters = sampled_rows(sps, gens, ks, dev)
    at = to_device([r for r, k in enumerate(ks) for _ in range(k)] + [j for k in ks for j in range(k)], dev)
    rix, cix = at[:sum(ks)], at[sum(ks):]
    p = params[rix]
    q = probs_rows(torch.cat(logits), p[:, 0], p[:, 1].long(), p[:, 2], filters)
    bad = ~torch.isfinite(q.sum(-1)).all()
    flat = torch.cat([draw_rows(q, u[rix, cix]), bad.long().view(1)]).tolist()
    if flat.pop():
        raise non_finite_drafts(name)
    out, lo = [], 0
    for k in ks:
        out.append(Proposal(torch.tensor(flat[lo:lo + k], dtype=torch.long), q[lo:lo + k]))
        lo += k
    return out


class ChainPicks:
    def __init__(self, live, sps, gens, dev):
        """`live`: the drafting requests as (index into the batch, drafter, context, k)."""
        self.live = live
        self.picks: list[torch.Tensor] = []
        self.order: list[list[int]] = []
        self.samp = [r for r, (i, *_) in enumerate(live) if not sps[i].greedy]
        self.at = {r: j for j, r in enumerate(self.samp)}  # request -> its row of the sampled params
        self.qs: dict[int, list[torch.Tensor]] = {r: [] for r in self.samp}
        self.bad = None  # a device flag: some draft distribution was not finite
        if self.samp:
            idx = [live[r][0] for r in self.samp]
            self.params, self.u, self.filters = sampled_rows([sps[i] for i in idx], [gens[i] for i in idx],
                                                             [live[r][3] for r in self.samp], dev)
            self.dev = dev

    def take(self, active: list[int], tok: torch.Tensor, dist) -> torch.Tensor:
        """One chain step: `tok` (n_active,) the greedy ids on the device, its sampled requests'
        entries replaced by their draws from `dist(sel)` ((n, V) logits over the target vocabulary
        of the active rows `sel`, a device index). Returns the step's drafts."""
        s = len(self.picks)
        rows = [(a, self.at[r]) for a, r in enumerate(active) if r in self.at]
        if rows:
            ix = to_device([a for a, _ in rows] + [j for _, j in rows], self.dev)
            sel, js = ix[:len(rows)], ix[len(rows):]
            p = self.params[js]
            q = probs_rows(dist(sel), p[:, 0], p[:, 1].long(), p[:, 2], self.filters)
            tok = tok.index_put((sel,), draw_rows(q, self.u[js, s]))
            bad = ~torch.isfinite(q.sum(-1)).all()
            self.bad = bad if self.bad is None else self.bad | bad
            for n, (a, _) in enumerate(rows):
                self.qs[active[a]].append(q[n:n + 1])
        self.picks.append(tok)
        self.order.append(active)
        return tok

    def proposals(self, n: int) -> list[Proposal]:
        """Every request's Proposal (EMPTY for one not drafting), from one readback."""
        flat = torch.cat(self.picks + ([self.bad.long().view(1)] if self.bad is not None else [])).tolist() \
            if self.picks else []
        if self.bad is not None and flat.pop():
            raise non_finite_drafts(self.live[self.samp[0]][1].name)
        got: list[list[int]] = [[] for _ in self.live]
        lo = 0
        for rs in self.order:
            for r in rs:
                got[r].append(flat[lo])
                lo += 1
        out: list[Proposal] = [EMPTY for _ in range(n)]
        for r, (i, *_) in enumerate(self.live):
            out[i] = Proposal(ids=got[r]) if r not in self.qs else Proposal(torch.tensor(got[r], dtype=torch.long), torch.cat(self.qs[r]))
        return out
