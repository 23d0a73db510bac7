"""A bench-only drafter: a real tap drafter (dflash, mtp, eagle3) runs its propose in full, so its cost is
paid on the device as in any round, and its drafts are then replaced by a replay proposal (a
recorded greedy continuation corrupted to a chosen acceptance, specdec/drafters/replay.py).
The engine therefore runs at a controlled acceptance with the real drafter's cost. Not in the
engine's drafter registry: the benchmark installs it on an open engine (benchmarks/tap_drafters.py).

The real drafter's state stays its own: dflash's context K/V is ingested from the target's taps
of the verified rows (whatever was proposed), mtp recomputes its draft rows from the verified
tokens each round, eagle3's first forward of a round starts at its committed rows (its chain rows are
rewritten before any row reads them), so replacing the proposals leaves each consistent.
"""

from __future__ import annotations

from ..specdec.drafters.base import Drafter, Proposal
from ..specdec.drafters.replay import ReplayDrafter
from ..specdec.drafters.wrapping import Wrapping

__all__ = ["TapReplay"]


class TapReplay(Wrapping):
    def __init__(self, real: Drafter, replay: ReplayDrafter):
        super().__init__(real, f"{real.name}+replay")  # the real drafter, paid in full
        self.replay = replay

    # in a batched engine, a greedy request's rounds are the step leader's when the real drafter's
    # are, and it drafts with the other requests' real drafters in one forward (batching/chain_drafts.py)
    @property
    def defers(self) -> bool:
        """Where the real drafter leaves its drafts on the device, so does its forward here: the
        loop then launches the verify while it runs, as it does for the real drafts (the replayed
        ones are on the host already)."""
        return getattr(self.inner, "defers", False)

    @staticmethod
    def propose_many(drafters, contexts, ks, sps, gens, defer: bool = False) -> list[Proposal]:
        kw = {"defer": True} if defer else {}
        real = Wrapping.inner_many(drafters, contexts, ks, sps, gens, **kw)  # paid in full
        return [d.replay.propose(c, r.count(), sp, g) for d, c, r, sp, g in zip(drafters, contexts, real, sps, gens)]

    def propose(self, context, k, sp, gen) -> Proposal:
        real = self.inner.propose(context, k, sp, gen)  # paid in full: its forward(s) and readback
        return self.replay.propose(context, min(k, real.count()), sp, gen)  # greedy bench: deterministic drafts
