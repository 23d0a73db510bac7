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

from contextlib import contextmanager

import torch

from ..device import to_device
from ..specdec.drafters.base import Drafter, Proposal
from ..specdec.drafters.dflash_pool_graph import DeviceDrafts
from ..specdec.drafters.replay import ReplayDrafter
from ..specdec.drafters.wrapping import Wrapping

__all__ = ["TapReplay", "replaying", "wrap_drafters"]


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

    # a verify launched ahead (batching/verify_ahead.py): the real drafter's early drafts paid in
    # full, the verify's drafts the replay's, drawn on the device where the acceptance is known
    @property
    def verifies_ahead(self) -> bool:
        return getattr(self.inner, "verifies_ahead", False)

    @property
    def early(self):
        return getattr(self.inner, "early", None)

    ahead = None  # (DeviceDrafts, row): the replay's drafts a verify launched ahead runs (ahead_drafts_many)

    @staticmethod
    def ahead_drafts_many(drafters, earlies, ks: list[int]) -> list:
        """Each drafter's replayed drafts for the round after its verify, on the device: its real
        drafter's early drafts `earlies[i]` = (DeviceDrafts, row, lo, k) carry the acceptance a
        the device found, and the replay's drafts then are its table's (`ReplayDrafter.drafted`)
        from entry lo + 2 + a - prompt_len on: the entries every a in [0, k] could start from,
        copied in once, and one gather by a."""
        n, kmax = len(drafters), max(ks)
        W = max(e[3] for e in earlies) + kmax
        win = []
        for d, e in zip(drafters, earlies):
            at = e[2] + 2 - d.replay.prompt_len
            row = d.replay.drafted[max(at, 0):at + W] if at + W > 0 else []
            win.extend(row + [0] * (W - len(row)))  # (past the recording: placeholders, as at its end)
        dd0 = earlies[0][0]
        dev = dd0.ids.device
        if any(e[0] is not dd0 for e in earlies):  # (one early forward a step: not seen)
            acc = torch.stack([e[0].acc[e[1]] for e in earlies])
            bonus = torch.stack([e[0].bonus[e[1]] for e in earlies])
        else:
            rows = to_device([e[1] for e in earlies], dev)
            acc, bonus = dd0.acc[rows], dd0.bonus[rows]
        at = acc[:, None] + torch.arange(kmax, device=dev)
        ids = to_device(win, dev).view(n, W).gather(1, at)
        dd = DeviceDrafts(ids, acc, bonus)
        for r, d in enumerate(drafters):
            d.ahead = (dd, r)
        return [(dd, r) for r in range(n)]

    def take_early(self, context, k: int):
        mine, self.ahead = self.ahead, None
        return mine if self.inner.take_early(context, k) is not None else None

    def drop_pre(self) -> None:
        self.inner.drop_pre()
        self.ahead = None


def wrap_drafters(eng, wrap):
    """From now on, each request `eng` (an engine at pp 1: the engine loop) makes gets its drafter
    as `wrap(real drafter, prompt)` (e.g. a TapReplay over it, a new one each request), set before
    its first round -> a function that stops it."""
    backend = eng._backend
    make = backend.request

    def request(plan, prompt, *rest):
        req = make(plan, prompt, *rest)
        req.session.drafter = wrap(req.session.drafter, prompt)
        return req

    backend.request = request
    return lambda: setattr(backend, "request", make)


@contextmanager
def replaying(eng, wrap):
    """`wrap_drafters` while open."""
    undo = wrap_drafters(eng, wrap)
    try:
        yield
    finally:
        undo()
