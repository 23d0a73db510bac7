"""The picks of a batched draft chain (eagle3_batch.py, mtp_batch.py): each chain step's draft
for every request still drafting, greedy on the device or, for a sampled request, drawn on the
host with its own generator (its step's distribution kept for the acceptance), and at the end
one readback of them all, unpacked into each request's Proposal."""

from __future__ import annotations

import torch

from ..sampling import draw_drafts, probs
from .base import EMPTY, Proposal

__all__ = ["ChainPicks"]


class ChainPicks:
    def __init__(self, live, sps, gens):
        """`live`: the drafting requests as (index into the batch, drafter, context, k)."""
        self.live, self.sps, self.gens = live, sps, gens
        self.picks: list[torch.Tensor] = []
        self.order: list[list[int]] = []
        self.qs: dict[int, list[torch.Tensor]] = {r: [] for r, (i, *_) in enumerate(live) if not sps[i].greedy}

    def take(self, active: list[int], tok: torch.Tensor, dist) -> torch.Tensor:
        """One chain step: `tok` (n_active,) the greedy ids on the device, its sampled requests'
        entries replaced by their draws from `dist(a)` ((1, V) logits over the target vocabulary
        of active row a), as each request's solo step draws them. Returns the step's drafts."""
        for a, r in enumerate(active):
            if r in self.qs:
                i = self.live[r][0]
                q = probs(dist(a), self.sps[i])
                self.qs[r].append(q)
                tok[a] = int(draw_drafts(q, self.gens[i], self.live[r][1].name)[0])
        self.picks.append(tok)
        self.order.append(active)
        return tok

    def proposals(self, n: int) -> list[Proposal]:
        """Every request's Proposal (EMPTY for one not drafting), from one readback."""
        flat = torch.cat(self.picks).tolist() if self.picks else []
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
