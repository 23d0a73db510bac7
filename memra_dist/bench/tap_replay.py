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

__all__ = ["TapReplay"]


class TapReplay(Drafter):
    def __init__(self, real: Drafter, replay: ReplayDrafter):
        self.real, self.replay = real, replay
        self.name = f"{real.name}+replay"
        self.device = real.device
        self.forwards_per_draft = getattr(real, "forwards_per_draft", 1)

    # in a batched engine, a greedy request's rounds are the step leader's when the real drafter's
    # are, and it drafts with the other requests' real drafters in one forward (batching/chain_drafts.py)
    @property
    def chains(self) -> bool:
        return getattr(self.real, "chains", False)

    @property
    def batched(self) -> bool:
        return getattr(self.real, "batched", False)

    @property
    def catches_up(self) -> bool:
        return getattr(self.real, "catches_up", False)

    @property
    def batch_key(self):
        return self.real.batch_key

    @staticmethod
    def maintain_many(drafters, contexts) -> None:
        type(drafters[0].real).maintain_many([d.real for d in drafters], contexts)

    @staticmethod
    def propose_many(drafters, contexts, ks, sps, gens) -> list[Proposal]:
        real = type(drafters[0].real).propose_many([d.real for d in drafters], contexts, ks, sps, gens)  # paid in full
        return [Proposal(d.replay.propose(c, int(r.tokens.numel()), sp, g).tokens)
                for d, c, r, sp, g in zip(drafters, contexts, real, sps, gens)]

    def alloc(self, capacity: int) -> float:
        return self.real.alloc(capacity)

    def prime(self, prompt: list[int], chunks=None) -> None:
        self.real.prime(prompt, chunks)

    def propose(self, context, k, sp, gen) -> Proposal:
        real = self.real.propose(context, k, sp, gen)  # paid in full: its forward(s) and readback
        rep = self.replay.propose(context, min(k, int(real.tokens.numel())), sp, gen)
        return rep if real.q is None else Proposal(rep.tokens, None)  # greedy bench: deterministic drafts

    def maintain(self, context) -> None:
        self.real.maintain(context)

    def drain(self) -> None:
        self.real.drain()
